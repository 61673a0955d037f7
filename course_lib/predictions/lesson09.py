"""Lesson 09's predictions (see course_lib/predictions/__init__.py).

Each measures from what a run cell of notebooks/09_context_parallel.ipynb published (`cl.results`) and from
the ledger of the cell that published it: the messages and bytes rank 0 sends in one ring-attention forward
on 4 ranks (the ledger's `batch_isend_irecv` records, their "ops" lists), the attention scores each rank
computes there (counted on the ranks), the score tiles ranks compute under a causal mask with the
contiguous and the zigzag split (counted on the ranks), and the bytes rank 0 sends to the other ranks in one
Ulysses forward (the ledger's `all_to_all_single` records).
"""

from __future__ import annotations

from .spec import Prediction

__all__ = ["PREDICTIONS", "causal_tiles", "kept_isends", "sent_to_others"]

FLOAT32 = 4  # bytes


def causal_tiles(rank: int, p: int, zigzag: bool) -> int:
    """Tiles (one chunk of s/2p queries x one chunk of keys) rank `rank` of `p` computes under a causal mask:
    its 2 chunks, chunks 2r and 2r + 1 (contiguous) or r and 2p - 1 - r (zigzag); query chunk c needs key
    chunks 0..c, c + 1 tiles (the last one, the diagonal, masked in half)."""
    chunks = (rank, 2 * p - 1 - rank) if zigzag else (2 * rank, 2 * rank + 1)
    return sum(c + 1 for c in chunks)


def kept_isends(calls: list) -> list[int]:
    """Bytes of each isend in the `batch_isend_irecv` calls after the rank's last barrier (the kept run)."""
    marks = [k for k, c in enumerate(calls) if c["op"] == "barrier"]
    kept = calls[marks[-1] + 1 :] if marks else calls
    return [op[2] for c in kept for op in c.get("ops") or [] if op[0] == "isend"]


def _ring_bytes_measured(results, ledgers) -> tuple:
    sent = kept_isends(ledgers[0])
    return len(sent), sum(sent)


def _ring_bytes_formula(results) -> tuple:
    p = len(results["ring4"])
    _, heads, s, dim = results["ring4"][0]["shape"]       # the whole sequence's q: [1, heads, s, dim]
    block = 2 * heads * (s // p) * dim * FLOAT32           # one rank's k and v, stacked: one message a step
    return p - 1, (p - 1) * block


def _scores_formula(results) -> int:
    p = len(results["ring4"])
    _, heads, s, _ = results["ring4"][0]["shape"]
    return heads * (s // p) * s                            # its s/p queries against all s keys, every head


def _tiles_measured(results, ledgers) -> tuple:
    runs, last = results["causal"], max(results["causal"])
    return runs[0]["contiguous"]["tiles"], runs[last]["contiguous"]["tiles"], runs[0]["zigzag"]["tiles"]


def _tiles_formula(results) -> tuple:
    p = len(results["causal"])
    return causal_tiles(0, p, False), causal_tiles(p - 1, p, False), causal_tiles(0, p, True)


def sent_to_others(call: dict) -> int:
    """Bytes an even all_to_all_single sends to the other ranks: its input's first dimension holds one piece per
    rank (`shapes[0][0]` pieces), and the piece for the rank itself stays."""
    pieces = call["shapes"][0][0]
    return call["bytes"] - call["bytes"] // pieces


def _ulysses_measured(results, ledgers) -> int:
    forward = [c for c in ledgers[0] if c["op"] == "all_to_all_single"][:2]   # q, k, v out; the output back
    return sum(sent_to_others(c) for c in forward)


def _ulysses_formula(results) -> int:
    p = len(results["ulysses4"])
    _, heads, s, dim = results["ulysses4"][0]["shape"]
    rows = heads * (s // p) * dim * FLOAT32                # one of q, k, v, out: this rank's rows, every head
    return (p - 1) * 4 * rows // p                         # q, k, v and the output, (p - 1)/p of each leaves


PREDICTIONS: dict[str, Prediction] = {
    "09.ring_bytes": Prediction(
        id="09.ring_bytes",
        question="ring attention forward on 4 ranks (s = 1024, 4 heads of 32, float32): isends and bytes rank 0 sends",
        needs="ring4",
        measure=_ring_bytes_measured,
        formula=_ring_bytes_formula,
        explanation=("each rank holds s/p = 256 rows; its k and v, stacked, are 2 x 4 heads x 256 x 32 x 4 bytes "
                     "= 262,144 bytes, one message a step. A block visits the other p - 1 = 3 ranks, so rank 0 "
                     "sends 3 messages, 786,432 bytes: (p - 1)/p of the whole sequence's k and v, as an "
                     "all-gather of them would move. Per rank it grows toward the whole sequence's k and v as p "
                     "grows (1/2 on 2 ranks, 3/4 on 4), while the compute per rank falls as 1/p: overlap gets "
                     "harder the more ranks share the sequence."),
        unit="",
    ),
    "09.scores_per_rank": Prediction(
        id="09.scores_per_rank",
        question="ring attention on 4 ranks, no mask (s = 1024, 4 heads): attention scores one rank computes",
        needs="ring4",
        measure=lambda results, ledgers: results["ring4"][0]["scores"],
        formula=_scores_formula,
        explanation=("each rank's s/p = 256 queries meet every one of the s = 1,024 keys, block by block, in "
                     "each of the 4 heads: 4 x 256 x 1,024 = 1,048,576 scores, 1/p of one process's "
                     "4 x 1,024 x 1,024: the quadratic compute is split p ways. This hand-written ring keeps "
                     "every tile for backward (autograd saves each tile's scores and probabilities: "
                     "2 x heads x (s/p) x s x 4 bytes a rank, 8 MiB here); a fused kernel per block saves only "
                     "the log-sum-exp and recomputes the tile in backward, as launch/ring_attention.py does."),
        unit="scores",
    ),
    "09.causal_tiles": Prediction(
        id="09.causal_tiles",
        question="causal ring on 4 ranks, tiles of s/8 x s/8: rank 0 and rank 3 contiguous, rank 0 zigzag",
        needs="causal",
        measure=_tiles_measured,
        formula=_tiles_formula,
        explanation=("cut the sequence into 2p = 8 chunks; query chunk c needs key chunks 0 to c: c + 1 tiles. "
                     "Contiguous, rank r holds chunks 2r and 2r + 1: 4r + 3 tiles, 3 on rank 0 and 15 on rank "
                     "3, five times the work, and the ring lasts at least as long as its busiest rank's compute. Zigzag, rank r "
                     "holds chunks r and 2p - 1 - r: (r + 1) + (2p - r) = 2p + 1 = 9 tiles on every rank; the "
                     "total, p(2p + 1) = 36, is the same."),
        unit="tiles",
    ),
    "09.ulysses_bytes": Prediction(
        id="09.ulysses_bytes",
        question="Ulysses forward on 4 ranks (s = 512, 4 heads of 32, float32): bytes rank 0 sends to the other ranks",
        needs="ulysses4",
        measure=_ulysses_measured,
        formula=_ulysses_formula,
        explanation=("rank 0 holds s/p = 128 rows of q, k and v: 4 heads x 128 x 32 x 4 bytes = 65,536 bytes "
                     "each. The first all-to-all sends q, k and v, the second the output: 4 x 65,536 bytes, of "
                     "which 1/p, the piece of its own heads, stays: 3/4 x 262,144 = 196,608 bytes. The ring sends "
                     "k and v, 131,072 bytes, p - 1 = 3 times: 393,216 bytes. Ulysses over the ring: "
                     "(4(p - 1)/p) / (2(p - 1)) = 2/p, the same at p = 2, half at p = 4; Ulysses' bytes per rank "
                     "fall as 1/p, the ring's stay near the whole sequence's k and v. That holds with as many "
                     "k/v heads as query heads, as here: under grouped-query attention the ring moves only the "
                     "few k/v heads, and Ulysses sends (h + h_kv)/(p h_kv) of the ring's bytes (Llama 3 8B's "
                     "32/8 heads: fewer only beyond p = 5)."),
        unit="B",
    ),
}
