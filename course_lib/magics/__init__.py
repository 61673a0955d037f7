"""The notebook magics, the only IPython layer: `%%torchrun`, `%dist` / `%%dist`, `%%exercise`, `%reveal`.

`%load_ext course_lib` calls `register(ipython)`. State lives on the Magics
instances, nothing module-wide: `DistMagics.pool` holds this kernel's
persistent ranks (reach it with `get_ipython().magics_manager.registry["DistMagics"]`).
"""

from __future__ import annotations

__all__ = ["register"]


def register(ipython) -> None:
    """Register `%%torchrun`, `%dist`/`%%dist`, `%%exercise` and `%reveal` with this IPython shell."""
    from .dist_magic import DistMagics
    from .exercise_magic import ExerciseMagics
    from .reveal_magic import RevealMagics
    from .torchrun_magic import TorchrunMagics

    ipython.register_magics(TorchrunMagics)
    ipython.register_magics(DistMagics)
    ipython.register_magics(ExerciseMagics)
    ipython.register_magics(RevealMagics)
