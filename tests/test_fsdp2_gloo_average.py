"""FSDP2 averages gradients on gloo (pytorch/pytorch#162338), and lesson 05's workaround holds either way.

`fully_shard` reduce-scatters gradients with ReduceOp.AVG where the reduce
dtype is float32; gloo summed instead of averaging in some torch releases,
silently: gradients N times too large. One launch on 2 gloo ranks probes
the collective itself, trains one backward with the default reduction and
one with `set_force_sum_reduction_for_comms(True)` (SUM, then divide: the
workaround lesson 05 shows), and compares both with one process computed on
each rank without torch.distributed.
"""

import pytest

from course_lib.launcher.torchrun import run_torchrun

SCRIPT = """
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
import course_lib as cl
from course_lib.models import Block, toy_batch, toy_model

info = cl.init(timeout_s=60)
mine = torch.full((2,), float(info.rank + 1))
out = torch.empty(1)
dist.reduce_scatter_single(out, mine, op=dist.ReduceOp.AVG)
cl.publish("probe", out.item())

inputs, targets = toy_batch()
one = toy_model()
torch.nn.functional.mse_loss(one(inputs), targets).backward()       # one process, the whole batch
rows = slice(info.rank * len(inputs) // 2, (info.rank + 1) * len(inputs) // 2)
mesh = init_device_mesh("cpu", (2,))
agree = {}
for force_sum in (False, True):
    model = toy_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(force_sum)
    torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows]).backward()
    reference = dict(one.named_parameters())
    agree[force_sum] = {name: torch.allclose(p.grad.full_tensor(), reference[name].grad, atol=1e-7)
                        for name, p in model.named_parameters()}
cl.publish("agree", agree)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def run():
    result = run_torchrun(SCRIPT, 2, backend="gloo", timeout_s=120)
    assert result.ok, "\n".join(result.stderr.values()) or result.agent_output
    return result


def test_gloo_reduce_scatter_averages(run):
    # Ranks hold 1s and 2s: the average is 1.5, the sum 3.0 (the bug).
    assert run.results["probe"] == {0: 1.5, 1: 1.5}, (
        "gloo's reduce-scatter with ReduceOp.AVG does not average on this torch (pytorch#162338): "
        "fully_shard's gradients are N times too large; set_force_sum_reduction_for_comms(True) works around it")


def test_fully_shard_gradients_equal_one_process_on_gloo(run):
    for rank, agree in run.results["agree"].items():
        wrong = [name for name, same in agree[False].items() if not same]
        assert not wrong, f"rank {rank}: fully_shard's gradients differ from one process on gloo: {wrong}"


def test_force_sum_workaround_equals_one_process(run):
    for rank, agree in run.results["agree"].items():
        wrong = [name for name, same in agree[True].items() if not same]
        assert not wrong, f"rank {rank}: SUM-then-divide gradients differ from one process: {wrong}"
