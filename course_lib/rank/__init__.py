"""Helpers a rank's script calls: set up the process group, print once, publish results.

These run inside processes started by torchrun, whether from a `%%torchrun`
cell or from `launch/`. The launcher passes its decisions through environment
variables (see `contract.py`); without them (plain torchrun) the same rule
from `course_lib.backend_choice` decides here.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import faulthandler
import os
import pathlib
import signal
from typing import Any

from ..backend_choice import BackendChoice, choose_backend
from .gloo_init_race import init_barrier
from .contract import (ENV_BACKEND, ENV_DEVICE, ENV_LEDGER, ENV_RESULTS_DIR, ledger_file, published_file, ready_file,
                       stacks_file)

__all__ = [
    "DistInfo",
    "backend",
    "device",
    "destroy_process_group_at_exit",
    "device_mesh",
    "dump_stacks_on_signal",
    "init",
    "instrument",
    "print0",
    "publish",
    "record_collectives",
]


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """What a rank needs to know about itself after `init()`."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: Any  # torch.device


def _require_torchrun() -> None:
    missing = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not set: this code must run under torchrun "
            "(a %%torchrun cell, or `torchrun --nproc-per-node 2 script.py`)"
        )


def _choice() -> BackendChoice:
    if ENV_BACKEND in os.environ:
        return BackendChoice(os.environ[ENV_BACKEND], os.environ.get(ENV_DEVICE, "cpu"), "set by the launcher")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return choose_backend(local_world)


def backend() -> str:
    """The backend this rank should use: "nccl" with a GPU per rank, else "gloo"."""
    return _choice().backend


def device() -> Any:
    """This rank's device: `cuda:LOCAL_RANK` under NCCL, else `cpu`."""
    import torch

    if _choice().device_type == "cuda":
        # One GPU per rank under NCCL; ranks sharing fewer GPUs (gloo on CUDA, the GPU script's check) wrap.
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def device_mesh(shape: int | tuple[int, ...], *, mesh_dim_names: tuple[str, ...] | None = None) -> Any:
    """`init_device_mesh(device().type, shape, mesh_dim_names=...)`: a DeviceMesh of this rank's device type.

    "cpu" under gloo, "cuda" under NCCL: the mesh follows the backend choice, never
    `torch.cuda.is_available()`. NOTE: with gloo on a machine that has a GPU, FSDP2
    and DTensor need a CPU mesh; a "cuda" one fails with "invalid device ordinal"
    or a segfault (https://github.com/pytorch/pytorch/issues/132471).
    `shape` is the number of ranks along each dimension, e.g. `(2, 2)`; an int is a 1-D mesh.
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return init_device_mesh(device().type, shape, mesh_dim_names=mesh_dim_names)


_stack_file: Any = None  # kept open: faulthandler writes to its descriptor from a signal handler


def instrument() -> None:
    """Under a notebook launcher: record collectives (rank/ledger.py) and dump stacks on SIGUSR1.

    Both go to files in the launch's folder, which the kernel reads after the
    cell, or at a deadline to say which rank is stuck where. Idempotent.
    """
    dump_stacks_on_signal()
    record_collectives()


def dump_stacks_on_signal() -> None:
    """Under a notebook launcher: SIGUSR1 writes every thread's Python stack to the launch's folder."""
    global _stack_file
    results_dir = os.environ.get(ENV_RESULTS_DIR)
    if not results_dir or _stack_file is not None or not hasattr(signal, "SIGUSR1"):
        return
    rank = os.environ.get("RANK", "0")
    _stack_file = open(os.path.join(results_dir, stacks_file(rank)), "w")
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)


def record_collectives() -> None:
    """Under a notebook launcher: every torch.distributed collective goes to this rank's ledger file.

    Imports torch.distributed; `course_lib.cell_hook` calls it the moment
    torch loads it, so cells that never import course_lib are recorded too.
    """
    results_dir = os.environ.get(ENV_RESULTS_DIR)
    if not results_dir or os.environ.get(ENV_LEDGER, "1") == "0":
        return
    from . import ledger

    rank = os.environ.get("RANK", "0")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)  # > 0 after torchrun restarted the ranks
    ledger.install(os.path.join(results_dir, ledger_file(rank, attempt)))


def mark_ready_after_init() -> None:
    """Under a notebook launcher: touch this rank's ready file when `init_process_group` first returns.

    The launcher's deadline counts from when every rank's file exists, so that the seconds a loaded
    machine spends importing torch (and transformers) are not the cell's. Wraps c10d's function when
    `torch.distributed.distributed_c10d` loads (cell_hook), before `torch.distributed` copies its name.
    On gloo the same wrapper turns torch's init barrier on for that one call (gloo_init_race.py).
    """
    results_dir = os.environ.get(ENV_RESULTS_DIR)
    if not results_dir:
        return
    import contextlib
    import functools

    import torch.distributed.distributed_c10d as c10d

    original = c10d.init_process_group
    if getattr(original, "__course_lib_ready__", False):
        return
    path = os.path.join(results_dir, ready_file(os.environ.get("RANK", "0")))

    # gloo only: no rank leaves init before every rank is connected (gloo_init_race.py).
    barrier = init_barrier if os.environ.get(ENV_BACKEND) == "gloo" else contextlib.nullcontext

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        with barrier():
            result = original(*args, **kwargs)
        if not os.path.exists(path):
            with open(path, "w"):
                pass
        return result

    init_process_group.__course_lib_ready__ = True
    c10d.init_process_group = init_process_group


def _destroy_if_open() -> None:
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the process is ending anyway; a broken group must not add a traceback
        pass


_destroy_registered = False


def destroy_process_group_at_exit() -> None:
    """At exit, destroy the default process group if the program left it open (idempotent).

    A learner's script that forgets `dist.destroy_process_group()` must still end
    cleanly: on torch 2.13 a gloo group left open aborts the process at exit in
    some runs ("terminate called without an active exception", SIGABRT after
    correct results), and NCCL warns that destroy_process_group() was not called.
    """
    global _destroy_registered
    if not _destroy_registered:
        atexit.register(_destroy_if_open)
        _destroy_registered = True


def init(*, timeout_s: float = 60.0) -> DistInfo:
    """Start the default process group with the course's backend and device.

    Equivalent to `dist.init_process_group(backend, timeout=...)` plus
    `torch.cuda.set_device(LOCAL_RANK)` under NCCL. A short timeout (default
    60 s instead of torch's 30 min for gloo, 10 min for NCCL) makes a stuck
    collective fail quickly.

    It does not pass `device_id`: a bound device makes NCCL create its
    communicator at once and every later `new_group` an `ncclCommSplit` that
    all ranks of the default group enter, members or not, so a lesson's
    `new_group` pattern that is right on gloo would deadlock on a GPU node.
    Unbound, NCCL starts at the first collective on the current device (set
    here) and `new_group` behaves as on gloo. Lesson 01 shows binding by hand.
    """
    import torch
    import torch.distributed as dist

    _require_torchrun()
    instrument()
    destroy_process_group_at_exit()
    choice = _choice()
    dev = device()
    if dev.type == "cuda":
        # NCCL needs each process on its own GPU, chosen before the group starts.
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend=choice.backend, timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    if rank == 0 and ENV_BACKEND not in os.environ:
        # Outside a notebook cell nobody printed the header: say it here.
        print(choice.header(dist.get_world_size()), flush=True)
    return DistInfo(rank, dist.get_world_size(), int(os.environ["LOCAL_RANK"]), choice.backend, dev)


def print0(*args: Any, **kwargs: Any) -> None:
    """`print` on global rank 0 only (every rank must still run the code around it)."""
    if int(os.environ.get("RANK", "0")) == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


_publish_hook: Any = None  # set by a persistent worker (course_lib.launcher.pool_worker): values go over its connection


def set_publish_hook(hook: Any) -> None:
    """Make `publish(name, value)` call `hook(name, value)` instead of writing a file."""
    global _publish_hook
    _publish_hook = hook


def publish(name: str, value: Any) -> None:
    """Send `value` back to the notebook: after the cell, `cl.results[name][rank] == value`.

    Outside a notebook cell (plain torchrun) there is no notebook to send to,
    so this does nothing. Values are saved with `torch.save`, so tensors,
    numbers, strings, lists and dicts of them all work.
    """
    if not name.isidentifier():
        raise ValueError(f"publish name must be an identifier, got {name!r}")
    if _publish_hook is not None:
        import torch

        _publish_hook(name, value.detach().cpu() if isinstance(value, torch.Tensor) else value)
        return
    results_dir = os.environ.get(ENV_RESULTS_DIR)
    if not results_dir:
        return
    import torch

    rank = int(os.environ.get("RANK", "0"))
    target = pathlib.Path(results_dir) / published_file(name, rank)
    tmp = target.with_suffix(".tmp")
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
    torch.save(value, tmp)
    os.replace(tmp, target)  # atomic: the kernel never reads a half-written file
