"""What lesson 09's two ring exercises judge alike: the allowed calls, each rank's output against one process's
rows, the ring's messages (from the rank's record of its process group's sends and receives: peer and bytes)
and the overlap of each transfer with compute (from the rank's clocks: posts, waits, matmuls)."""

from __future__ import annotations

import math

from ....vocabulary import RECEIVES, SENDS

__all__ = ["P2P", "REQUIRED", "attention_wrong", "overlap_problem", "ring_problem", "tensor_wrong"]

P2P = frozenset((*SENDS, *RECEIVES, "batch_isend_irecv"))
REQUIRED = frozenset((*SENDS, "batch_isend_irecv"))


def tensor_wrong(got, want) -> str:
    """"" if `got` equals `want` (RTOL, ATOL); else where it differs first ([1, heads, rows, dim]), in words."""
    import torch

    from .common import ATOL, RTOL

    if got.shape != want.shape:
        return f"has shape {list(got.shape)}, expected {list(want.shape)}"
    close = torch.isclose(got, want, rtol=RTOL, atol=ATOL)
    if close.all():
        return ""
    _, head, row, col = (~close).nonzero()[0].tolist()
    return (f"differs from one process's at head {head}, row {row}, column {col}: {got[0, head, row, col].item():.6g} "
            f"where one process has {want[0, head, row, col].item():.6g}")


def attention_wrong(got, ref: dict, rows, causal: bool) -> str:
    """"" if `got` is one process's output at `rows`; else how it differs, and, causal, whether it is the
    attention with the mask on the wrong side (each query over the keys at or after it)."""
    import torch

    wrong = tensor_wrong(got, ref["out"][..., rows, :])
    if wrong and causal and got.shape == ref["out"][..., rows, :].shape:
        q, k, v = ref["q"], ref["k"], ref["v"]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        index = torch.arange(q.shape[-2])
        flipped = torch.softmax(scores.masked_fill(index[None, :] < index[:, None], float("-inf")), -1) @ v
        if not tensor_wrong(got, flipped[..., rows, :]):
            wrong += (": it is attention over the keys at or after each query: the mask is on the wrong side "
                      "(mask a key whose position is after its query's)")
    return wrong


def ring_problem(messages: list, rank: int, p: int, expected: dict[str, int], what: str) -> str:
    """"" if this rank sent to one neighbour and received from the other, the bytes `expected` ({"send": n,
    "recv": n}); else what is wrong. `what` says what the expected bytes are."""
    sent = {peer for kind, peer, *_ in messages if kind == "send"}
    received = {peer for kind, peer, *_ in messages if kind == "recv"}
    neighbours = {(rank + 1) % p, (rank - 1) % p}
    if len(sent) > 1 or not sent <= neighbours:
        return (f"sent to ranks {', '.join(map(str, sorted(sent)))}: in a ring each rank sends to one neighbour "
                f"only ({' or '.join(map(str, sorted(neighbours)))})")
    if len(received) > 1 or not received <= neighbours or (p > 2 and sent and sent == received):
        return (f"received from ranks {', '.join(map(str, sorted(received)))} and sent to "
                f"{', '.join(map(str, sorted(sent)))}: in a ring each rank receives from the neighbour it does not "
                "send to")
    for kind in ("send", "recv"):
        sizes = [n for k, _, n, *_ in messages if k == kind]
        if sum(sizes) != expected[kind]:
            verb = "sent" if kind == "send" else "received"
            return (f"{verb} {sum(sizes):,} bytes in {len(sizes)} message(s); expected {expected[kind]:,}: {what}")
    return ""


def overlap_problem(output: dict) -> str:
    """"" if every receive was waited for only after some compute since it was posted; else the first that was
    not (a transfer waited for with no compute in between: the rank sat idle while the block travelled)."""
    receives = [m for m in output["messages"] if m[0] == "recv"]
    for number, (_, peer, _, _, posted, work) in enumerate(receives, 1):
        waited = [start for start, _, on in output["waits"] if on == work]   # the wait on this receive's own Work
        if not waited:
            return (f"receive {number} (from rank {peer}) was never waited for: its buffer may not be filled when "
                    "you read it; call wait() on what the call returned before using it")
        if not any(posted <= t <= waited[0] for t in output["computes"]):
            return (f"receive {number} (from rank {peer}) was waited for right after it was posted, with no compute "
                    "in between: the rank sat idle while the block travelled. Post the transfer, compute with the "
                    "block you hold, then wait (dist.send and dist.recv wait at once)")
    return ""
