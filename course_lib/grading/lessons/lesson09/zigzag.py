"""09.zigzag: the zigzag split of a sequence over p ranks and its inverse, for any length s and any p.

The sequence (dimension -2) is cut into 2p chunks as `torch.tensor_split` cuts it (the first s mod 2p chunks one
row longer); rank r holds chunk r, then chunk 2p - 1 - r. Judged per case (each call on its own, an exception
included): the split against the reference, on lengths that 2p divides and on lengths it does not; the merge of
the reference's shards against the sequence. Each row of a case's x holds its sequence position (column 0), so a
message can say which row a rank got.
"""

from __future__ import annotations

from ...cells import is_stub_error
from ...checker import not_written_yet
from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec

__all__ = ["ZIGZAG", "reference_split"]

# (s, p): 2p divides s in the first three; then s mod 2p > 0, s < 2p included (empty chunks).
CASES = ((8, 2), (24, 4), (12, 3), (10, 2), (13, 3), (22, 4), (5, 3))

HINTS = (
    "Reread lesson 09, section 4: why rank r holds one chunk from the start and one from the end, chunks r and "
    "2p - 1 - r, and the lesson's `shard`, which assumed 2p divides s.",
    "torch.tensor_split (2p chunks for any s; torch.chunk's are ceil(s / 2p) rows, the last one shorter and the "
    "trailing ones missing when 2p does not divide s), "
    "torch.cat; plain Python for the sizes. No torch.distributed call is needed.",
    "Split: cut into 2p chunks with tensor_split's sizes and give rank r chunks r and 2p - 1 - r. Merge: from p "
    "(the number of shards) and s (their rows in all) work out the 2p chunk sizes; cut each shard back into its "
    "two chunks by those sizes, put every chunk at its place, and concatenate.",
)


def make_x(s: int):
    """[1, 2, s, 3] float32: column 0 of head 0 holds each row's position; the rest tells heads and columns."""
    import torch

    position = torch.arange(s, dtype=torch.float32)[None, None, :, None]
    return (position + 1000 * torch.arange(2.0)[None, :, None, None] + torch.tensor([0.0, 0.25, 0.5])).contiguous()


def reference_split(x, p: int) -> list:
    import torch

    chunks = torch.tensor_split(x, 2 * p, dim=-2)
    return [torch.cat([chunks[r], chunks[2 * p - 1 - r]], dim=-2) for r in range(p)]


def _cases(nproc: int) -> list[dict[int, tuple]]:
    mine = {r: [] for r in range(nproc)}
    for number, (s, p) in enumerate(CASES):
        x = make_x(s)
        mine[number % nproc].append((x, p, reference_split(x, p)))
    return [{r: (cases,) for r, cases in mine.items()}]


def _mine(rank: int, nproc: int) -> list[tuple[int, int]]:
    return [case for number, case in enumerate(CASES) if number % nproc == rank]


def _said(returned: str) -> str:
    """What a call gave instead of an answer, the stub's NotImplementedError in the checker's words."""
    if returned.startswith("raised ") and is_stub_error(returned.removeprefix("raised "), "09.zigzag"):
        return "raised " + not_written_yet("09.zigzag")
    return returned


def _positions(t) -> str:
    rows = [int(v) for v in t[0, 0, :, 0].tolist()]
    return "[" + ", ".join(map(str, rows)) + "]"


def _split(divides: bool):
    def judge(outcome: RunOutcome) -> list[str]:
        for _, rank, result in each_result(outcome):
            for (s, p), entry in zip(_mine(rank, outcome.nproc), result.output):
                if (s % (2 * p) == 0) != divides:
                    continue
                call = f"rank {rank}, zigzag_split(x, {p}) with s = {s}"
                if entry["split_returned"]:
                    return [f"{call} {_said(entry['split_returned'])}"]
                got, want = entry["split"], reference_split(make_x(s), p)
                if len(got) != p:
                    return [f"{call} returned {len(got)} shards; expected {p}, one per rank"]
                for r, (g, w) in enumerate(zip(got, want)):
                    if g.shape != w.shape or not (g == w).all():
                        text = (f"{call}: shard {r} holds the rows at positions {_positions(g)}; expected "
                                f"{_positions(w)} (chunks {r} and {2 * p - 1 - r} of {2 * p})")
                        if g.shape[-2] != w.shape[-2] and s % (2 * p):
                            text += (f"; 2p = {2 * p} does not divide s = {s}: tensor_split's chunks have "
                                     f"{s // (2 * p) + 1} rows for the first {s % (2 * p)}, {s // (2 * p)} after")
                        return [text]
        return []
    return judge


def _merge(divides: bool):
    def judge(outcome: RunOutcome) -> list[str]:
        for _, rank, result in each_result(outcome):
            for (s, p), entry in zip(_mine(rank, outcome.nproc), result.output):
                if (s % (2 * p) == 0) != divides:
                    continue
                call = f"rank {rank}, zigzag_merge of the {p} shards of s = {s}"
                if entry["merge_returned"]:
                    return [f"{call}: zigzag_merge {_said(entry['merge_returned'])}"]
                got, want = entry["merge"], make_x(s)
                if got.shape != want.shape or not (got == want).all():
                    shown = _positions(got) if got.dim() == 4 and got.shape[:2] == (1, 2) else list(got.shape)
                    return [f"{call}: returned the rows at positions {shown}; expected 0 to {s - 1} in order"]
        return []
    return judge


ITEMS = (
    Item("split: rank r holds chunks r and 2p - 1 - r, on lengths 2p divides (2 ranks)", 1, _split(True)),
    Item("split: the same with tensor_split's chunk sizes, on lengths 2p does not divide (2 ranks)", 1,
         _split(False)),
    Item("merge: the sequence back from the p shards, on lengths 2p divides (2 ranks)", 1, _merge(True)),
    Item("merge: the same on lengths 2p does not divide (2 ranks)", 1, _merge(False)),
)

ZIGZAG = Exercise(
    id="09.zigzag",
    function="zigzag_split",
    signature="zigzag_split(x, p) -> list[Tensor]; zigzag_merge(shards) -> Tensor",
    driver="zigzag",
    hints=HINTS,
    runs=(RunSpec(2, _cases, ITEMS, timeout_s=15),),
)
