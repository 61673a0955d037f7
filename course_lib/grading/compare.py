"""Judges' vocabulary: compare what a rank sent back with the reference, and say what differs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from ..vocabulary import SENDS

if TYPE_CHECKING:
    from .spec import CaseResult, RunOutcome

__all__ = ["bytes_sent", "each_result", "first_difference", "ops_called"]


def each_result(outcome: "RunOutcome") -> Iterator[tuple[int, int, "CaseResult"]]:
    """Every (case, rank, result) of a run: cases in order, ranks sorted within each (the judges' loop)."""
    for case, by_rank in enumerate(outcome.results):
        for rank in sorted(by_rank):
            yield case, rank, by_rank[rank]


def first_difference(got: Any, expected: Any, *, rtol: float = 0.0, atol: float = 0.0, what: str = "") -> str:
    """"" if `got` equals the tensor `expected`; else the first difference, in words.

    Exact by default; with `rtol`/`atol`, elements within `atol + rtol * |expected|` count as
    equal (torch.isclose's rule, as `torch.testing.assert_close` applies it). A `got` of None is a
    gradient that never arrived: "is None: no gradient reached `what`" (e.g. "down_bias on rank 1").
    """
    import torch

    if got is None:
        return f"is None: no gradient reached {what or 'it'}"
    if not isinstance(got, torch.Tensor):
        return f"got a {type(got).__name__}, expected a tensor of shape {list(expected.shape)}"
    if got.shape != expected.shape:
        return f"shape {list(got.shape)}, expected {list(expected.shape)}"
    if got.dtype != expected.dtype:
        return f"dtype {str(got.dtype)[6:]}, expected {str(expected.dtype)[6:]}"
    if rtol or atol:
        differs = (~torch.isclose(got, expected, rtol=rtol, atol=atol)).nonzero()
    else:
        differs = (got != expected).nonzero()
    if len(differs) == 0:
        return ""
    index = tuple(int(i) for i in differs[0])
    where = f"element {list(index)}" if got.dim() > 1 else f"element {index[0]}" if index else "the value"
    return f"{where} is {got[index].item():g}, expected {expected[index].item():g}"


def ops_called(ledger: list[dict]) -> list[str]:
    """The torch.distributed calls in a ledger, in order."""
    return [entry["op"] for entry in ledger]


def bytes_sent(ledger: list[dict]) -> int:
    """Bytes this rank handed to send/isend, alone or inside batch_isend_irecv (the ledger's "ops")."""
    alone = sum(entry["bytes"] for entry in ledger if entry["op"] in SENDS)
    batched = sum(nbytes for entry in ledger if entry["op"] == "batch_isend_irecv"
                  for name, _peer, nbytes in entry.get("ops", ()) if name == "isend")
    return alone + batched
