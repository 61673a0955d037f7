"""Answer cells for lesson 02's grader tests: the solutions (as in solutions/02_ddp_solutions.ipynb) and
plausible wrong answers, each of which must lose exactly the points its mistake deserves."""

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

# Sums in float16 and divides afterwards: right for small gradients, inf where the sum passes 65504.
FP16_SUM_THEN_DIVIDE = FP16_SOLUTION.replace(".div_(group.size())", "").replace(
    "buffer.copy_(fut.value()[0])", "buffer.copy_(fut.value()[0].float() / group.size())")

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


DDP_SOLUTION = """%%exercise 02.ddp_from_scratch
import contextlib

import torch
import torch.distributed as dist


class DDPFromScratch(torch.nn.Module):
    \"\"\"`module` on every rank, trained as one process would train it on the whole batch.\"\"\"

    def __init__(self, module: torch.nn.Module, bucket_cap_bytes: int):
        super().__init__()
        self.module = module
        ### BEGIN SOLUTION
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p, src=0)  # every rank starts from rank 0's parameters
        self.sync = True  # False inside no_sync()
        self.pending = []  # (work handle, flat bucket, its parameters) per bucket started
        self.bucket, self.bucket_bytes, self.ready = [], 0, 0
        params = [p for p in module.parameters() if p.requires_grad]

        def start_bucket():
            flat = torch.cat([p.grad.reshape(-1) for p in self.bucket])
            work = dist.all_reduce(flat, async_op=True)  # returns at once: backward goes on
            self.pending.append((work, flat, self.bucket))
            self.bucket, self.bucket_bytes = [], 0

        def on_gradient_ready(p):  # runs inside backward, once p.grad holds this backward's sum
            if not self.sync:
                return  # inside no_sync(): the gradient stays in p.grad, added to by the next backward
            nbytes = p.grad.numel() * p.grad.element_size()
            if self.bucket and self.bucket_bytes + nbytes > bucket_cap_bytes:
                start_bucket()  # full: this gradient would pass the cap
            self.bucket.append(p)
            self.bucket_bytes += nbytes
            self.ready += 1
            if self.ready == len(params):  # the last gradient of this backward
                start_bucket()
                self.ready = 0

        for p in params:
            p.register_post_accumulate_grad_hook(on_gradient_ready)
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        \"\"\"After loss.backward(), before optimizer.step(): every .grad then holds the average over the ranks.\"\"\"
        ### BEGIN SOLUTION
        world = dist.get_world_size()
        for work, flat, params in self.pending:
            work.wait()  # the only wait: backward has returned already
            flat /= world
            offset = 0
            for p in params:  # copy each slice back into its gradient
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.pending = []
        ### END SOLUTION

    @contextlib.contextmanager
    def no_sync(self):
        \"\"\"Backward passes run inside communicate nothing: gradients add up in .grad.\"\"\"
        ### BEGIN SOLUTION
        self.sync = False
        try:
            yield
        finally:
            self.sync = True
        ### END SOLUTION
"""

# Waits for each bucket's all-reduce inside the hook: right values, but backward stalls on every bucket.
DDP_WAITS_IN_HOOK = DDP_SOLUTION.replace(
    "            self.pending.append((work, flat, self.bucket))\n",
    "            work.wait()  # make sure it is done before going on\n"
    "            self.pending.append((work, flat, self.bucket))\n")

# Never copies rank 0's parameters: ranks that start different stay different.
DDP_NO_BROADCAST = DDP_SOLUTION.replace(
    "        with torch.no_grad():\n"
    "            for p in module.parameters():\n"
    "                dist.broadcast(p, src=0)  # every rank starts from rank 0's parameters\n", "")

# Divides while copying into the bucket, as DDP does, and again after the all-reduce: 1/N of the average.
DDP_AVERAGES_TWICE = DDP_SOLUTION.replace(
    "            flat = torch.cat([p.grad.reshape(-1) for p in self.bucket])\n",
    "            flat = torch.cat([p.grad.reshape(-1) for p in self.bucket]) / dist.get_world_size()\n")

# Divides while copying into the bucket (DDP's order) and not after: the average all the same. Right.
DDP_PRE_DIVIDES = DDP_AVERAGES_TWICE.replace("            flat /= world\n", "")

# Leaves the last bucket open in backward and all-reduces it in finish_gradient_synchronization (allowed),
# but never copies that bucket's result back: its gradients stay this rank's own.
DDP_LAST_BUCKET_NOT_COPIED_BACK = DDP_SOLUTION.replace(
    "            if self.ready == len(params):  # the last gradient of this backward\n"
    "                start_bucket()\n"
    "                self.ready = 0\n", "").replace(
    "        world = dist.get_world_size()\n",
    "        world = dist.get_world_size()\n"
    "        if self.bucket:  # the last bucket, still open: backward is over, so a blocking call is fine\n"
    "            last = torch.cat([p.grad.reshape(-1) for p in self.bucket])\n"
    "            dist.all_reduce(last)\n"
    "            last /= world\n"
    "            self.bucket, self.bucket_bytes = [], 0\n")

# Collects the buckets in backward but starts every all-reduce in finish_gradient_synchronization: no overlap.
DDP_ALL_IN_FINISH = DDP_SOLUTION.replace(
    "            work = dist.all_reduce(flat, async_op=True)  # returns at once: backward goes on\n"
    "            self.pending.append((work, flat, self.bucket))\n",
    "            self.pending.append((None, flat, self.bucket))\n").replace(
    "        for work, flat, params in self.pending:\n"
    "            work.wait()  # the only wait: backward has returned already\n",
    "        works = [dist.all_reduce(flat, async_op=True) for _, flat, _ in self.pending]\n"
    "        for work, (_, flat, params) in zip(works, self.pending):\n"
    "            work.wait()\n")

# DDP's own bucket rule: add the gradient, then close the bucket once it reaches the cap (it may pass it).
DDP_REACHES_THE_CAP = DDP_SOLUTION.replace(
    "            if self.bucket and self.bucket_bytes + nbytes > bucket_cap_bytes:\n"
    "                start_bucket()  # full: this gradient would pass the cap\n"
    "            self.bucket.append(p)\n"
    "            self.bucket_bytes += nbytes\n"
    "            self.ready += 1\n",
    "            self.bucket.append(p)\n"
    "            self.bucket_bytes += nbytes\n"
    "            self.ready += 1\n"
    "            if self.bucket_bytes >= bucket_cap_bytes and self.ready < len(params):\n"
    "                start_bucket()\n")

# Inside no_sync() each gradient is dropped instead of kept: the next average has the outside micro-batch only.
DDP_NO_SYNC_DROPS = DDP_SOLUTION.replace(
    "                return  # inside no_sync(): the gradient stays in p.grad, added to by the next backward\n",
    "                p.grad.zero_()  # the gradient is dropped\n                return\n")
assert DDP_NO_SYNC_DROPS != DDP_SOLUTION

# DDP's assignment before its first rebuild: buckets of consecutive parameters in the order of module.parameters(),
# fixed in the constructor, each all-reduced once all of its gradients are ready. Right values and overlap; the
# buckets differ from those filled in the order of readiness (at the 2-rank cap of 128 B they did not).
DDP_PARAMETER_ORDER = DDP_SOLUTION.replace(
    DDP_SOLUTION[DDP_SOLUTION.index("        self.bucket, self.bucket_bytes, self.ready = [], 0, 0\n"):
                 DDP_SOLUTION.index("        for p in params:\n")],
    """        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets, size = [], 0
        for p in params:  # consecutive parameters, in the order of module.parameters()
            nbytes = p.numel() * p.element_size()
            if self.buckets and size + nbytes <= bucket_cap_bytes:
                self.buckets[-1].append(p)
                size += nbytes
            else:
                self.buckets.append([p])
                size = nbytes
        bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.missing = {}  # bucket index -> gradients it still waits for in this backward

        def on_gradient_ready(p):
            if not self.sync:
                return
            i = bucket_of[p]
            self.missing[i] = self.missing.get(i, len(self.buckets[i])) - 1
            if self.missing[i] == 0:  # the bucket is complete: start it
                del self.missing[i]
                flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
                self.pending.append((dist.all_reduce(flat, async_op=True), flat, self.buckets[i]))

""")
assert DDP_PARAMETER_ORDER != DDP_SOLUTION and "def start_bucket" not in DDP_PARAMETER_ORDER

# Registers a hook on every parameter, the frozen one too: torch refuses a hook on a tensor that requires no
# gradient, so the constructor raises on the module with a frozen parameter (the other runs pass).
DDP_HOOKS_ON_FROZEN = DDP_SOLUTION.replace(
    "        params = [p for p in module.parameters() if p.requires_grad]\n",
    "        params = list(module.parameters())\n")
assert DDP_HOOKS_ON_FROZEN != DDP_SOLUTION

# Hooks only where a gradient comes, but waits for as many gradients as module.parameters() lists: with a frozen
# parameter the count never reaches it, so the last bucket is never started (nor its gradients averaged).
DDP_COUNTS_FROZEN = DDP_SOLUTION.replace(
    "            if self.ready == len(params):  # the last gradient of this backward\n",
    "            if self.ready == len(list(module.parameters())):  # the last gradient of this backward\n")
assert DDP_COUNTS_FROZEN != DDP_SOLUTION

# Collects the parameters module by module: a weight two layers share is listed (and hooked) twice, so it is
# put in a bucket and all-reduced twice per backward. Right values (the same average copied back twice),
# twice its bytes on the wire.
DDP_TIED_TWICE = DDP_SOLUTION.replace(
    "        params = [p for p in module.parameters() if p.requires_grad]\n",
    "        params = [p for m in module.modules() for p in m.parameters(recurse=False) if p.requires_grad]\n")
assert DDP_TIED_TWICE != DDP_SOLUTION
