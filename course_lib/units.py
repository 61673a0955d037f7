"""Byte counts as people read them, in one place for every printed line and axis label.

Binary units (KiB, MiB, GiB) for what programs allocate and send; decimal units
(kB, MB, GB, TB) for GPU memory as it is sold ("80 GB").
"""

from __future__ import annotations

__all__ = ["binary_bytes", "decimal_bytes"]

_BINARY = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_DECIMAL = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def _format(n: float, units: tuple, significant: int | None) -> str:
    spec = "g" if significant is None else f".{significant}g"
    for unit, size in units:
        if n >= size:
            return f"{n / size:{spec}} {unit}"
    return f"{n:g} B"


def binary_bytes(n: float, *, significant: int | None = None) -> str:
    """`4 MiB`, `2.07 KiB` (with significant=3), `8 B`."""
    return _format(n, _BINARY, significant)


def decimal_bytes(n: float, *, significant: int | None = None) -> str:
    """`80 GB`, `13.48 GB` (with significant=4), `500 B`."""
    return _format(n, _DECIMAL, significant)
