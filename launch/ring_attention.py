"""Ring attention by hand, for context parallelism (`train.py --cp N`): causal attention over a sequence cut
into N contiguous slices, one per rank of the cp group, registered with transformers as "ring".

Forward: each rank keeps its queries; the key/value blocks travel round the ring (`batch_isend_irecv`: send to
the next cp rank, receive from the previous), and each rank merges the blocks it sees with an online softmax
(a running log-sum-exp), so no rank ever holds the whole sequence's keys or scores.
Backward (by hand, not autograd): a second trip round the ring; each key/value block travels with its gradient
accumulators (dk, dv), every rank adds its queries' part, and after N hops the accumulators are home.

Causal with contiguous slices: rank r's queries see all of the blocks of ranks < r, their own block up to
the diagonal, and nothing of ranks > r (those blocks are passed on unread). So rank N-1 computes N blocks and
rank 0 one: the load imbalance that zigzag slices (rank r holding chunks r and 2N-1-r) would even out.

Torch's own `context_parallel` does this for CUDA's attention kernels only (on CPU it fails with
"... _scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered").
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NAME = "ring"  # the `attn_implementation` a model selects with `model.set_attn_implementation(NAME)`


def ring_pass(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Send `tensor` to the next rank of `group`'s ring and return the previous rank's (one P2P pair each)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), group=group, group_peer=(rank + 1) % size),
           dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % size)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    """Scaled scores of the local queries against one block of keys; the diagonal block is causal within itself."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal:  # same positions on both sides: query i sees keys 0..i of the block
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


class RingAttention(torch.autograd.Function):
    """softmax(q k^T * scale, causal) v over the whole sequence, q/k/v (batch, heads, slice, head_dim) per rank."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, group: dist.ProcessGroup):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        qf = q.float()  # accumulate in float32 whatever the model's dtype
        kv = torch.stack([k, v]).float()
        out = lse = None
        for step in range(size):
            source = (rank - step) % size  # whose block this rank holds now
            if source <= rank:  # a later slice's keys are all in this rank's future: skipped
                s = _scores(qf, kv[0], scale, diagonal=source == rank)
                block_lse = torch.logsumexp(s, dim=-1, keepdim=True)
                block_out = torch.matmul(torch.exp(s - block_lse), kv[1])
                if out is None:  # step 0: the own (diagonal) block
                    out, lse = block_out, block_lse
                else:  # online softmax: rescale both partial results to the merged normaliser
                    merged = torch.logaddexp(lse, block_lse)
                    out = out * torch.exp(lse - merged) + block_out * torch.exp(block_lse - merged)
                    lse = merged
            if step < size - 1:
                kv = ring_pass(kv, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group = scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale, group = ctx.scale, ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        qf, do = q.float(), grad_out.float()
        delta = (do * out).sum(-1, keepdim=True)  # rowsum(dO * O): the softmax's backward term
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v]).float()
        dkv = torch.zeros_like(kv)  # travels with its block: every rank adds its queries' gradient
        for step in range(size):
            source = (rank - step) % size
            if source <= rank:
                p = torch.exp(_scores(qf, kv[0], scale, diagonal=source == rank) - lse)  # the forward's softmax
                dkv[1] += torch.matmul(p.transpose(-1, -2), do)
                ds = p * (torch.matmul(do, kv[1].transpose(-1, -2)) - delta)
                dq += torch.matmul(ds, kv[0]) * scale
                dkv[0] += torch.matmul(ds.transpose(-1, -2), qf) * scale
            if step < size - 1:
                kv = ring_pass(kv, group)
            dkv = ring_pass(dkv, group)  # N hops in all: block r's gradients end on rank r
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def register(group: dist.ProcessGroup) -> str:
    """Register ring attention over the cp `group` with transformers' AttentionInterface (transformers 5.24 here).

    The model must get each rank's slice with its global `position_ids` (for the rotary embeddings). The
    causal mask comes from the slices' order: transformers builds no mask for "ring" (it has no mask function
    registered), so a padding mask given to the model never arrives here; train.py pads nothing.
    """
    from transformers import AttentionInterface

    def ring_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if attention_mask is not None or dropout:  # a mask only if a mask function were registered for NAME
            raise ValueError("ring attention here is causal only: no padding mask, no attention dropout")
        groups = query.shape[1] // key.shape[1]  # grouped-query attention: each KV head serves `groups` heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = RingAttention.apply(query, key, value, scale, group)
        return out.transpose(1, 2).contiguous(), None  # (batch, slice, heads, head_dim), as transformers expects

    AttentionInterface.register(NAME, ring_attention)
    return NAME
