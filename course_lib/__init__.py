"""course_lib: the package behind the PyTorch distributed training course.

In a notebook: `%load_ext course_lib`, then `%%torchrun -n 2` cells (one-shot
scripts), or `%dist start -n 2` and `%%dist` cells (persistent ranks).
On a rank: `import course_lib as cl; cl.init(); cl.print0(...); cl.publish(...)`.
Importing this package on a rank is cheap: IPython parts load only in a kernel.
"""

from .backend_choice import BackendChoice, BackendError, choose_backend
from .rank import DistInfo, backend, device, init, print0, publish
from .results import ledgers, results

# Imported on first use: every rank imports this package (line 1 of a %%torchrun
# cell), and these pull in psutil, matplotlib, ipywidgets, ...
_LAZY = {
    # launching and checking
    "describe_machine": "machine", "LaunchResult": "torchrun", "run_torchrun": "torchrun", "check": "grading",
    # on a rank: collect plain data to publish
    "sharding_of": "sharding", "mesh_of": "sharding", "measure_step": "memory", "comm_counts": "comm",
    # in the kernel: draw what the ranks published (each returns its data)
    "show_collective": "collectives_draw", "show_sharding": "sharding_draw", "draw_mesh": "sharding_draw",
    "show_memory": "memory_draw", "comm_table": "comm", "show_timeline": "comm_draw", "show_comm": "comm_draw",
    "memory_explorer": "widgets", "ring_allreduce_stepper": "widgets",
    # at scale, without the hardware (fake process group, meta tensors; labelled SIMULATED)
    "simulate_table": "simulate", "show_simulation": "simulate",
}
# Whole modules reachable as `cl.<name>`: `cl.theory.ring_all_reduce_bytes(...)`, `cl.models.toy_model()`.
_LAZY_MODULES = ("theory", "models", "simulate")


def __getattr__(name: str):
    import importlib

    if name in _LAZY_MODULES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


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
    "draw_mesh",
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

__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """`%load_ext course_lib`: registers `%%torchrun`, `%dist`, `%%dist` and `%%exercise`."""
    from .dist_magics import DistMagics
    from .grading.magic import ExerciseMagics
    from .magics import TorchrunMagics

    ipython.register_magics(TorchrunMagics)
    ipython.register_magics(DistMagics)
    ipython.register_magics(ExerciseMagics)

