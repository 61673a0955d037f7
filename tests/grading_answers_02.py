"""Answer cells for lesson 02's grader tests: the solutions (as in solutions/02_ddp.ipynb) and
plausible wrong answers, each of which must lose exactly the points its mistake deserves."""

AVERAGE_SOLUTION = '''%%exercise 02.average_gradients
import torch
import torch.distributed as dist


def average_gradients(model: torch.nn.Module) -> None:
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:  # frozen (requires_grad=False), or not used in this forward
            continue
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world
'''

# ReduceOp.AVG averages in one call (gloo supports it): right.
AVERAGE_REDUCE_OP_AVG = AVERAGE_SOLUTION.replace("dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)\n        p.grad /= world",
                                                 "dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)")

# Sums and forgets to divide: every gradient N times the average.
AVERAGE_SUMS = AVERAGE_SOLUTION.replace("        p.grad /= world\n", "")

# Divides by 2, the world size the learner tried: right on 2 ranks only.
AVERAGE_DIVIDES_BY_2 = AVERAGE_SOLUTION.replace("p.grad /= world", "p.grad /= 2")

# Averages the weights only (p.dim() > 1): the biases keep this rank's own gradient.
AVERAGE_SKIPS_BIASES = AVERAGE_SOLUTION.replace("if p.grad is None:", "if p.grad is None or p.dim() < 2:")

# Averages the parameters instead of their gradients: every .grad stays this rank's own.
AVERAGE_PARAMS = AVERAGE_SOLUTION.replace("dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)\n        p.grad /= world",
                                          "dist.all_reduce(p.data, op=dist.ReduceOp.SUM)\n        p.data /= world")

# Does not skip a parameter without a gradient: all_reduce(None) raises.
AVERAGE_NO_NONE_CHECK = AVERAGE_SOLUTION.replace(
    "        if p.grad is None:  # frozen (requires_grad=False), or not used in this forward\n            continue\n", "")

BUCKETED_SOLUTION = '''%%exercise 02.bucketed_allreduce
import torch
import torch.distributed as dist


def allreduce_bucketed(tensors: list[torch.Tensor], bucket_cap_bytes: int) -> None:
    buckets, size = [], 0
    for t in tensors:  # greedy, in order: a new bucket when the next tensor would pass the cap
        nbytes = t.numel() * t.element_size()
        if buckets and size + nbytes <= bucket_cap_bytes:
            buckets[-1].append(t)
            size += nbytes
        else:
            buckets.append([t])
            size = nbytes
    for bucket in buckets:
        flat = torch.cat([t.reshape(-1) for t in bucket])  # one contiguous buffer
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for t in bucket:  # copy back: the views of flat, in the tensors' shapes
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
'''

# One all_reduce per tensor: right values, more calls than buckets.
BUCKETED_PER_TENSOR = '''%%exercise 02.bucketed_allreduce
import torch.distributed as dist


def allreduce_bucketed(tensors, bucket_cap_bytes):
    for t in tensors:
        dist.all_reduce(t)
        t /= dist.get_world_size()
'''

# Averages the flat buffer but never copies it back: the tensors are unchanged.
BUCKETED_NO_COPY_BACK = BUCKETED_SOLUTION.replace("            t.copy_(flat[offset:offset + t.numel()].view_as(t))\n",
                                                  "            flat[offset:offset + t.numel()].view_as(t)\n")

# Puts the averaged slices into the list instead of copying them into the tensors: the caller's
# tensors (a model's gradients, in DDP) are unchanged.
BUCKETED_REPLACES_ENTRIES = '''%%exercise 02.bucketed_allreduce
import torch
import torch.distributed as dist


def allreduce_bucketed(tensors, bucket_cap_bytes):
    buckets, size = [], 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if buckets and size + nbytes <= bucket_cap_bytes:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size = nbytes
    for bucket in buckets:
        flat = torch.cat([tensors[i].reshape(-1) for i in bucket])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for i in bucket:
            n = tensors[i].numel()
            tensors[i] = flat[offset:offset + n].view_as(tensors[i])
            offset += n
'''

# Sums the buckets without dividing.
BUCKETED_SUMS = BUCKETED_SOLUTION.replace("        flat /= dist.get_world_size()\n", "")

# Closes a bucket when it would reach the cap (< instead of <=): a bucket exactly at the cap is split.
BUCKETED_STRICT_CAP = BUCKETED_SOLUTION.replace("size + nbytes <= bucket_cap_bytes", "size + nbytes < bucket_cap_bytes")

ACCUMULATION_SOLUTION = '''%%exercise 02.no_sync_accumulation
import torch
import torch.nn.functional as F


def accumulation_step(ddp_model, optimizer, micro_batches) -> None:
    k = len(micro_batches)
    for inputs, targets in micro_batches[:-1]:
        with ddp_model.no_sync():  # gradients add up locally, no all-reduce
            (F.mse_loss(ddp_model(inputs), targets) / k).backward()
    inputs, targets = micro_batches[-1]
    (F.mse_loss(ddp_model(inputs), targets) / k).backward()  # this backward all-reduces the sum
    optimizer.step()
    optimizer.zero_grad()
'''

# Synchronises on every micro-batch: right parameters, K all-reduces per bucket.
ACCUMULATION_SYNC_EVERY_TIME = '''%%exercise 02.no_sync_accumulation
import torch.nn.functional as F


def accumulation_step(ddp_model, optimizer, micro_batches):
    for inputs, targets in micro_batches:
        (F.mse_loss(ddp_model(inputs), targets) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()
'''

# Every backward inside no_sync: DDP never all-reduces, each rank steps on its own gradient.
ACCUMULATION_NEVER_SYNCS = '''%%exercise 02.no_sync_accumulation
import torch.nn.functional as F


def accumulation_step(ddp_model, optimizer, micro_batches):
    with ddp_model.no_sync():
        for inputs, targets in micro_batches:
            (F.mse_loss(ddp_model(inputs), targets) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()
'''

# Forgets to divide each loss by K: the step is K times too large.
ACCUMULATION_NO_DIVIDE = ACCUMULATION_SOLUTION.replace(" / k).backward()", ").backward()")

# Forgets zero_grad: the next step would add this one's gradients.
ACCUMULATION_NO_ZERO_GRAD = ACCUMULATION_SOLUTION.replace("    optimizer.zero_grad()\n", "")

FP16_SOLUTION = '''%%exercise 02.fp16_compress_hook
import torch
import torch.distributed as dist


def fp16_compress(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()  # this bucket's float32 gradients, flattened
    compressed = buffer.to(torch.float16).div_(group.size())  # divide first: the sum stays in range
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])  # back to float32, in place
        return buffer

    return future.then(decompress)
'''

# Does not divide by the world size: gradients N times too large.
FP16_NO_DIVIDE = FP16_SOLUTION.replace(".div_(group.size())", "")

# Sends the float32 buffer: right gradients, twice the bytes.
FP16_NO_COMPRESSION = FP16_SOLUTION.replace("buffer.to(torch.float16).div_(group.size())",
                                            "buffer.div_(group.size())")

# A blocking all_reduce and a future made by hand: right values, but backward waits for it.
FP16_BLOCKING = '''%%exercise 02.fp16_compress_hook
import torch
import torch.distributed as dist


def fp16_compress(process_group, bucket):
    buffer = bucket.buffer()
    compressed = buffer.to(torch.float16).div_(dist.get_world_size())
    dist.all_reduce(compressed)
    buffer.copy_(compressed)
    future = torch.futures.Future()
    future.set_result(buffer)
    return future
'''

# torch's own hook, called from the learner's: refused.
FP16_TORCH_HOOK = '''%%exercise 02.fp16_compress_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook


def fp16_compress(process_group, bucket):
    return fp16_compress_hook(process_group, bucket)
'''

# The same, reached through the module at run time.
FP16_TORCH_HOOK_BY_MODULE = '''%%exercise 02.fp16_compress_hook
import torch


def fp16_compress(process_group, bucket):
    hooks = torch.distributed.algorithms.ddp_comm_hooks.default_hooks
    return hooks.fp16_compress_hook(process_group, bucket)
'''

# Returns the float16 result without casting it back: DDP copies it into the float32 .grad itself,
# so this passes (torch 2.13: the Reducer copies the future's tensor into each gradient).
FP16_NO_CAST_BACK = FP16_SOLUTION.replace('''    def decompress(fut):
        buffer.copy_(fut.value()[0])  # back to float32, in place
        return buffer

    return future.then(decompress)''', '''    return future.then(lambda fut: fut.value()[0])''')
