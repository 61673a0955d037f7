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
    "        return mine\n",
    "        terms = terms.clone()\n        dist.all_reduce(terms)\n"
    "        rows = terms.shape[0] // dist.get_world_size()\n"
    "        return terms[dist.get_rank() * rows:(dist.get_rank() + 1) * rows]\n")

# The all-gather's backward only slices this rank's rows of the gradient (no sum over the ranks).
SP_GATHER_BACKWARD_SLICES = _replaced(
    SP_SOLUTION,
    "        mine = grad.new_empty(grad.shape[0] // dist.get_world_size(), *grad.shape[1:])\n"
    "        dist.reduce_scatter_tensor(mine, grad.contiguous())  # every rank's hidden units used these rows: sum\n"
    "        return mine\n",
    "        rows = grad.shape[0] // dist.get_world_size()\n"
    "        return grad[dist.get_rank() * rows:(dist.get_rank() + 1) * rows]\n")

# down's bias added as a plain parameter: its gradient covers this rank's rows only (a Partial left unsummed).
SP_BIAS_TERM = _replaced(SP_SOLUTION, "+ BiasOnRows.apply(self.down_bias)", "+ self.down_bias")

# Tokens not masked: a token outside this rank's rows clamped into them, read from the wrong row.
EMBEDDING_NOT_MASKED = _replaced(
    EMBEDDING_SOLUTION,
    "        rows = torch.nn.functional.embedding(local, self.weight) * mine.unsqueeze(-1)\n",
    "        rows = torch.nn.functional.embedding((tokens - self.start).clamp(0, self.weight.shape[0] - 1), "
    "self.weight)\n")

# The all-reduce's backward sums again (f's backward where g's belongs).
EMBEDDING_BACKWARD_SUMS = _replaced(
    EMBEDDING_SOLUTION,
    "        return grad  # every rank holds the whole output's gradient: its own rows take their part\n",
    "        grad = grad.clone()\n        dist.all_reduce(grad)\n        return grad\n")

# Each rank's own max, not the whole row's: the ranks' sums of exponentials are shifted differently.
CE_LOCAL_MAX = _replaced(CE_SOLUTION,
                         "    dist.all_reduce(top, op=dist.ReduceOp.MAX)               # the whole row's max: a constant shift\n",
                         "")

# No max at all: exp of logits around 100 overflows float32.
CE_NO_MAX = _replaced(CE_SOLUTION, "    shifted = logits - top.unsqueeze(-1)\n", "    shifted = logits\n")

# The target's logit not masked: every rank adds a logit, one of them the target's.
CE_NOT_MASKED = _replaced(CE_SOLUTION, "    picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine\n",
                          "    picked = shifted.gather(-1, (targets - start).clamp(0, per - 1).unsqueeze(-1)).squeeze(-1)\n")

# The sums' backward all-reduces: every rank's loss is the same, so the gradient is counted N times.
CE_BACKWARD_SUMS = _replaced(
    CE_SOLUTION,
    "        return grad  # every rank holds the same loss: each rank's own terms get their gradient, no sum\n",
    "        grad = grad.clone()\n        dist.all_reduce(grad)\n        return grad\n")

# down's bias added to every rank's terms before the reduce-scatter: the sum holds it N times.
SP_BIAS_BEFORE_SCATTER = _replaced(
    SP_SOLUTION,
    "        return ScatterRows.apply(hidden @ self.down_weight.t()) + BiasOnRows.apply(self.down_bias)\n",
    "        return ScatterRows.apply(hidden @ self.down_weight.t() + BiasOnRows.apply(self.down_bias))\n")

# The whole table rebuilt on every rank (the zero-padded shards all-reduced), then a plain lookup: the right
# numbers, but the table moves every forward; vocabulary parallelism sums only the looked-up rows.
EMBEDDING_WHOLE_TABLE = _replaced(
    EMBEDDING_SOLUTION,
    "        mine = (tokens >= self.start) & (tokens < self.stop)\n",
    "        table = self.weight.new_zeros(self.weight.shape[0] * dist.get_world_size(), self.weight.shape[1])\n"
    "        table = table.index_copy(0, torch.arange(self.start, self.stop), self.weight)\n"
    "        return torch.nn.functional.embedding(tokens, Combine.apply(table))\n"
    "        mine = (tokens >= self.start) & (tokens < self.stop)\n")

# The ranks' maxes summed (the default op), not MAX'd: the shift is too large, every exp underflows to 0.
CE_SUM_MAX = _replaced(CE_SOLUTION, "dist.all_reduce(top, op=dist.ReduceOp.MAX)", "dist.all_reduce(top)")

# The whole logits built on every rank by one all-reduce of zero-padded shards (two dummy all-reduces make the
# count three), then F.cross_entropy: the right numbers, the logits whole on one rank.
CE_WHOLE_LOGITS = _replaced(
    CE_SOLUTION,
    "    top = logits.detach().amax(dim=-1)\n",
    "    whole = logits.new_zeros(logits.shape[0], per * dist.get_world_size())\n"
    "    whole = Combine.apply(whole.index_copy(1, torch.arange(start, start + per), logits))\n"
    "    dist.all_reduce(torch.zeros(1))\n    dist.all_reduce(torch.zeros(1))\n"
    "    return torch.nn.functional.cross_entropy(whole, targets)\n"
    "    top = logits.detach().amax(dim=-1)\n")
