"""What the GPU script runs: one step per check, each a command with its own time limit.

On a machine with one GPU (`plan(dry_run=False)`): every lesson notebook under nbval (its 2- and 4-rank
cells fall back to gloo there: one GPU), every multi-rank cell once more at 1 rank under NCCL
(one_rank_nccl.py), each lesson again with its ranks sharing the GPU (gloo moving CUDA tensors,
COURSE_GLOO_ON_SHARED_GPU=1: the multi-rank device paths 1-rank NCCL cannot reach), the grader on solutions/, launch/train.py at 1 rank in each mode that fits one
rank, the doctor, and nccl_facts.py. The CPU dry run (`plan(dry_run=True)`, in the suite) runs the
same kinds of step on gloo with the first few cells of each lesson, so that a GPU machine's minutes are
never spent on a typo in this plumbing.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

# course_lib.backend_choice's name for it, spelled here so the script needs no import from the checkout
# (tests/test_gpu_node_script.py checks that the two agree).
ENV_GLOO_ON_SHARED_GPU = "COURSE_GLOO_ON_SHARED_GPU"

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
HERE = pathlib.Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Step:
    name: str  # the log's name, OUT/<name>.log
    kind: str  # "nbval", "one_rank", "grader", "train", "doctor", "facts": how its result is read
    argv: tuple[str, ...]
    limit_s: int
    notebook: str | None = None  # "02_ddp" for the per-notebook steps
    env: tuple[tuple[str, str], ...] = ()  # set for this step only


def lesson_notebooks() -> list[str]:
    """Every lesson notebook's stem (appendices included), in order."""
    return sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _nbval(stem: str, out: pathlib.Path, cells: int | None, limit_s: int, kind: str = "nbval",
           env: tuple[tuple[str, str], ...] = ()) -> Step:
    path = f"notebooks/{stem}.ipynb"
    # pytest takes node ids: the first `cells` code cells of the notebook, in order.
    targets = [path] if cells is None else [f"{path}::Cell {i}" for i in range(cells)]
    # --nbval-lax: on a GPU the headers say NCCL or "1 GPU for 2 ranks", so stored outputs differ by design;
    # a cell still fails on any error, and every distributed result is asserted inside its cell.
    argv = (sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--nbval-lax", "-o", "addopts=",
            "--junitxml", str(out / f"{kind}_{stem}.xml"), "--nbval-cell-timeout", "240", *targets)
    return Step(f"{kind}_{stem}", kind, argv, limit_s, stem, env)


def _one_rank(stem: str, backend: str, cells: int | None, limit_s: int) -> Step:
    argv = (sys.executable, str(HERE / "one_rank_nccl.py"), "--backend", backend, "--json",
            *(("--cells", str(cells)) if cells is not None else ()), f"notebooks/{stem}.ipynb")
    return Step(f"one_rank_{stem}", "one_rank", argv, limit_s, stem)


def _torchrun(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *args)


def plan(out: pathlib.Path, *, dry_run: bool, notebooks: list[str] | None = None, cells: int = 2) -> list[Step]:
    """The steps, longest first (so the parallel run ends soonest). `notebooks` and `cells` only narrow a
    dry run: on a GPU every lesson notebook runs whole."""
    stems = notebooks or lesson_notebooks()
    backend = "gloo" if dry_run else "nccl"
    few = cells if dry_run else None
    steps = [_nbval(s, out, few, 120 if dry_run else 420) for s in stems]
    steps += [_one_rank(s, backend, few, 120 if dry_run else 420) for s in stems]
    if not dry_run:  # the lessons' 2- and 4-rank cells with every rank on the one GPU: gloo moving CUDA tensors
        shared = ((ENV_GLOO_ON_SHARED_GPU, "1"),)
        steps += [_nbval(s, out, None, 420, "nbval_shared_gpu", shared) for s in stems if "_appendix_" not in s]
    # On a GPU every solution; in a dry run one lesson's, for the grader's plumbing (the suite grades them all).
    graded = (("solutions/01_process_groups_solutions.ipynb", "--exercises", "01.allgather_from_broadcast") if dry_run
              else ("solutions/",))
    grader = (sys.executable, "-m", "course_lib.grade", *graded, "--out", str(out / "grades"),
              "--jobs", "2" if dry_run else "8")
    steps.append(Step("grader_solutions", "grader", grader, 240 if dry_run else 300))
    for mode, extra in (("ddp", ()), ("fsdp", ()), ("2d", ("--tp", "1"))):
        steps.append(Step(f"train_{mode}", "train",
                          _torchrun("launch/train.py", "--parallel", mode, *extra, "--steps", "1" if dry_run else "4",
                                    "--batch", "4", "--ckpt-dir", str(out / f"ckpt_{mode}")), 180))
    steps.append(Step("doctor", "doctor", (sys.executable, "-m", "course_lib.doctor"), 120))
    if not dry_run:  # the CUDA facts need CUDA
        steps.append(Step("nccl_facts", "facts", _torchrun(str(HERE / "nccl_facts.py")), 120))
    return steps
