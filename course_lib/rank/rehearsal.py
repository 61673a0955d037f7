"""A GPU node rehearsed on CPU: what in a rank's program would break with one GPU per rank and NCCL.

On a node with one GPU per rank the course's ranks use NCCL and `cuda:LOCAL_RANK`. No machine
that runs the test suite has such a node, so the suite runs every lesson, solution and grader
rank with `COURSE_REHEARSE_GPU_NODE=1`: the ranks still run gloo on CPU and print the same
output, and this module adds checks. Each failure raises `RehearsalError` in the rank, one line
saying what NCCL or CUDA would do:

1. **A collective on a tensor never put on the rank's device** (on a group made with
   `backend="gloo"`, CPU tensors are right: that is what such a group is for). NCCL serves CUDA tensors only
   ("No backend type associated with device type cpu"). A tensor counts as put on the device when
   it came from `.to(device)`/`.cuda()`, a factory called with `device=` the rank's device type,
   or an operation on such a tensor (the gradient of such a parameter included). Checked where the
   program calls the collective, not inside torch (DDP, FSDP and DTensor place their own buffers).
2. **`DistributedDataParallel` around a module whose parameters are not on the device.**
3. **An operation in the program that mixes a tensor on the device with one that is not** (other
   than a 0-dim scalar, or a copy): CUDA raises "Expected all tensors to be on the same device".
   `torch.testing.assert_close` of a device tensor against a CPU one fails on CUDA too (on `device`).
4. **`new_group` under a default group bound to a device** (`init_process_group(device_id=...)` on a GPU;
   here `rehearse_a_bound_device()` stands for it, since gloo refuses a CPU `device_id`):
   NCCL then creates sub-groups with `ncclCommSplit`, which every rank of the default group enters,
   members or not (torch's `_new_process_group_helper`). Here `new_group` waits until every rank
   has entered it, so a pattern that deadlocks on a GPU node deadlocks here too, and the cell's
   deadline names the rank.

What it cannot see: NCCL's asynchronous errors and watchdog, `wait()` ordering a CUDA stream
instead of blocking the CPU, GPU memory and timings, and a device written as a literal "cpu"
(`tests/test_gpu_node_rehearsal.py` checks the cells' sources for that).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import Any

ENV_REHEARSE = "COURSE_REHEARSE_GPU_NODE"
_MARK = "_course_on_device"  # attribute set on a tensor that is on the rank's device

__all__ = ["ENV_REHEARSE", "RehearsalError", "enabled", "install", "install_after_init", "on_device",
           "rehearse_a_bound_device"]


class RehearsalError(RuntimeError):
    """What would fail on a node with one GPU per rank under NCCL (one line)."""


def enabled() -> bool:
    return os.environ.get(ENV_REHEARSE, "") not in ("", "0")


def on_device(tensor: Any) -> bool:
    """Whether `tensor` was put on the rank's device (or computed from one that was)."""
    return bool(getattr(tensor, _MARK, False))


def _mark(value: Any) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        try:
            setattr(value, _MARK, True)
        except (AttributeError, RuntimeError):  # a tensor type that takes no attributes
            pass
    elif isinstance(value, (list, tuple)):
        for item in value:
            _mark(item)


def _tensors(value: Any, found: list) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found)
    return found


# --- whose code is calling ------------------------------------------------------------------------

def _library_roots() -> tuple[str, ...]:
    import sysconfig

    import torch

    course_lib_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # rank/ -> course_lib/
    roots = {os.path.dirname(torch.__file__), course_lib_dir}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(path)
    return tuple(sorted(roots))


_ROOTS: tuple[str, ...] = ()
# course_lib code that is the learner's program in all but location: the grader's rank-side drivers.
_PROGRAM_DIRS = (os.path.join("course_lib", "grading", "lessons") + os.sep,)
# torch's thin wrappers an operation passes through on its way from the program.
_PASS_THROUGH = ("torch/nn/functional.py", "torch/_tensor.py", "torch/overrides.py", "torch/functional.py",
                 "torch/nn/modules/", "torch/_jit_internal.py", "torch/utils/_device.py", "torch/testing/")


def _is_program(filename: str) -> bool:
    if any(part in filename for part in _PROGRAM_DIRS):
        return True
    return not filename.startswith(_ROOTS) and not filename.startswith("<frozen")


def _caller_is_program(skip: int) -> bool:
    """Whether the nearest frame outside this module and torch's pass-through wrappers is the program's,
    and the program is not running as a callback from torch (an FSDP or DDP communication hook):
    the tensors torch hands a hook are on the device torch chose, and their history is torch's."""
    frame = sys._getframe(skip)
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if name != __file__.replace(os.sep, "/") and not any(part in name for part in _PASS_THROUGH):
            if not _is_program(frame.f_code.co_filename):
                return False
            break
        frame = frame.f_back
    if frame is None:
        return False
    caller = frame.f_back
    while caller is not None:
        name = caller.f_code.co_filename.replace(os.sep, "/")
        if "/torch/" in name and not any(part in name for part in _PASS_THROUGH):
            return False  # called back from torch
        caller = caller.f_back
    return True


# --- placement, followed through every operation -------------------------------------------------

_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange",
              "linspace", "logspace", "eye", "empty_strided", "randperm", "scalar_tensor")
_COPIES = ("copy_", "__setitem__", "__getitem__", "index_select", "set_", "to", "cpu", "cuda", "type",
           "__set__", "__get__", "tolist", "item", "numpy", "clone", "detach")


def _device_type(value: Any) -> str | None:
    import torch

    if isinstance(value, torch.device):
        return value.type
    if isinstance(value, str):
        return torch.device(value).type
    if isinstance(value, int) and not isinstance(value, bool):
        return "cuda"
    return None


def _is_dtensor(tensor: Any) -> bool:
    """A DTensor, or a functional collective's output (what a parallel style hands on as a plain tensor): torch
    put it where the collective's input was."""
    return any(cls.__name__ in ("DTensor", "AsyncCollectiveTensor") for cls in type(tensor).__mro__)


_DTENSOR_PATCHED = False


def _dtensor_outputs_keep_the_mark(device_type: str) -> None:
    """Once torch.distributed.tensor is loaded: what `to_local()` and `full_tensor()` return is where the
    DTensor's mesh is (the parallel styles hand their outputs on through `to_local()`, inside torch)."""
    global _DTENSOR_PATCHED
    if _DTENSOR_PATCHED or "torch.distributed.tensor" not in sys.modules:
        return
    _DTENSOR_PATCHED = True
    from torch.distributed.tensor import DTensor

    for name in ("to_local", "full_tensor"):
        original = getattr(DTensor, name)

        @functools.wraps(original)
        def kept(self, *args, _original=original, **kwargs):
            out = _original(self, *args, **kwargs)
            if _mesh_device_type(self) == device_type:
                _mark(out)
            return out

        setattr(DTensor, name, kept)


def _mesh_device_type(tensor: Any) -> str | None:
    mesh = getattr(tensor, "device_mesh", None)
    return getattr(mesh, "device_type", None)


def _placement_mode(device_type: str):
    from torch.overrides import TorchFunctionMode
    import torch

    tensor_to, tensor_cuda, tensor_cpu = torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu
    factories = {getattr(torch, name) for name in _FACTORIES if hasattr(torch, name)}

    class Placement(TorchFunctionMode):
        """Marks every tensor on the rank's device; raises where the program mixes devices."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            _dtensor_outputs_keep_the_mark(device_type)
            if getattr(func, "__course_lib_rehearsed__", False):
                # A collective dispatched to this mode comes back through the module's name, which
                # our wrappers hold: call torch's own function, so the ledger records a call once
                # and `dist.all_reduce.__wrapped__` stays unrecorded (lesson 01 times it).
                func = func.__wrapped__
            out = func(*args, **kwargs)
            if func is tensor_to:
                target = kwargs.get("device")
                if target is None:
                    target = next((a for a in args[1:] if _device_type(a) or isinstance(a, torch.Tensor)), None)
                    target = target.device if isinstance(target, torch.Tensor) else target
                placed = _device_type(target) == device_type if target is not None else on_device(args[0])
            elif func is tensor_cuda:
                placed = True
            elif func is tensor_cpu:
                # On a GPU `.cpu()` copies to the host; here it returns the tensor itself, which is
                # marked: hand back an unmarked alias so the copy counts as on the CPU.
                return out.view_as(out) if out is args[0] else out
            elif func in factories:
                placed = _device_type(kwargs.get("device")) == device_type
            else:
                inputs = _tensors(args, _tensors(kwargs, []))
                # A DTensor is where its mesh is; what comes out of one (to_local() included) is there too.
                placed = any(on_device(t) or (_is_dtensor(t) and _mesh_device_type(t) == device_type)
                             for t in inputs)
                name = getattr(func, "__name__", "")
                # A DTensor's device is its mesh's (init_device_mesh(device.type, ...)), and the tensors the
                # parallel styles make from it inside torch carry no mark: an operation on one is DTensor's
                # to place, not the program's (tests/test_gpu_node_rehearsal.py, tensor parallel).
                if placed and name not in _COPIES and not any(_is_dtensor(t) for t in inputs):
                    stray = [t for t in inputs if not on_device(t) and t.dim() > 0]
                    if stray and _caller_is_program(2):
                        raise RehearsalError(
                            f"GPU-node rehearsal: {name}() mixes a tensor on the rank's device with one of shape "
                            f"{tuple(stray[0].shape)} left on the CPU; on a GPU this raises 'Expected all tensors "
                            "to be on the same device': move it with .to(device)")
            if placed:
                _mark(out)
            return out

    return Placement()


# --- the checks around torch.distributed ----------------------------------------------------------

def _check_collective(name: str, fn):
    import inspect

    from .ledger import _WRAPPER_CODE

    params = list(inspect.signature(fn).parameters)
    checked = [p for p in ("tensor", "input_tensor", "input_tensor_list", "input_list", "input", "tensor_list",
                           "output_tensor", "output_tensor_list", "output", "output_list") if p in params]

    group_index = params.index("group") if "group" in params else None

    @functools.wraps(fn)
    def rehearsed(*args, **kwargs):
        group = args[group_index] if group_index is not None and group_index < len(args) else kwargs.get("group")
        if _caller_is_program(2) and not _on_a_gloo_group(group):
            values = [args[params.index(p)] if params.index(p) < len(args) else kwargs.get(p) for p in checked]
            stray = [t for t in _tensors(values, []) if not on_device(t)]
            if stray:
                raise RehearsalError(
                    f"GPU-node rehearsal: dist.{name}() on a tensor of shape {tuple(stray[0].shape)} that was never "
                    "put on the rank's device; NCCL serves CUDA tensors only ('No backend type associated with "
                    "device type cpu'): create it with device=device or move it with .to(device)")
        return fn(*args, **kwargs)

    rehearsed.__course_lib_rehearsed__ = True
    # `dist.all_reduce.__wrapped__` stays torch's own function, as under the ledger alone (lesson 01 times it).
    rehearsed.__wrapped__ = getattr(fn, "__wrapped__", fn)
    _WRAPPER_CODE.add(rehearsed.__code__)
    return rehearsed


def _on_a_gloo_group(group: Any) -> bool:
    return group is not None and any(group is made for made in _GLOO_GROUPS)


def _check_ddp() -> None:
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.__init__
    if getattr(original, "__course_lib_rehearsed__", False):
        return

    @functools.wraps(original)
    def __init__(self, module, *args, **kwargs):
        stray = [name for name, p in module.named_parameters() if not on_device(p)]
        group = kwargs.get("process_group", args[5] if len(args) > 5 else None)
        if stray and _caller_is_program(2) and not _on_a_gloo_group(group):
            raise RehearsalError(
                f"GPU-node rehearsal: DistributedDataParallel around a module whose parameter {stray[0]!r} is on the "
                "CPU; under NCCL its first broadcast raises 'No backend type associated with device type cpu': move the "
                "module with .to(device) first")
        original(self, module, *args, **kwargs)

    __init__.__course_lib_rehearsed__ = True
    DistributedDataParallel.__init__ = __init__


def _parameters_keep_the_mark() -> None:
    """`nn.Parameter(t)` is a new tensor object around `t`'s storage (made in C++, unseen by the
    mode): FSDP1 and FSDP2 wrap their unsharded views this way, so the mark is carried over here."""
    import torch

    original = torch.nn.Parameter.__new__
    if getattr(original, "__course_lib_rehearsed__", False):
        return

    def __new__(cls, data=None, requires_grad=True):
        parameter = original(cls, data, requires_grad)
        if data is not None and on_device(data):
            _mark(parameter)
        return parameter

    __new__.__course_lib_rehearsed__ = True
    torch.nn.Parameter.__new__ = __new__


_GLOO_GROUPS: list = []  # groups the program made with backend="gloo": CPU tensors belong there
_new_group_count = 0
_bound = False  # the program bound the default group to its device (init_process_group(device_id=...))
_new_group_lock = threading.Lock()


def _eager_new_group(fn):
    """`new_group` that, under a default group bound to a device, waits for every rank (NCCL's comm split)."""
    from .ledger import _WRAPPER_CODE

    @functools.wraps(fn)
    def new_group(*args, **kwargs):
        global _new_group_count
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_group

        default = _get_default_group()
        if _bound or getattr(default, "bound_device_id", None) is not None:
            with _new_group_lock:
                _new_group_count += 1
                key = f"course_rehearsal/new_group/{_new_group_count}"
            store = dist.distributed_c10d._get_default_store()
            # Every rank of the default group enters the split together (ncclCommSplit with NOCOLOR
            # for non-members): arrive, then wait for the last to arrive.
            if store.add(key, 1) == dist.get_world_size():
                store.set(key + "/all", "1")
            store.wait([key + "/all"])
        group = fn(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is not None and "gloo" in str(backend).lower() and "nccl" not in str(backend).lower():
            _GLOO_GROUPS.append(group)  # made for CPU tensors on purpose: gloo on a GPU node too
        return group

    new_group.__course_lib_rehearsed__ = True
    _WRAPPER_CODE.add(new_group.__code__)
    return new_group


_installed = False


def install(device_type: str = "cpu") -> None:
    """Start the rehearsal in this rank (idempotent): placement tracking and the checks above.

    `device_type` is the type the rank's tensors live on here ("cpu"): a tensor put there
    explicitly stands for one put on `cuda:LOCAL_RANK` on a GPU node.
    """
    global _installed, _ROOTS
    if _installed:
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from ..vocabulary import RECORDED_OPS

    _installed = True
    _ROOTS = _library_roots()
    for name in RECORDED_OPS:
        if name.endswith("_object") or name.endswith("_object_list") or name in ("barrier", "monitored_barrier"):
            continue  # objects and barriers: NCCL moves them itself
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "__course_lib_rehearsed__", False):
            continue
        wrapped = _check_collective(name, original)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
    if not getattr(c10d.new_group, "__course_lib_rehearsed__", False):
        original = c10d.new_group
        wrapped = _eager_new_group(original)
        c10d.new_group = wrapped
        if dist.new_group is original:
            dist.new_group = wrapped
    _check_ddp()
    _parameters_keep_the_mark()
    _placement_mode(device_type).__enter__()  # for the rest of the process


def rehearse_a_bound_device() -> None:
    """Treat the default group as bound to its device, as `init_process_group(device_id=cuda:N)` binds it
    on a GPU node (the CPU cannot be bound: gloo refuses it): from now on `new_group` waits for every rank."""
    global _bound
    _bound = True


def install_after_init() -> None:
    """Under the rehearsal, start it when the program's `init_process_group` returns (idempotent).

    Not earlier: the placement tracking needs torch fully imported, and the device is the
    process group's business. Called when `torch.distributed` loads (cell_hook).
    """
    if not enabled():
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.init_process_group
    if getattr(original, "__course_lib_rehearsed__", False):
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        result = original(*args, **kwargs)
        install()
        return result

    init_process_group.__course_lib_rehearsed__ = True
    c10d.init_process_group = init_process_group
    if getattr(dist, "init_process_group", None) is original:
        dist.init_process_group = init_process_group
