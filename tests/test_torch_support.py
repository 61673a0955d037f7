"""The torch the course supports: one lower bound (pyproject.toml), the same in the installed metadata and
the README, and a one-line warning below it."""

from __future__ import annotations

import pathlib
import re

from course_lib.torch_support import minimum_torch, unsupported_torch_message

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bound_in_pyproject() -> tuple[int, ...]:
    match = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert match, "pyproject.toml has no torch>=X.Y requirement"
    return tuple(int(x) for x in match.group(1).split("."))


def test_the_installed_bound_is_pyprojects():
    # A stale install (pyproject changed, `pip install -e .` not rerun) would disagree here.
    assert minimum_torch() == _bound_in_pyproject()


def test_readme_and_environment_state_the_same_bound():
    wanted = ".".join(map(str, _bound_in_pyproject()))
    assert f"torch>={wanted}" in (ROOT / "README.md").read_text()
    assert f"pytorch>={wanted}" in (ROOT / "environment.yml").read_text()


def test_older_torch_gets_one_line_and_supported_ones_none():
    major, minor = minimum_torch()[:2]
    older = f"{major}.{minor - 1}.0+cu130"
    message = unsupported_torch_message(older)
    assert message is not None and "\n" not in message
    assert older in message and f"torch>={major}.{minor}" in message
    for fine in (f"{major}.{minor}.0", f"{major}.{minor}.0+cpu", f"{major}.{minor + 2}.0+cu132", f"{major + 1}.0.0a0+git1"):
        assert unsupported_torch_message(fine) is None, fine
    assert unsupported_torch_message() is None  # the torch this suite runs on
