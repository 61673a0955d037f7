"""course_lib: the package behind the PyTorch distributed training course.

In a notebook: `%load_ext course_lib`, then `%%torchrun -n 2` cells (one-shot
scripts), or `%dist start -n 2` and `%%dist` cells (persistent ranks).
On a rank: `import course_lib as cl; cl.init(); cl.print0(...); cl.publish(...)`.
Importing this package on a rank is cheap: IPython parts load only in a kernel.
"""

from .backend_choice import BackendChoice, BackendError, choose_backend
from .rank import DistInfo, backend, device, device_mesh, init, print0, publish
from .results import ledgers, results

# Imported on first use: every rank imports this package (line 1 of a %%torchrun
# cell), and these pull in psutil, matplotlib, ipywidgets, ...
_LAZY = {
    # launching and checking
    "describe_machine": "doctor.machine", "LaunchResult": "launcher.torchrun", "run_torchrun": "launcher.torchrun",
    "check": "grading",
    # on a rank: collect plain data to publish
    "sharding_of": "measure.sharding", "mesh_of": "measure.sharding", "measure_step": "measure.memory",
    "comm_counts": "measure.comm",
    # in the kernel: draw what the ranks published (each returns its data)
    "show_collective": "draw.collectives", "show_sharding": "draw.sharding", "draw_mesh": "draw.sharding",
    "show_memory": "draw.memory", "draw_schedule": "draw.pipeline", "draw_flow": "draw.flow", "comm_table": "measure.comm", "show_timeline": "draw.comm", "show_comm": "draw.comm",
    "memory_explorer": "draw.widgets", "ring_allreduce_stepper": "draw.widgets",
    # at scale, without the hardware (fake process group, meta tensors; labelled SIMULATED)
    "simulate_table": "measure.simulate", "show_simulation": "draw.simulation",
}
# Whole modules reachable as `cl.<name>`: `cl.theory.ring_all_reduce_bytes(...)`, `cl.models.toy_model()`.
_LAZY_MODULES = {"theory": "theory", "models": "models", "simulate": "measure.simulate"}


def __getattr__(name: str):
    import importlib

    if name == "__version__":  # lazy too: importlib.metadata costs every rank ~10 ms at start
        value = _installed_version()
    elif name in _LAZY_MODULES:
        value = importlib.import_module(f".{_LAZY_MODULES[name]}", __name__)
    elif name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(__name__)
    except PackageNotFoundError:  # run from a checkout without installing it
        return "unknown"


__all__ = [
    "BackendChoice",
    "BackendError",
    "DistInfo",
    "LaunchResult",
    "backend",
    "check",
    "choose_backend",
    "comm_counts",
    "comm_table",
    "describe_machine",
    "device",
    "device_mesh",
    "draw_flow",
    "draw_mesh",
    "draw_schedule",
    "init",
    "ledgers",
    "load_ipython_extension",
    "measure_step",
    "memory_explorer",
    "mesh_of",
    "models",
    "print0",
    "publish",
    "results",
    "ring_allreduce_stepper",
    "run_torchrun",
    "sharding_of",
    "show_collective",
    "show_comm",
    "show_memory",
    "show_sharding",
    "show_simulation",
    "show_timeline",
    "simulate",
    "simulate_table",
    "theory",
]



def load_ipython_extension(ipython) -> None:
    """`%load_ext course_lib`: registers `%%torchrun`, `%dist`, `%%dist` and `%%exercise`."""
    from .magics import register
    from .torch_support import unsupported_torch_message

    too_old = unsupported_torch_message()
    if too_old:
        print(too_old)
    register(ipython)

