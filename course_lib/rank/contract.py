"""The contract between the kernel side (course_lib.launcher) and the ranks it starts.

Everything both sides must spell the same way lives here, once:

- the environment variables a launcher sets for every rank (backend, device,
  the launch's folder, the process mark, the persistent pool's address);
- the file names ranks write into the launch's folder (published values,
  collective ledgers, stack dumps), which the kernel reads back;
- where torchrun (`--log-dir DIR --redirects 3`) puts each rank's output;
- the name of the module a `%%torchrun` script imports on line 1, and of the
  module torchrun runs for a cell (`-m course_lib.rank.cell_runner cell.py`).

Plain strings and small functions only: imported by every rank, it must stay cheap.
"""

from __future__ import annotations

import pathlib
import re

__all__ = [
    "CELL_HOOK_MODULE", "CELL_LABEL", "CELL_RUNNER_MODULE", "ENV_BACKEND", "ENV_CELL_FILE", "ENV_DEVICE",
    "ENV_LAUNCH_MARK", "ENV_LEDGER",
    "ENV_POOL_ADDRESS", "ENV_POOL_INIT", "ENV_POOL_KEYFILE", "ENV_RESULTS_DIR", "PUBLISHED_GLOB", "SCRIPT_NAME",
    "ledger_file", "log_files", "ready_file", "parse_log_path", "parse_published", "published_file", "stacks_file",
]

# --- environment variables set by the launcher (course_lib.launcher.torchrun) -------------------
ENV_BACKEND = "COURSE_BACKEND"  # the launcher's decision ("gloo"/"nccl"): ranks use it, never decide again
ENV_DEVICE = "COURSE_DEVICE"  # "cpu" or "cuda"
ENV_RESULTS_DIR = "COURSE_RESULTS_DIR"  # the launch's private folder: published values, ledgers, stacks
ENV_LEDGER = "COURSE_LEDGER"  # "0": do not record collectives (bench/ measures the ledger's cost)
ENV_LAUNCH_MARK = "COURSE_LAUNCH_MARK"  # a value unique to one launch, inherited by all its processes
ENV_POOL_ADDRESS = "COURSE_POOL_ADDRESS"  # persistent ranks: the kernel's "127.0.0.1:PORT"
ENV_POOL_KEYFILE = "COURSE_POOL_KEYFILE"  # persistent ranks: file with the session's secret (mode 0600)
ENV_POOL_INIT = "COURSE_POOL_INIT"  # persistent ranks: "1" starts the default process group first
# Set by the cell runner on a rank, not by the launcher: the cell's file, read again by the processes the cell spawns.
ENV_CELL_FILE = "COURSE_CELL_FILE"

# --- files in the launch's folder (ENV_RESULTS_DIR) ------------------------------------------------
PUBLISHED_GLOB = "*.rank*.pt"


def published_file(name: str, rank: int | str) -> str:
    """`cl.publish(name, value)` on `rank` writes this file (torch.save)."""
    return f"{name}.rank{rank}.pt"


def parse_published(path: pathlib.Path) -> tuple[str, int]:
    """(name, rank) of a file written by `published_file`."""
    name, _, rank = path.stem.rpartition(".rank")
    return name, int(rank)


def ready_file(rank: int | str) -> str:
    """Written (empty) when the rank's first `init_process_group` returns: the launcher's deadline starts when
    every rank's exists (launcher/torchrun.py), so a slow `import torch` is not the cell's time."""
    return f"ready.rank{rank}"


def ledger_file(rank: int | str, attempt: int = 0) -> str:
    """The rank's collective ledger (course_lib.rank.ledger), one JSON line per event.

    `attempt`: torchrun's restart count (TORCHELASTIC_RESTART_COUNT): after a restart each attempt
    has a file of its own, so that the last attempt's ledger is not mixed with the dead one's.
    """
    return f"ledger.rank{rank}.jsonl" if not attempt else f"ledger.rank{rank}.attempt{attempt}.jsonl"


def stacks_file(rank: int | str) -> str:
    """Where the rank's faulthandler writes every thread's stack on SIGUSR1."""
    return f"stacks.rank{rank}.txt"


# --- torchrun's per-rank output: <log_dir>/<run id>/attempt_<n>/<local rank>/<stream>.log -----------
_LOG_PATH = re.compile(r"attempt_\d+/(\d+)/(stdout|stderr)\.log$")


def log_files(log_dir: pathlib.Path, rank: int | str = "*", stream: str = "*") -> list[pathlib.Path]:
    """torchrun's log files of `rank` ("*": all) and `stream` ("stdout", "stderr", "*"), sorted."""
    return sorted(log_dir.glob(f"*/attempt_*/{rank}/{stream}.log"))


def parse_log_path(path: pathlib.Path) -> tuple[int, str] | None:
    """(local rank, stream) of one of torchrun's log files, or None for another file."""
    match = _LOG_PATH.search(path.as_posix())
    return (int(match.group(1)), match.group(2)) if match else None


# --- the script a %%torchrun cell becomes ------------------------------------------------------------
SCRIPT_NAME = "cell.py"  # the cell's file in the launch's folder
CELL_LABEL = "<cell>"  # how tracebacks and stacks name the cell (the temporary path is replaced by it)
# The module imported on line 1 of that script, named from this package so a move cannot break it
# (tests/test_layout.py checks that it imports).
CELL_HOOK_MODULE = f"{__name__.rpartition('.')[0]}.cell_hook"
# The module torchrun runs on every rank, with the script's path as its argument (cell_runner.py).
CELL_RUNNER_MODULE = f"{__name__.rpartition('.')[0]}.cell_runner"
