"""09.ring_backward: ring attention's backward with dk and dv travelling around the ring with their blocks.

Each rank is handed its rows of q, k, v, of one process's output and log-sum-exp, and of the output's gradient;
it recomputes each block's probabilities from the log-sum-exp (nothing of the forward's graph is kept) and
returns dq, dk, dv of its own rows. Judged on 2 and 4 ranks (no mask; causal, contiguous and zigzag) against
one process's autograd through `F.scaled_dot_product_attention`, and from the rank's record of its process
group's messages: one neighbour only, k and v sent p - 1 times, the block's dk and dv p times (the last hop
brings them home): no reduce_scatter.
"""

from __future__ import annotations

from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import case_inputs, one_process, positions_of, where
from .ring_common import P2P, REQUIRED, ring_problem, tensor_wrong
from .ring_online import CASES

__all__ = ["RING_BACKWARD"]

HINTS = (
    "Reread lesson 09's appendix (09_appendix_in_depth.ipynb), section 1: attention's backward from the "
    "log-sum-exp, block by block; lesson 09, section 3's gradients: what a rank's queries owe each block's "
    "owner, and where the lesson's reduce_scatter brings it.",
    "dist.batch_isend_irecv with dist.P2POp(dist.isend, ...) and dist.P2POp(dist.irecv, ...) (or dist.isend / "
    "dist.irecv, wait()); torch.exp, Tensor.masked_fill, Tensor.transpose, @; Tensor.sum(-1, keepdim=True).",
    "Rebuild each tile's probabilities from the scores and lse (masked keys 0); the block's dv takes them "
    "against grad_out; the scores' gradient is the probabilities times (the output gradient's projection on "
    "v, minus each row's grad_out . out, which softmax's backward subtracts); dq and the block's dk come from "
    "it, scaled as the scores were. Carry a dk, dv accumulator with each block: add this rank's share, pass it "
    "on to the same neighbour as the block, and after the last step pass it once more: it reaches the owner.",
)


def _cases(nproc: int) -> list[dict[int, tuple]]:
    return [case_inputs(nproc, case, ("q", "k", "v", "out", "lse", "grad")) for case in CASES[nproc]]


def _gradient(name: str):
    def judge(outcome: RunOutcome) -> list[str]:
        for case, rank, result in each_result(outcome):
            said = where(outcome, case, rank, CASES[outcome.nproc])
            if result.output["returned"]:
                return [f"{said}: ring_attention_backward {result.output['returned']}; return (dq, dk, dv), "
                        "three tensors"]
            s, heads, dim, causal, zigzag, seed = CASES[outcome.nproc][case]
            rows = positions_of(s, outcome.nproc, zigzag)[rank]
            want = one_process(s, heads, dim, causal, seed)[name][..., rows, :]
            wrong = tensor_wrong(result.output[name], want)
            if wrong:
                text = f"{said}: {name} {wrong}"
                if name in ("dk", "dv"):
                    for hops, peer in ((-1, (rank + 1) % outcome.nproc), (1, (rank - 1) % outcome.nproc)):
                        other = one_process(s, heads, dim, causal, seed)[name][
                            ..., positions_of(s, outcome.nproc, zigzag)[peer], :]
                        if peer != rank and not tensor_wrong(result.output[name], other):
                            text += (f": it is rank {peer}'s {name}, the block's accumulator stopped one hop "
                                     f"{'short of' if hops < 0 else 'past'} its owner")
                            break
                return [text]
        return []
    return judge


def _messages(outcome: RunOutcome) -> list[str]:
    p = outcome.nproc
    for case, rank, result in each_result(outcome):
        s, heads, dim, *_ = CASES[p][case]
        block = 2 * (s // p) * heads * dim * 4  # k and v of one rank's rows (and dk, dv as many bytes), float32
        bytes_ = (2 * p - 1) * block
        wrong = ring_problem(result.output["messages"], rank, p, {"send": bytes_, "recv": bytes_},
                             f"k and v sent p - 1 = {p - 1} times, each block's dk and dv p = {p} times "
                             "(the last hop brings them to the block's owner)")
        if wrong:
            return [f"{where(outcome, case, rank, CASES[p])}: {wrong}"]
    return []


def _items(nproc: int) -> tuple[Item, ...]:
    return (
        Item(f"dq equals one process's, on every case ({nproc} ranks)", 1, _gradient("dq")),
        Item(f"dk equals one process's, on the block's owner ({nproc} ranks)", 1, _gradient("dk")),
        Item(f"dv equals one process's, on the block's owner ({nproc} ranks)", 1, _gradient("dv")),
        Item(f"around the ring: k, v p - 1 hops, dk, dv p hops, one neighbour each way ({nproc} ranks)", 1,
             _messages),
    )


RING_BACKWARD = Exercise(
    id="09.ring_backward",
    function="ring_attention_backward",
    signature="ring_attention_backward(q, k, v, out, lse, grad_out, positions, causal) -> (dq, dk, dv)",
    driver="ring_backward",
    hints=HINTS,
    allowed_ops=P2P,
    required_ops=REQUIRED,
    runs=(
        RunSpec(2, _cases, _items(2), timeout_s=20),
        RunSpec(4, _cases, _items(4), timeout_s=30),
    ),
)
