"""course_lib: the package behind the PyTorch distributed training course.

In a notebook: `%load_ext course_lib`, then `%%torchrun -n 2` cells (one-shot
scripts), or `%dist start -n 2` and `%%dist` cells (persistent ranks).
On a rank: `import course_lib as cl; cl.init(); cl.print0(...); cl.publish(...)`.
Importing this package on a rank is cheap: IPython parts load only in a kernel.
"""

from .backend_choice import BackendChoice, BackendError, choose_backend
from .rank import DistInfo, backend, device, init, print0, publish
from .results import ledgers, results

# Kernel-side names, imported on first use: every rank imports this package
# (line 1 of a %%torchrun cell), and these pull in psutil, subprocess, ...
_LAZY = {"describe_machine": "machine", "LaunchResult": "torchrun", "run_torchrun": "torchrun",
         "check": "grading"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "BackendChoice",
    "BackendError",
    "DistInfo",
    "LaunchResult",
    "backend",
    "check",
    "choose_backend",
    "describe_machine",
    "device",
    "init",
    "ledgers",
    "load_ipython_extension",
    "print0",
    "publish",
    "results",
    "run_torchrun",
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

