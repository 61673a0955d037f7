"""What a notebook cell costs: %%dist and %%torchrun against their floors, measured side by side.

    .venv/bin/python bench/bench_cells.py [--quick | --smoke] [--profile]

Run it from the repository root. Full run about 5 min, --quick about 1.5 min, on 2 cores;
--smoke runs every part once (numbers meaningless; tests/test_bench.py runs it).
Every comparison is made in ONE run with its variants interleaved (a new
random order each round), so a load that comes and goes (another job on the
machine) lands on all variants alike; read the medians and the ratios, not
the absolute numbers. What is measured:

1. trivial cell (`pass`) on 2 and 4 persistent ranks: through a real IPython
   kernel as a learner meets it (execute request -> the kernel's idle status,
   jupyter_client), against Pool.run in this process and against a kernel
   cell without any magic (the kernel's own round trip).
2. one 4 MiB all_reduce (float32, 1M elements) per %%dist cell, collective
   ledger ON vs OFF (COURSE_LEDGER=0 set before `%dist start`), in a kernel
   and with Pool.run; then the ledger's cost per call inside a rank (1 float
   and 4 MiB), and the trivial cell again once the ledger holds many entries.
3. the same 4 MiB all_reduce script as a one-shot `%%torchrun -n 2` cell,
   as a kernel cell calling `cl.run_torchrun` (no magic), as `run_torchrun`
   in this process, and as bare `torchrun --standalone --nproc-per-node 2
   script.py` (OMP_NUM_THREADS=1); plus CPU seconds of each whole launch.

The last part splits run_torchrun's time into its steps, by wrapping them
here (course_lib is not changed), and times the ledger's parts in-process.
`--profile` adds cProfile tables of Pool.run, of the %%dist magic inside
the kernel, and of run_torchrun.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import cProfile
import datetime
import io
import json
import os
import pathlib
import platform
import pstats
import random
import resource
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import torch
import torch.distributed as dist
from jupyter_client import KernelManager

from course_lib.rank import ledger
from course_lib.launcher import torchrun as torchrun_mod
from course_lib.launcher.pool import Pool
from course_lib.launcher.processes import ProcessTree
from course_lib.launcher.torchrun import TorchrunProcess, run_torchrun

ROOT = pathlib.Path(__file__).resolve().parent.parent
TORCHRUN = pathlib.Path(sys.executable).parent / "torchrun"

# Goals from the issue.
GOAL_TRIVIAL_S = 0.010  # median trivial %%dist cell at 2 ranks, through the kernel
GOAL_LEDGER_RATIO = 1.05  # 4 MiB all_reduce cell, ledger ON / OFF
GOAL_ONESHOT_RATIO = 1.05  # %%torchrun -n 2 / bare torchrun, same script

# Rounds per part: (full, --quick, --smoke).
ROUNDS = {"cells": (200, 40, 1), "per_call": (12, 4, 1), "grown": (40, 12, 1), "oneshot": (8, 2, 1)}
WARM_UP = (5, 5, 0)  # cell rounds before the measured ones
IN_KERNEL = (10, 3, 1)  # samples of the %%dist magic inside the kernel
TINY_CALLS, BIG_CALLS = 500, 40  # collectives per in-rank timing cell
GROW_CALLS = (10_000, 2_000, 100)  # tiny all_reduces recorded before the "grown ledger" cells

SETUP = """\
import time
import torch
import torch.distributed as dist
import course_lib as cl

big = torch.ones(1 << 20)  # 4 MiB of float32
tiny = torch.ones(1)
"""

PER_CALL = """\
def _per_call(x, n):
    dist.barrier()  # start together
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x)
    return (time.perf_counter() - t0) / n


cl.publish("per_call_s", _per_call({x}, {n}))
"""

GROW = "for _ in range({n}):\n    dist.all_reduce(tiny)\n"

ONE_SHOT = """\
import torch
import torch.distributed as dist
import course_lib as cl

info = cl.init()
x = torch.ones(1 << 20, device=info.device)  # 4 MiB of float32
dist.all_reduce(x)
assert x[0].item() == info.world_size
dist.destroy_process_group()
"""


# ---------------------------------------------------------------------- drivers


class Kernel:
    """A real IPython kernel driven by jupyter_client, as a notebook front end drives it."""

    def __init__(self, name: str):
        self.name = name
        self.log = tempfile.TemporaryFile()  # the kernel's own stdout/stderr (TCP warning etc.)
        self.km = KernelManager(kernel_name="python3")
        env = dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1")
        self.km.start_kernel(env=env, cwd=str(ROOT), stdout=self.log, stderr=self.log)
        self.proc = psutil.Process(self.km.provisioner.process.pid)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout_s: float = 300) -> tuple[float, str]:
        """Seconds from the execute request to the kernel's idle status, and what the cell printed."""
        started = time.perf_counter()
        msg_id = self.kc.execute(code)
        printed, error = [], None
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout_s)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                elapsed = time.perf_counter() - started
                break
            if kind == "stream":
                printed.append(content["text"])
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
        while self.kc.get_shell_msg(timeout=timeout_s)["parent_header"].get("msg_id") != msg_id:
            pass  # keep the shell channel drained: its execute_reply came before the idle status
        if error:
            raise RuntimeError(f"{self.name}: cell {code[:40]!r} failed: {error}\n{''.join(printed)[-2000:]}")
        return elapsed, "".join(printed)

    def cpu_s(self) -> float:
        """CPU seconds of the kernel and of every child it has reaped (a %%torchrun launch tree)."""
        t = self.proc.cpu_times()
        return t.user + t.system + t.children_user + t.children_system

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run("%dist stop", timeout_s=30)
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def start_kernel_pool(name: str, nproc: int, *, ledger_on: bool = True) -> Kernel:
    kernel = Kernel(name)
    kernel.run("%load_ext course_lib")
    if not ledger_on:
        kernel.run('import os\nos.environ["COURSE_LEDGER"] = "0"  # read by the ranks at %dist start')
    kernel.run(f"%dist start -n {nproc}")
    kernel.run("%%dist\n" + SETUP)
    return kernel


def start_pool(nproc: int, *, ledger_on: bool = True) -> Pool:
    old = os.environ.pop("COURSE_LEDGER", None)
    if not ledger_on:
        os.environ["COURSE_LEDGER"] = "0"  # the ranks inherit this process's environment
    try:
        pool = Pool(nproc)
        pool.start()
    finally:
        os.environ.pop("COURSE_LEDGER", None)
        if old is not None:
            os.environ["COURSE_LEDGER"] = old
    check(pool.run(SETUP))
    return pool


def check(result):
    if not result.ok:
        raise RuntimeError(f"pool cell failed: {result.errors or result.dead or result.unfinished}")
    return result


def timed_pool_run(pool: Pool, source: str) -> float:
    started = time.perf_counter()
    check(pool.run(source))
    return time.perf_counter() - started


def interleave(variants: dict, rounds: int, rng: random.Random, samples: dict) -> None:
    """Each round runs every variant once, in a new random order; appends seconds to samples[name]."""
    for _ in range(rounds):
        names = list(variants)
        rng.shuffle(names)
        for name in names:
            samples.setdefault(name, []).append(variants[name]())


# ---------------------------------------------------------------------- run_torchrun split into steps


class Splits:
    """perf_counter marks at the steps of run_torchrun, by wrapping them (nothing in course_lib changes)."""

    def __init__(self):
        self.marks: dict[str, float] = {}

    @contextlib.contextmanager
    def active(self):
        marks, now = self.marks, time.perf_counter
        orig = (TorchrunProcess.__init__, TorchrunProcess.kill, torchrun_mod._start_watchdog,
                ProcessTree.find_marked, torchrun_mod._read_results)

        def init(proc_self, *args, **kwargs):
            marks["launch"] = now()
            orig[0](proc_self, *args, **kwargs)
            marks["popen_done"] = now()
            watch_exit(proc_self.proc.pid, marks, "agent_exit")

        def kill(proc_self):
            marks["kill"] = now()
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(proc_self.watchdog.pid).cpu_times()
                marks["watchdog_cpu_s"] = t.user + t.system
            orig[1](proc_self)
            marks["kill_done"] = now()

        def start_watchdog(*args, **kwargs):
            marks["watchdog"] = now()
            try:
                return orig[2](*args, **kwargs)
            finally:
                marks["watchdog_done"] = now()

        def find_marked(tree_self):
            t = now()
            orig[3](tree_self)
            marks["find_marked_s"] = marks.get("find_marked_s", 0.0) + now() - t

        def read_results(*args):
            t = now()
            try:
                return orig[4](*args)
            finally:
                marks["read_results_s"] = now() - t

        TorchrunProcess.__init__, TorchrunProcess.kill = init, kill
        torchrun_mod._start_watchdog, ProcessTree.find_marked, torchrun_mod._read_results = (
            start_watchdog, find_marked, read_results)
        try:
            yield
        finally:
            (TorchrunProcess.__init__, TorchrunProcess.kill, torchrun_mod._start_watchdog,
             ProcessTree.find_marked, torchrun_mod._read_results) = orig

    def steps(self) -> dict[str, float]:
        m = self.marks
        return {
            "before launch (tempdir, script file)": m["launch"] - m["start"],
            "start watchdog (Popen)": m["watchdog_done"] - m["watchdog"],
            "start torchrun (Popen)": m["popen_done"] - m["watchdog_done"],
            "torchrun agent running": wait_for_mark(m, "agent_exit") - m["popen_done"],
            "exit noticed (poll every 50 ms)": m["kill"] - m["agent_exit"],
            "kill(): kill_all, reap, watchdog": m["kill_done"] - m["kill"],
            "  of which find_marked (scan all procs)": m.get("find_marked_s", 0.0),
            "after kill (ledgers, results, parse)": m["end"] - m["kill_done"],
            "  of which _read_results": m.get("read_results_s", 0.0),
            "CPU: the watchdog process": m.get("watchdog_cpu_s", 0.0),
            "CPU: this process (follow logs, tree refresh...)": m["self_cpu_s"],
        }


def watch_exit(pid: int, marks: dict, key: str) -> None:
    """Record in marks[key] the moment process `pid` exits (a pidfd becomes readable; nothing is reaped)."""
    fd = os.pidfd_open(pid)

    def wait():
        select.select([fd], [], [])
        marks[key] = time.perf_counter()
        os.close(fd)

    threading.Thread(target=wait, daemon=True).start()


def wait_for_mark(marks: dict, key: str) -> float:
    """The mark watch_exit records, once its thread has run (it is set within microseconds of the exit)."""
    deadline = time.monotonic() + 1.0
    while key not in marks and time.monotonic() < deadline:
        time.sleep(0.001)
    return marks[key]


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# ---------------------------------------------------------------------- the ledger's parts, in-process


def ledger_parts(tmp: pathlib.Path) -> dict[str, float]:
    """Seconds per call of the ledger wrapper and its parts, and of read_ledger per recorded collective."""
    def fake_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return None

    recorder = ledger._Recorder(str(tmp / "ledger.bench.jsonl"))
    wrapped = recorder.wrap("all_reduce", fake_all_reduce)
    x, n = torch.ones(1), 20_000
    record = {"seq": 1, "op": "all_reduce", "group": "world", "shapes": [[1]], "dtype": "float32",
              "bytes": 4, "start": time.monotonic(), "async": False}
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()

    def per_call(fn):
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best.append((time.perf_counter() - t0) / n)
        return statistics.median(best)

    parts = {
        "wrapper, total (minus the bare call)": per_call(lambda: wrapped(x)) - per_call(lambda: fake_all_reduce(x)),
        "  the group's name (get_process_group_ranks)": per_call(lambda: ledger._group_name(None)),
        "  os.write of one line (O_APPEND, x2 per call)": per_call(lambda: os.write(recorder.fd, line)),
    }
    # read_ledger re-parses the whole file of every rank after every %%dist cell.
    path = tmp / "ledger.grown.jsonl"
    entries = 10_000
    with open(path, "w") as handle:
        for seq in range(1, entries + 1):
            handle.write(json.dumps({**record, "seq": seq}, separators=(",", ":")) + "\n")
            handle.write(json.dumps({"seq": seq, "group": "world", "end": 1.0}, separators=(",", ":")) + "\n")
    t0 = time.perf_counter()
    for _ in range(5):
        ledger.read_ledger(str(path))
    parts["read_ledger, per recorded collective per rank"] = (time.perf_counter() - t0) / 5 / entries
    os.close(recorder.fd)
    return parts


# ---------------------------------------------------------------------- report


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def fmt(seconds: float, unit: str) -> str:
    scale = {"s": 1, "ms": 1e3, "us": 1e6}[unit]
    value = seconds * scale
    return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"


class Table:
    """Rows of: measure, variant, n, median, p25 - p75, ratio to the measure's reference, goal, met?

    The ratio is the median of per-round ratios when the variant and its reference ran in the same
    interleaved rounds (a load that comes and goes then cancels out), else the ratio of medians (*).
    """

    def __init__(self):
        self.rows: list[list[str]] = []

    def measure(self, measure: str, unit: str, variants: list[tuple[str, list[float]]], *,
                ref: str | None = None, goals: dict | None = None) -> None:
        """goals: {variant: (goal text, check(median, ratio) -> bool)}."""
        by_name = dict(variants)
        for i, (name, xs) in enumerate(variants):
            q1, median, q3 = quantiles(xs)
            ratio, ratio_text = None, ""
            if name == ref:
                ratio_text = "ref"
            elif ref is not None:
                base = by_name[ref]
                if len(base) == len(xs):
                    ratio = statistics.median(x / b for x, b in zip(xs, base))
                    ratio_text = f"{ratio:.3f}"
                else:
                    ratio = median / statistics.median(base)
                    ratio_text = f"{ratio:.3f}*"
            goal_text, verdict = "", ""
            if goals and name in goals:
                goal_text, check_goal = goals[name]
                verdict = "yes" if check_goal(median, ratio) else "NO"
            self.rows.append([measure if i == 0 else "", name, str(len(xs)), fmt(median, unit),
                              f"{fmt(q1, unit)} - {fmt(q3, unit)}", ratio_text, goal_text, verdict])

    def print(self) -> None:
        head = ["measure", "variant", "n", "median", "p25 - p75", "ratio", "goal", "met?"]
        widths = [max(len(r[i]) for r in self.rows + [head]) for i in range(len(head))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        print(line(head))
        print(line(["-" * w for w in widths]))
        for r in self.rows:
            if r[0]:
                print()
            print(line(r))
        print("\nratio: median of per-round ratios to the measure's ref (same interleaved rounds); "
              "* = ratio of medians")


def print_profile(title: str, profile: cProfile.Profile, limit: int = 18) -> None:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).strip_dirs().sort_stats("cumulative").print_stats(limit)
    print(f"\n--- cProfile: {title}\n" + "\n".join(out.getvalue().splitlines()[4:]))


# ---------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--quick", action="store_true", help="fewer rounds (about 1.5 min)")
    speed.add_argument("--smoke", action="store_true", help="every part once: checks the script runs")
    parser.add_argument("--profile", action="store_true", help="also print cProfile tables")
    args = parser.parse_args()
    pick = 2 if args.smoke else 1 if args.quick else 0
    rounds = {k: v[pick] for k, v in ROUNDS.items()}
    rng = random.Random(0)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load_before = os.getloadavg()
    started = time.monotonic()
    print(f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.node()}: {os.cpu_count()} cores, "
          f"torch {torch.__version__}, Python {platform.python_version()}; load average {load_before[0]:.2f}",
          flush=True)

    kernels: dict[str, Kernel] = {}
    pools: dict[str, Pool] = {}
    samples: dict[str, list[float]] = {}
    table = Table()
    try:
        # ---- part 1 and 2: persistent ranks. One kernel / pool per variant, so each keeps its own ledger.
        print("starting 4 kernels and 4 pools ...", flush=True)
        # --smoke: the "4-rank" variants on 2 ranks; the same code runs, at half the start-up cost.
        four = 2 if args.smoke else 4
        # Started side by side (each mostly imports torch): the machine is idle again before any timing.
        with concurrent.futures.ThreadPoolExecutor(4) as starter:
            started_k = {name: starter.submit(start_kernel_pool, name, n, **kw) for name, n, kw in (
                ("k2", 2, {}), ("k4", four, {}), ("k2_on", 2, {}), ("k2_off", 2, {"ledger_on": False}))}
            started_p = {name: starter.submit(start_pool, n, **kw) for name, n, kw in (
                ("p2", 2, {}), ("p4", four, {}), ("p2_on", 2, {}), ("p2_off", 2, {"ledger_on": False}))}
            kernels.update({name: f.result() for name, f in started_k.items()})
            pools.update({name: f.result() for name, f in started_p.items()})
        k, p = kernels, pools
        dist_pass, dist_big = "%%dist\npass", "%%dist\ndist.all_reduce(big)"
        cell_variants = {
            "kernel: `pass` (no magic), 2": lambda: k["k2"].run("pass")[0],
            "kernel: %%dist pass, 2": lambda: k["k2"].run(dist_pass)[0],
            "kernel: %%dist pass, 4": lambda: k["k4"].run(dist_pass)[0],
            "Pool.run('pass'), 2": lambda: timed_pool_run(p["p2"], "pass"),
            "Pool.run('pass'), 4": lambda: timed_pool_run(p["p4"], "pass"),
            "kernel: 4 MiB, ledger ON": lambda: k["k2_on"].run(dist_big)[0],
            "kernel: 4 MiB, ledger OFF": lambda: k["k2_off"].run(dist_big)[0],
            "Pool.run: 4 MiB, ledger ON": lambda: timed_pool_run(p["p2_on"], "dist.all_reduce(big)"),
            "Pool.run: 4 MiB, ledger OFF": lambda: timed_pool_run(p["p2_off"], "dist.all_reduce(big)"),
        }
        interleave(cell_variants, WARM_UP[pick], rng, {})  # warm-up, not kept
        print(f"part 1-2: {rounds['cells']} rounds of {len(cell_variants)} cells ...", flush=True)
        interleave(cell_variants, rounds["cells"], rng, samples)
        entries_a = len(check(p["p2_on"].run("pass")).ledgers[0])

        # The %%dist magic alone, inside the kernel (no execute round trip, no iopub).
        magic_cell = ("import statistics, time\n_ip, _t = get_ipython(), []\nfor _ in range({n}):\n"
                      "    _s = time.perf_counter()\n    _ip.run_cell_magic('dist', '', 'pass')\n"
                      "    _t.append(time.perf_counter() - _s)\nprint('MAGIC', statistics.median(_t))\n")
        for name, kname in (("in-kernel run_cell_magic('dist'), 2", "k2"), ("in-kernel run_cell_magic('dist'), 4", "k4")):
            for _ in range(IN_KERNEL[pick]):
                out = k[kname].run(magic_cell.format(n=20))[1]
                samples.setdefault(name, []).append(float(out.rsplit("MAGIC", 1)[1]))

        # ---- part 2b: the ledger's cost per collective, timed inside the ranks.
        print(f"part 2b: {rounds['per_call']} rounds of in-rank timing ...", flush=True)

        def in_rank(pool, x, n):
            return lambda: check(pool.run(PER_CALL.format(x=x, n=n))).published["per_call_s"][0]

        interleave({
            "1 float, ledger ON": in_rank(p["p2_on"], "tiny", TINY_CALLS),
            "1 float, ledger OFF": in_rank(p["p2_off"], "tiny", TINY_CALLS),
            "4 MiB, ledger ON": in_rank(p["p2_on"], "big", BIG_CALLS),
            "4 MiB, ledger OFF": in_rank(p["p2_off"], "big", BIG_CALLS),
        }, rounds["per_call"], rng, samples)

        # ---- part 2c: a trivial cell once the ledger holds many entries (it is re-read after every cell).
        grow = GROW_CALLS[pick]
        print(f"part 2c: {grow} collectives recorded, then {rounds['grown']} rounds ...", flush=True)
        for name in ("k2_on", "k2_off"):
            k[name].run("%%dist\n" + GROW.format(n=grow))
        entries_k = k["k2_on"].run("import course_lib as cl\nprint(len(cl.ledgers[0]))")[1].strip()
        entries_p = len(check(p["p2_on"].run("pass")).ledgers[0])
        interleave({
            "kernel: %%dist pass, ledger ON (grown)": lambda: k["k2_on"].run(dist_pass)[0],
            "kernel: %%dist pass, ledger OFF (grown)": lambda: k["k2_off"].run(dist_pass)[0],
            "Pool.run('pass'), ledger ON (grown)": lambda: timed_pool_run(p["p2_on"], "pass"),
            "Pool.run('pass'), ledger OFF (grown)": lambda: timed_pool_run(p["p2_off"], "pass"),
        }, rounds["grown"], rng, samples)

        profiles = {}
        if args.profile:
            profiles["Pool.run('pass'), 2 ranks, ledger with %d entries" % entries_p] = cProfile.Profile()
            with profiles[next(iter(profiles))]:
                for _ in range(50):
                    p["p2_on"].run("pass")
            out = k["k2"].run("import cProfile, pstats, io\n_pr = cProfile.Profile()\n_pr.enable()\n"
                              "for _ in range(50):\n    get_ipython().run_cell_magic('dist', '', 'pass')\n"
                              "_pr.disable()\n_s = io.StringIO()\n"
                              "pstats.Stats(_pr, stream=_s).strip_dirs().sort_stats('cumulative').print_stats(18)\n"
                              "print('PROFILE' + _s.getvalue())")[1]
            kernel_profile = out.split("PROFILE", 1)[1]

        # ---- part 3: one-shot launches. Only one kernel left, no idle ranks around.
        for name in ("k4", "k2_on", "k2_off"):
            kernels.pop(name).close()
        for pool in pools.values():
            pool.stop()
        pools.clear()
        k["k2"].run("%dist stop")
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_cells_"))
        script = tmp / "script.py"
        script.write_text(ONE_SHOT)
        cpu: dict[str, list[float]] = {}
        steps: list[dict[str, float]] = []
        bare_agent: list[float] = []

        def bare():
            env = dict(os.environ, OMP_NUM_THREADS="1")
            cpu0, marks = children_cpu_s(), {}
            t0 = time.perf_counter()
            proc = subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(script)],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp)
            marks["popen_done"] = time.perf_counter()
            watch_exit(proc.pid, marks, "agent_exit")
            out = proc.communicate()[0]
            elapsed = time.perf_counter() - t0
            if proc.returncode != 0:
                raise RuntimeError(f"bare torchrun failed:\n{out.decode()[-2000:]}")
            cpu.setdefault("bare torchrun", []).append(children_cpu_s() - cpu0)
            bare_agent.append(wait_for_mark(marks, "agent_exit") - marks["popen_done"])
            return elapsed

        def library(profile: cProfile.Profile | None = None):
            splits = Splits()
            cpu0, self0 = children_cpu_s(), self_cpu_s()
            with splits.active():
                splits.marks["start"] = t0 = time.perf_counter()
                with profile or contextlib.nullcontext():
                    result = run_torchrun(ONE_SHOT, 2, timeout_s=120)
                splits.marks["end"] = time.perf_counter()
            splits.marks["self_cpu_s"] = self_cpu_s() - self0
            if not result.ok:
                raise RuntimeError(f"run_torchrun failed: {result.stderr}")
            cpu.setdefault("run_torchrun", []).append(children_cpu_s() - cpu0 + self_cpu_s() - self0)
            steps.append(splits.steps())
            return splits.marks["end"] - t0

        def kernel_oneshot():
            cpu0 = k["k2"].cpu_s()
            elapsed = k["k2"].run("%%torchrun -n 2\n" + ONE_SHOT)[0]
            cpu.setdefault("%%torchrun", []).append(k["k2"].cpu_s() - cpu0)
            return elapsed

        def kernel_call():
            return k["k2"].run(f"_r = cl.run_torchrun({ONE_SHOT!r}, 2)\nassert _r.ok, _r.stderr")[0]

        k["k2"].run("import course_lib as cl")
        oneshot = {"bare torchrun": bare, "run_torchrun (library)": library,
                   "kernel: cl.run_torchrun() (no magic)": kernel_call, "%%torchrun -n 2 (kernel)": kernel_oneshot}
        print(f"part 3: 1 warm-up + {rounds['oneshot']} rounds of 4 launches (~5 s each) ...", flush=True)
        interleave(oneshot, 0 if args.smoke else 1, rng, {})
        cpu.clear(), steps.clear(), bare_agent.clear()
        interleave(oneshot, rounds["oneshot"], rng, samples)
        if args.profile:
            profiles["run_torchrun (one launch, in this process)"] = cProfile.Profile()
            library(profiles["run_torchrun (one launch, in this process)"])
            cpu["run_torchrun"].pop(), steps.pop()  # profiled: not one of the measured launches
        parts = ledger_parts(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    finally:
        for kernel in kernels.values():
            kernel.close()
        for pool in pools.values():
            pool.stop()

    # ---- report
    s = samples
    at_most = lambda limit: lambda median, ratio: median <= limit  # noqa: E731
    ratio_at_most = lambda limit: lambda median, ratio: ratio <= limit  # noqa: E731
    rows = lambda *names: [(name, s[name]) for name in names]  # noqa: E731
    table.measure("trivial cell, 2 ranks", "ms", rows(
        "Pool.run('pass'), 2", "in-kernel run_cell_magic('dist'), 2", "kernel: `pass` (no magic), 2",
        "kernel: %%dist pass, 2"), ref="Pool.run('pass'), 2",
        goals={"kernel: %%dist pass, 2": ("<= 10 ms", at_most(GOAL_TRIVIAL_S))})
    table.measure("trivial cell, 4 ranks", "ms", rows(
        "Pool.run('pass'), 4", "in-kernel run_cell_magic('dist'), 4", "kernel: %%dist pass, 4"),
        ref="Pool.run('pass'), 4")
    table.measure(f"4 MiB all_reduce cell, 2 ranks, kernel (ON ledger: 0 -> {entries_a} entries)", "ms", rows(
        "kernel: 4 MiB, ledger OFF", "kernel: 4 MiB, ledger ON"), ref="kernel: 4 MiB, ledger OFF",
        goals={"kernel: 4 MiB, ledger ON": ("ON/OFF <= 1.05", ratio_at_most(GOAL_LEDGER_RATIO))})
    table.measure("4 MiB all_reduce cell, 2 ranks, Pool.run (same)", "ms", rows(
        "Pool.run: 4 MiB, ledger OFF", "Pool.run: 4 MiB, ledger ON"), ref="Pool.run: 4 MiB, ledger OFF",
        goals={"Pool.run: 4 MiB, ledger ON": ("ON/OFF <= 1.05", ratio_at_most(GOAL_LEDGER_RATIO))})
    table.measure("in-rank all_reduce, time per call, 2 ranks", "us", rows(
        "1 float, ledger OFF", "1 float, ledger ON"), ref="1 float, ledger OFF")
    table.measure("", "us", rows("4 MiB, ledger OFF", "4 MiB, ledger ON"), ref="4 MiB, ledger OFF",
                  goals={"4 MiB, ledger ON": ("ON/OFF <= 1.05", ratio_at_most(GOAL_LEDGER_RATIO))})
    table.measure(f"trivial cell once the ledger holds {entries_k} entries (kernel), {entries_p} (pool)", "ms", rows(
        "kernel: %%dist pass, ledger OFF (grown)", "kernel: %%dist pass, ledger ON (grown)"),
        ref="kernel: %%dist pass, ledger OFF (grown)",
        goals={"kernel: %%dist pass, ledger ON (grown)": ("<= 10 ms", at_most(GOAL_TRIVIAL_S))})
    table.measure("", "ms", rows("Pool.run('pass'), ledger OFF (grown)", "Pool.run('pass'), ledger ON (grown)"),
                  ref="Pool.run('pass'), ledger OFF (grown)")
    table.measure("one-shot 4 MiB all_reduce script, 2 ranks", "s", rows(*oneshot), ref="bare torchrun",
                  goals={"%%torchrun -n 2 (kernel)": ("<= 1.05x bare", ratio_at_most(GOAL_ONESHOT_RATIO))})
    table.measure("  CPU seconds per launch (whole tree)", "s", [
        ("bare torchrun", cpu["bare torchrun"]), ("run_torchrun (library)", cpu["run_torchrun"]),
        ("%%torchrun -n 2 (kernel)", cpu["%%torchrun"])], ref="bare torchrun")
    print()
    table.print()

    print("\nWhere run_torchrun's time goes (median of each step; bare torchrun's agent ran "
          f"{fmt(statistics.median(bare_agent), 'ms')} from Popen to exit):")
    for key in steps[0]:
        print(f"  {key:50} {fmt(statistics.median(st[key] for st in steps), 'ms'):>10}")
    longer = statistics.median(st["torchrun agent running"] - b for st, b in zip(steps, bare_agent))
    print(f"  {'agent running, run_torchrun - bare (same round)':50} {fmt(longer, 'ms'):>10}")
    print("\nThe ledger's parts, timed in this process (per call):")
    for key, value in parts.items():
        print(f"  {key:50} {fmt(value, 'us'):>10}")
    on, off = statistics.median(s["1 float, ledger ON"]), statistics.median(s["1 float, ledger OFF"])
    big_on, big_off = statistics.median(s["4 MiB, ledger ON"]), statistics.median(s["4 MiB, ledger OFF"])
    print(f"  in-rank difference ON - OFF: 1 float {fmt(on - off, 'us')}, 4 MiB {fmt(big_on - big_off, 'us')}")
    per_entry = parts["read_ledger, per recorded collective per rank"]
    print(f"  => every %%dist cell re-reads all ranks' ledgers: ~{fmt(per_entry * 2 * 1000, 'ms')} per cell "
          "per 1000 collectives recorded so far, at 2 ranks")
    if args.profile:
        for title, profile in profiles.items():
            print_profile(title, profile)
        print("\n--- cProfile: %%dist pass magic inside the kernel (50 cells), 2 ranks\n" + kernel_profile)
    load_after = os.getloadavg()
    print(f"\nload average: {load_before[0]:.2f} before, {load_after[0]:.2f} after (1-min); "
          f"wall {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
