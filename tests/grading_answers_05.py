"""Answer cells for lesson 05's grader tests: the solutions (as in solutions/05_fsdp2_solutions.ipynb) and
plausible wrong answers, each of which must lose exactly the points its mistake deserves."""

SHARD_SOLUTION = '''%%exercise 05.shard_bottom_up
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def shard_bottom_up(model) -> None:
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
'''

# Only the root: one group holds every parameter, gathered whole before the forward.
SHARD_ROOT_ONLY = SHARD_SOLUTION.replace("    for block in model.blocks:\n        fully_shard(block, mesh=mesh)\n", "")

# Top down: the root first, then the Blocks, whose parameters the root has already made DTensors.
SHARD_ROOT_FIRST = SHARD_SOLUTION.replace(
    "    for block in model.blocks:\n        fully_shard(block, mesh=mesh)\n    fully_shard(model, mesh=mesh)\n",
    "    fully_shard(model, mesh=mesh)\n    for block in model.blocks:\n        fully_shard(block, mesh=mesh)\n")

# The mesh's size written in the code: right on 2 ranks, wrong on 4.
SHARD_MESH_OF_2 = SHARD_SOLUTION.replace("(dist.get_world_size(),)", "(2,)")

ZERO3_SOLUTION = '''%%exercise 05.zero3_linear
import torch
import torch.distributed as dist


def gather_rows(shard):
    whole = shard.new_empty(dist.get_world_size() * shard.shape[0], *shard.shape[1:])
    dist.all_gather_into_tensor(whole, shard.contiguous())
    return whole


def scatter_rows(whole):
    mine = whole.new_empty(whole.shape[0] // dist.get_world_size(), *whole.shape[1:])
    dist.reduce_scatter_tensor(mine, whole.contiguous(), op=dist.ReduceOp.AVG)
    return mine


class ZeRO3Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, weight_shard, bias_shard):
        weight = gather_rows(weight_shard)
        ctx.save_for_backward(inputs, weight_shard)
        return inputs @ weight.t() + gather_rows(bias_shard)

    @staticmethod
    def backward(ctx, grad_output):
        inputs, weight_shard = ctx.saved_tensors
        weight = gather_rows(weight_shard)
        grad_inputs = grad_output @ weight
        grad_weight = scatter_rows(grad_output.t() @ inputs)
        grad_bias = scatter_rows(grad_output.sum(0))
        return grad_inputs, grad_weight, grad_bias


class ShardedLinear(torch.nn.Module):
    def __init__(self, linear):
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        rows = linear.out_features // world
        mine = slice(rank * rows, (rank + 1) * rows)
        self.weight = torch.nn.Parameter(linear.weight.detach()[mine].clone())
        self.bias = torch.nn.Parameter(linear.bias.detach()[mine].clone())

    def forward(self, inputs):
        return ZeRO3Linear.apply(inputs, self.weight, self.bias)
'''

# A Function that only gathers, under F.linear: right values, but F.linear saves the whole weight for backward.
ZERO3_NO_FREE = ZERO3_SOLUTION.replace(
    "    def forward(self, inputs):\n        return ZeRO3Linear.apply(inputs, self.weight, self.bias)\n",
    "    def forward(self, inputs):\n"
    "        return torch.nn.functional.linear(inputs, Gather.apply(self.weight), Gather.apply(self.bias))\n"
    "\n\n"
    "class Gather(torch.autograd.Function):\n"
    "    @staticmethod\n"
    "    def forward(ctx, shard):\n"
    "        return gather_rows(shard)\n"
    "\n"
    "    @staticmethod\n"
    "    def backward(ctx, grad_whole):\n"
    "        return scatter_rows(grad_whole)\n")

# The reduce-scatter's default, a sum: N times the average.
ZERO3_SUM = ZERO3_SOLUTION.replace(", op=dist.ReduceOp.AVG)", ")")

# All-reduce the whole gradient, then keep this rank's rows: right values, N times the traffic received.
ZERO3_ALL_REDUCE = ZERO3_SOLUTION.replace(
    "    mine = whole.new_empty(whole.shape[0] // dist.get_world_size(), *whole.shape[1:])\n"
    "    dist.reduce_scatter_tensor(mine, whole.contiguous(), op=dist.ReduceOp.AVG)\n"
    "    return mine\n",
    "    whole = whole.contiguous()\n"
    "    dist.all_reduce(whole, op=dist.ReduceOp.AVG)\n"
    "    return whole.chunk(dist.get_world_size())[dist.get_rank()].clone()\n")

ACCUMULATE_SOLUTION = '''%%exercise 05.accumulate
import torch.nn.functional as F


def accumulate(model, optimizer, micro_batches) -> None:
    k = len(micro_batches)
    for i, (inputs, targets) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == k - 1)
        loss = F.mse_loss(model(inputs), targets) / k
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
'''

# Sync turned off and never back on: no reduce-scatter, no gradient on the shards, no step.
ACCUMULATE_NEVER_ON = ACCUMULATE_SOLUTION.replace("set_requires_gradient_sync(i == k - 1)",
                                                  "set_requires_gradient_sync(False)")

# Only the root's own group turned off: the Blocks reduce-scatter every micro-batch (the result is right).
ACCUMULATE_ROOT_ONLY = ACCUMULATE_SOLUTION.replace("set_requires_gradient_sync(i == k - 1)",
                                                   "set_requires_gradient_sync(i == k - 1, recurse=False)")

# The gradients left in .grad after the step (the statement asks for them zeroed).
ACCUMULATE_GRADS_KEPT = ACCUMULATE_SOLUTION.replace("    optimizer.zero_grad()\n", "", 1)

# The loss not divided by K: the K backwards add up to K times the mean.
ACCUMULATE_NOT_DIVIDED = ACCUMULATE_SOLUTION.replace(" / k\n", "\n")

# Divided by the world size too, as if FSDP summed over the ranks.
ACCUMULATE_DIVIDED_BY_WORLD = ACCUMULATE_SOLUTION.replace(
    "import torch.nn.functional as F\n", "import torch.distributed as dist\nimport torch.nn.functional as F\n").replace(
    " / k\n", " / (k * dist.get_world_size())\n")

META_SOLUTION = '''%%exercise 05.meta_init_broadcast
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def init_sharded(build, full_state):
    with torch.device("meta"):
        model = build()
    device = torch.device("cpu") if dist.get_backend() == "gloo" else torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state, options=options)
    return model
'''

# Each rank initialises its shards itself: the same random draws on every rank.
META_RESET = META_SOLUTION.replace(
    "    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)\n"
    "    set_model_state_dict(model, full_state, options=options)\n",
    "    for module in model.modules():\n"
    "        if hasattr(module, \"reset_parameters\"):\n"
    "            module.reset_parameters()\n")

# A full state dict without broadcast_from_rank0: the ranks given {} have nothing to load.
META_NO_BROADCAST = META_SOLUTION.replace("full_state_dict=True, broadcast_from_rank0=True", "full_state_dict=True")

# Built on the CPU: right values, but every rank held the whole model first.
META_ON_CPU = META_SOLUTION.replace("    with torch.device(\"meta\"):\n        model = build()\n",
                                    "    model = build()\n")

# Loading on rank 0 only ("only rank 0 has the weights"): rank 0 waits for the others in the broadcast.
META_LOAD_ON_RANK_0 = META_SOLUTION.replace(
    "    set_model_state_dict(model, full_state, options=options)\n",
    "    if dist.get_rank() == 0:\n        set_model_state_dict(model, full_state, options=options)\n")

HSDP_SOLUTION = '''%%exercise 05.hsdp_mesh
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def shard_hsdp(model, shard_size):
    replicas = dist.get_world_size() // shard_size
    mesh = init_device_mesh(next(model.parameters()).device.type, (replicas, shard_size),
                            mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh
'''

# The names swapped, as if fully_shard sharded over the first dim: the same groups, named for what they do not do.
HSDP_NAMES_SWAPPED = HSDP_SOLUTION.replace('mesh_dim_names=("replicate", "shard")', 'mesh_dim_names=("shard", "replicate")')

# A 1-D mesh of every rank: FSDP over all 4 ranks, nothing replicated.
HSDP_ONE_DIM = HSDP_SOLUTION.replace(
    '(replicas, shard_size),\n                            mesh_dim_names=("replicate", "shard"))\n',
    '(dist.get_world_size(),), mesh_dim_names=("shard",))\n')
assert HSDP_ONE_DIM != HSDP_SOLUTION

# The gathered weight kept on ctx (an attribute, not save_for_backward: autograd's saved-tensor hooks never see it),
# with an all-gather in backward whose result goes unused: the right numbers and collectives, but the whole weight
# lives from forward to backward.
ZERO3_KEPT_ON_CTX = ZERO3_SOLUTION.replace(
    "        weight = gather_rows(weight_shard)\n        ctx.save_for_backward(inputs, weight_shard)\n",
    "        weight = gather_rows(weight_shard)\n        ctx.weight = weight\n"
    "        ctx.save_for_backward(inputs, weight_shard)\n").replace(
    "        weight = gather_rows(weight_shard)\n        grad_inputs = grad_output @ weight\n",
    "        gather_rows(weight_shard)\n        grad_inputs = grad_output @ ctx.weight\n")
assert ZERO3_KEPT_ON_CTX.count("ctx.weight") == 2
