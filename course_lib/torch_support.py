"""Which torch the course supports: the lower bound in pyproject.toml, and a one-line warning below it.

The bound is read from the installed package's metadata, so pyproject.toml is
the only place it is written. It is the lowest version the whole suite passed
on (README, "Testing"). An older torch can be installed anyway (conda, a GPU
node's preinstalled build with `pip install --no-deps`): `%load_ext course_lib`
and the grader then say so in one line instead of failing later in a lesson
cell with an API error.
"""

from __future__ import annotations

import re

__all__ = ["minimum_torch", "unsupported_torch_message"]

_FALLBACK_MINIMUM = (2, 13)  # only when running from a checkout that was never installed


def _numbers(version: str) -> tuple[int, ...]:
    """(2, 13, 0) for "2.13.0+cpu" or "2.13.0a0+git1234"."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def minimum_torch() -> tuple[int, ...]:
    """The lower bound of the `torch>=X.Y` requirement of the installed course_lib."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        needs = requires("course_lib") or []
    except PackageNotFoundError:
        return _FALLBACK_MINIMUM
    for need in needs:
        match = re.fullmatch(r"torch\s*>=\s*([\d.]+)", need.split(";")[0].strip())
        if match:
            return _numbers(match.group(1))
    return _FALLBACK_MINIMUM


def unsupported_torch_message(version: str | None = None) -> str | None:
    """A one-line warning if `version` (default: the installed torch) is below the course's minimum; else None."""
    if version is None:
        import torch

        version = torch.__version__
    minimum = minimum_torch()
    if _numbers(version)[:len(minimum)] >= minimum:
        return None
    wanted = ".".join(map(str, minimum))
    return (f"course_lib: torch {version} is older than {wanted}, the oldest version the course is tested "
            f"with; some lesson cells will fail (install torch>={wanted})")
