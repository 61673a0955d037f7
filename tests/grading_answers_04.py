"""Answer cells for lesson 04's grader tests: the solutions (as in solutions/04_fsdp1.ipynb) and
plausible wrong answers, each of which must lose exactly the points its mistake deserves."""

POLICY_SOLUTION = '''%%exercise 04.wrap_policy
import torch
from course_lib.models import Block

MIN_NUMEL = 1000


def policy(module, recurse, nonwrapped_numel) -> bool:
    if recurse:
        return True
    if isinstance(module, Block):
        return True
    return isinstance(module, torch.nn.Linear) and nonwrapped_numel >= MIN_NUMEL
'''

# No recurse branch: asked about the root with recurse=True, it answers False and FSDP looks no further.
POLICY_NO_RECURSE = POLICY_SOLUTION.replace("    if recurse:\n        return True\n", "")

# Every Linear, the small ones and those inside Blocks too.
POLICY_EVERY_LINEAR = POLICY_SOLUTION.replace(
    "isinstance(module, torch.nn.Linear) and nonwrapped_numel >= MIN_NUMEL", "isinstance(module, torch.nn.Linear)")

# "At least" read as "more than": a Linear of exactly MIN_NUMEL parameters is left out.
POLICY_STRICTLY_MORE = POLICY_SOLUTION.replace("nonwrapped_numel >= MIN_NUMEL", "nonwrapped_numel > MIN_NUMEL")

SHARD_SOLUTION = '''%%exercise 04.flat_shard_numel
def shard_numel(param_numels: list[int], world_size: int) -> tuple[int, int]:
    total = sum(param_numels)
    shard = -(-total // world_size)
    return shard, shard * world_size - total
'''

# Floor division: no padding.
SHARD_FLOOR = '''%%exercise 04.flat_shard_numel
def shard_numel(param_numels: list[int], world_size: int) -> tuple[int, int]:
    return sum(param_numels) // world_size, 0
'''

# Each parameter padded to a multiple of the world size on its own.
SHARD_PER_PARAMETER = '''%%exercise 04.flat_shard_numel
def shard_numel(param_numels: list[int], world_size: int) -> tuple[int, int]:
    shard = sum(-(-numel // world_size) for numel in param_numels)
    return shard, shard * world_size - sum(param_numels)
'''

# The padding as world_size - total % world_size: a whole world size of it when the total divides.
SHARD_PADS_WHEN_EVEN = '''%%exercise 04.flat_shard_numel
def shard_numel(param_numels: list[int], world_size: int) -> tuple[int, int]:
    total = sum(param_numels)
    return -(-total // world_size), world_size - total % world_size
'''

CLIP_SOLUTION = '''%%exercise 04.clip_grad_norm
import torch


def clip(model, max_norm: float) -> torch.Tensor:
    return model.clip_grad_norm_(max_norm)
'''

# torch.nn.utils.clip_grad_norm_ over the rank's FlatParameter shards: the norm of this rank's shard only.
CLIP_LOCAL = '''%%exercise 04.clip_grad_norm
import torch


def clip(model, max_norm: float) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
'''

# By hand, but all-reducing the local norms instead of their squares.
CLIP_SUMS_NORMS = '''%%exercise 04.clip_grad_norm
import torch
import torch.distributed as dist


def clip(model, max_norm: float) -> torch.Tensor:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.stack([g.square().sum() for g in grads]).sum().sqrt()
    dist.all_reduce(norm)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale)
    return norm
'''

SAVE_SOLUTION = '''%%exercise 04.full_state_dict
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def save_full_state_dict(model, path: str) -> None:
    on_gpu = next(model.parameters()).is_cuda
    config = FullStateDictConfig(offload_to_cpu=on_gpu, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()
    if dist.get_rank() == 0:
        torch.save(state, path)
'''

# state_dict() is a collective (it all-gathers every unit's shards): called on rank 0 only, it waits.
SAVE_ON_RANK_0_ONLY = SAVE_SOLUTION.replace(
    "    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):\n"
    "        state = model.state_dict()\n    if dist.get_rank() == 0:\n        torch.save(state, path)\n",
    "    if dist.get_rank() == 0:\n"
    "        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):\n"
    "            torch.save(model.state_dict(), path)\n")

# Every rank saves: with rank0_only=True the others save an empty dict.
SAVE_EVERY_RANK = SAVE_SOLUTION.replace("    if dist.get_rank() == 0:\n        torch.save(state, path)\n",
                                        "    torch.save(state, path)\n")

# The local state dict: each rank's FlatParameter shards, not the model's parameters.
SAVE_LOCAL = SAVE_SOLUTION.replace(
    "    on_gpu = next(model.parameters()).is_cuda\n"
    "    config = FullStateDictConfig(offload_to_cpu=on_gpu, rank0_only=True)\n"
    "    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):\n",
    "    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):\n")

# What the lesson's GPU code passes, on the CPU: torch 2.13 frees the gathered parameters before they are read
# (https://github.com/pytorch/pytorch/issues/188989); a torch with the fix saves the right file.
SAVE_OFFLOAD_ON_CPU = SAVE_SOLUTION.replace("offload_to_cpu=on_gpu", "offload_to_cpu=True")

# FSDP's clip_grad_norm_ on rank 0 only: it all-reduces the squared norms, and rank 1 never joins.
CLIP_ON_RANK_0_ONLY = CLIP_SOLUTION.replace(
    "import torch\n", "import torch\nimport torch.distributed as dist\n", 1).replace(
    "    return model.clip_grad_norm_(max_norm)\n",
    "    if dist.get_rank() == 0:\n        return model.clip_grad_norm_(max_norm)\n    return torch.zeros(())\n")

# Only the big Linears: the Blocks are left to the root's unit.
POLICY_NO_BLOCKS = POLICY_SOLUTION.replace("    if isinstance(module, Block):\n        return True\n", "")

# The sharded state dict: each rank's part of each parameter, as ShardedTensors (for distributed checkpoints).
SAVE_SHARDED = SAVE_LOCAL.replace("LOCAL_STATE_DICT", "SHARDED_STATE_DICT")

MEMORY_SOLUTION = '''%%exercise 04.memory_per_rank
import math

FLOAT32 = 4
STATE_TENSORS = {"adam": 2, "sgd-momentum": 1, "sgd": 0}


def memory_per_rank(units, strategy: str, world_size: int, optimizer: str) -> dict:
    """Bytes of parameters, gradients and optimizer state this rank holds after one step."""
    group = 1 if strategy == "NO_SHARD" else world_size
    sizes = [sum(math.prod(shape) for shape in shapes) for shapes in units]
    flats = [-(-size // group) for size in sizes if size]
    held = sum(flats)
    state = STATE_TENSORS[optimizer] * FLOAT32 * held
    if optimizer == "adam":
        state += 4 * len(flats)
    return {"parameters": FLOAT32 * held, "gradients": FLOAT32 * held, "optimizer": state}
'''

# No padding: floor division of each unit's elements.
MEMORY_NO_PADDING = MEMORY_SOLUTION.replace("-(-size // group)", "size // group")

# SHARD_GRAD_OP read as ZeRO-2 (the lesson's table row): its parameters whole, gradients and state sharded.
MEMORY_SHARD_GRAD_OP_WHOLE = MEMORY_SOLUTION.replace(
    '    return {"parameters": FLOAT32 * held,',
    '    whole = sum(sizes) if strategy == "SHARD_GRAD_OP" else held\n'
    '    return {"parameters": FLOAT32 * whole,')

# NO_SHARD's gradients sharded like FULL_SHARD's.
MEMORY_NO_SHARD_GRADS_SHARDED = MEMORY_SOLUTION.replace(
    '"gradients": FLOAT32 * held,', '"gradients": FLOAT32 * sum(-(-size // world_size) for size in sizes if size),')

# Adam's state as one tensor per parameter, no step.
MEMORY_ADAM_ONE_TENSOR = MEMORY_SOLUTION.replace('{"adam": 2,', '{"adam": 1,').replace(
    "        state += 4 * len(flats)\n", "        pass\n")

# Adam's step counted per original parameter instead of per FlatParameter.
MEMORY_STEP_PER_PARAMETER = MEMORY_SOLUTION.replace(
    "        state += 4 * len(flats)\n", "        state += 4 * sum(len(shapes) for shapes in units)\n")
