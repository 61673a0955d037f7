"""course_lib.launcher.pool: persistent ranks at the library level, with real torchrun processes on gloo.

test_dist_magic.py runs the whole fault suite through the magic (what a learner
sees); this module checks what the magic builds on (CellResult's fields, the
ledgers, `broken`), interrupts raised inside `Pool.run`, start/stop cycles and
the authentication of the pool's port, and one fault of each kind that ends
the pool: a hang ended by the deadline, a dead rank (an interrupt that is not
answered is tested through the kernel, with a real SIGINT).

A fault (deadline, dead rank, unanswered interrupt) must end the cell within
its deadline plus a few seconds, name the rank that failed or is stuck, kill
every process of the pool and remove its folder; an exception on a rank must
keep the pool and its variables. Every process these tests start carries this
module's environment mark (proc_helpers), so a leftover is found even after it
was re-parented away from this process.

Pools are shared: `pools.get()` returns a running 2-rank pool and starts a new
one only when a fault ended the last one (which is what `%%dist` does too).
Line numbers: the worker counts a first line for the `%%dist` magic, so line k
of a source given to `Pool.run` is reported as line k + 1.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import socket
import textwrap
import threading
import time
from multiprocessing.connection import AuthenticationError, Client, Connection

import psutil
import pytest

from course_lib.backend_choice import BackendChoice, BackendError
from course_lib.launcher.pool import INTERRUPT_GRACE_S, Pool, PoolError
from proc_helpers import MARK_VAR, describe, env_var, kill_quietly, marked_processes, new_mark, still_alive

MARK = new_mark()
MARGIN_S = 5.0  # a fault must end within its deadline (or the interrupt grace) plus this
LINE = 1  # what the worker adds to a source line number (the magic's line)
CYCLES = 4  # each cycle is a real torchrun start and stop (~1.8 s); a leak shows in any of them (2 per thread)
CYCLE_THREADS = 2  # two cores: two start/stop loops side by side halve the wall time


@pytest.fixture(scope="module", autouse=True)
def _marked():
    """Every process started in this module inherits MARK; none may outlive the module."""
    with env_var(MARK_VAR, MARK):
        yield
    left = still_alive(marked_processes(MARK), timeout_s=5)
    kill_quietly(left)
    assert left == [], describe(left)


def leftovers() -> list[str]:
    """Processes started by this module (by mark, or still below this process) that are alive."""
    procs = {p.pid: p for p in marked_processes(MARK)}
    procs.update({p.pid: p for p in psutil.Process().children(recursive=True)})
    left = still_alive(list(procs.values()), timeout_s=2)
    names = describe(left)
    kill_quietly(left)
    return names


class Pools:
    """One running pool at a time, restarted after a fault (as the magic does)."""

    def __init__(self):
        self.pool: Pool | None = None

    def get(self, nproc: int = 2) -> Pool:
        if self.pool is None or not self.pool.running or self.pool.nproc != nproc:
            if self.pool is not None:
                self.pool.stop()
            self.pool = Pool(nproc, "gloo")
            self.pool.start()
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.stop()
            self.pool = None


@pytest.fixture(scope="module")
def pools():
    p = Pools()
    try:
        yield p
    finally:
        p.close()


def seq_next(pool: Pool) -> dict[int, int]:
    """The `seq` each rank's next world-group collective will have (ledgers are kept per pool)."""
    result = pool.run("pass")
    assert result.ok
    return {r: sum(e["group"] == "world" for e in entries) + 1 for r, entries in result.ledgers.items()}


def run_fault(pool: Pool, source: str, timeout_s: float, **kwargs):
    """Run a cell that must break the pool; check the time it took and that nothing is left."""
    run_dir = pool.run_dir
    pids = dict(pool.pids)
    started = time.monotonic()
    result = pool.run(textwrap.dedent(source), timeout_s=timeout_s, **kwargs)
    elapsed = time.monotonic() - started
    assert elapsed < timeout_s + MARGIN_S, elapsed
    assert not pool.running and pool.broken
    assert leftovers() == []
    assert not any(psutil.pid_exists(pid) and still_alive([psutil.Process(pid)], 0.5) for pid in pids.values())
    assert not run_dir.exists()
    return result, elapsed


def assert_next_cell_works(pools: Pools) -> None:
    result = pools.get().run("import torch, torch.distributed as dist\n"
                             "t = torch.ones(1)\ndist.all_reduce(t)\nprint(int(t.item()))\n")
    assert result.ok and result.stdout == {0: "2\n", 1: "2\n"}, result


PRE = """\
import os, time, torch
import torch.distributed as dist
rank = dist.get_rank()
"""


# ---------------------------------------------------------------- cells that work


def test_state_persists_between_cells(pools):
    pool = pools.get()
    first = pool.run("import torch.distributed as dist\nx = 10 * dist.get_rank()\nitems = []\n")
    assert first.ok and first.stdout == {0: "", 1: ""}
    for _ in range(3):
        assert pool.run("items.append(x)").ok
    again = pool.run("print(x, items)")
    assert again.ok
    assert again.stdout == {0: "0 [0, 0, 0]\n", 1: "10 [10, 10, 10]\n"}
    assert again.stderr == {0: "", 1: ""}


def test_cell_runs_only_on_the_ranks_asked(pools):
    pool = pools.get()
    assert pool.run("seen = 'no'").ok
    result = pool.run("seen = 'yes'\nprint(seen)", ranks=[1])
    assert result.ok and result.ranks == [1] and result.stdout == {1: "yes\n"}
    assert pool.run("print(seen)").stdout == {0: "no\n", 1: "yes\n"}


def test_output_streams_to_on_output_in_order(pools):
    chunks = []
    result = pools.get().run("import sys\nfor i in range(3):\n    print(i, flush=True)\nprint('oops', file=sys.stderr)\n",
                             on_output=lambda rank, stream, text: chunks.append((rank, stream, text)))
    assert result.ok
    for rank in (0, 1):
        assert "".join(t for r, s, t in chunks if (r, s) == (rank, "stdout")) == "0\n1\n2\n" == result.stdout[rank]
        assert "".join(t for r, s, t in chunks if (r, s) == (rank, "stderr")) == "oops\n" == result.stderr[rank]


def test_output_below_python_is_shown_with_its_cell(pools):
    # os.write to fds 1/2, a subprocess and C stdio (libc printf, buffered: the
    # worker flushes it before reporting done) bypass sys.stdout; they come
    # from torchrun's log files, and only with the cell that wrote them.
    chunks = []
    source = textwrap.dedent("""\
        import ctypes, os, subprocess, sys
        os.write(1, f"fd1 of rank {os.environ['RANK']}\\n".encode())
        os.write(2, b"fd2\\n")
        subprocess.run([sys.executable, "-c", "print('child')"], check=True)
        ctypes.CDLL(None).printf(b"from C\\n")
        """)
    result = pools.get().run(source, on_output=lambda rank, stream, text: chunks.append((rank, stream, text)))
    assert result.ok, result
    for rank in (0, 1):
        assert sorted(result.stdout[rank].splitlines()) == sorted([f"fd1 of rank {rank}", "child", "from C"])
        assert result.stderr[rank] == "fd2\n"
        assert "".join(t for r, s, t in chunks if (r, s) == (rank, "stdout")) == result.stdout[rank]
    after = pools.get().run("print('next')")
    assert after.stdout == {0: "next\n", 1: "next\n"} and after.stderr == {0: "", 1: ""}


def test_publish_and_ledgers(pools):
    pool = pools.get()
    before = seq_next(pool)
    result = pool.run(PRE + textwrap.dedent("""\
        import course_lib as cl
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        dist.broadcast(torch.zeros(5, dtype=torch.float64), src=0)
        dist.barrier()
        cl.publish("total", t)
        cl.publish("word", f"r{rank}")
        """))
    assert result.ok, result
    assert result.published["word"] == {0: "r0", 1: "r1"}
    assert {r: v.tolist() for r, v in result.published["total"].items()} == {0: [3.0] * 3, 1: [3.0] * 3}
    for rank in (0, 1):
        new = result.ledgers[rank][-3:]
        assert [(e["op"], e["seq"], e["bytes"], e["shapes"], e["dtype"], e["group"]) for e in new] == [
            ("all_reduce", before[rank], 12, [[3]], "float32", "world"),
            ("broadcast", before[rank] + 1, 40, [[5]], "float64", "world"),
            ("barrier", before[rank] + 2, 0, [], None, "world"),
        ]
        assert all(e["end"] is not None and e["end"] >= e["start"] for e in new)


def test_the_backend_is_decided_once():
    """A BackendChoice (the magic's, printed in its header; a restarted pool's) is used as is; a name is decided."""
    given = BackendChoice("gloo", "cpu", "decided by the caller")
    assert Pool(2, given).choice is given
    assert Pool(2, "gloo").choice == BackendChoice("gloo", "cpu", "asked for gloo", requested="gloo")
    with pytest.raises(BackendError, match="unknown backend"):
        Pool(2, "mpi")


def test_run_on_a_pool_not_started_raises():
    pool = Pool(1, "gloo", init=False)
    with pytest.raises(PoolError, match="not running"):
        pool.run("pass")


# ---------------------------------------------------------------- an exception keeps the pool


def test_exception_on_one_rank_keeps_the_pool_and_its_variables(pools):
    pool = pools.get()
    assert pool.run("kept = 'before'").ok
    pids = dict(pool.pids)
    result = pool.run(textwrap.dedent("""\
        import torch.distributed as dist
        if dist.get_rank() == 1:
            raise ValueError(f"bad value on rank {dist.get_rank()}")
        print("fine")
        """), timeout_s=10)
    assert list(result.errors) == [1]
    kind, tb = result.errors[1]
    assert kind == "ValueError"
    lines = tb.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1] == f'  File "<cell>", line {3 + LINE}, in <module>'
    assert lines[2] == '    raise ValueError(f"bad value on rank {dist.get_rank()}")'
    assert lines[-1] == "ValueError: bad value on rank 1"
    assert "course_lib" not in tb  # the worker's own frames are left out
    assert result.stdout == {0: "fine\n", 1: ""}
    assert not (result.timed_out or result.dead or result.unfinished)
    assert pool.running and pool.broken is None and pool.pids == pids
    after = pool.run("print(kept)")
    assert after.ok and after.stdout == {0: "before\n", 1: "before\n"}


# ---------------------------------------------------------------- ranks that hang: the deadline


def test_mismatched_ops_hang_both_ranks_and_diagnosis_names_each_wait(pools):
    """gloo pairs rank 0's all_reduce with rank 1's broadcast (same size) and both wait forever."""
    seq = seq_next(pools.get())
    result, _ = run_fault(pools.get(), PRE + textwrap.dedent("""\
        t = torch.ones(2)
        if rank == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=0)
        print("returned", flush=True)
        """), timeout_s=1)
    assert result.timed_out and result.unfinished == [0, 1] and result.dead == []
    assert result.stdout == {0: "", 1: ""}
    assert result.diagnosis == [
        f"rank 0 is waiting in all_reduce #{seq[0]} (8 B, world group)",
        f"rank 1 is waiting in broadcast #{seq[1]} (8 B, world group)",
    ]
    assert f'File "<cell>", line {6 + LINE} in <module>' in result.stacks[0]
    assert f'File "<cell>", line {8 + LINE} in <module>' in result.stacks[1]
    assert_next_cell_works(pools)


# ---------------------------------------------------------------- ranks that die


def test_a_cpp_abort_in_gloo_is_a_dead_rank(pools):
    """all_reduce of 1000 vs 2000 floats: gloo aborts (SIGABRT) the rank with the smaller buffer."""
    result, elapsed = run_fault(pools.get(), PRE + textwrap.dedent("""\
        dist.all_reduce(torch.ones(1000 if rank == 1 else 2000))
        print("returned", flush=True)
        """), timeout_s=20)
    assert elapsed < 5
    assert result.dead == [1] and not result.timed_out
    assert result.exit_codes == {1: -6}  # from torchrun's failure summary: the magic need not read it
    assert "terminate called" in result.stderr[1]  # C++'s last words, from the rank's log file
    assert_next_cell_works(pools)


def test_broken_says_which_rank_died(pools):
    result, _ = run_fault(pools.get(), PRE + "if rank == 1:\n    os._exit(1)\ntime.sleep(30)\n", timeout_s=20)
    assert result.dead == [1] and result.unfinished == [0] and not result.interrupted
    assert result.exit_codes == {1: 1}  # only the rank that died: rank 0 was stopped with the pool
    assert pools.pool.broken == "rank 1 died"


# ---------------------------------------------------------------- interrupts


class Interrupter:
    """Raises KeyboardInterrupt in Pool.run's wait loop (as Ctrl-C would) once every rank printed
    `started`, and a little later, so that the ranks are back in the cell's own code (see
    test_interrupt_while_ranks_print_a_lot_ends_in_time for what happens otherwise)."""

    def __init__(self, ranks, after_output: int | None = None, pause_s: float = 0.0):
        self.waiting_for = set(ranks)
        self.after_output = after_output
        self.pause_s = pause_s  # stop reading for a while first, as a slow live view would
        self.outputs = 0
        self.last_started = 0.0
        self.at: float | None = None

    def on_output(self, rank, stream, text):
        self.outputs += 1
        if "started" in text:
            self.waiting_for.discard(rank)
            self.last_started = time.monotonic()

    def on_poll(self):
        if self.at is not None:
            return
        if self.after_output is not None:
            ready = self.outputs >= self.after_output
        else:
            ready = not self.waiting_for and time.monotonic() - self.last_started > 0.2
        if ready:
            time.sleep(self.pause_s)
            self.at = time.monotonic()
            raise KeyboardInterrupt


def test_interrupt_answered_by_every_rank_keeps_the_pool(pools):
    pool = pools.get()
    assert pool.run("kept = 'yes'").ok
    stop = Interrupter([0, 1])
    result = pool.run("import time\nprint('started', flush=True)\ntime.sleep(30)\n", timeout_s=60,
                      on_output=stop.on_output, on_poll=stop.on_poll)
    assert stop.at is not None
    assert time.monotonic() - stop.at < 1.5
    assert result.interrupted and not result.timed_out and result.unfinished == [] and result.dead == []
    assert {r: kind for r, (kind, _) in result.errors.items()} == {0: "KeyboardInterrupt", 1: "KeyboardInterrupt"}
    assert f'File "<cell>", line {3 + LINE}, in <module>' in result.errors[0][1]
    assert pool.running and pool.broken is None
    assert pool.run("print(kept)").stdout == {0: "yes\n", 1: "yes\n"}


# ---------------------------------------------------------------- start / stop


def test_stop_leaves_nothing(pools):
    pool = pools.get()
    run_dir, pids = pool.run_dir, list(pool.pids.values())
    pool.stop()
    assert not pool.running and pool.broken == "stopped"
    assert not run_dir.exists()
    assert leftovers() == []
    assert not any(psutil.pid_exists(pid) and still_alive([psutil.Process(pid)], 0.5) for pid in pids)


def test_interrupt_while_ranks_print_a_lot_ends_in_time():
    pool = Pool(1, "gloo", init=False)
    pool.start()
    # While the kernel does not read, the rank's socket fills and it blocks half-way through a message.
    stop = Interrupter([], after_output=3, pause_s=0.5)
    outcome = {}

    def run():
        try:
            outcome["result"] = pool.run("big = 'x' * 200_000\nwhile True:\n    print(big, flush=True)\n", timeout_s=60,
                                         on_output=stop.on_output, on_poll=stop.on_poll)
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while stop.at is None and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stop.at is not None
        thread.join(timeout=max(0.0, stop.at + INTERRUPT_GRACE_S + 2 - time.monotonic()))
        hung = thread.is_alive()
    finally:
        pool.kill()  # also ends a blocked read: the workers' ends of the connections close
        thread.join(timeout=10)
    assert leftovers() == []
    assert not hung, "Pool.run still blocked after the interrupt grace"
    assert "error" not in outcome, outcome
    assert outcome["result"].interrupted


@pytest.mark.slow
def test_start_stop_cycles_leave_no_process_and_no_folder():
    """CYCLES start/stop cycles, as cheap as a cycle gets (1 rank, no process group)."""
    errors: list[BaseException] = []
    done: list[pathlib.Path] = []  # each cycle's folder

    def cycles(n):
        try:
            for _ in range(n):
                pool = Pool(1, "gloo", init=False)
                pool.start()
                assert pool.run_dir.name.startswith("course_lib_pool_") and pool.run_dir.is_dir()
                done.append(pool.run_dir)
                assert pool.run("print('up')").stdout == {0: "up\n"}
                pool.stop()
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=cycles, args=(CYCLES // CYCLE_THREADS,)) for _ in range(CYCLE_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(set(done)) == CYCLES
    assert leftovers() == []
    assert [d for d in done if d.exists()] == []


# ---------------------------------------------------------------- authentication


class _Evil:
    """Unpickling this creates a folder: proof that someone unpickled it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _capture_server(monkeypatch) -> list[socket.socket]:
    servers: list[socket.socket] = []
    real = socket.create_server

    def create_server(*args, **kwargs):
        server = real(*args, **kwargs)
        servers.append(server)
        return server

    monkeypatch.setattr(socket, "create_server", create_server)
    return servers


def test_clients_without_the_key_are_rejected_and_never_unpickled(pools, monkeypatch, tmp_path):
    """While the pool waits for its workers, two intruders connect first: one with a wrong key,
    one that sends a pickle instead of answering the challenge. Neither gets in; the pickle
    is never loaded; the real workers still connect."""
    pools.close()  # this test's pool is the only one running
    servers = _capture_server(monkeypatch)
    canary = tmp_path / "unpickled"
    outcome: dict[str, object] = {}

    def intrude():
        while not servers:
            time.sleep(0.005)
        address = servers[0].getsockname()
        try:
            Client(address, authkey=b"not the key")
            outcome["wrong_key"] = "accepted"
        except AuthenticationError:
            outcome["wrong_key"] = "rejected"
        except Exception as exc:  # noqa: BLE001
            outcome["wrong_key"] = repr(exc)
        conn = Connection(socket.create_connection(address).detach())
        try:
            conn.send_bytes(pickle.dumps(_Evil(str(canary))))  # read by the pool as the answer to its challenge
            outcome["challenge"] = conn.recv_bytes()
            outcome["verdict"] = conn.recv_bytes()
            conn.send_bytes(pickle.dumps(("hello", 0, os.getpid())))  # too late: the pool has hung up
            conn.send_bytes(pickle.dumps(_Evil(str(canary))))
        except (EOFError, OSError):
            pass
        finally:
            conn.close()

    intruder = threading.Thread(target=intrude)
    intruder.start()
    pool = Pool(1, "gloo", init=False)
    try:
        pool.start()
        intruder.join(timeout=10)
        assert outcome["wrong_key"] == "rejected"
        assert outcome["challenge"].startswith(b"#CHALLENGE#") and outcome["verdict"] == b"#FAILURE#", outcome
        assert not canary.exists()
        assert pool.run("print('in')").stdout == {0: "in\n"}
        assert set(pool.pids) == {0} and pool.pids[0] != os.getpid()
    finally:
        pool.stop()
    assert leftovers() == []


def test_a_silent_peer_does_not_block_start_past_its_timeout(pools, monkeypatch):
    pools.close()
    servers = _capture_server(monkeypatch)
    # The peer holds its connection until start() has returned (or hold_s): a start that waited
    # for it would take hold_s, far above the bound, however loaded the machine.
    hold_s, timeout_s = 30.0, 1.5
    released = threading.Event()

    def silent():
        while not servers:
            time.sleep(0.005)
        with socket.create_connection(servers[0].getsockname()):
            released.wait(hold_s)

    peer = threading.Thread(target=silent)
    peer.start()
    pool = Pool(1, "gloo", init=False)
    started = time.monotonic()
    try:
        pool.start(timeout_s=timeout_s)
    except PoolError:
        pass
    finally:
        elapsed = time.monotonic() - started
        released.set()
        pool.stop()
        peer.join()
    assert leftovers() == []
    assert elapsed < timeout_s + 6, f"start took {elapsed:.1f} s with timeout_s={timeout_s}"
