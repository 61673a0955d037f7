"""09.ring_online: ring attention's forward with the online softmax's running state carried across the blocks.

Judged on 2 and 4 ranks against one process's `F.scaled_dot_product_attention` (no mask; causal with the
contiguous and the zigzag split): each rank's rows of the output and of the log-sum-exp; from the rank's own
record of its process group's sends and receives, p - 1 transfers of this rank's k and v to one neighbour and
from the other; and from the rank's clocks, every transfer in flight while the rank computes (posted before a
compute, waited after it).
"""

from __future__ import annotations

from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ATOL, RTOL, case_inputs, lse_of, one_process, positions_of, where
from .ring_common import P2P, REQUIRED, attention_wrong, overlap_problem, ring_problem

__all__ = ["RING_ONLINE"]

# (s, heads, dim, causal, zigzag, seed): no mask, then causal on both splits.
CASES = {
    2: ((16, 2, 8, False, False, 91), (16, 2, 8, True, False, 92), (16, 2, 8, True, True, 93)),
    4: ((32, 2, 8, False, False, 94), (32, 2, 8, True, False, 95), (32, 2, 8, True, True, 96)),
}

HINTS = (
    "Reread lesson 09, section 2 (the running max m, the running sum l and acc, rescaled by exp(m_old - m_new) "
    "when a block raises the max) and section 3 (which rank's block a rank holds at each step, and how the next "
    "one travels while this one is computed).",
    "dist.batch_isend_irecv with dist.P2POp(dist.isend, ...) and dist.P2POp(dist.irecv, ...), or dist.isend / "
    "dist.irecv; Work.wait(); torch.maximum, Tensor.amax, torch.exp, Tensor.masked_fill. (A row with no key yet has "
    "m = -inf, and exp(-inf - (-inf)) is nan: it cannot happen here, since a rank's own block comes first and "
    "every query sees its own key; it does in a ring that starts with a received block.)",
    "Start m at -inf, l and acc at 0. At step t the block you hold is rank (rank - t) mod p's, its positions "
    "positions[(rank - t) mod p]. Post the transfer of the block you hold to the next rank (and the receive of "
    "the previous rank's into a new buffer) before computing with it, unless it is the last step; compute the "
    "scores, mask a key whose position is after its query's, raise m, rescale l and acc by exp(old m - new m), "
    "add this block's exponentials; then wait and take the received block. Return acc / l and m + log(l).",
)


def _cases(nproc: int) -> list[dict[int, tuple]]:
    return [case_inputs(nproc, case, ("q", "k", "v")) for case in CASES[nproc]]


def _returned(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        if result.output["returned"]:
            return [f"{where(outcome, case, rank, CASES[outcome.nproc])}: ring_attention_online "
                    f"{result.output['returned']}; return (out, lse), both tensors"]
    return []


def _out(causal: bool):
    def judge(outcome: RunOutcome) -> list[str]:
        problems = _returned(outcome)
        if problems:
            return problems
        for case, rank, result in each_result(outcome):
            s, heads, dim, is_causal, zigzag, seed = CASES[outcome.nproc][case]
            if is_causal != causal:
                continue
            ref = one_process(s, heads, dim, causal, seed)
            rows = positions_of(s, outcome.nproc, zigzag)[rank]
            wrong = attention_wrong(result.output["out"], ref, rows, causal)
            if wrong:
                return [f"{where(outcome, case, rank, CASES[outcome.nproc])}: out {wrong}"]
        return []
    return judge


def _row_max(ref: dict, causal: bool):
    """Each query row's largest score (over the keys it may see): the running max m at the end of the ring."""
    import torch

    scores = ref["q"] @ ref["k"].transpose(-2, -1) / ref["q"].shape[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return scores.amax(-1)


def _lse(outcome: RunOutcome) -> list[str]:
    import torch

    problems = _returned(outcome)
    if problems:
        return problems
    for case, rank, result in each_result(outcome):
        s, heads, dim, causal, zigzag, seed = CASES[outcome.nproc][case]
        ref = one_process(s, heads, dim, causal, seed)
        rows = positions_of(s, outcome.nproc, zigzag)[rank]
        want = ref["lse"][..., rows]
        got = result.output["lse"]
        said = where(outcome, case, rank, CASES[outcome.nproc])
        if got.shape == (*want.shape, 1):
            got = got.squeeze(-1)
        if got.shape != want.shape:
            return [f"{said}: lse has shape {list(got.shape)}, expected {list(want.shape)} (one number per head and "
                    "query row, or with a last dimension of 1)"]
        if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
            index = (~torch.isclose(got, want, rtol=RTOL, atol=ATOL)).nonzero()[0].tolist()
            text = (f"{said}: lse of head {index[1]}, row {index[2]} is {got[tuple(index)].item():.6g}, one "
                    f"process's log-sum-exp of that row's scores is {want[tuple(index)].item():.6g}")
            if causal and torch.allclose(got, lse_of(ref["q"], ref["k"], True, flipped=True)[..., rows],
                                         rtol=RTOL, atol=ATOL):
                text += ": that is the log-sum-exp over the keys at or after each query; mask the keys after it"
            elif torch.allclose(got + _row_max(ref, causal)[..., rows], want, rtol=RTOL, atol=ATOL):
                text += ": that is log(l) without the running max; the log-sum-exp is m + log(l)"
            return [text]
    return []


def _messages(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        s, heads, dim, *_ = CASES[outcome.nproc][case]
        block = 2 * (s // outcome.nproc) * heads * dim * 4  # this rank's k and v, float32
        wrong = ring_problem(result.output["messages"], rank, outcome.nproc, {"send": (outcome.nproc - 1) * block,
                                                                             "recv": (outcome.nproc - 1) * block},
                             "p - 1 transfers of a block's k and v (the last step sends nothing: every rank has "
                             "met every block)")
        if wrong:
            return [f"{where(outcome, case, rank, CASES[outcome.nproc])}: {wrong}"]
    return []


def _overlap(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        wrong = overlap_problem(result.output)
        if wrong:
            return [f"{where(outcome, case, rank, CASES[outcome.nproc])}: {wrong}"]
    return []


def _items(nproc: int) -> tuple[Item, ...]:
    return (
        Item(f"out equals one process's attention, no mask ({nproc} ranks)", 1, _out(False)),
        Item(f"out equals one process's causal attention, contiguous and zigzag splits ({nproc} ranks)", 1,
             _out(True)),
        Item(f"lse equals each query row's log-sum-exp, on every case ({nproc} ranks)", 1, _lse),
        Item(f"p - 1 transfers of k and v, to one neighbour and from the other ({nproc} ranks)", 1, _messages),
        Item(f"every transfer in flight while the rank computes: posted before, waited after ({nproc} ranks)", 1,
             _overlap),
    )


RING_ONLINE = Exercise(
    id="09.ring_online",
    function="ring_attention_online",
    signature="ring_attention_online(q, k, v, positions, causal) -> (out, lse)",
    driver="ring_forward",
    hints=HINTS,
    allowed_ops=P2P,
    required_ops=REQUIRED,
    runs=(
        RunSpec(2, _cases, _items(2), timeout_s=20),
        RunSpec(4, _cases, _items(4), timeout_s=30),
    ),
)
