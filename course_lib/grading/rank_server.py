"""A process that has imported torch once and forks grading ranks on request.

Importing torch takes ~1.5 s a process; a rank forked from a process that
already has it starts in milliseconds. `RankServer` (the checker's side) starts

    python -m course_lib.grading.rank_server

(followed by the names of modules to import before forking, if any: `Exercise.preload`)
and writes one JSON request per line on its stdin; for each the server forks a
rank that connects back to the checker's socket and serves jobs
(rank_runner.serve). The server answers on stdout, one line each:

    started <request id> <pid>
    exit <pid> <exit code>          (negative: the signal that ended it)

Ranks are the server's children, so the server reaps them and reports their
exit codes. When its stdin closes (the checker is done, or died) it kills the
ranks it forked, by PID, and exits: nothing outlives the checker.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading

__all__ = ["RankServer"]

READY = "ready"
START_TIMEOUT_S = 60.0  # importing torch on a loaded machine


# ---------------------------------------------------------------- the server process

def _fork_rank(request: dict, closing: list[int]) -> int:
    """Fork one rank; in the child, connect to the checker and serve jobs until told to stop."""
    pid = os.fork()
    if pid:
        return pid
    try:
        for fd in closing:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)  # not the server's requests
        os.dup2(null, 1)  # not the server's answers (each run redirects output to its own files)
        from multiprocessing.connection import Client

        from . import rank_runner

        conn = Client(request["address"], family="AF_UNIX", authkey=bytes.fromhex(request["authkey"]))
        rank_runner.serve(request["rank"], conn, conn, request["set_dir"], request["store_port"],
                          request["limits"], request["mark"], request["grader_pid"])
    except BaseException:  # noqa: BLE001 - a rank that could not start: the checker sees it exit
        import traceback

        traceback.print_exc()
    finally:
        os._exit(1)


def main(preload: list[str]) -> None:
    import importlib

    from . import rank_runner  # noqa: F401 - imports torch, once, before any fork
    # torch.distributed.nn.functional binds `group=group.WORLD` as its functions' default at import. Imported
    # here, before any rank's group exists, the default is None: "the default group at call time". Imported by
    # a learner's cell, it would be that run's group, and a rank reused for the next run (another size) would
    # call a destroyed group: "not initialized in the world group map", or all-reduce with the wrong peers.
    import torch.distributed.nn.functional  # noqa: F401

    for name in preload:  # what the exercises' drivers import (torch._dynamo for DDP): forks inherit it
        importlib.import_module(name)

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd is written
    signal.set_wakeup_fd(wake_w)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    answers = os.fdopen(1, "w", buffering=1)
    answers.write(READY + "\n")
    children: set[int] = set()
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fd == wake_r:
                os.read(wake_r, 4096)
                while children:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    children.discard(pid)
                    answers.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
                continue
            data = os.read(0, 65536)
            if not data:  # the checker is done (or died): no rank outlives it
                for pid in children:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os._exit(0)
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = _fork_rank(request, [wake_r, wake_w, selector.fileno()])
                children.add(pid)
                answers.write(f"started {request['id']} {pid}\n")


# ---------------------------------------------------------------- the checker's side

class RankServer:
    """The server process, from the checker: `fork(request) -> pid`, `exit_code(pid)`, `stop()`. Thread-safe.

    `preload`: modules the server imports before forking any rank (`Exercise.preload`).
    """

    def __init__(self, preload: tuple[str, ...] = ()):
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.preload = tuple(preload)
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, *self.preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self._cond = threading.Condition()
        self._started: dict[int, int] = {}  # request id -> pid
        self._exits: dict[int, int] = {}  # pid -> exit code
        self._ready = False
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, daemon=True, name="course-rank-server")
        self._reader.start()
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self.proc.poll() is not None, START_TIMEOUT_S):
                self.stop()
                raise RuntimeError(f"the grading rank server did not start within {START_TIMEOUT_S:g} s")
        if not self._ready:
            raise RuntimeError(f"the grading rank server ended while starting (exit code {self.proc.returncode})")

    def _read(self) -> None:
        for raw in self.proc.stdout:
            word, *rest = raw.decode().split()
            with self._cond:
                if word == READY:
                    self._ready = True
                elif word == "started":
                    self._started[int(rest[0])] = int(rest[1])
                elif word == "exit":
                    self._exits[int(rest[0])] = int(rest[1])
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def fork(self, request: dict, timeout_s: float = 10.0) -> int:
        """Start a rank (see `_fork_rank` for the request's keys); its PID."""
        with self._cond:
            self._next_id += 1
            request_id = self._next_id
            self.proc.stdin.write(json.dumps({**request, "id": request_id}).encode() + b"\n")
            self.proc.stdin.flush()
            if not self._cond.wait_for(lambda: request_id in self._started or self.proc.poll() is not None,
                                       timeout_s):
                raise RuntimeError("the grading rank server did not answer")
            if request_id not in self._started:
                raise RuntimeError(f"the grading rank server ended (exit code {self.proc.returncode})")
            return self._started.pop(request_id)

    def exit_code(self, pid: int, timeout_s: float = 2.0) -> int | None:
        """The exit code of a rank that ended (negative: its signal), once the server has reaped it."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self.proc.poll() is not None, timeout_s)
            return self._exits.get(pid)

    def stop(self) -> None:
        """Close its stdin: it kills the ranks it forked and exits."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)


if __name__ == "__main__":
    main(sys.argv[1:])
