"""01.ring_allreduce: a chunked ring all-reduce built from isend/irecv, checked on 2 and 4 real ranks.

Judges: every rank holds the exact sum (integer-valued inputs, float32 and int64), and no rank sends more
than a ring's 2(N-1)/N of the tensor (nor less than the tensor, which would mean the sum came from
somewhere the ledger cannot see). They recognise an unchanged tensor, an average instead of a sum, the
whole tensor passed around, and buffers of a narrower dtype than the tensor.
"""

from __future__ import annotations

import math

from ....units import binary_bytes
from ....vocabulary import SENDS
from ...compare import bytes_sent, each_result, first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import P2P_OPS, _case_label, _int64, _integer_tensors

__all__ = ["RING", "_ring_sums"]


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

        problems, reported = [], set()  # one rank per case is enough to see the pattern
        n = outcome.nproc
        for case, rank, result in each_result(outcome):
            if case in reported or (cases is not None and case not in cases):
                continue
            too_little = _sent_too_little(outcome, case, rank)
            if too_little:
                problems.append(too_little)
                reported.add(case)
                continue
            expected = sum(outcome.inputs[case][r][0] for r in range(n))
            got = result.output["tensor"]
            wrong = first_difference(got, expected)
            if not wrong:
                continue
            hint = ""
            if torch.equal(got, outcome.inputs[case][rank][0]):
                hint = ": the tensor is unchanged; did the ranks exchange anything?"
            elif got.shape == expected.shape and torch.allclose(got.double(), expected.double() / n):
                hint = f": that is the sum divided by {n}; sum, do not average"
            problems.append(f"rank {rank}, {_case_label(outcome, case)}: {wrong}{hint}")
            reported.add(case)
        return problems

    return judge


def _ring_bandwidth(outcome: RunOutcome) -> list[str]:
    """Judge: no rank sends more than a chunked ring's 2(N-1)/N of the tensor (nor less than the tensor once)."""
    n = outcome.nproc
    for case, rank, result in each_result(outcome):
        tensor = outcome.inputs[case][0][0]
        size = tensor.numel() * tensor.element_size()
        # A ring over n chunks sends n-1 chunks to reduce and n-1 to gather: 2(n-1)/n of the
        # tensor, rounded up to whole chunks when the size does not divide by n.
        bound = 2 * (n - 1) * math.ceil(tensor.numel() / n) * tensor.element_size()
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
