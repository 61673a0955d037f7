"""Run on a GPU node with torchrun (1 rank is enough): the NCCL facts the rehearsal and the lessons state.

    torchrun --nproc-per-node 1 tests/gpu_node/nccl_facts.py

Each line printed is "FACT <name>: <what was seen>"; the course states these, and the rehearsal
(course_lib/rank/rehearsal.py) raises in their place on CPU.
"""

import datetime

import torch
import torch.distributed as dist
from torch.testing import assert_close

import course_lib as cl
from course_lib.models import make_batch, make_model


def fact(name, value):
    print(f"FACT {name}: {value}", flush=True)


info = cl.init()
fact("backend and device", f"{info.backend} {info.device} ({torch.cuda.get_device_name(info.device)})")
fact("torch, cuda, nccl", f"{torch.__version__} {torch.version.cuda} {torch.cuda.nccl.version()}")
fact("default group bound to a device", dist.distributed_c10d._get_default_group().bound_device_id)

x = torch.ones(4, device=info.device)
dist.all_reduce(x)
fact("all_reduce on cuda", x.tolist())

try:
    dist.all_reduce(torch.ones(4))
    fact("all_reduce on a CPU tensor", "no error")
except Exception as error:  # noqa: BLE001 - the message is the fact
    fact("all_reduce on a CPU tensor", f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")

try:
    torch.nn.Linear(4, 1).to(info.device)(torch.randn(2, 4))
    fact("a cuda module on a CPU batch", "no error")
except Exception as error:  # noqa: BLE001
    fact("a cuda module on a CPU batch", f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")

try:
    assert_close(torch.ones(2, device=info.device), torch.ones(2))
    fact("assert_close cuda vs cpu", "no error")
except Exception as error:  # noqa: BLE001
    fact("assert_close cuda vs cpu", f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")

try:
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    fact("DDP around a CPU module under NCCL", "no error")
except Exception as error:  # noqa: BLE001
    fact("DDP around a CPU module under NCCL", f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")

# One step of each wrapper on the GPU equals one process on the CPU (the lessons' model and batch).
inputs, targets = make_batch()
reference = make_model()
torch.nn.functional.mse_loss(reference(inputs), targets).backward()
expected = {name: p.grad for name, p in reference.named_parameters()}


def check(name, model, *, named=None):
    loss = torch.nn.functional.mse_loss(model(inputs.to(info.device)), targets.to(info.device))
    loss.backward()
    grads = named() if named else {n: p.grad for n, p in model.named_parameters()}
    for key, grad in grads.items():
        assert_close(grad.cpu(), expected[key.replace("_fsdp_wrapped_module.", "").replace("module.", "")])
    fact(name, "gradients equal one process on the CPU")


check("DDP on cuda", torch.nn.parallel.DistributedDataParallel(make_model().to(info.device)))

from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402

fsdp = FSDP(make_model(), device_id=info.device, use_orig_params=True)
check("FSDP1 on cuda", fsdp)

from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

mesh = init_device_mesh(info.device.type, (info.world_size,))
model = make_model()
for block in (model[1], model[2]):
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
fact("fully_shard moved the parameters to", {p.device.type for p in model.parameters()})
check("fully_shard on cuda", model, named=lambda: {n: p.grad.full_tensor() for n, p in model.named_parameters()})

group = dist.new_group(ranks=[0])
fact("new_group under a bound default group", f"returned {dist.get_rank(group)}")
dist.destroy_process_group()

# The mixed default group the README weighs: CPU tensors over gloo beside CUDA ones over NCCL.
dist.init_process_group("cpu:gloo,cuda:nccl", timeout=datetime.timedelta(seconds=60))
y = torch.ones(4)
dist.all_reduce(y)
fact("cpu:gloo,cuda:nccl: all_reduce on a CPU tensor", y.tolist())
dist.destroy_process_group()

# Bound: the eager path the old cl.init() took.
dist.init_process_group("nccl", device_id=info.device, timeout=datetime.timedelta(seconds=60))
fact("bound_device_id after init_process_group(device_id=...)", dist.distributed_c10d._get_default_group().bound_device_id)
dist.destroy_process_group()
fact("done", "all facts above ran")
