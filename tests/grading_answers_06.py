"""Answer cells for lesson 06's grader tests: the solutions (as in solutions/06_tensor_parallel_solutions.ipynb)
and the wrong answers a learner would write, each of which must lose the points its mistake deserves, with a
message that says what is wrong."""

import nbformat

from course_lib.grading.cells import exercise_cells
from exercise_notebooks import notebook_path

SOLUTIONS = exercise_cells(nbformat.read(notebook_path("solutions", "06_tensor_parallel.ipynb"), as_version=4))
SP_SOLUTION, EMBEDDING_SOLUTION, CE_SOLUTION = (
    SOLUTIONS[i] for i in ("06.sp_mlp", "06.vocab_embedding", "06.vocab_cross_entropy"))


def _replaced(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old   # the mistake is made exactly where it is meant
    return source.replace(old, new)


# SP's exit as an all-reduce, then this rank's rows cut out: the right numbers, the whole sequence summed.
SP_ALL_REDUCE_EXIT = _replaced(
    SP_SOLUTION,
    "        mine = terms.new_empty(terms.shape[0] // dist.get_world_size(), *terms.shape[1:])\n"
    "        dist.reduce_scatter_tensor(mine, terms.contiguous())  # the ranks' terms summed, this rank's rows kept\n"
    "        return mine + bias\n",
    "        terms = terms.clone()\n        dist.all_reduce(terms)\n"
    "        rows = terms.shape[0] // dist.get_world_size()\n"
    "        return terms[dist.get_rank() * rows:(dist.get_rank() + 1) * rows] + bias\n")

# The all-gather's backward only slices this rank's rows of the gradient (no sum over the ranks).
SP_GATHER_BACKWARD_SLICES = _replaced(
    SP_SOLUTION,
    "        mine = grad.new_empty(grad.shape[0] // dist.get_world_size(), *grad.shape[1:])\n"
    "        dist.reduce_scatter_tensor(mine, grad.contiguous())  # every rank's hidden units used these rows: sum\n"
    "        return mine\n",
    "        rows = grad.shape[0] // dist.get_world_size()\n"
    "        return grad[dist.get_rank() * rows:(dist.get_rank() + 1) * rows]\n")

# down's bias gradient from this rank's rows only (its term), as if the bias met no other rank's rows.
SP_BIAS_TERM = _replaced(SP_SOLUTION, "return whole, whole.sum(dim=0)", "return whole, grad.sum(dim=0)")

# The lesson's f on the bias: its term all-reduced, a collective the gathered gradient makes unnecessary.
SP_BIAS_ALL_REDUCED = _replaced(
    SP_SOLUTION,
    "        return whole, whole.sum(dim=0)",
    "        bias_grad = grad.sum(dim=0)\n        dist.all_reduce(bias_grad)\n        return whole, bias_grad")

# down's bias added to every rank's terms before the reduce-scatter: the sum holds it N times.
SP_BIAS_BEFORE_SCATTER = _replaced(
    SP_SOLUTION,
    "        dist.reduce_scatter_tensor(mine, terms.contiguous())  # the ranks' terms summed, this rank's rows kept\n"
    "        return mine + bias\n",
    "        dist.reduce_scatter_tensor(mine, (terms + bias).contiguous())\n        return mine\n")

# Tokens not masked: a token outside this rank's rows clamped into them, read from the wrong row.
EMBEDDING_NOT_MASKED = _replaced(
    EMBEDDING_SOLUTION,
    "        rows = torch.nn.functional.embedding(local, weight) * mine.unsqueeze(-1)\n",
    "        rows = torch.nn.functional.embedding((tokens - start).clamp(0, weight.shape[0] - 1), weight)\n")

# Backward sums the output's gradient over the ranks first (as if each rank held only its part of it).
EMBEDDING_BACKWARD_SUMS = _replaced(
    EMBEDDING_SOLUTION,
    "        local, mine = ctx.saved_tensors\n",
    "        local, mine = ctx.saved_tensors\n        grad = grad.clone()\n        dist.all_reduce(grad)\n")

# The whole table rebuilt on every rank (the zero-padded shards all-reduced), then a plain lookup: the right
# numbers, but the table moves every forward; vocabulary parallelism sums only the looked-up rows.
EMBEDDING_WHOLE_TABLE = _replaced(
    EMBEDDING_SOLUTION,
    "        dist.all_reduce(rows)  # each token's row comes from the one rank that holds it; zeros elsewhere\n",
    "        table = weight.new_zeros(weight.shape[0] * dist.get_world_size(), weight.shape[1])\n"
    "        table[start:start + weight.shape[0]] = weight\n"
    "        dist.all_reduce(table)\n"
    "        rows = torch.nn.functional.embedding(tokens, table)\n")

# Each rank's own max, not the whole row's: the ranks' sums of exponentials are shifted differently.
CE_LOCAL_MAX = _replaced(
    CE_SOLUTION, "        dist.all_reduce(top, op=dist.ReduceOp.MAX)               # the whole row's max: a constant shift\n", "")

# No max at all: exp of logits around 100 overflows float32.
CE_NO_MAX = _replaced(CE_SOLUTION, "        shifted = logits - top.unsqueeze(-1)\n", "        shifted = logits\n")

# The target's logit not masked: every rank adds a logit, one of them the target's.
CE_NOT_MASKED = _replaced(
    CE_SOLUTION, "        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine\n",
    "        picked = shifted.gather(-1, (targets - start).clamp(0, per - 1).unsqueeze(-1)).squeeze(-1)\n")

# Backward all-reduces the loss's gradient: every rank's loss is the same, so the gradient is counted N times.
CE_BACKWARD_SUMS = _replaced(
    CE_SOLUTION,
    "        softmax, local, mine = ctx.saved_tensors\n",
    "        softmax, local, mine = ctx.saved_tensors\n        grad = grad.clone()\n        dist.all_reduce(grad)\n")

# The ranks' maxes summed (the default op), not MAX'd: the shift is too large, every exp underflows to 0.
CE_SUM_MAX = _replaced(CE_SOLUTION, "dist.all_reduce(top, op=dist.ReduceOp.MAX)", "dist.all_reduce(top)")

# The whole logits built on every rank by one all-reduce of zero-padded shards (two dummy all-reduces make the
# count three), then F.cross_entropy: the right numbers, the logits whole on one rank.
CE_WHOLE_LOGITS = _replaced(
    CE_SOLUTION,
    "        top = logits.amax(dim=-1)\n",
    "        whole = logits.new_zeros(logits.shape[0], per * dist.get_world_size())\n"
    "        whole[:, start:start + per] = logits\n"
    "        dist.all_reduce(whole)\n        dist.all_reduce(torch.zeros(1))\n        dist.all_reduce(torch.zeros(1))\n"
    "        mine = (targets >= start) & (targets < start + per)\n"
    "        local = torch.where(mine, targets - start, 0)\n"
    "        ctx.save_for_backward(whole.softmax(-1)[:, start:start + per], local, mine)\n"
    "        return torch.nn.functional.cross_entropy(whole, targets)\n"
    "        top = logits.amax(dim=-1)\n")

# The hand-written backward of a sum, not of the mean over the rows.
CE_BACKWARD_NOT_MEAN = _replaced(CE_SOLUTION, "return logits_grad * grad / softmax.shape[0], None",
                                 "return logits_grad * grad, None")

# No autograd.Function: a masked lookup, then an in-place all-reduce that autograd takes for the identity. The
# right numbers on every rank, but autograd wrote the backward the exercise asks the learner to write.
EMBEDDING_NO_FUNCTION = '''import torch
import torch.distributed as dist


class VocabEmbedding(torch.nn.Module):
    def __init__(self, embedding: torch.nn.Embedding):
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        per = embedding.num_embeddings // world
        self.start = rank * per
        self.weight = torch.nn.Parameter(embedding.weight.detach()[self.start:self.start + per].clone())

    def forward(self, tokens):
        mine = (tokens >= self.start) & (tokens < self.start + self.weight.shape[0])
        local = torch.where(mine, tokens - self.start, 0)
        rows = torch.nn.functional.embedding(local, self.weight) * mine.unsqueeze(-1)
        dist.all_reduce(rows)
        return rows
'''

# A Function around the all-reduce only (the lesson's g), the lookup left to autograd: the weight's gradient is
# still autograd's (F.embedding's backward), not the learner's.
EMBEDDING_FUNCTION_FOR_THE_SUM_ONLY = '''import torch
import torch.distributed as dist


class SumRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows):
        rows = rows.clone()
        dist.all_reduce(rows)
        return rows

    @staticmethod
    def backward(ctx, grad):
        return grad


class VocabEmbedding(torch.nn.Module):
    def __init__(self, embedding: torch.nn.Embedding):
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        per = embedding.num_embeddings // world
        self.start = rank * per
        self.weight = torch.nn.Parameter(embedding.weight.detach()[self.start:self.start + per].clone())

    def forward(self, tokens):
        mine = (tokens >= self.start) & (tokens < self.start + self.weight.shape[0])
        local = torch.where(mine, tokens - self.start, 0)
        return SumRanks.apply(torch.nn.functional.embedding(local, self.weight) * mine.unsqueeze(-1))
'''

# No autograd.Function: the loss as a plain function, autograd differentiating through three in-place all-reduces.
CE_NO_FUNCTION = '''import torch
import torch.distributed as dist


def vocab_parallel_cross_entropy(logits, targets):
    per = logits.shape[-1]
    start = dist.get_rank() * per
    top = logits.detach().amax(dim=-1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    shifted = logits - top.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)
    dist.all_reduce(sum_exp)
    mine = (targets >= start) & (targets < start + per)
    local = torch.where(mine, targets - start, 0)
    picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
    dist.all_reduce(picked)
    return (sum_exp.log() - picked).mean()
'''

# The hand-written backward ignores its incoming gradient: right only when the loss is backpropagated alone.
CE_IGNORES_GRAD = _replaced(CE_SOLUTION, "return logits_grad * grad / softmax.shape[0], None",
                            "return logits_grad / softmax.shape[0], None")

# The sum of exponentials and the target's logit stacked into one all-reduce: right numbers, two all-reduces.
CE_TWO_IN_ONE = _replaced(
    _replaced(CE_SOLUTION, "        dist.all_reduce(sum_exp)                                 # the ranks' partial sums\n",
              ""),
    "        dist.all_reduce(picked)                                  # only the rank holding the target adds it\n",
    "        both = torch.stack([sum_exp, picked])\n        dist.all_reduce(both)\n"
    "        sum_exp, picked = both[0], both[1]\n")
