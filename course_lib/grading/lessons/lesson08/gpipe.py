"""08.gpipe: one GPipe training step by hand, any number of ranks, point-to-point messages only.

Judged on 2 and 4 ranks: every stage's gradients equal one process's (the loss averaged over the microbatches),
the loss the last rank returns, the messages each rank sent and received (from the ledger: `m` activations
forward, `m` gradients back, one microbatch each; a message's shape or peer tells which boundary and direction)
and the order each stage ran (hooks on the stage: every forward before the first backward).
"""

from __future__ import annotations

from ....vocabulary import RECEIVES, SENDS
from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import grad_wrong, one_process, where
from .drivers import make_batch, widths

__all__ = ["GPIPE"]

P2P = frozenset((*SENDS, *RECEIVES, "batch_isend_irecv"))
SEED = 8

GPIPE_HINTS = (
    "Reread lesson 08, sections 2-4: what crosses a boundary in each direction, who allocates the buffer, and "
    "GPipe's order (all forwards, then all backwards), with each microbatch's loss divided by m. gloo fills a "
    "receive buffer larger than the message without complaint (only its start), so a wrong shape or dtype "
    "shows up later, at the layer or the loss.",
    "dist.send / dist.recv (or isend / irecv and wait(), or batch_isend_irecv); Tensor.chunk; "
    "Tensor.requires_grad_(); Tensor.detach(); torch.autograd.backward(tensors, grad_tensors).",
    "Cut the rows into m equal microbatches. Forwards first, microbatch by microbatch: a stage after the first "
    "receives its input into a buffer of the microbatch's shape and marks it as needing a gradient; a stage "
    "before the last sends its output's values on and keeps the output; the last computes each microbatch's "
    "loss divided by m and keeps it. Then the backwards, in the same microbatch order: the last stage starts "
    "from its kept losses, the others from the gradient they receive for their kept output; every stage after "
    "the first sends its input's gradient back.",
)


def _cases(nproc: int, ms: tuple[int, ...], rows_per: int) -> list[dict[int, tuple]]:
    cases = []
    for m in ms:
        rows = rows_per * m
        x, y = make_batch(nproc, rows, SEED)
        cases.append({r: (SEED, nproc, m, rows, x if r == 0 else None, y if r == nproc - 1 else None)
                      for r in range(nproc)})
    return cases


def _m(outcome: RunOutcome, case: int) -> int:
    return outcome.inputs[case][0][2]


def _grads_equal(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        _, stages, m, rows, *_ = outcome.inputs[case][rank]
        _, want = one_process(stages, rows, SEED)
        got = result.output["grads"]
        for name, value in want[rank].items():
            wrong = grad_wrong(got.get(name), value)
            if not wrong:
                continue
            said = f"{where(outcome, case, rank, m)}: the gradient of the stage's {name} {wrong}"
            g = got.get(name)
            if g is not None and value.norm() > 0 and not grad_wrong(g / m, value):
                said += (f": it is {m} times one process's: each microbatch's loss must be divided by m = {m} "
                         "before its backward (the mean over microbatches)")
            elif g is None or not g.abs().sum():
                said += (": no gradient came back to this stage; a stage after it must send its input's "
                         "gradient back, so its received input must require a gradient")
            return [said]
    return []


def _loss(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        _, stages, m, rows, *_ = outcome.inputs[case][rank]
        out = result.output
        if out["returned"]:
            return [f"{where(outcome, case, rank, m)}: gpipe_step returned a {out['returned']}; the last rank "
                    "returns the loss as a float (or a one-element tensor), the others None"]
        if rank < stages - 1:
            if out["loss"] is not None:
                return [f"{where(outcome, case, rank, m)}: returned {out['loss']:g}; only the last rank has the "
                        "loss, the others return None"]
            continue
        want, _ = one_process(stages, rows, SEED)
        got = out["loss"]
        if got is None:
            return [f"{where(outcome, case, rank, m)}: returned None; the last rank returns the batch's loss"]
        if abs(got - want) > 1e-5 * abs(want) + 1e-7:
            said = f"{where(outcome, case, rank, m)}: returned the loss {got:g}, one process's is {want:g}"
            if abs(got - m * want) <= 1e-5 * abs(m * want):
                said += f": that is the sum over the {m} microbatches; return their mean"
            return [said]
    return []


def messages(ledger: list[dict], rank: int, stages: int) -> list[tuple[str, str, int]]:
    """This rank's point-to-point messages in call order, each ("send" | "recv", "activation" | "gradient", bytes).

    A batch_isend_irecv entry names each op's peer; a lone send or recv does not, but its shape does: every
    boundary has a width of its own, so the width says which neighbour the tensor comes from or goes to."""
    w = widths(stages)
    found = []
    for entry in ledger:
        if entry["op"] == "batch_isend_irecv":
            for name, peer, nbytes in entry.get("ops", ()):
                way = "send" if name == "isend" else "recv"
                ahead = peer == rank + 1  # the next stage: activations go there, gradients come from there
                found.append((way, "activation" if ahead == (way == "send") else "gradient", nbytes))
        elif entry["op"] in SENDS + RECEIVES:
            way = "send" if entry["op"] in SENDS else "recv"
            width = entry["shapes"][0][-1] if entry["shapes"] and entry["shapes"][0] else None
            ahead = width == w[rank + 1]  # the boundary to the next stage
            found.append((way, "activation" if ahead == (way == "send") else "gradient", entry["bytes"]))
    return found


def _messages(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        _, stages, m, rows, *_ = outcome.inputs[case][rank]
        said = where(outcome, case, rank, m)
        found = messages(result.ledger, rank, stages)
        expected = []
        if rank < stages - 1:
            expected += [("send", "activation", rows * widths(stages)[rank + 1] * 4)]
            expected += [("recv", "gradient", rows * widths(stages)[rank + 1] * 4)]
        if rank > 0:
            expected += [("recv", "activation", rows * widths(stages)[rank] * 4)]
            expected += [("send", "gradient", rows * widths(stages)[rank] * 4)]
        for way, kind, batch_bytes in expected:
            sizes = [n for w, k, n in found if (w, k) == (way, kind)]
            if len(sizes) == m and all(n * m == batch_bytes for n in sizes):
                continue
            verb = "sent" if way == "send" else "received"
            what = f"{kind}s"
            if sizes and sum(sizes) == batch_bytes and len(sizes) < m:
                return [f"{said}: {verb} the {what} in {len(sizes)} message(s) of {sizes[0]:,} bytes, the whole "
                        f"batch's rows at once: GPipe sends one message per microbatch ({m} of {batch_bytes // m:,} bytes), so "
                        "the next stage can start on the first while this one computes the second"]
            return [f"{said}: {verb} {len(sizes)} {what} ({', '.join(f'{n:,}' for n in sizes) or 'none'} "
                    f"bytes); expected {m}, one per microbatch, of {batch_bytes // m:,} bytes each"]
    return []


def _order(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        m = _m(outcome, case)
        ran = [kind for kind, _ in result.output["ran"]]
        if "B" in ran and "F" in ran[ran.index("B"):]:
            shown = " ".join(ran)
            return [f"{where(outcome, case, rank, m)}: the stage ran {shown} (F a forward, B a backward, in "
                    "order): a backward before the last forward; GPipe runs every forward, then every backward"]
    return []


def _items(nproc: int) -> tuple[Item, ...]:
    return (
        Item(f"every stage's gradients equal one process's (loss averaged over the microbatches) ({nproc} ranks)",
             2, _grads_equal),
        Item(f"the last rank returns the batch's loss, the others None ({nproc} ranks)", 1, _loss),
        Item(f"from the ledger: m activations forward and m gradients back per boundary, one microbatch each "
             f"({nproc} ranks)", 1, _messages),
        Item(f"GPipe's order on every stage: all forwards, then all backwards ({nproc} ranks)", 1, _order),
    )


GPIPE = Exercise(
    id="08.gpipe",
    function="gpipe_step",
    signature="gpipe_step(stage, inputs, targets, loss_fn, n_microbatches, input_shape) -> float | None",
    driver="gpipe",
    hints=GPIPE_HINTS,
    allowed_ops=P2P,
    required_ops=frozenset((*SENDS, "batch_isend_irecv")),
    runs=(
        RunSpec(2, lambda n: _cases(n, (2, 4), 3), _items(2), timeout_s=20),
        RunSpec(4, lambda n: _cases(n, (4, 3), 2), _items(4), timeout_s=30),
    ),
)
