"""Answer cells for lesson 04's grader tests: the solutions (as in solutions/04_fsdp1_solutions.ipynb) and
plausible wrong answers, each of which must lose exactly the points its mistake deserves."""

POLICY_SOLUTION = '''%%exercise 04.wrap_policy
from course_lib.models import Block


def policy(module, recurse, nonwrapped_numel) -> bool:
    if recurse:
        return True
    if isinstance(module, Block):
        return True
    own = list(module.parameters(recurse=False))
    return nonwrapped_numel > 0 and len(own) > 0 and not any(p.requires_grad for p in own)
'''

# The lesson's ModuleWrapPolicy({Block}) written by hand: the root's unit mixes the frozen embedding with the head.
POLICY_BLOCKS_ONLY = POLICY_SOLUTION.replace(
    "    own = list(module.parameters(recurse=False))\n"
    "    return nonwrapped_numel > 0 and len(own) > 0 and not any(p.requires_grad for p in own)\n",
    "    return False\n")

# "Every parameter below it frozen", with no check that anything is left: a ReLU (no parameters) and embed (whose
# children are units already, their FlatParameters frozen) become units of nothing.
POLICY_ALL_FROZEN = POLICY_SOLUTION.replace(
    "    own = list(module.parameters(recurse=False))\n"
    "    return nonwrapped_numel > 0 and len(own) > 0 and not any(p.requires_grad for p in own)\n",
    "    return all(not p.requires_grad for p in module.parameters())\n")

# FSDP not let inside a Block: a Block with a frozen Linear is one unit of mixed parameters (the 3-rank case).
POLICY_NOT_INSIDE_BLOCKS = POLICY_SOLUTION.replace(
    "    if recurse:\n        return True\n", "    if recurse:\n        return not isinstance(module, Block)\n")

# No recurse branch: asked about the root with recurse=True, it answers False and FSDP looks no further.
POLICY_NO_RECURSE = POLICY_SOLUTION.replace("    if recurse:\n        return True\n", "")

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

# The all-reduce on rank 0 only: rank 1 never joins it.
CLIP_ON_RANK_0_ONLY = CLIP_SOLUTION.replace(
    "    dist.all_reduce(squares)\n", "    if dist.get_rank() == 0:\n        dist.all_reduce(squares)\n")

# Only the frozen modules: the Blocks are left to the root's unit.
POLICY_NO_BLOCKS = POLICY_SOLUTION.replace("    if isinstance(module, Block):\n        return True\n", "")

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

LOAD_SOLUTION = '''%%exercise 04.full_state_dict
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType


def load_full_state_dict(model, path: str) -> None:
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        template = model.state_dict()
    if dist.get_rank() == 0:
        saved = torch.load(path, weights_only=True)
        for name, tensor in template.items():
            tensor.copy_(saved[name])
    for name in sorted(template):
        dist.broadcast(template[name], src=0)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model.load_state_dict(template)
'''

# The lesson's reload: every rank reads the file, which only rank 0 has.
LOAD_EVERY_RANK_READS = LOAD_SOLUTION.replace(
    "    if dist.get_rank() == 0:\n        saved = torch.load(path, weights_only=True)\n",
    "    saved = torch.load(path, weights_only=True)\n    if True:\n")

# No broadcast: rank 0 loads the file's values, the others load the model's own (the template) back.
LOAD_NO_BROADCAST = LOAD_SOLUTION.replace(
    "    for name in sorted(template):\n        dist.broadcast(template[name], src=0)\n", "")

# Broadcast into the state dict, never loaded: its tensors are copies, not the model's parameters.
LOAD_NOT_LOADED = LOAD_SOLUTION.replace(
    "    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):\n        model.load_state_dict(template)\n",
    "")

# The whole dict pickled from rank 0 (not allowed: tensors travel as tensors).
LOAD_PICKLED = LOAD_SOLUTION.replace(
    "    for name in sorted(template):\n        dist.broadcast(template[name], src=0)\n",
    "    box = [template]\n    dist.broadcast_object_list(box, src=0)\n    template = box[0]\n")

# Only rank 0 loads: FSDP's load is a collective (it gathers every unit), so rank 0 waits for the others.
LOAD_ON_RANK_0_ONLY = '''%%exercise 04.full_state_dict
import torch
import torch.distributed as dist


def load_full_state_dict(model, path: str) -> None:
    if dist.get_rank() == 0:
        model.load_state_dict(torch.load(path, weights_only=True))
'''
