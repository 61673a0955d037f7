"""Answer cells for lesson 04's grader tests: the solutions (as in solutions/04_fsdp1_solutions.ipynb) and
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
    align = 16 // 4
    end = 0
    for numel in param_numels:
        end = -(-end // align) * align + numel
    shard = -(-end // world_size)
    return shard, shard * world_size - sum(param_numels)
'''

# The lesson's use_orig_params=False layout: the parameters back to back, no alignment.
SHARD_NO_ALIGNMENT = SHARD_SOLUTION.replace("    align = 16 // 4\n", "    align = 1\n")

# 16 elements, not 16 bytes.
SHARD_ALIGNS_16_ELEMENTS = SHARD_SOLUTION.replace("    align = 16 // 4\n", "    align = 16\n")

# The end of the last parameter aligned too, before the world-size padding.
SHARD_ALIGNS_END = SHARD_SOLUTION.replace(
    "    shard = -(-end // world_size)\n", "    end = -(-end // align) * align\n    shard = -(-end // world_size)\n")

# Floor division: the rest of the aligned FlatParameter left out, no padding at the end.
SHARD_FLOOR = SHARD_SOLUTION.replace("    shard = -(-end // world_size)\n", "    shard = end // world_size\n").replace(
    "    return shard, shard * world_size - sum(param_numels)\n", "    return shard, end - sum(param_numels)\n")

# The end padding as world_size - end % world_size: a whole world size of it when the end divides.
SHARD_PADS_WHEN_EVEN = SHARD_SOLUTION.replace(
    "    return shard, shard * world_size - sum(param_numels)\n",
    "    return shard, end - sum(param_numels) + world_size - end % world_size\n")

CLIP_SOLUTION = '''%%exercise 04.clip_grad_norm
import torch
import torch.distributed as dist


def clip(model, max_norm: float) -> torch.Tensor:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    squares = torch.stack([torch.linalg.vector_norm(g) ** 2 for g in grads]).sum()
    dist.all_reduce(squares)
    norm = squares.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale)
    return norm
'''

# No collective: the norm of this rank's shard only, and each rank clips by its own.
CLIP_LOCAL = CLIP_SOLUTION.replace("    dist.all_reduce(squares)\n", "")

# The ranks' norms added, instead of their squares.
CLIP_SUMS_NORMS = CLIP_SOLUTION.replace(
    "    dist.all_reduce(squares)\n    norm = squares.sqrt()\n", "    norm = squares.sqrt()\n    dist.all_reduce(norm)\n")

# The ranks' norms all-reduced with MAX: the largest shard norm.
CLIP_MAX = CLIP_SOLUTION.replace(
    "    dist.all_reduce(squares)\n    norm = squares.sqrt()\n",
    "    norm = squares.sqrt()\n    dist.all_reduce(norm, op=dist.ReduceOp.MAX)\n")

# The factor not capped at 1: a max_norm above the norm scales the gradients up.
CLIP_ALWAYS_SCALES = CLIP_SOLUTION.replace("torch.clamp(max_norm / (norm + 1e-6), max=1.0)", "max_norm / (norm + 1e-6)")

# torch's clipping, refused while the learner's code runs.
CLIP_WITH_TORCH = '''%%exercise 04.clip_grad_norm
import torch
from torch.nn.utils import clip_grad_norm_


def clip(model, max_norm: float) -> torch.Tensor:
    return clip_grad_norm_(model.parameters(), max_norm)
'''

# FSDP's own method, refused too.
CLIP_WITH_FSDP = CLIP_WITH_TORCH.replace("    return clip_grad_norm_(model.parameters(), max_norm)\n",
                                         "    return model.clip_grad_norm_(max_norm)\n")

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

# The all-reduce on rank 0 only: rank 1 never joins it.
CLIP_ON_RANK_0_ONLY = CLIP_SOLUTION.replace(
    "    dist.all_reduce(squares)\n", "    if dist.get_rank() == 0:\n        dist.all_reduce(squares)\n")

# Only the big Linears: the Blocks are left to the root's unit.
POLICY_NO_BLOCKS = POLICY_SOLUTION.replace("    if isinstance(module, Block):\n        return True\n", "")

# No state_dict_type: FSDP1's default is FULL_STATE_DICT without rank0_only, so every rank builds the whole model.
SAVE_DEFAULT = SAVE_SOLUTION.replace(
    "    on_gpu = next(model.parameters()).is_cuda\n"
    "    config = FullStateDictConfig(offload_to_cpu=on_gpu, rank0_only=True)\n"
    "    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):\n"
    "        state = model.state_dict()\n",
    "    state = model.state_dict()\n")

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
