"""Kill a launch's processes if the notebook kernel that started them dies.

A kernel that is restarted or killed while a cell runs cannot clean up after
itself, and torchrun's ranks live in sessions of their own, so nothing else
would end them. `run_torchrun` therefore starts this small process next to
torchrun:

    python course_lib/launcher/watchdog.py KERNEL_PID MARK_VARIABLE MARK RUN_DIR

(run as a file: it imports nothing from course_lib, so it starts fast; the
launcher passes the mark's variable name, `rank.contract.ENV_LAUNCH_MARK`)

It waits for the kernel to die, then kills every process whose environment
has MARK_VARIABLE=MARK (see processes.py) and removes the launch's temporary folder. When
the launch ends normally, the kernel kills the watchdog itself.
"""

from __future__ import annotations

import shutil
import sys
import time

import psutil

__all__ = ["watch"]

CHECK_S = 0.5


def _marked(variable: str, mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(variable) == mark:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watch(kernel_pid: int, variable: str, mark: str, run_dir: str) -> None:
    """Block until `kernel_pid` is gone, then SIGKILL every process with `variable=mark` and remove `run_dir`."""
    while _alive(kernel_pid):
        time.sleep(CHECK_S)
    # Two passes: a rank may start a helper while we kill the first batch.
    for _ in range(2):
        procs = _marked(variable, mark)
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=3)
    shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
