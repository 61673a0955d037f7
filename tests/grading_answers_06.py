"""Answer cells for lesson 06's grader tests: the solutions (as in solutions/06_tensor_parallel_solutions.ipynb)
and plausible wrong answers, each of which must lose the points its mistake deserves, with a message that
says what is wrong."""

import nbformat

from course_lib.grading.cells import exercise_cells
from exercise_notebooks import notebook_path

SOLUTIONS = exercise_cells(nbformat.read(notebook_path("solutions", "06_tensor_parallel.ipynb"), as_version=4))
MLP_SOLUTION, ATTENTION_SOLUTION, MESH_SOLUTION = (
    SOLUTIONS[i] for i in ("06.megatron_mlp", "06.attention_plan", "06.mesh_2d"))

# The all-reduce after the column-parallel layer too: it sums different hidden units of the ranks.
MLP_REDUCE_AFTER_COLUMN = MLP_SOLUTION.replace(
    "hidden = torch.nn.functional.gelu(CopyToParallel.apply(x) @ self.up_weight.t() + self.up_bias)",
    "hidden = torch.nn.functional.gelu(ReduceFromParallel.apply(CopyToParallel.apply(x) @ self.up_weight.t() "
    "+ self.up_bias))")

# f without its all-reduce: the gradient of x is this rank's term only.
MLP_NO_BACKWARD_REDUCE = MLP_SOLUTION.replace(
    "        grad = grad.clone()\n        dist.all_reduce(grad)  # f: each rank's hidden units contribute a term of x's gradient\n",
    "")

# The module keeps all n_heads: its view fails on this rank's q.
ATTENTION_HEADS_KEPT = ATTENTION_SOLUTION.replace(
    "    attention.n_heads //= mesh.size()  # the forward's view: this rank's heads only\n", "")

# q row-parallel: its weight sharded on the input dimension.
ATTENTION_Q_ROWWISE = ATTENTION_SOLUTION.replace('{"q": ColwiseParallel()', '{"q": RowwiseParallel()')

# FSDP over tp and TP over dp: the sub-meshes swapped.
MESH_SWAPPED = MESH_SOLUTION.replace('parallelize_module(block, mesh["tp"]', 'parallelize_module(block, mesh["dp"]') \
    .replace('fully_shard(block, mesh=mesh["dp"])', 'fully_shard(block, mesh=mesh["tp"])') \
    .replace('fully_shard(model, mesh=mesh["dp"])', 'fully_shard(model, mesh=mesh["tp"])')
