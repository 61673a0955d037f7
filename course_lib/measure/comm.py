"""Communication, measured: the collective ledger as bytes per op per training step, beside theory.

Every rank records each `torch.distributed` call it makes (course_lib/rank/ledger.py):
op, group, input bytes, start and end. This module reads those records in the
kernel: it cuts them into training steps, sums bytes and counts per (rank,
step, op, group), and compares them with the count `course_lib.theory` predicts:

- DDP: every gradient all-reduced once per step, in buckets (`ddp_step_bytes`).
- FSDP2: each unit's shard all-gathered in forward and again in backward, its
  padded gradient reduce-scattered in backward (`fsdp2_step_collectives`).
- TP: per layer all-reduces, or reduce-scatter + all-gather with sequence
  parallelism (`tp_layer_comm`).

Steps: the lesson calls `dist.barrier()` on the world group before each step;
the ledger records it, so step k is what a rank called between its k-th world
barrier and the next (step 0: everything before the first barrier, i.e. set-up).
Barriers themselves are never counted as a step's communication.

What the ledger cannot see: collectives issued from C++ or through functional
collectives without passing through the Python `torch.distributed` API, above
all DDP's gradient all-reduce (its C++ Reducer) and DTensor/TP collectives.
Registering DDP's stock `allreduce_hook` issues the same all-reduce from
Python, which the ledger records. `comm_counts` runs code under CommDebugMode,
which counts at the dispatcher level and sees both.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Union

from ..units import binary_bytes
from ..vocabulary import canonical_op

__all__ = [
    "CommRow", "CommTable", "TheoryRow", "comm_counts", "comm_table", "compare_with_theory", "exact_bytes",
    "split_steps",
]

Expected = Union[dict[str, int], list[tuple[str, int]]]


def exact_bytes(n: int) -> str:
    """`2,012 B`; from 1 MiB on with the rounded size beside it: `25,165,824 B (24 MiB)`."""
    return f"{n:,} B" + (f" ({binary_bytes(n)})" if n >= 2**20 else "")


def _is_step_barrier(entry: dict, group: str) -> bool:
    return entry["op"] == "barrier" and entry.get("group") == group


def split_steps(entries: list[dict], *, steps: str | int = "barrier", group: str = "world") -> list[list[dict]]:
    """One rank's ledger cut into steps: `result[k]` is step k's calls, barriers left out.

    `steps="barrier"`: step k runs from the k-th barrier on `group` to the next
    (barriers on other groups are left out too);
    step 0 holds the calls before the first barrier. `steps=n` (an int), for a
    ledger without barriers: the calls, in order, cut into n equal steps (the
    per-step pattern repeats), with an empty step 0 so steps still count from 1.
    """
    if steps == "barrier":
        result: list[list[dict]] = [[]]
        for entry in entries:
            if _is_step_barrier(entry, group):
                result.append([])
            elif entry["op"] != "barrier":  # a barrier on a subgroup: not a step boundary, not data either
                result[-1].append(entry)
        return result
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be 'barrier' or a positive int, got {steps!r}")
    calls = [e for e in entries if e["op"] != "barrier"]
    if len(calls) % steps:
        raise ValueError(f"{len(calls)} calls do not split into {steps} equal steps; separate steps with "
                         "dist.barrier() and use steps='barrier'")
    size = len(calls) // steps
    return [[]] + [calls[i * size:(i + 1) * size] for i in range(steps)]


@dataclasses.dataclass(frozen=True)
class CommRow:
    """Calls of one op on one group by one rank in one step: how many, and their input bytes summed."""
    rank: int
    step: int
    op: str
    group: str
    count: int
    bytes: int


@dataclasses.dataclass
class CommTable:
    """Per rank, per step, that step's calls (op names made canonical, the ledger's own in `ledger_op`)."""
    calls: dict[int, list[list[dict]]]

    @property
    def ranks(self) -> list[int]:
        return sorted(self.calls)

    @property
    def num_steps(self) -> int:
        """Number of steps including step 0 (set-up): steps are 0 .. num_steps - 1."""
        return max((len(steps) for steps in self.calls.values()), default=0)

    def step_calls(self, rank: int, step: int) -> list[dict]:
        steps = self.calls.get(rank, [])
        return steps[step] if step < len(steps) else []

    def sequence(self, rank: int, step: int) -> list[tuple[str, int]]:
        """The (op, input bytes) of each call, in the order the rank made them."""
        return [(e["op"], e["bytes"]) for e in self.step_calls(rank, step)]

    def by_op(self, rank: int, step: int) -> dict[str, int]:
        """{op: input bytes summed over the step}."""
        totals: dict[str, int] = collections.defaultdict(int)
        for op, nbytes in self.sequence(rank, step):
            totals[op] += nbytes
        return dict(totals)

    def counts(self, rank: int, step: int) -> dict[str, int]:
        """{op: number of calls in the step}."""
        return dict(collections.Counter(op for op, _ in self.sequence(rank, step)))

    def total(self, rank: int, step: int) -> int:
        return sum(nbytes for _, nbytes in self.sequence(rank, step))

    def rows(self) -> list[CommRow]:
        """One row per (rank, step, op, group), in rank, step, first-call order."""
        out = []
        for rank in self.ranks:
            for step, calls in enumerate(self.calls[rank]):
                groups: dict[tuple[str, str], list[int]] = {}
                for e in calls:
                    groups.setdefault((e["op"], e["group"]), []).append(e["bytes"])
                out += [CommRow(rank, step, op, group, len(b), sum(b)) for (op, group), b in groups.items()]
        return out

    def format(self, *, rank: int = 0) -> str:
        """A text table of `rank`'s steps: step, op, group, calls, bytes."""
        lines = [f"{'step':>4}  {'op':<24}{'group':<10}{'calls':>5}  {'bytes':>12}"]
        for row in (r for r in self.rows() if r.rank == rank):
            lines.append(f"{row.step:>4}  {row.op:<24}{row.group:<10}{row.count:>5}  {exact_bytes(row.bytes):>12}")
        return "\n".join(lines)


def comm_table(ledgers: dict[int, list[dict]], *, steps: str | int = "barrier", group: str = "world") -> CommTable:
    """Bytes and counts per (rank, step, op, group) from `{rank: ledger entries}` (see `split_steps`)."""
    calls = {}
    for rank, entries in ledgers.items():
        canon = [{**e, "op": canonical_op(e["op"]), "ledger_op": e.get("call", e["op"])} for e in entries]
        calls[int(rank)] = split_steps(canon, steps=steps, group=group)
    return CommTable(calls)


@dataclasses.dataclass(frozen=True)
class TheoryRow:
    """One op of one step on one rank: measured next to predicted (counts None when theory gives only bytes)."""
    rank: int
    step: int
    op: str
    measured_bytes: int
    predicted_bytes: int
    measured_count: int
    predicted_count: int | None
    match: bool


def compare_with_theory(table: CommTable, expected: Expected, *, ranks: list[int] | None = None,
                        steps: list[int] | None = None) -> list[TheoryRow]:
    """Measured bytes per op per step next to `expected`, the same for every rank and step.

    `expected`: `{op: bytes}` (as `theory.ddp_step_bytes` gives: a row matches when
    the step's bytes of that op sum to it) or a list of `(op, bytes)` calls (as
    `theory.fsdp2_step_collectives` gives: a row matches when the step has exactly
    those calls of that op, the same sizes, in any order; use `table.sequence` for
    the order). `steps` default: every step from 1 on.
    """
    if isinstance(expected, dict):
        predicted = {canonical_op(op): (nbytes, None) for op, nbytes in expected.items()}
        sizes = None
    else:
        sizes = collections.defaultdict(list)
        for op, nbytes in expected:
            sizes[canonical_op(op)].append(nbytes)
        predicted = {op: (sum(b), len(b)) for op, b in sizes.items()}
    rows = []
    for rank in table.ranks if ranks is None else ranks:
        for step in range(1, table.num_steps) if steps is None else steps:
            calls = table.sequence(rank, step)
            ops = list(dict.fromkeys([op for op, _ in calls] + list(predicted)))
            for op in ops:
                measured = sorted(b for o, b in calls if o == op)
                pred_bytes, pred_count = predicted.get(op, (0, 0 if sizes is not None else None))
                if sizes is None:
                    match = sum(measured) == pred_bytes
                else:
                    match = measured == sorted(sizes.get(op, []))
                rows.append(TheoryRow(rank, step, op, sum(measured), pred_bytes, len(measured), pred_count, match))
    return rows


def comm_counts(fn: Callable[[], Any], *, by_phase: bool = False) -> dict:
    """Rank-side: run `fn()` under CommDebugMode; return `{op: count}` as plain data (publishable).

    Names are CommDebugMode's own (`c10d.allreduce_`, `c10d._allgather_base_`); `vocabulary.canonical_op`
    gives the ledger's (`all_reduce`, `all_gather_single`).
    `by_phase=True`: `{"forward": {...}, "backward": {...}}` instead.
    NOTE: `fn` must run each module's forward at most once (one training step):
    CommDebugMode's module tracker (torch 2.13) registers a forward hook per call
    and keeps one handle per module name, so a second forward of the same module
    pops its parent stack twice (IndexError in `_fw_set_module_hook`) and leaves
    hooks behind that break every later forward of that model.
    Call `comm_counts` once per step instead.
    """
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    try:
        with mode:
            fn()
    except IndexError as exc:
        if "_comm_mode" in repr(_frames(exc)):
            raise RuntimeError("CommDebugMode failed in its module tracker: a module ran forward twice inside "
                               "one comm_counts call; count one step per call") from exc
        raise
    if not by_phase:
        return {str(op): int(n) for op, n in mode.get_comm_counts().items()}
    per_module = mode.comm_module_counts.get("Global", {})
    return {phase: {str(op): int(n) for op, n in per_module.get(phase, {}).items()} for phase in ("forward", "backward")}


def _frames(exc: BaseException) -> list[str]:
    tb, names = exc.__traceback__, []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return names
