"""Byte counts as people read them, in one place for every printed line and axis label.

Binary units (KiB, MiB, GiB) for what programs allocate and send; decimal units
(kB, MB, GB, TB) for GPU memory as it is sold ("80 GB"). Numbers never print
in exponent notation ("1.12e+03"): `readable_number` writes "1120", "12,300".
"""

from __future__ import annotations

import math

__all__ = ["binary_bytes", "decimal_bytes", "readable_number", "unit_for"]

_BINARY = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_DECIMAL = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def readable_number(x: float, significant: int = 3) -> str:
    """`x` to `significant` digits as `:g` writes it, but never in exponent notation.

    `1120.4 -> "1120"`, `12345 -> "12,300"` (thousands grouped from 10,000 up), `36.75 -> "36.8"`,
    `0.000123 -> "0.000123"`, `2.50 -> "2.5"`.
    """
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    rounded = float(f"{x:.{significant}g}")  # the digits :g keeps (rounding may add one: 999.9 -> 1000)
    decimals = max(0, significant - 1 - math.floor(math.log10(abs(rounded))))
    text = f"{rounded:{',' if abs(rounded) >= 10_000 else ''}.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _format(n: float, units: tuple, significant: int | None) -> str:
    digits = 6 if significant is None else significant  # :g's default precision
    for unit, size in units:
        if n >= size:
            return f"{readable_number(n / size, digits)} {unit}"
    return f"{readable_number(n, digits)} B"


def binary_bytes(n: float, *, significant: int | None = None) -> str:
    """`4 MiB`, `2.07 KiB` (with significant=3), `8 B`."""
    return _format(n, _BINARY, significant)


def decimal_bytes(n: float, *, significant: int | None = None) -> str:
    """`80 GB`, `13.48 GB` (with significant=4), `500 B`."""
    return _format(n, _DECIMAL, significant)


def unit_for(largest: float, *, decimal: bool = False, units: tuple[str, ...] | None = None,
             min_multiple: float = 1.0) -> tuple[str, float]:
    """(unit, bytes per unit) an axis or a table column counts in, so that its largest value reads well.

    The biggest unit (of `units`, default all) of which `largest` holds at least `min_multiple`;
    below them all, the smallest of `units` (or bytes): `unit_for(3e9, decimal=True) == ("GB", 1e9)`.
    """
    table = [(unit, size) for unit, size in (_DECIMAL if decimal else _BINARY) if units is None or unit in units]
    for unit, size in table:
        if largest >= min_multiple * size:
            return unit, size
    return table[-1] if units is not None and table else ("B", 1)
