"""Lesson 01's exercises: a ring all-reduce, all-gather from broadcast, a grid of subgroups.

Inputs are integer-valued tensors made from a fixed seed here, in the
checker's process, so sums are exact in any order and every reference is
computed without torch.distributed. Judges name the rank, the case and the
first wrong value, and recognise the usual mistakes (averaging, aliasing,
swapping rows and columns, passing the whole tensor around the ring).
"""

from __future__ import annotations

import math

from ....units import binary_bytes
from ....vocabulary import RECEIVES, SENDS
from ...compare import bytes_sent, first_difference, ops_called
from ...spec import Exercise, Item, RunOutcome, RunSpec

__all__ = ["EXERCISES"]

P2P_OPS = frozenset(SENDS + RECEIVES)


def _integer_tensors(nproc: int, shapes: list[tuple], seed: int, dtype=None) -> list[dict[int, tuple]]:
    """One case per shape; rank r gets its own integer-valued tensor (floats unless dtype is given)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    cases = []
    for shape in shapes:
        case = {}
        for rank in range(nproc):
            values = torch.randint(-9, 10, shape, generator=generator)
            case[rank] = (values.to(dtype or torch.float32),)
        cases.append(case)
    return cases


def _case_label(outcome: RunOutcome, case: int) -> str:
    shape = list(outcome.inputs[case][0][0].shape)
    return f"case {case + 1} of {len(outcome.inputs)} (shape {shape})"


def _int64():
    import torch

    return torch.int64


# ---------------------------------------------------------------- 01.ring_allreduce


def _sent_too_little(outcome: RunOutcome, case: int, rank: int) -> str:
    """Why `rank` cannot have contributed its tensor by send/isend in `case`, or "".

    Every element of a rank's tensor must leave it at least once, in some message, for
    the others to end with the sum: fewer bytes sent means the sum came from somewhere
    else (a collective below torch.distributed, which the ledger cannot see).
    """
    tensor = outcome.inputs[case][rank][0]
    size = tensor.numel() * tensor.element_size()
    sent = bytes_sent(outcome.results[case][rank].ledger)
    if sent >= size:
        return ""
    return (f"rank {rank}, {_case_label(outcome, case)}: sent only {binary_bytes(sent, significant=3)} of a "
            f"{binary_bytes(size, significant=3)} tensor with send/isend, so its values cannot all have reached "
            f"the other ranks{_narrower_dtype(outcome, case, rank)}")


def _narrower_dtype(outcome: RunOutcome, case: int, rank: int) -> str:
    """If the messages were of another dtype than the tensor (int64 sent as float32 buffers), say so."""
    dtype = str(outcome.inputs[case][rank][0].dtype).removeprefix("torch.")
    other = sorted({e["dtype"] for e in outcome.results[case][rank].ledger if e["op"] in SENDS} - {dtype, None})
    if not other:
        return ""
    return f" (the messages were {', '.join(other)}, the tensor {dtype}: make the buffers with the tensor's dtype)"


def _ring_sums(cases: range | None = None):
    """Judge: every rank holds the sum of the inputs, in the cases given (default all)."""

    def judge(outcome: RunOutcome) -> list[str]:
        import torch

        problems = []
        n = outcome.nproc
        for case in cases if cases is not None else range(len(outcome.results)):
            by_rank = outcome.results[case]
            expected = sum(outcome.inputs[case][r][0] for r in range(n))
            for rank in range(n):
                too_little = _sent_too_little(outcome, case, rank)
                if too_little:
                    problems.append(too_little)
                    break
                got = by_rank[rank].output["tensor"]
                wrong = first_difference(got, expected)
                if not wrong:
                    continue
                hint = ""
                if torch.equal(got, outcome.inputs[case][rank][0]):
                    hint = ": the tensor is unchanged; did the ranks exchange anything?"
                elif got.shape == expected.shape and torch.allclose(got.double(), expected.double() / n):
                    hint = f": that is the sum divided by {n}; sum, do not average"
                problems.append(f"rank {rank}, {_case_label(outcome, case)}: {wrong}{hint}")
                break  # one rank per case is enough to see the pattern
        return problems

    return judge


def _ring_bandwidth(outcome: RunOutcome) -> list[str]:
    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        tensor = outcome.inputs[case][0][0]
        size = tensor.numel() * tensor.element_size()
        # A ring over n chunks sends n-1 chunks to reduce and n-1 to gather: 2(n-1)/n of the
        # tensor, rounded up to whole chunks when the size does not divide by n.
        bound = 2 * (n - 1) * math.ceil(tensor.numel() / n) * tensor.element_size()
        for rank, result in by_rank.items():
            too_little = _sent_too_little(outcome, case, rank)
            if too_little:
                return [too_little]
            sent = bytes_sent(result.ledger)
            if sent > bound:
                return [f"rank {rank}, {_case_label(outcome, case)}: sent {binary_bytes(sent, significant=3)} for a "
                        f"{binary_bytes(size, significant=3)} tensor; a ring over {n} chunks sends at most "
                        f"{binary_bytes(bound, significant=3)} (2(N-1)/N of it); are you passing the whole "
                        "tensor around?"]
    return []


RING = Exercise(
    id="01.ring_allreduce",
    function="ring_allreduce",
    signature="ring_allreduce(tensor: torch.Tensor) -> None",
    driver="in_place",
    hints=(
        "Reread lesson 01, section 8, 'Where 2(N-1)/N comes from', and step through its ring stepper: "
        "which chunk each rank sends, and what the receiver does with it, at every step.",
        "dist.isend, dist.recv (or dist.irecv) and wait() on the work objects; torch.tensor_split on a flat "
        "view of the tensor, which gives exactly N pieces (Tensor.chunk may give fewer), each a view that "
        "writes through to the tensor.",
        "Cut the flattened tensor into N pieces that are views of it, so that changing a piece changes the "
        "tensor. In N-1 steps, each rank sends one piece to its right neighbour while it receives one from "
        "its left neighbour and adds what arrives into its own piece of the same index; the index a rank "
        "sends moves back by one each step, so that afterwards each rank holds one piece summed over all "
        "ranks. Then N-1 more steps pass the summed pieces on around the ring, copied instead of added. In "
        "every step, start the send without blocking before the blocking receive, and wait for the send "
        "before you touch that piece again (this completes on gloo, where the check runs; on NCCL the same "
        "exchange is posted with batch_isend_irecv, lesson 01 section 3).",
    ),
    allowed_ops=P2P_OPS,
    required_ops=frozenset(SENDS),
    runs=(
        RunSpec(2, lambda n: (_integer_tensors(n, [(10,), (3, 4)], seed=101)
                              + _integer_tensors(n, [(5,)], seed=103, dtype=_int64())),
                (Item("sums float32 tensors on 2 ranks", 1, _ring_sums(range(0, 2))),
                 Item("sums an int64 tensor on 2 ranks (keeps its dtype)", 1, _ring_sums(range(2, 3))))),
        RunSpec(4, lambda n: _integer_tensors(n, [(7,), (4, 5)], seed=102),
                (Item("sums on 4 ranks, sizes that do not divide by 4", 1, _ring_sums()),
                 Item("sends 2(N-1)/N of the tensor per rank (a chunked ring)", 1, _ring_bandwidth))),
    ),
)


# ---------------------------------------------------------------- 01.allgather_from_broadcast


def _gathered(outcome: RunOutcome) -> list[str]:
    import torch

    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        expected = [outcome.inputs[case][r][0] for r in range(n)]
        for rank in range(n):
            out = by_rank[rank].output
            where = f"rank {rank}, {_case_label(outcome, case)}"
            if "list" not in out:
                return [f"{where}: returned a {out['not_a_tensor_list']}, expected a list of {n} tensors"]
            got = out["list"]
            if len(got) != n:
                return [f"{where}: returned {len(got)} tensors, expected {n} (one per rank)"]
            shared = [(i, j) for i, others in enumerate(out["shared"]) for j in others if i < j]
            if shared:
                i, j = shared[0]
                return [f"{where}: entries {i} and {j} are the same tensor; give each rank's data its own "
                        "buffer (clone, or a new torch.empty_like per broadcast)"]
            for src in range(n):
                wrong = first_difference(got[src], expected[src])
                if wrong:
                    hint = ""
                    if src != n - 1 and torch.equal(got[src], expected[n - 1]):
                        hint = f": it holds rank {n - 1}'s tensor, the last one broadcast; one buffer reused?"
                    return [f"{where}: entry {src} (rank {src}'s tensor): {wrong}{hint}"]
    return []


def _input_unchanged(outcome: RunOutcome) -> list[str]:
    for case, by_rank in enumerate(outcome.results):
        for rank, result in by_rank.items():
            wrong = first_difference(result.output["input_after"], outcome.inputs[case][rank][0])
            if wrong:
                return [f"rank {rank}, {_case_label(outcome, case)}: the input tensor was changed ({wrong}); "
                        "receive other ranks' data into new buffers"]
    return []


def _one_broadcast_per_rank(outcome: RunOutcome) -> list[str]:
    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        for rank, result in by_rank.items():
            ops = ops_called(result.ledger)
            if set(ops) - {"broadcast"}:
                return [f"rank {rank} called {', '.join(sorted(set(ops) - {'broadcast'}))}; only broadcast is allowed"]
            if len(ops) != n:
                return [f"rank {rank}, {_case_label(outcome, case)}: {len(ops)} broadcasts, expected {n} (one per source rank)"]
    return []


ALLGATHER = Exercise(
    id="01.allgather_from_broadcast",
    function="all_gather_by_broadcast",
    signature="all_gather_by_broadcast(tensor: torch.Tensor) -> list[torch.Tensor]",
    driver="returns_tensor_list",
    hints=(
        "Reread lesson 01, section 4 'Collectives': what broadcast does to the tensor it is given, on the "
        "source rank and on every other rank.",
        "dist.broadcast(tensor, src=...), with Tensor.clone and torch.empty_like for the buffers.",
        "Take every rank in turn as the source. The source gives broadcast a copy of its own tensor, every "
        "other rank a new buffer of the same shape and dtype to receive into; keep the buffers in a list in "
        "rank order, one new buffer per source, since broadcast writes into the buffer it is given.",
    ),
    allowed_ops=frozenset({"broadcast"}),
    required_ops=frozenset({"broadcast"}),
    runs=(
        RunSpec(2, lambda n: (_integer_tensors(n, [(3,)], seed=201, dtype=_int64())
                              + _integer_tensors(n, [(2, 2)], seed=202)),
                (Item("gathers on 2 ranks (int64 and float32)", 1, _gathered),)),
        RunSpec(3, lambda n: _integer_tensors(n, [(5,)], seed=203),
                (Item("gathers on 3 ranks", 1, _gathered),
                 Item("leaves the input tensor unchanged", 1, _input_unchanged),
                 Item("exactly one broadcast per source rank", 1, _one_broadcast_per_rank))),
    ),
)


# ---------------------------------------------------------------- 01.grid_groups


def _grid_cases(nproc: int) -> list[dict[int, tuple]]:
    return [{rank: (rows, cols) for rank in range(nproc)} for rows, cols in ((2, 2), (1, 4))]


def _expected_members(kind: str, rank: int, rows: int, cols: int) -> list[int]:
    row, col = divmod(rank, cols)
    if kind == "row":
        return [row * cols + c for c in range(cols)]
    return [r * cols + col for r in range(rows)]


def _group_judge(kind: str):
    other = "col" if kind == "row" else "row"
    word = {"row": "row", "col": "column"}

    def judge(outcome: RunOutcome) -> list[str]:
        for case, by_rank in enumerate(outcome.results):
            rows, cols = outcome.inputs[case][0]
            for rank, result in by_rank.items():
                out = result.output
                where = f"rank {rank} of a {rows}x{cols} grid"
                if "not_a_pair" in out:
                    return [f"{where}: returned a {out['not_a_pair']}, expected (row_group, col_group)"]
                if "error" in out[kind]:
                    return [f"{where}: the {word[kind]} group is not usable here: {out[kind]['error']}"]
                expected = _expected_members(kind, rank, rows, cols)
                got = out[kind]["members"]
                if sorted(got) != expected:
                    hint = ""
                    if sorted(got) == _expected_members(other, rank, rows, cols):
                        hint = f": that is its {word[other]}; rank r sits at row r // cols, column r % cols"
                    return [f"{where}: {word[kind]} group has ranks {got}, expected {expected}{hint}"]
        return []

    return judge


def _groups_work(outcome: RunOutcome) -> list[str]:
    for case, by_rank in enumerate(outcome.results):
        rows, cols = outcome.inputs[case][0]
        for rank, result in by_rank.items():
            for kind in ("row", "col"):
                part = result.output.get(kind, {})
                if "same_name" in part:
                    other = part["same_name"]
                    return [f"rank {rank} of a {rows}x{cols} grid: its {'row' if kind == 'row' else 'column'} group {part['members']} has the same name "
                            f"({other['name']!r}) as the group {other['members']} that rank {other['rank']} created, so "
                            "gloo would connect the ranks of both as one group (a hang or a wrong sum, depending on "
                            "timing; the check did not use it). A plain new_group names each group by how many groups "
                            "this process has created so far (lesson 01, section 6)"]
                if "sum" not in part:
                    return [f"rank {rank} of a {rows}x{cols} grid: no usable {kind} group to all_reduce over"]
                expected = sum(_expected_members(kind, rank, rows, cols))
                if part["sum"] != expected:
                    return [f"rank {rank} of a {rows}x{cols} grid: all_reduce of the ranks over its {kind} group "
                            f"gave {part['sum']}, expected {expected}"]
    return []


GRID = Exercise(
    id="01.grid_groups",
    function="grid_groups",
    signature="grid_groups(rows: int, cols: int) -> tuple[ProcessGroup, ProcessGroup]",
    driver="process_groups",
    hints=(
        "Reread lesson 01, section 6 'Groups and sub-groups' (which ranks call new_group, and in which "
        "order) and 'A first look at DeviceMesh' (which ranks share a row, which a column).",
        "dist.new_group(ranks=[...]), plain or with use_local_synchronization=True, and dist.get_rank().",
        "List the members of every row (rank r is in row r // cols) and of every column (column r % cols). "
        "With a plain new_group, every rank creates every one of those groups, in the same order on every "
        "rank, members or not, and keeps the two it belongs to. With use_local_synchronization=True, a rank "
        "may create only its own row's group and then its own column's.",
    ),
    runs=(
        RunSpec(4, _grid_cases,
                (Item("row groups of a 2x2 and a 1x4 grid", 1, _group_judge("row")),
                 Item("column groups of a 2x2 and a 1x4 grid", 1, _group_judge("col")),
                 Item("each group works (all_reduce over it)", 1, _groups_work))),
    ),
)

EXERCISES = {exercise.id: exercise for exercise in (RING, ALLGATHER, GRID)}
