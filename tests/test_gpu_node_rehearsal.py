"""The GPU-node rehearsal (course_lib/rank/rehearsal.py): what would break with one GPU per rank and NCCL.

No machine that runs this suite has a GPU per rank. `make test` sets COURSE_REHEARSE_GPU_NODE=1, so
every lesson and solution notebook that nbval runs has its ranks checked as they run (the same
gloo run, the same output, plus the checks). This file shows that each check fails where it
must, on small cells and on the cells lessons 00 and 01 had before the GPU-node fixes, and
passes on the right version; and it reads every multi-rank cell's source for what the running
checks cannot see (a device written as a literal "cpu", a gloo-only demonstration not gated).
"""

from __future__ import annotations

import pathlib
import re

import nbformat
import pytest

from course_lib.backend_choice import choose_backend
from course_lib.rank.rehearsal import ENV_REHEARSE
from proc_helpers import env_var, launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("_rehearsed")


@pytest.fixture
def _rehearsed():
    with env_var(ENV_REHEARSE, "1"):
        yield


def _rank_errors(run) -> str:
    return "".join(text for _, stream, text in run.chunks if stream == "stderr")


def test_a_node_with_a_gpu_per_rank_chooses_nccl_on_cuda():
    assert (choose_backend(4, gpus=4).backend, choose_backend(4, gpus=4).device_type) == ("nccl", "cuda")
    assert choose_backend(4, gpus=2).backend == "gloo"  # fewer GPUs than ranks: gloo on CPU, said in the header


def test_make_test_runs_every_notebook_rehearsed():
    makefile = (ROOT / "Makefile").read_text()
    test_recipe = re.search(r"^test: .*\n\t(.*)", makefile, re.M).group(1)
    assert f"{ENV_REHEARSE}=1" in test_recipe


# --- the running checks, each on a small cell: wrong fails, right passes --------------------------

# Lesson 00 cells 26 + 28 before the fix: a tensor made without device=, then all-reduced.
OLD_00_CELLS_26_28 = """
import torch
import torch.distributed as dist
import course_lib as cl
info = cl.init()
x = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(x)
"""

# Lesson 01 cell 26 (data parallelism by hand) before the fix: the model and batch stay on the CPU.
OLD_01_CELL_26 = """
import torch
import torch.distributed as dist
import course_lib as cl
info = cl.init()
torch.manual_seed(0)
model, inputs, targets = torch.nn.Linear(4, 1), torch.randn(8, 4), torch.randn(8, 1)
per_rank = len(inputs) // info.world_size
mine = slice(info.rank * per_rank, (info.rank + 1) * per_rank)
torch.nn.functional.mse_loss(model(inputs[mine]), targets[mine]).backward()
for p in model.parameters():
    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
    p.grad /= info.world_size
"""

FIXED_01_CELL_26 = """
import torch
import torch.distributed as dist
import course_lib as cl
from torch.testing import assert_close
info = cl.init()
device = info.device
torch.manual_seed(0)
model, inputs, targets = torch.nn.Linear(4, 1), torch.randn(8, 4), torch.randn(8, 1)
reference = torch.nn.Linear(4, 1)
reference.load_state_dict(model.state_dict())
torch.nn.functional.mse_loss(reference(inputs), targets).backward()
model, inputs, targets = model.to(device), inputs.to(device), targets.to(device)
per_rank = len(inputs) // info.world_size
mine = slice(info.rank * per_rank, (info.rank + 1) * per_rank)
torch.nn.functional.mse_loss(model(inputs[mine]), targets[mine]).backward()
for p in model.parameters():
    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
    p.grad /= info.world_size
assert_close(model.weight.grad.cpu(), reference.weight.grad)   # compared on the CPU
ddp = torch.nn.parallel.DistributedDataParallel(model)
ddp(inputs[mine]).sum().backward()
gloo = dist.new_group(backend="gloo")            # a group made for CPU tensors: right on a GPU node too
dist.all_reduce(torch.ones(2), group=gloo)
torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1), process_group=gloo)
print("RIGHT", flush=True)
"""

MIXED_DEVICES = """
import torch
import course_lib as cl
info = cl.init()
model = torch.nn.Linear(4, 1).to(info.device)
model(torch.randn(8, 4)).sum().backward()   # the batch was never moved
"""

DDP_ON_CPU = """
import torch
import course_lib as cl
info = cl.init()
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
"""

COMPARED_ACROSS_DEVICES = """
import torch
from torch.testing import assert_close
import course_lib as cl
info = cl.init()
assert_close(torch.ones(3, device=info.device), torch.ones(3))
"""

# Lesson 01 cell 29 as it ran with the old `cl.init()`, which bound device_id on CUDA: rank 3 enters
# new_group([0, 1, 2]) alone while the members wait for its store key. Eager NCCL deadlocks here.
NEW_GROUP_BEFORE_THE_MEMBERS = """
import os
import torch
import torch.distributed as dist
import course_lib as cl
BIND = {bind}
cl.init()                      # what cl.init() does now: no device_id
if BIND:                       # what the old cl.init() did on a GPU node: device_id=cuda:LOCAL_RANK
    from course_lib.rank.rehearsal import rehearse_a_bound_device
    rehearse_a_bound_device()
rank = dist.get_rank()
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
if rank == 3:
    first_three = dist.new_group(ranks=[0, 1, 2])
    store.set("rank 3 returned from new_group", "yes")
else:
    store.wait(["rank 3 returned from new_group"])
    first_three = dist.new_group(ranks=[0, 1, 2])
print("RIGHT", flush=True)
"""


@pytest.mark.parametrize("script, says", [
    (OLD_00_CELLS_26_28, "dist.all_reduce() on a tensor of shape (1,) that was never put on the rank's device"),
    (OLD_01_CELL_26, "dist.all_reduce() on a tensor of shape (1, 4) that was never put on the rank's device"),
    (MIXED_DEVICES, "linear() mixes a tensor on the rank's device with one of shape (8, 4) left on the CPU"),
    (DDP_ON_CPU, "DistributedDataParallel around a module whose parameter 'weight' is on the CPU"),
    (COMPARED_ACROSS_DEVICES, "mixes a tensor on the rank's device"),
], ids=["00-cells-26-28", "01-cell-26", "mixed-devices", "ddp-on-cpu", "assert-close-across-devices"])
def test_what_would_fail_under_nccl_fails_rehearsed_with_one_line_saying_what_nccl_would_do(script, says):
    run = launch(script, 2, timeout_s=60, backend="auto")
    assert not run.result.ok
    assert says in _rank_errors(run)


def test_the_same_work_with_every_tensor_on_the_device_passes():
    run = launch(FIXED_01_CELL_26, 2, timeout_s=60, backend="auto")
    assert run.result.ok, _rank_errors(run)[-2000:]
    assert "RIGHT" in "".join(text for _, _, text in run.chunks)


TENSOR_PARALLEL_ON_THE_DEVICE = """
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
import course_lib as cl
info = cl.init()
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4), torch.nn.RMSNorm(4),
                            torch.nn.Linear(4, 6)).to(info.device)
mesh = init_device_mesh(info.device.type, (info.world_size,))
parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel(),
                                 "3": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
logits = model(torch.randn(5, 4, device=info.device))      # the norm sees the row-parallel layer's output
with loss_parallel():
    F.cross_entropy(logits, torch.randint(0, 6, (5,), device=info.device)).backward()
print("RIGHT", flush=True)
"""


def test_tensor_parallel_with_every_tensor_on_the_device_passes():
    """The tensors the parallel styles make inside torch carry no mark; DTensor places them (lesson 06)."""
    run = launch(TENSOR_PARALLEL_ON_THE_DEVICE, 2, timeout_s=90, backend="auto")
    assert run.result.ok, _rank_errors(run)[-2000:]
    assert "RIGHT" in "".join(text for _, _, text in run.chunks)


def test_01_cell_29_deadlocks_under_a_bound_device_and_the_deadline_names_the_rank_in_new_group():
    run = launch(NEW_GROUP_BEFORE_THE_MEMBERS.format(bind=True), 4, timeout_s=20, backend="auto")
    assert run.result.timed_out
    # The script's line k is the cell's line k + 1 (line 1 is the %%torchrun line); the text starts with "\n".
    new_group_line = NEW_GROUP_BEFORE_THE_MEMBERS.splitlines().index("    first_three = dist.new_group(ranks=[0, 1, 2])") + 2
    assert f"rank 3 is running Python at cell line {new_group_line}, before any collective" in run.result.diagnosis


def test_01_cell_29_runs_under_cl_init_which_binds_no_device():
    run = launch(NEW_GROUP_BEFORE_THE_MEMBERS.format(bind=False), 4, timeout_s=60, backend="auto")
    assert run.result.ok, _rank_errors(run)[-2000:]


# --- what the running checks cannot see: read from the cells' sources -----------------------------

MULTI_RANK = re.compile(r"^%%(torchrun|dist)\b")
NOTEBOOKS = sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("solutions/*.ipynb")])
# A device written as a literal CPU where the rank's device belongs.
LITERAL_CPU = re.compile(r"""init_device_mesh\(\s*["']cpu["']|device\s*=\s*["']cpu["']|\.to\(\s*["']cpu["']\s*\)""")
# Demonstrations that rely on gloo: a cell that catches the error of a collective that timed out or
# lost its peer. On NCCL the watchdog ends the process instead (TORCH_NCCL_ASYNC_ERROR_HANDLING).
CATCHES = re.compile(r"except\s+(RuntimeError|dist\.DistBackendError|Exception|BaseException)\b")
WAITS_FOR_A_PEER = re.compile(r"timeout\s*=|monitored_barrier|--expect-failure|peer")


def _multi_rank_cells():
    for path in NOTEBOOKS:
        for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "code" and MULTI_RANK.match(cell.source):
                yield f"{path.parent.name}/{path.name} cell {index}", cell.source


@pytest.mark.parametrize("where, source", list(_multi_rank_cells()), ids=lambda value: value if " cell " in value else "")
def test_no_multi_rank_cell_writes_the_cpu_where_the_ranks_device_belongs(where, source):
    for line in source.splitlines():
        if LITERAL_CPU.search(line):
            assert "gloo" in line or "on purpose" in line, f"{where}: {line.strip()!r} (use the rank's device)"


@pytest.mark.parametrize("where, source", list(_multi_rank_cells()), ids=lambda value: value if " cell " in value else "")
def test_a_cell_that_catches_a_collectives_error_runs_it_on_gloo_only(where, source):
    if CATCHES.search(source) and WAITS_FOR_A_PEER.search(source):
        assert "gloo" in source, f"{where} catches an error that NCCL's watchdog would turn into a crash: gate it"


def test_the_rehearsals_frames_are_hidden_from_what_a_learner_sees():
    from course_lib.launcher.rank_output import without_rehearsal

    plain_stack = ('  File "torch/autograd/__init__.py", line 395 in backward\n'
                   '  File "torch/_tensor.py", line 623 in backward\n'
                   '  File "<cell>", line 16 in <module>\n')
    rehearsed_stack = plain_stack.replace(
        '  File "<cell>"',
        '  File "course_lib/rank/rehearsal.py", line 157 in __torch_function__\n'
        '  File "torch/overrides.py", line 1800 in handle_torch_function\n'
        '  File "torch/_tensor.py", line 600 in backward\n'
        '  File "<cell>"')
    assert without_rehearsal(rehearsed_stack) == plain_stack
    # As the stack file reads once the diagnosis has dropped the rehearsal's own lines: torch's
    # dispatch to the mode and the public function called a second time are left out too.
    plain_wait = ('  File "torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
                  '  File "torch/distributed/c10d_logger.py", line 83 in wrapper\n  File "<cell>", line 8 in <module>\n')
    dispatched_wait = plain_wait.replace(
        '  File "<cell>"', '  File "torch/overrides.py", line 1771 in handle_torch_function\n'
        '  File "torch/distributed/distributed_c10d.py", line 3211 in all_reduce\n'
        '  File "torch/distributed/c10d_logger.py", line 83 in wrapper\n  File "<cell>"')
    assert without_rehearsal(dispatched_wait) == plain_wait
    plain_traceback = ('Traceback (most recent call last):\n  File "<cell>", line 7, in <module>\n'
                       '    loss.backward()\n  File "torch/_tensor.py", line 623, in backward\n'
                       '    torch.autograd.backward(\nRuntimeError: boom\n')
    rehearsed_traceback = plain_traceback.replace(
        '  File "torch/_tensor.py", line 623',
        '  File "torch/_tensor.py", line 600, in backward\n    return handle_torch_function(\n'
        '           ^^^^^^^^^^^^^^^^^^^^^^\n'
        '  File "torch/overrides.py", line 1800, in handle_torch_function\n'
        '    result = mode.__torch_function__(public_api, types, args, kwargs)\n'
        '  File "course_lib/rank/rehearsal.py", line 157, in __torch_function__\n'
        '    out = func(*args, **kwargs)\n'
        '  File "torch/_tensor.py", line 623')
    assert without_rehearsal(rehearsed_traceback) == plain_traceback


def test_a_cell_that_asks_for_gloo_keeps_the_cpu_and_is_not_rehearsed():
    # `%%torchrun --backend gloo` is gloo on a GPU node too: CPU tensors are right there.
    run = launch(OLD_00_CELLS_26_28, 2, timeout_s=60, backend="gloo")
    assert run.result.ok, _rank_errors(run)[-2000:]


def test_only_a_launch_that_asked_for_gloo_drops_the_rehearsal(monkeypatch, tmp_path):
    # `%%torchrun --backend gloo` and `%dist start --backend gloo` (the pool starts its ranks through the
    # same TorchrunProcess) ask for the CPU; auto's gloo on a CPU machine and the grader's ranks do not.
    from course_lib.backend_choice import choose_backend
    from course_lib.grading.rank_set import GLOO
    from course_lib.launcher.torchrun import _child_env
    from course_lib.rank.rehearsal import ENV_REHEARSE

    monkeypatch.setenv(ENV_REHEARSE, "1")
    asked = _child_env(choose_backend(2, "gloo", gpus=4), tmp_path, "mark")
    auto = _child_env(choose_backend(2, "auto", gpus=0), tmp_path, "mark")
    grading = _child_env(GLOO, tmp_path, "mark")
    assert ENV_REHEARSE not in asked
    assert auto[ENV_REHEARSE] == "1" and grading[ENV_REHEARSE] == "1"
