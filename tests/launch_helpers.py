"""Shared by tests/test_launch_*.py: run launch/ scripts with a deadline, kill what they started, read the losses.

Every process a run starts carries a mark in its environment (tests/proc_helpers.py),
so the processes are found again by it and killed one by one, by PID, even after
torchrun's agent died and its workers were re-parented.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time

import torch

from proc_helpers import MARK_VAR, describe, kill_quietly, marked_processes, new_mark, still_alive

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch"
TRAIN = LAUNCH / "train.py"
STEP_LINE = re.compile(r"^(?:\[rank0\]:)?step\s+(\d+)/\d+ .*? loss ([0-9.]+) ")
FINAL_LINE = re.compile(r"^(?:\[rank0\]:)?final loss ([0-9.e-]+)$")


@dataclasses.dataclass
class Run:
    returncodes: list[int | None]  # one per command; None: killed at the deadline
    outputs: list[str]  # stdout and stderr, merged, one per command
    elapsed_s: float
    leftovers: list[str]  # processes still alive after the commands ended (killed)

    @property
    def text(self) -> str:
        return "\n".join(self.outputs)

    def part(self, i: int) -> "Run":
        """Command i's result alone, when run_all started several at once."""
        return Run([self.returncodes[i]], [self.outputs[i]], self.elapsed_s, self.leftovers)

    def explain(self) -> str:
        tails = "\n".join(f"--- command {i} (rc {rc}):\n{out[-4000:]}"
                          for i, (rc, out) in enumerate(zip(self.returncodes, self.outputs)))
        return f"after {self.elapsed_s:.0f} s:\n{tails}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHON=sys.executable, HF_HUB_OFFLINE="1", **extra)
    for name in ("COURSE_BACKEND", "COURSE_REHEARSE_GPU_NODE", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)  # a plain shell's environment, not a notebook launcher's
    return env


def run_all(commands: list[list[str]], env: dict[str, str], timeout_s: float) -> Run:
    """Start every command at once, wait for all up to `timeout_s`, then kill whatever they left, by PID."""
    mark = new_mark()
    env = dict(env, **{MARK_VAR: mark})
    logs = [io.StringIO() for _ in commands]
    started = time.monotonic()
    procs: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    codes: list[int | None] = [None] * len(commands)
    try:
        for cmd, log in zip(commands, logs):
            p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(p)
            readers.append(threading.Thread(target=lambda p=p, log=log: log.write(p.stdout.read()), daemon=True))
            readers[-1].start()
        for i, p in enumerate(procs):
            left = max(0.1, timeout_s - (time.monotonic() - started))
            with contextlib.suppress(subprocess.TimeoutExpired):
                codes[i] = p.wait(timeout=left)
    finally:
        # Every process of this run, found by its mark, killed by its PID (the commands' own first).
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        left = still_alive(marked_processes(mark), timeout_s=1.0)
        leftovers = describe(left)
        kill_quietly(left)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        for t in readers:
            t.join(timeout=5)
    return Run(codes, [log.getvalue() for log in logs], time.monotonic() - started, leftovers)


def losses(text: str) -> tuple[dict[int, float], float | None]:
    """rank 0's loss per step (the last one printed for a step wins: a restart prints it again) and the final loss."""
    steps: dict[int, float] = {}
    final = None
    for line in text.splitlines():
        if m := STEP_LINE.match(line):
            steps[int(m.group(1))] = float(m.group(2))
        elif m := FINAL_LINE.match(line):
            final = float(m.group(1))
    return steps, final


def load_train():
    spec = importlib.util.spec_from_file_location("launch_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(argv: list[str], keep: dict | None = None) -> tuple[dict[int, float], float]:
    """One process, in this interpreter: train.py without torchrun, with the same flags.

    `keep`, if given, receives its final AppState as "app" (model and optimizer, to compare with a checkpoint).
    """
    train = load_train()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.train(train.parse_args(argv), keep)
    steps, final = losses(out.getvalue())
    assert final is not None, out.getvalue()
    return steps, final


def assert_matches(run: Run, ref: tuple[dict[int, float], float], *, steps: list[int]) -> None:
    got_steps, got_final = losses(run.text)
    assert got_final is not None, f"no final loss line\n{run.explain()}"
    assert sorted(got_steps) == steps, run.explain()
    # Progress lines print 6 decimals: equal to one process within that rounding.
    torch.testing.assert_close(torch.tensor([got_steps[s] for s in steps]), torch.tensor([ref[0][s] for s in steps]),
                               rtol=0, atol=2e-6)
    torch.testing.assert_close(torch.tensor(got_final), torch.tensor(ref[1]))


def file_hashes(folder: pathlib.Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too) -> its sha256: compare before and after a run to show nothing changed."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# Prefixes each output line of the command it runs with the seconds since it started ("12.3 line").
_STAMP = ("import subprocess, sys, time\n"
          "start = time.monotonic()\n"
          "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)\n"
          "for line in p.stdout:\n"
          "    print(f'{time.monotonic() - start:.1f} {line}', end='', flush=True)\n"
          "sys.exit(p.wait())\n")


def timestamped(cmd: list[str]) -> list[str]:
    """`cmd`, its output lines prefixed with when they came (seconds): to time a part of a run, not its start-up."""
    return [sys.executable, "-c", _STAMP, *cmd]


def unstamp(text: str) -> list[tuple[float, str]]:
    """(seconds, line) for each line of a timestamped command's output."""
    return [(float(t), line) for t, line in (ln.split(" ", 1) for ln in text.splitlines())]
