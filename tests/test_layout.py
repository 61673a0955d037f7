"""course_lib's layout as a contract: what imports what, what every rank loads, what an install carries.

The rooms and their direction (pyproject.toml, [tool.importlinter]):
draw -> measure -> theory; magics -> grading -> launcher -> rank; never upward;
doctor/ (pre-flight, machine facts, lab settings) imported by no other room.
"""

import importlib
import importlib.util
import pathlib
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

import course_lib as cl

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "course_lib"
LINT_IMPORTS = pathlib.Path(sys.executable).parent / "lint-imports"
HEAVY = ("IPython", "matplotlib", "ipywidgets", "psutil")


def _lint_imports(cwd: pathlib.Path, pythonpath: pathlib.Path, *contracts: str) -> subprocess.CompletedProcess:
    only = [arg for contract in contracts for arg in ("--contract", contract)]
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo", *only], cwd=cwd, capture_output=True,
                          text=True, env={"PYTHONPATH": str(pythonpath), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_import_contracts_hold():
    done = _lint_imports(ROOT, ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("rank/contract.py", "from ..magics import args", "kernel-side-layers"),
    ("theory/comm.py", "from ..draw import figures", "seeing-layers"),
    ("measure/comm.py", "import matplotlib", "drawing-only-in-draw"),
    ("rank/ledger.py", "import psutil", "rank-is-light"),
    ("grading/report.py", "from IPython.display import display", "ipython-only-in-magics"),
    ("launcher/torchrun.py", "from ..doctor import checks", "doctor-is-a-leaf"),
])
def test_each_contract_catches_a_wrong_import(tmp_path, module, line, contract):
    # A copy of the package with one import that breaks one rule: that contract must fail.
    shutil.copytree(PACKAGE, tmp_path / "course_lib", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    assert _lint_imports(tmp_path, tmp_path, contract).returncode == 0  # the copy is as good as the original
    target = tmp_path / "course_lib" / module
    target.write_text(target.read_text() + f"\n{line}  # added by the test\n")
    done = _lint_imports(tmp_path, tmp_path, contract)
    assert done.returncode != 0 and "BROKEN" in done.stdout, done.stdout


def test_every_public_name_resolves():
    lazy = set(cl._LAZY) | set(cl._LAZY_MODULES)
    assert lazy <= set(cl.__all__), lazy - set(cl.__all__)
    for name in cl.__all__:
        assert getattr(cl, name) is not None, name
    assert cl.__version__ not in ("", None)


def _loaded_after(statement: str) -> set[str]:
    """Top-level packages in sys.modules after `statement`, in a fresh interpreter."""
    code = f"import sys\n{statement}\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_what_every_rank_imports_stays_light():
    # Line 1 of every %%torchrun script, a persistent worker, and `import course_lib as cl` on a rank.
    loaded = _loaded_after("import course_lib.rank.cell_hook, course_lib.launcher.pool_worker\n"
                           "import course_lib as cl; cl.init, cl.publish, cl.print0")
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_measure_never_imports_matplotlib():
    modules = sorted(p.stem for p in (PACKAGE / "measure").glob("*.py") if p.stem != "__init__")
    loaded = _loaded_after("\n".join(f"import course_lib.measure.{m}" for m in modules))
    assert "course_lib" in loaded
    assert not loaded & {"matplotlib", "ipywidgets", "IPython"}


def test_strings_that_name_modules_name_real_ones():
    from course_lib.launcher import pool_worker, torchrun
    from course_lib.rank import contract

    hook_line = torchrun._with_cell_hook("pass", "%%torchrun -n 2").splitlines()[0]
    module = hook_line.split()[1]
    assert module == contract.CELL_HOOK_MODULE
    assert importlib.util.find_spec(module) is not None
    assert importlib.util.find_spec(pool_worker.__name__).origin == pool_worker.__file__


def _source_modules() -> list[str]:
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                  for p in PACKAGE.rglob("*.py"))


def test_a_non_editable_install_carries_every_module(tmp_path):
    # Build the wheel `pip install .` would install (from a copy: a build leaves build/ behind),
    # install it without dependencies into a fresh venv, and find every module of the source tree there.
    source = tmp_path / "source"
    shutil.copytree(PACKAGE, source / "course_lib", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    wheels = tmp_path / "wheels"
    # With build isolation, as `pip install .` builds: pyproject's own build requirements, not this venv's.
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(source)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("course_lib-*.whl")
    in_wheel = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    assert len(in_wheel) == len(_source_modules())
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                              "--no-index", "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    check = textwrap.dedent(f"""
        import importlib.util, sys
        missing = [m for m in {_source_modules()!r} if importlib.util.find_spec(m) is None]
        import course_lib
        print(course_lib.__file__)
        sys.exit(f"missing: {{missing}}" if missing else 0)
    """)
    # No PYTHONPATH: the fresh venv must find the package it installed, not a checkout.
    done = subprocess.run([str(python), "-c", check], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert str(venv) in done.stdout  # the installed copy, not this checkout
