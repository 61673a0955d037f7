"""Errors a notebook shows as one line, without a traceback through this library."""

from __future__ import annotations

__all__ = ["OneLineError"]


class OneLineError(Exception):
    """IPython shows `_render_traceback_()`, one line, instead of a traceback.

    For errors whose cause is already on screen (a rank's own traceback) or
    fits in a sentence (an exercise never saved): the library's frames would
    only hide it.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]
