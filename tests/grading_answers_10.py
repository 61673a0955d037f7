"""Answer cells for lesson 10's grader tests: the solutions (as in solutions/10_moe_expert_parallel_solutions.ipynb)
and plausible wrong answers, each of which must lose exactly the points its mistake deserves."""

PRIORITY_SOLUTION = '''%%exercise 10.priority_capacity
import math
import torch


def priority_moe(x, params, k, factor, route, expert_mlp):
    probs, weights, experts = route(x, params["router"], k)
    n_tokens, n_experts = probs.shape
    room = math.ceil(factor * n_tokens * k / n_experts)       # pairs each expert takes
    ranked = probs.amax(dim=1).argsort(descending=True, stable=True)   # surest tokens first
    line = experts[ranked].T.reshape(-1)                     # all first choices, then all second choices
    taken = torch.zeros(n_experts, dtype=torch.long)
    admit = torch.zeros(line.numel(), dtype=torch.bool)
    for i, e in enumerate(line.tolist()):                    # T * k steps: small enough to walk
        admit[i] = taken[e] < room
        taken[e] += 1
    kept = torch.zeros_like(experts, dtype=torch.bool)
    kept[ranked] = admit.reshape(k, n_tokens).T
    gains = weights * kept                                   # a dropped pair adds nothing
    out = torch.zeros_like(x)
    for e in range(n_experts):
        who, slot = torch.where(experts == e)
        if who.numel():
            y = expert_mlp(x[who], params["gate_up"][e], params["down"][e])
            out = out.index_add(0, who, y * gains[who, slot].unsqueeze(1))
    return out, kept
'''

# The lesson's position order: the tokens not ranked.
PRIORITY_POSITION = PRIORITY_SOLUTION.replace(
    "ranked = probs.amax(dim=1).argsort(descending=True, stable=True)", "ranked = torch.arange(n_tokens)")
assert PRIORITY_POSITION != PRIORITY_SOLUTION
# The least sure tokens first.
PRIORITY_LOWEST = PRIORITY_SOLUTION.replace("argsort(descending=True, stable=True)", "argsort(stable=True)")
assert PRIORITY_LOWEST != PRIORITY_SOLUTION
# Capacity rounded down.
PRIORITY_FLOOR = PRIORITY_SOLUTION.replace("math.ceil(factor", "math.floor(factor")
assert PRIORITY_FLOOR != PRIORITY_SOLUTION
# Capacity counted in tokens, not pairs.
PRIORITY_NO_K = PRIORITY_SOLUTION.replace("factor * n_tokens * k / n_experts", "factor * n_tokens / n_experts")
assert PRIORITY_NO_K != PRIORITY_SOLUTION
# The kept weights renormalised to sum to 1.
PRIORITY_RENORMALISED = PRIORITY_SOLUTION.replace(
    "gains = weights * kept                                   # a dropped pair adds nothing",
    "gains = weights * kept\n    gains = gains / gains.sum(1, keepdim=True).clamp_min(1e-30)")
assert PRIORITY_RENORMALISED != PRIORITY_SOLUTION
# Each expert keeps its highest-weight pairs, first and second choices competing.
PRIORITY_PER_EXPERT = PRIORITY_SOLUTION.replace(
    '''    ranked = probs.amax(dim=1).argsort(descending=True, stable=True)   # surest tokens first
    line = experts[ranked].T.reshape(-1)                     # all first choices, then all second choices
    taken = torch.zeros(n_experts, dtype=torch.long)
    admit = torch.zeros(line.numel(), dtype=torch.bool)
    for i, e in enumerate(line.tolist()):                    # T * k steps: small enough to walk
        admit[i] = taken[e] < room
        taken[e] += 1
    kept = torch.zeros_like(experts, dtype=torch.bool)
    kept[ranked] = admit.reshape(k, n_tokens).T
''', '''    kept = torch.zeros_like(experts, dtype=torch.bool)
    for e in range(n_experts):
        who, slot = torch.where(experts == e)
        best = weights[who, slot].argsort(descending=True, stable=True)[:room]
        kept[who[best], slot[best]] = True
''')
assert PRIORITY_PER_EXPERT != PRIORITY_SOLUTION

# The tokens ranked by route's renormalised top weight, not by their largest router probability.
PRIORITY_RENORMALISED_RANKING = PRIORITY_SOLUTION.replace(
    "ranked = probs.amax(dim=1).argsort(", "ranked = weights[:, 0].argsort(")
assert PRIORITY_RENORMALISED_RANKING != PRIORITY_SOLUTION
# Right, computed in float64 "for precision": judged by its values.
PRIORITY_FLOAT64 = PRIORITY_SOLUTION.replace(
    '    probs, weights, experts = route(x, params["router"], k)\n',
    "    x = x.double()                                          # float64 for precision\n"
    "    params = {n: t.double() for n, t in params.items()}\n"
    '    probs, weights, experts = route(x, params["router"], k)\n', 1)
assert PRIORITY_FLOAT64 != PRIORITY_SOLUTION

DEDUP_SOLUTION = '''%%exercise 10.dedup_dispatch
import torch
import torch.distributed as dist


def dedup_moe(x, router, gate_up, down, k, route, expert_mlp):
    class Swap(torch.autograd.Function):
        """Rows out by `sizes_out`, rows in by `sizes_in`; the gradient takes the way back."""

        @staticmethod
        def forward(ctx, rows, sizes_in, sizes_out):
            ctx.sizes = sizes_in, sizes_out
            landed = rows.new_empty((sum(sizes_in), rows.shape[1]))
            dist.all_to_all_single(landed, rows.contiguous(), output_split_sizes=sizes_in, input_split_sizes=sizes_out)
            return landed

        @staticmethod
        def backward(ctx, grad):
            sizes_in, sizes_out = ctx.sizes
            home = grad.new_empty((sum(sizes_out), grad.shape[1]))
            dist.all_to_all_single(home, grad.contiguous(), output_split_sizes=sizes_out, input_split_sizes=sizes_in)
            return home, None, None

    world = dist.get_world_size()
    n_tokens, n_experts, per_rank = x.shape[0], router.shape[0], gate_up.shape[0]
    _, weights, experts = route(x, router, k)
    # Each token's weight on every expert (0 where not chosen), grouped by the rank holding the expert.
    gain = torch.zeros(n_tokens, n_experts, dtype=x.dtype).scatter(1, experts, weights)
    gain = gain.view(n_tokens, world, per_rank)
    visits = torch.zeros(n_tokens, world, dtype=torch.bool)
    visits[torch.arange(n_tokens).unsqueeze(1), experts // per_rank] = True
    dest, token = visits.T.nonzero(as_tuple=True)          # (rank, token) pairs, ordered by rank
    sizes_out = visits.sum(0)
    sizes_in = torch.empty_like(sizes_out)
    dist.all_to_all_single(sizes_in, sizes_out)             # how many rows each rank sends me
    sizes_out, sizes_in = sizes_out.tolist(), sizes_in.tolist()
    rows = Swap.apply(x[token], sizes_in, sizes_out)        # each token once per rank it visits
    mix = Swap.apply(gain[token, dest], sizes_in, sizes_out)   # its weights on that rank's experts
    summed = torch.zeros_like(rows)
    for e in range(per_rank):
        hit = torch.where(mix[:, e] > 0)[0]
        y = expert_mlp(rows[hit], gate_up[e], down[e])       # every local expert, even on no rows
        summed = summed.index_add(0, hit, y * mix[hit, e].unsqueeze(1))
    back = Swap.apply(summed, sizes_out, sizes_in)          # one row back per visit
    return torch.zeros_like(x).index_add(0, token, back)
'''

# One row per (token, expert) pair, as the lesson's ep_moe: right values, more bytes.
DEDUP_DUPLICATES = DEDUP_SOLUTION.replace(
    '''    visits = torch.zeros(n_tokens, world, dtype=torch.bool)
    visits[torch.arange(n_tokens).unsqueeze(1), experts // per_rank] = True
    dest, token = visits.T.nonzero(as_tuple=True)          # (rank, token) pairs, ordered by rank
    sizes_out = visits.sum(0)
''', '''    pair = experts.flatten().argsort(stable=True)          # (wrong: one entry per (token, expert) pair)
    token, dest = pair // k, experts.flatten()[pair] // per_rank
    gain = gain.repeat_interleave(k, dim=0)[pair].clone()
    chosen = torch.zeros_like(gain, dtype=torch.bool).view(len(pair), -1)
    chosen[torch.arange(len(pair)), experts.flatten()[pair]] = True
    gain = gain * chosen.view_as(gain)                     # each entry keeps its own expert's weight only
    entry = torch.arange(len(pair))
    sizes_out = torch.bincount(dest, minlength=world)
''').replace("mix = Swap.apply(gain[token, dest]", "mix = Swap.apply(gain[entry, dest]")
assert DEDUP_DUPLICATES.count("gain[entry, dest]") == 1

# The router weight applied at the expert's rank and again at home.
DEDUP_SCORES_TWICE = DEDUP_SOLUTION.replace(
    "    return torch.zeros_like(x).index_add(0, token, back)",
    "    again = gain[token, dest].sum(1, keepdim=True)          # (wrong: applied once already)\n"
    "    return torch.zeros_like(x).index_add(0, token, back * again)")
assert DEDUP_SCORES_TWICE != DEDUP_SOLUTION

# The receiver's split sizes taken from its own send sizes: the ranks' all_to_all_single calls disagree.
DEDUP_SENDER_VIEW = DEDUP_SOLUTION.replace(
    "    rows = Swap.apply(x[token], sizes_in, sizes_out)", "    rows = Swap.apply(x[token], sizes_out, sizes_out)")
assert DEDUP_SENDER_VIEW != DEDUP_SOLUTION

# The weights sent as plain data: no gradient reaches the router through them.
DEDUP_WEIGHTS_DETACHED = DEDUP_SOLUTION.replace(
    "mix = Swap.apply(gain[token, dest], sizes_in, sizes_out)", "mix = Swap.apply(gain[token, dest].detach(), sizes_in, sizes_out)")
assert DEDUP_WEIGHTS_DETACHED != DEDUP_SOLUTION

# The combine with a bare all_to_all_single: the output has no graph, no gradient reaches x, router or experts.
DEDUP_COMBINE_NO_AUTOGRAD = DEDUP_SOLUTION.replace(
    "    back = Swap.apply(summed, sizes_out, sizes_in)          # one row back per visit",
    "    back = summed.new_empty((sum(sizes_out), summed.shape[1]))\n"
    "    dist.all_to_all_single(back, summed, output_split_sizes=sizes_out, input_split_sizes=sizes_in)")
assert DEDUP_COMBINE_NO_AUTOGRAD != DEDUP_SOLUTION

# A rank with nothing to send skips the count exchange: the others wait for it.
DEDUP_SKIPS_COUNTS = DEDUP_SOLUTION.replace(
    "    dist.all_to_all_single(sizes_in, sizes_out)             # how many rows each rank sends me",
    "    if dist.get_rank() == 1:                                # (wrong: every rank must join)\n"
    "        return x * 0\n"
    "    dist.all_to_all_single(sizes_in, sizes_out)             # how many rows each rank sends me")
assert DEDUP_SKIPS_COUNTS != DEDUP_SOLUTION

# Right, done another way: torch's autograd all-to-all (torch.distributed.nn.functional), imported in the cell,
# the weights as [rows, E], every local expert on every received row times its weight.
DEDUP_NN_FUNCTIONAL = '''%%exercise 10.dedup_dispatch
import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single as a2a


def dedup_moe(x, router, gate_up, down, k, route, expert_mlp):
    p, r = dist.get_world_size(), dist.get_rank()
    E, local = router.shape[0], gate_up.shape[0]
    _, weights, experts = route(x, router, k)
    dense = torch.zeros(x.shape[0], E).scatter(1, experts, weights)      # [T, E], 0 where not chosen
    visit = torch.zeros(x.shape[0], p, dtype=torch.bool)
    for j in range(k):
        visit[torch.arange(x.shape[0]), experts[:, j] // local] = True
    ranks_of, tokens = visit.t().nonzero(as_tuple=True)
    send = visit.sum(0)
    recv = torch.zeros_like(send)
    dist.all_to_all_single(recv, send)
    send, recv = send.tolist(), recv.tolist()
    rows = a2a(x.new_empty(sum(recv), x.shape[1]), x[tokens], recv, send)
    w = a2a(x.new_empty(sum(recv), E), dense[tokens], recv, send)
    mine = w[:, r * local:(r + 1) * local]
    result = sum(mine[:, e:e + 1] * expert_mlp(rows, gate_up[e], down[e]) for e in range(local))
    back = a2a(x.new_empty(sum(send), x.shape[1]), result, send, recv)
    return torch.zeros_like(x).index_add(0, tokens, back)
'''

# Experts with no rows skipped: a rank that receives nothing returns an output with no autograd graph.
DEDUP_SKIP_EMPTY = DEDUP_SOLUTION.replace(
    """        hit = torch.where(mix[:, e] > 0)[0]
        y = expert_mlp(rows[hit], gate_up[e], down[e])       # every local expert, even on no rows
""", """        hit = torch.where(mix[:, e] > 0)[0]
        if hit.numel() == 0:                                  # (wrong: nothing for this expert, so no graph)
            continue
        y = expert_mlp(rows[hit], gate_up[e], down[e])
""")
assert DEDUP_SKIP_EMPTY != DEDUP_SOLUTION

# The dispatch as a bare all_to_all_single (the weights and the combine through Swap): no gradient reaches x.
DEDUP_DISPATCH_PLAIN = DEDUP_SOLUTION.replace(
    "    rows = Swap.apply(x[token], sizes_in, sizes_out)        # each token once per rank it visits\n",
    "    rows = x.new_empty((sum(sizes_in), x.shape[1]))\n"
    "    dist.all_to_all_single(rows, x[token], output_split_sizes=sizes_in, input_split_sizes=sizes_out)\n")
assert DEDUP_DISPATCH_PLAIN != DEDUP_SOLUTION

GLOBAL_SOLUTION = '''%%exercise 10.global_balance_loss
import torch
import torch.distributed as dist


def global_balance_loss(probs, experts):
    n_experts = probs.shape[1]
    counts = torch.bincount(experts.reshape(-1), minlength=n_experts).double()
    mass = probs.sum(dim=0)                                  # my tokens' probabilities, in the graph
    totals = torch.cat([counts, mass.detach().double(), torch.tensor([float(len(probs))], dtype=torch.double)])
    dist.all_reduce(totals)                                  # every rank's counts, sums and tokens
    counts_all, mass_all, tokens_all = totals[:n_experts], totals[n_experts:-1], totals[-1]
    share = (counts_all / (tokens_all * experts.shape[1])).to(probs.dtype)
    # The others' probabilities enter as a constant: each rank's gradient covers its own tokens.
    mean_prob = (mass + (mass_all.to(probs.dtype) - mass.detach())) / tokens_all.to(probs.dtype)
    return n_experts * (share * mean_prob).sum()
'''

# Each rank's own loss.
GLOBAL_LOCAL = GLOBAL_SOLUTION.replace("    dist.all_reduce(totals)                                  # every rank's counts, sums and tokens\n", "")
assert GLOBAL_LOCAL != GLOBAL_SOLUTION
# f over all ranks, P from this rank's tokens.
GLOBAL_P_LOCAL = GLOBAL_SOLUTION.replace(
    "mean_prob = (mass + (mass_all.to(probs.dtype) - mass.detach())) / tokens_all.to(probs.dtype)",
    "mean_prob = probs.mean(dim=0)")
assert GLOBAL_P_LOCAL != GLOBAL_SOLUTION
# P as the mean of the ranks' means: wrong only when the batches differ in size.
GLOBAL_MEAN_OF_MEANS = GLOBAL_SOLUTION.replace(
    "mass = probs.sum(dim=0)                                  # my tokens' probabilities, in the graph",
    "mass = probs.mean(dim=0)").replace(
    "mean_prob = (mass + (mass_all.to(probs.dtype) - mass.detach())) / tokens_all.to(probs.dtype)",
    "mean_prob = (mass + (mass_all.to(probs.dtype) - mass.detach())) / dist.get_world_size()")
assert GLOBAL_MEAN_OF_MEANS != GLOBAL_SOLUTION
# The all-reduced sum of probabilities kept in the graph beside the rank's own: the gradient twice.
GLOBAL_TWICE = GLOBAL_SOLUTION.replace(
    "    totals = torch.cat([counts, mass.detach().double(), torch.tensor([float(len(probs))], dtype=torch.double)])",
    "    totals = torch.cat([counts, mass.double(), torch.tensor([float(len(probs))], dtype=torch.double)])")
assert GLOBAL_TWICE != GLOBAL_SOLUTION
# The value right, but each rank's share of P divided by its own token count: the gradient scaled by p.
GLOBAL_SCALED = GLOBAL_SOLUTION.replace(
    "mean_prob = (mass + (mass_all.to(probs.dtype) - mass.detach())) / tokens_all.to(probs.dtype)",
    "mean_prob = mass_all.to(probs.dtype) / tokens_all.to(probs.dtype) + (mass - mass.detach()) / len(probs)")
assert GLOBAL_SCALED != GLOBAL_SOLUTION

# torch's differentiable all_reduce of the probability sums (torch.distributed.nn.functional, imported in the cell):
# the value right, the gradient p times one process's (its backward sums again).
GLOBAL_NN_ALL_REDUCE = '''%%exercise 10.global_balance_loss
import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce


def global_balance_loss(probs, experts):
    E, k = probs.shape[1], experts.shape[1]
    counts = torch.bincount(experts.flatten(), minlength=E).float()
    dist.all_reduce(counts)
    n = torch.tensor(float(probs.shape[0]))
    dist.all_reduce(n)
    P = differentiable_all_reduce(probs.sum(0)) / n
    return E * (counts / (n * k) * P).sum()
'''

# all_gather of probs and experts: right on batches of equal size; the sizes differ between ranks in case 3.
GLOBAL_ALL_GATHER_UNEVEN = '''%%exercise 10.global_balance_loss
import torch
import torch.distributed as dist


def global_balance_loss(probs, experts):
    p, r = dist.get_world_size(), dist.get_rank()
    E = probs.shape[1]
    every = [torch.empty_like(probs) for _ in range(p)]
    dist.all_gather(every, probs.detach())
    every[r] = probs
    chosen = [torch.empty_like(experts) for _ in range(p)]
    dist.all_gather(chosen, experts)
    allp, alle = torch.cat(every), torch.cat(chosen)
    f = torch.bincount(alle.flatten(), minlength=E) / alle.numel()
    return E * (f * allp.mean(0)).sum()
'''
