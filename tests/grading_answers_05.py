"""Answer cells for lesson 05's grader tests: the solutions (as in solutions/05_fsdp2_solutions.ipynb) and
plausible wrong answers, each of which must lose exactly the points its mistake deserves."""

SHARD_SOLUTION = '''%%exercise 05.shard_bottom_up
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from course_lib.models import Block


def shard_bottom_up(model) -> None:
    """Shard model over every rank: a group per Block, one for the tied embed and head, the root last."""
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    # The Blocks sit inside the stages: look for them, not for a known attribute. Listed first, since
    # fully_shard changes each Block's class as it goes.
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        fully_shard(block, mesh=mesh)
    # One Parameter, two modules: one call makes them one group (either alone: torch refuses the other).
    fully_shard([model.embed, model.head], mesh=mesh)
    fully_shard(model, mesh=mesh)  # last: what is left, the norm
'''

# The lesson's loop over model.blocks: this model has no such attribute (its Blocks are inside stages).
SHARD_BLOCKS_ATTRIBUTE = SHARD_SOLUTION.replace("[m for m in model.modules() if isinstance(m, Block)]", "model.blocks")

# A group per stage (a Sequential of Blocks), not per Block.
SHARD_PER_STAGE = SHARD_SOLUTION.replace("[m for m in model.modules() if isinstance(m, Block)]", "model.stages")

# The tied pair left to the root's group.
SHARD_PAIR_IN_ROOT = SHARD_SOLUTION.replace("    fully_shard([model.embed, model.head], mesh=mesh)\n", "")

# The embedding and the head sharded one by one (torch refuses the second).
SHARD_PAIR_APART = SHARD_SOLUTION.replace(
    "    fully_shard([model.embed, model.head], mesh=mesh)\n",
    "    fully_shard(model.embed, mesh=mesh)\n    fully_shard(model.head, mesh=mesh)\n")

# The root first, then the Blocks.
SHARD_ROOT_FIRST = SHARD_SOLUTION.replace("    fully_shard(model, mesh=mesh)\n", "").replace(
    "    for block in [", "    fully_shard(model, mesh=mesh)\n    for block in [")

# init_device_mesh("cpu", (2,)): right on 2 ranks only.
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
    model.set_reshard_after_forward(False)
    for i, (inputs, targets) in enumerate(micro_batches):
        last = i == k - 1
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        (F.mse_loss(model(inputs), targets) / k).backward()
    model.set_reshard_after_forward(True)
    optimizer.step()
    optimizer.zero_grad()
'''

# The lesson's recipe: gradient sync off for K-1 micro-batches, the groups resharded as usual.
ACCUMULATE_SYNC_ONLY = ACCUMULATE_SOLUTION.replace("    model.set_reshard_after_forward(False)\n", "").replace(
    "        model.set_reshard_after_backward(last)\n", "").replace("    model.set_reshard_after_forward(True)\n", "")

# Kept gathered after backward, but still resharded after each forward.
ACCUMULATE_NO_FORWARD = ACCUMULATE_SOLUTION.replace("    model.set_reshard_after_forward(False)\n", "").replace(
    "    model.set_reshard_after_forward(True)\n", "")

# Kept gathered after forward, but resharded after each backward.
ACCUMULATE_NO_BACKWARD = ACCUMULATE_SOLUTION.replace("        model.set_reshard_after_backward(last)\n", "")

# Never resharded after backward, the last one included: the parameters stay gathered.
ACCUMULATE_LEFT_GATHERED = ACCUMULATE_SOLUTION.replace("set_reshard_after_backward(last)",
                                                       "set_reshard_after_backward(False)")

# Gradient sync never turned back on.
ACCUMULATE_NEVER_ON = ACCUMULATE_SOLUTION.replace("set_requires_gradient_sync(last)", "set_requires_gradient_sync(False)")

# The gradients left after the step.
ACCUMULATE_GRADS_KEPT = ACCUMULATE_SOLUTION.replace("    optimizer.zero_grad()\n", "", 1)

# The loss not divided by K.
ACCUMULATE_NOT_DIVIDED = ACCUMULATE_SOLUTION.replace(" / k)", ")")

META_SOLUTION = '''%%exercise 05.meta_init_broadcast
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


def init_sharded(build, full_state):
    with torch.device("meta"):
        model = build()
    device = torch.device("cpu") if dist.get_backend() == "gloo" else torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name not in model.state_dict():
                continue
            whole = full_state[name].to(device) if rank == 0 else torch.empty(tensor.shape, device=device)
            dist.broadcast(whole, src=0)
            if isinstance(tensor, DTensor):
                rows = -(-whole.shape[0] // world)
                tensor.to_local().copy_(whole[rank * rows:(rank + 1) * rows])
            else:
                tensor.copy_(whole)
        dim = model.scale.freq.numel()
        model.scale.freq.copy_(100.0 ** (-torch.arange(dim, dtype=torch.float32, device=device) / dim))
    return model
'''

# The lesson's load: set_model_state_dict, refused here.
META_WITH_TORCH = META_SOLUTION.replace(
    "    rank, world = dist.get_rank(), dist.get_world_size()\n",
    "    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict\n"
    "    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, "
    "broadcast_from_rank0=True))\n    rank, world = dist.get_rank(), dist.get_world_size()\n")

# The computed buffer left as to_empty left it.
META_NO_FREQ = META_SOLUTION.replace(
    "        model.scale.freq.copy_(100.0 ** (-torch.arange(dim, dtype=torch.float32, device=device) / dim))\n", "")

# The parameters loaded, the buffers skipped.
META_PARAMETERS_ONLY = META_SOLUTION.replace("[*model.named_parameters(), *model.named_buffers()]",
                                             "model.named_parameters()")

# reset_parameters() on the shards instead of the load.
META_RESET = META_SOLUTION.replace(
    "    rank, world = dist.get_rank(), dist.get_world_size()\n",
    "    for module in model.modules():\n        if isinstance(module, torch.nn.Linear):\n"
    "            module.reset_parameters()\n    return model\n    rank, world = dist.get_rank(), dist.get_world_size()\n")

# Built on the CPU: every rank holds the whole model.
META_ON_CPU = META_SOLUTION.replace("    with torch.device(\"meta\"):\n        model = build()\n", "    model = build()\n")

# The broadcast on rank 0 only: the others never join it.
META_LOAD_ON_RANK_0 = META_SOLUTION.replace("            dist.broadcast(whole, src=0)\n",
                                            "            if rank == 0:\n                dist.broadcast(whole, src=0)\n")

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
