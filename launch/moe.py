"""Mixture of experts for launch/train.py: a tiny Mixtral, and expert parallelism written by hand.

`make_mixtral` builds transformers' `MixtralForCausalLM` (transformers 5.24 here) with the tiny Llama's sizes:
each decoder layer's MLP is a `MixtralSparseMoeBlock`, a router (`gate`: softmax over the experts, top-2,
renormalised) and `experts`, whose weights are two 3-D parameters, `gate_up_proj [E, 2I, H]` and
`down_proj [E, H, I]`. `ExpertParallelExperts` replaces `experts` on each rank with its E/ep experts
(a slice along dim 0) and a forward that sends every token to the ranks holding its experts:

1. one `all_to_all_single` of the token counts per expert: each rank learns how many rows it will receive,
   from whom, for which of its experts;
2. one `all_to_all_single` of the rows themselves, with uneven split sizes (`AllToAll`, whose backward is
   the reverse all-to-all: the rows' gradients go home the way the rows came);
3. the local experts on the rows they received;
4. the reverse all-to-all brings the results home, where the router's weights scale them and each token
   sums its top-2 experts' outputs.

Every rank routes its own tokens: the router and the rest of the model are data-parallel (FSDP2).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from train_flags import TOP_K  # noqa: F401 - Mixtral's num_experts_per_tok, 2: the flags check it too


def make_mixtral(experts: int, seed: int = 0, **sizes):
    """A `MixtralForCausalLM` with `experts` experts per layer, random weights from `seed`, on CPU.

    `sizes` are the tiny Llama's (course_lib.models.LLAMA_CONFIG). No jitter on the router (it would draw
    different noise on every rank); no auxiliary load-balancing loss (`output_router_logits=False`, the
    default), on one process as on many. Experts run by Mixtral's own loop ("eager"), the reference.
    """
    from transformers import MixtralConfig, MixtralForCausalLM  # imported here: transformers is slow to import

    torch.manual_seed(seed)
    config = MixtralConfig(**sizes, num_local_experts=experts, num_experts_per_tok=TOP_K, router_jitter_noise=0.0,
                           output_router_logits=False, experts_implementation="eager")
    return MixtralForCausalLM(config)


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits, differentiable: the backward is the same exchange reversed."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ExpertParallelExperts(torch.nn.Module):
    """This ep rank's E/ep experts of a `MixtralExperts`, and a forward that exchanges tokens over `ep_mesh`.

    The parameters keep Mixtral's names and become DTensors sharded along dim 0 (the expert index) on
    `ep_mesh`: FSDP2 can shard them further over the ranks that hold the same experts, and a DCP
    checkpoint stores each expert once, under its global index: it loads under another ep, without EP, or in
    one process (each checked; launch/README.md).
    """

    def __init__(self, experts: torch.nn.Module, ep_mesh):
        from torch.distributed.tensor import DTensor, Shard

        super().__init__()
        self.num_experts, self.act_fn, self.ep_mesh = experts.num_experts, experts.act_fn, ep_mesh
        ep, me = ep_mesh.size(), ep_mesh.get_local_rank()
        self.local = self.num_experts // ep
        mine = slice(me * self.local, (me + 1) * self.local)  # every rank built all E experts: the same seed
        for name in ("gate_up_proj", "down_proj"):
            local = getattr(experts, name).detach()[mine].clone()
            setattr(self, name, torch.nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden (tokens, H), each token's experts and router weights (tokens, k) -> the weighted sum (tokens, H)."""
        group, ep = self.ep_mesh.get_group(), self.ep_mesh.size()
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()  # (E/ep, 2I, H), (E/ep, H, I)
        if gate_up.requires_grad:
            # An expert's gradient comes back summed over the ep ranks whose tokens it served, and FSDP2 then
            # averages it over the dp_mod_ep ranks that hold the same expert: / ep as well makes it the mean
            # over all ranks' losses, as for every other parameter (torchtitan gets the same by setting the
            # experts' FSDP2 gradient divide factor to the whole dp size; done here by hand because that factor
            # becomes a PREMUL_SUM reduction, which gloo lacks, and FSDP2's sum-then-divide path divides twice
            # on a one-rank mesh, as dp_mod_ep is with ep = world: torch 2.13 and 2.15).
            for weight in (gate_up, down):
                weight.register_hook(lambda grad: grad / ep)
        expert = top_k_index.flatten()  # (tokens x k): token t's j-th choice at t * k + j
        order = torch.argsort(expert, stable=True)  # grouped by expert, hence by destination rank
        token = order // top_k_index.shape[1]
        # 1. Counts per expert, E/ep of them to each rank: afterwards got[s * local + l] is the number of rows
        #    rank s will send for my local expert l.
        sent = torch.bincount(expert, minlength=self.num_experts)
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent, group=group)
        send_splits = sent.view(ep, self.local).sum(1).tolist()  # split sizes are Python ints (host sync on GPU)
        recv_splits = got.view(ep, self.local).sum(1).tolist()
        # 2. The rows, grouped by source rank, then by my local expert within each source.
        rows = AllToAll.apply(hidden[token], recv_splits, send_splits, group)
        # 3. Each local expert on its rows (Mixtral's SiLU-gated MLP), in an order sorted by local expert.
        which = torch.repeat_interleave(torch.arange(self.local, device=got.device).repeat(ep), got)
        by_expert = torch.argsort(which, stable=True)
        outs, start = [], 0
        for i, n in enumerate(torch.bincount(which, minlength=self.local).tolist()):
            x = rows[by_expert[start:start + n]]
            gate, up = torch.nn.functional.linear(x, gate_up[i]).chunk(2, dim=-1)
            outs.append(torch.nn.functional.linear(self.act_fn(gate) * up, down[i]))
            start += n
        done = torch.cat(outs)[torch.argsort(by_expert)]  # back to the order the rows arrived in
        # 4. Home again, weighted by the router, each token's k results summed (Mixtral's index_add).
        back = AllToAll.apply(done, send_splits, recv_splits, group)
        weighted = back * top_k_weights.flatten()[order, None].to(back.dtype)
        return torch.zeros_like(hidden).index_add(0, token, weighted.to(hidden.dtype))


def expert_parallel(model: torch.nn.Module, ep_mesh) -> None:
    """Replace every decoder layer's experts by this rank's share of them (E/ep), exchanging tokens on ep_mesh."""
    for layer in model.model.layers:
        layer.mlp.experts = ExpertParallelExperts(layer.mlp.experts, ep_mesh)
