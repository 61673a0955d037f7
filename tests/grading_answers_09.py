"""Answer cells for lesson 09's grader tests: the solutions (as in solutions/09_context_parallel_solutions.ipynb)
and plausible wrong answers, each of which must lose exactly the points its mistake deserves."""

RING_ONLINE_SOLUTION = '''%%exercise 09.ring_online
import math
import torch
import torch.distributed as dist


def ring_attention_online(q, k, v, positions, causal):
    rank, p = dist.get_rank(), dist.get_world_size()
    after, before = (rank + 1) % p, (rank - 1) % p
    width = q.shape[-1]
    row_max = torch.full((*q.shape[:-1], 1), -math.inf)    # per query row: the largest score met so far
    denom = torch.zeros_like(row_max)                      # sum of exp(score - row_max) so far
    numer = torch.zeros_like(q)                            # the same weights times the values
    held = torch.cat((k, v), dim=-1)                       # k and v side by side: one message per hop
    for hop in range(p):
        owner = (rank - hop) % p                           # whose rows of k and v are in hand
        last = hop == p - 1
        if not last:                                       # the next block travels during this compute
            arriving = torch.empty_like(held)
            pending = dist.batch_isend_irecv([dist.P2POp(dist.isend, held, after),
                                              dist.P2POp(dist.irecv, arriving, before)])
        keys, vals = held[..., :width], held[..., width:]
        logits = torch.matmul(q, keys.transpose(-1, -2)) / math.sqrt(width)
        if causal:                                         # a key later than its query is not seen
            later = positions[owner].unsqueeze(0) > positions[rank].unsqueeze(1)
            logits = logits.masked_fill(later, -math.inf)
        new_max = torch.maximum(row_max, logits.amax(dim=-1, keepdim=True))
        base = torch.where(new_max == -math.inf, torch.zeros_like(new_max), new_max)  # no key yet: no nan
        shrink = torch.exp(row_max - base)                 # what was summed under the old max, rescaled
        weights = torch.exp(logits - base)
        denom = denom * shrink + weights.sum(dim=-1, keepdim=True)
        numer = numer * shrink + torch.matmul(weights, vals)
        row_max = new_max
        if not last:
            for work in pending:
                work.wait()
            held = arriving
    return numer / denom, (row_max + torch.log(denom)).squeeze(-1)
'''

# The max of each block alone, the sums never rescaled: rows whose max rises later keep old terms at the wrong
# scale (the "max not carried between blocks").
RING_ONLINE_MAX_NOT_CARRIED = RING_ONLINE_SOLUTION.replace(
    "new_max = torch.maximum(row_max, logits.amax(dim=-1, keepdim=True))",
    "new_max = logits.amax(dim=-1, keepdim=True)").replace(
    "shrink = torch.exp(row_max - base)                 # what was summed under the old max, rescaled",
    "shrink = 1.0")
assert RING_ONLINE_MAX_NOT_CARRIED.count("shrink = 1.0") == 1

# The causal mask on the wrong side: keys before the query masked.
RING_ONLINE_MASK_WRONG_SIDE = RING_ONLINE_SOLUTION.replace(
    "later = positions[owner].unsqueeze(0) > positions[rank].unsqueeze(1)",
    "later = positions[owner].unsqueeze(0) < positions[rank].unsqueeze(1)")
assert RING_ONLINE_MASK_WRONG_SIDE != RING_ONLINE_SOLUTION

# Whole blocks skipped under the causal mask on the wrong side: a block is left out when all its keys come
# before the queries (instead of after), and the diagonal is masked right.
RING_ONLINE_BLOCK_SKIP_WRONG_SIDE = RING_ONLINE_SOLUTION.replace(
    "        if causal:                                         # a key later than its query is not seen\n",
    "        if causal and positions[owner].max() < positions[rank].min():\n"
    "            logits = torch.full_like(logits, -math.inf)   # (wrong: these keys are all visible)\n"
    "        if causal:                                         # a key later than its query is not seen\n")
assert RING_ONLINE_BLOCK_SKIP_WRONG_SIDE != RING_ONLINE_SOLUTION

# The receive posted to the rank it sends to: on 4 ranks every rank waits for a block nobody sends it.
RING_ONLINE_RECEIVE_FROM_AFTER = RING_ONLINE_SOLUTION.replace("dist.P2POp(dist.irecv, arriving, before)",
                                                              "dist.P2POp(dist.irecv, arriving, after)")
assert RING_ONLINE_RECEIVE_FROM_AFTER != RING_ONLINE_SOLUTION

# The transfer waited for as soon as it is posted, the compute after: right values, nothing overlapped.
RING_ONLINE_WAIT_AT_ONCE = RING_ONLINE_SOLUTION.replace(
    "        if not last:\n            for work in pending:\n                work.wait()\n            held = arriving\n",
    "        if not last:\n            held = arriving\n").replace(
    "                                              dist.P2POp(dist.irecv, arriving, before)])\n",
    "                                              dist.P2POp(dist.irecv, arriving, before)])\n"
    "            for work in pending:\n"
    "                work.wait()                          # (wrong: before the compute)\n")
assert RING_ONLINE_WAIT_AT_ONCE.count("work.wait()") == 1

# The block sent on at the last step too: p transfers where p - 1 are needed (the values are right).
RING_ONLINE_EXTRA_HOP = (RING_ONLINE_SOLUTION.replace("        last = hop == p - 1\n", "        last = False\n")
                         .replace("    for hop in range(p):\n", "    for hop in range(p):\n"))
assert "last = False" in RING_ONLINE_EXTRA_HOP

# k and v as two tensors, an isend and an irecv each, waited after the compute: right, done differently.
RING_ONLINE_SEPARATE = RING_ONLINE_SOLUTION.replace('''            arriving = torch.empty_like(held)
            pending = dist.batch_isend_irecv([dist.P2POp(dist.isend, held, after),
                                              dist.P2POp(dist.irecv, arriving, before)])''','''            arriving = torch.empty_like(held)
            ka, va = arriving[..., :width], arriving[..., width:]
            kb, vb = torch.empty_like(k), torch.empty_like(v)
            pending = [dist.isend(held[..., :width].contiguous(), after), dist.isend(held[..., width:].contiguous(), after),
                       dist.irecv(kb, before), dist.irecv(vb, before)]''').replace('''            held = arriving
    return''','''            held = torch.cat((kb, vb), dim=-1)
    return''')
assert RING_ONLINE_SEPARATE != RING_ONLINE_SOLUTION
# The log-sum-exp taken with torch.logsumexp (refused: the exercise carries the running state itself).
RING_ONLINE_LOGSUMEXP = RING_ONLINE_SOLUTION.replace("(row_max + torch.log(denom)).squeeze(-1)", "torch.logsumexp(torch.log(denom) + row_max, -1)")
# Blocking send and recv, ordered by the rank's parity so that they cannot deadlock: right values, no overlap.
RING_ONLINE_BLOCKING = RING_ONLINE_SOLUTION.replace('''            arriving = torch.empty_like(held)
            pending = dist.batch_isend_irecv([dist.P2POp(dist.isend, held, after),
                                              dist.P2POp(dist.irecv, arriving, before)])''','''            arriving = torch.empty_like(held)
            if rank % 2 == 0:
                dist.send(held, after); dist.recv(arriving, before)
            else:
                dist.recv(arriving, before); dist.send(held, after)
            pending = []''')
assert RING_ONLINE_BLOCKING != RING_ONLINE_SOLUTION

RING_BACKWARD_SOLUTION = '''%%exercise 09.ring_backward
import math
import torch
import torch.distributed as dist


def ring_attention_backward(q, k, v, out, lse, grad_out, positions, causal):
    rank, p = dist.get_rank(), dist.get_world_size()
    after, before = (rank + 1) % p, (rank - 1) % p
    width = q.shape[-1]
    scale = 1 / math.sqrt(width)
    row_dot = (grad_out * out).sum(dim=-1, keepdim=True)   # D: what every probability's gradient subtracts
    log_norm = lse.unsqueeze(-1)
    dq = torch.zeros_like(q)
    held = torch.cat((k, v), dim=-1)                       # the block in hand
    owed = torch.zeros_like(held)                          # its dk, dv, summed over the ranks it has visited
    for hop in range(p):
        owner = (rank - hop) % p
        if hop < p - 1:                                    # the next block's k, v travel during this compute
            arriving = torch.empty_like(held)
            pending = dist.batch_isend_irecv([dist.P2POp(dist.isend, held, after),
                                              dist.P2POp(dist.irecv, arriving, before)])
        keys, vals = held[..., :width], held[..., width:]
        logits = torch.matmul(q, keys.transpose(-1, -2)) * scale
        if causal:
            later = positions[owner].unsqueeze(0) > positions[rank].unsqueeze(1)
            logits = logits.masked_fill(later, -math.inf)
        probs = torch.exp(logits - log_norm)              # this block's share of each row's softmax
        d_logits = probs * (torch.matmul(grad_out, vals.transpose(-1, -2)) - row_dot)
        dq = dq + torch.matmul(d_logits, keys) * scale
        mine = torch.cat((torch.matmul(d_logits.transpose(-1, -2), q) * scale,
                          torch.matmul(probs.transpose(-1, -2), grad_out)), dim=-1)
        # The accumulator goes on with its block; after the last hop it reaches the block's owner.
        carried = torch.empty_like(owed)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, owed + mine, after),
                                            dist.P2POp(dist.irecv, carried, before)]):
            work.wait()
        owed = carried
        if hop < p - 1:
            for work in pending:
                work.wait()
            held = arriving
    return dq, owed[..., :width], owed[..., width:]
'''

# D left out (the softmax's Jacobian without its subtracted term): dv is right, dq and dk are not.
RING_BACKWARD_NO_ROW_DOT = RING_BACKWARD_SOLUTION.replace(
    "vals.transpose(-1, -2)) - row_dot)", "vals.transpose(-1, -2)))")
assert RING_BACKWARD_NO_ROW_DOT != RING_BACKWARD_SOLUTION

# The accumulator passed on p - 1 times only (as the blocks are): each rank ends with its next rank's dk, dv.
RING_BACKWARD_ONE_HOP_SHORT = RING_BACKWARD_SOLUTION.replace(
    "        carried = torch.empty_like(owed)\n"
    "        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, owed + mine, after),\n"
    "                                            dist.P2POp(dist.irecv, carried, before)]):\n"
    "            work.wait()\n"
    "        owed = carried\n",
    "        owed = owed + mine\n"
    "        if hop < p - 1:\n"
    "            carried = torch.empty_like(owed)\n"
    "            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, owed, after),\n"
    "                                                dist.P2POp(dist.irecv, carried, before)]):\n"
    "                work.wait()\n"
    "            owed = carried\n")
assert "if hop < p - 1:\n            carried" in RING_BACKWARD_ONE_HOP_SHORT

# dk without the 1 / sqrt(dim) of the scores: dk wrong, the rest right.
RING_BACKWARD_DK_UNSCALED = RING_BACKWARD_SOLUTION.replace(
    "torch.matmul(d_logits.transpose(-1, -2), q) * scale,", "torch.matmul(d_logits.transpose(-1, -2), q),")
assert RING_BACKWARD_DK_UNSCALED != RING_BACKWARD_SOLUTION

ZIGZAG_SOLUTION = '''%%exercise 09.zigzag
import torch


def zigzag_split(x, p):
    pieces = torch.tensor_split(x, 2 * p, dim=-2)         # any length: the first s % 2p one row longer
    return [torch.cat((pieces[r], pieces[-1 - r]), dim=-2) for r in range(p)]


def zigzag_merge(shards):
    p = len(shards)
    s = sum(t.shape[-2] for t in shards)
    base, extra = divmod(s, 2 * p)
    size = [base + (c < extra) for c in range(2 * p)]      # tensor_split's chunk sizes
    place = [None] * (2 * p)
    for r, t in enumerate(shards):
        place[r], place[-1 - r] = t.split([size[r], size[-1 - r]], dim=-2)
    return torch.cat(place, dim=-2)
'''

# torch.chunk instead of tensor_split: fewer than 2p chunks when 2p does not divide s (or uneven ones).
ZIGZAG_CHUNK = ZIGZAG_SOLUTION.replace("pieces = torch.tensor_split(x, 2 * p, dim=-2)", "pieces = x.chunk(2 * p, dim=-2)")
assert ZIGZAG_CHUNK != ZIGZAG_SOLUTION

# The second chunk counted from the wrong end: p - 1 - r instead of 2p - 1 - r.
ZIGZAG_WRONG_END = ZIGZAG_SOLUTION.replace("torch.cat((pieces[r], pieces[-1 - r]), dim=-2)",
                                           "torch.cat((pieces[r], pieces[p - 1 - r]), dim=-2)")
assert ZIGZAG_WRONG_END != ZIGZAG_SOLUTION

# The merge concatenates the shards in rank order: the zigzag order, not the sequence's.
ZIGZAG_MERGE_RANK_ORDER = ZIGZAG_SOLUTION.replace("    return torch.cat(place, dim=-2)\n",
                                                  "    return torch.cat(shards, dim=-2)\n")
assert ZIGZAG_MERGE_RANK_ORDER != ZIGZAG_SOLUTION

# The merge takes every chunk as s // 2p rows: right only when 2p divides s.
ZIGZAG_MERGE_FLOOR = ZIGZAG_SOLUTION.replace("size = [base + (c < extra) for c in range(2 * p)]",
                                             "size = [base] * (2 * p)")
assert ZIGZAG_MERGE_FLOOR != ZIGZAG_SOLUTION


# Right, written differently: the send waited for before the compute (the block has left), the receive after.
RING_ONLINE_SEND_WAITED_FIRST = RING_ONLINE_SOLUTION.replace(
    """            pending = dist.batch_isend_irecv([dist.P2POp(dist.isend, held, after),
                                              dist.P2POp(dist.irecv, arriving, before)])
""", """            sending = dist.isend(held, after)
            pending = [dist.irecv(arriving, before)]
            sending.wait()                                 # my block has left (the receive still in flight)
""")
assert RING_ONLINE_SEND_WAITED_FIRST != RING_ONLINE_SOLUTION

# No wait at all: the works batch_isend_irecv returns are dropped (the buffer read before it is filled).
RING_ONLINE_NO_WAIT = RING_ONLINE_SOLUTION.replace(
    "            for work in pending:\n                work.wait()\n            held = arriving\n",
    "            held = arriving\n")
assert RING_ONLINE_NO_WAIT != RING_ONLINE_SOLUTION

# One isend more at the last step, which no rank receives (the values are right): gloo never completes it.
RING_ONLINE_UNMATCHED_SEND = RING_ONLINE_SOLUTION.replace(
    "        if not last:\n            for work in pending:",
    "        if last:\n            dist.isend(held, after)\n        if not last:\n            for work in pending:")
assert RING_ONLINE_UNMATCHED_SEND != RING_ONLINE_SOLUTION

# The running state kept in float64 (the values are right; the statements ask for values, not a dtype).
# The blocks travel in float32 as given; each is computed with in float64.
RING_ONLINE_FLOAT64 = RING_ONLINE_SOLUTION.replace(
    "    held = torch.cat((k, v), dim=-1)",
    "    q, row_max, denom, numer = q.double(), row_max.double(), denom.double(), numer.double()\n"
    "    held = torch.cat((k, v), dim=-1)").replace(
    "keys, vals = held[..., :width], held[..., width:]",
    "keys, vals = held[..., :width].double(), held[..., width:].double()")
assert RING_ONLINE_FLOAT64.count(".double()") == 6
assert RING_ONLINE_FLOAT64 != RING_ONLINE_SOLUTION

# The log-sum-exp returned as log(l), without the running max m.
RING_ONLINE_LSE_WITHOUT_MAX = RING_ONLINE_SOLUTION.replace("(row_max + torch.log(denom)).squeeze(-1)",
                                                           "torch.log(denom).squeeze(-1)")
assert RING_ONLINE_LSE_WITHOUT_MAX != RING_ONLINE_SOLUTION
