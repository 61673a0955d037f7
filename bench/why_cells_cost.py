"""Where the cost of a cell goes: ablations behind bench_cells.py's findings.

    .venv/bin/python bench/why_cells_cost.py [--quick | --smoke] [ledger|oneshot]

Run it from the repository root (about 3 min, --quick about 1 min; --smoke runs
each variant once, for tests/test_bench.py). Nothing
in course_lib changes: variants are built in the ranks or patched in this
process only. Variants are interleaved, a new random order each round;
read medians and differences, not absolute numbers.

ledger:  time per 1-float all_reduce inside a rank, with the ledger's own
         wrapper (as installed, writing to a file), the same wrapper writing to
         /dev/null (the cost of the wrapper without the file), and a fast-path
         recorder (the record built with one bytes %-format per line, same two
         unbuffered writes) that shows what a cheaper wrapper could cost.
oneshot: run_torchrun against bare torchrun, and run_torchrun without its
         periodic ProcessTree.refresh (psutil scans of /proc) or without its
         watchdog process: wall seconds and CPU seconds of the whole launch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_cells import ONE_SHOT, TORCHRUN, check, children_cpu_s, self_cpu_s, start_pool  # noqa: E402

from course_lib.launcher import torchrun as torchrun_mod  # noqa: E402
from course_lib.launcher.processes import ProcessTree  # noqa: E402

RANK_SETUP = r'''
import os
from course_lib.rank import ledger as _ledger

_dir = os.environ["COURSE_RESULTS_DIR"]  # the pool's private folder, removed when the pool stops

plain = getattr(dist.all_reduce, "__wrapped__", dist.all_reduce)  # this pool runs with COURSE_LEDGER=0
as_installed = _ledger._Recorder(os.path.join(_dir, f"as_installed.{dist.get_rank()}")).wrap("all_reduce", plain)
to_devnull = _ledger._Recorder(os.devnull).wrap("all_reduce", plain)

_fd = os.open(os.path.join(_dir, f"fast_path.{dist.get_rank()}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
_seq = 0


def fast_path(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    # The same two JSON lines as the ledger (world group, one tensor), built without inspect or json.
    global _seq
    _seq += 1
    seq = _seq
    os.write(_fd, b'{"seq":%d,"op":"all_reduce","group":"world","shapes":[%s],"dtype":"%s","bytes":%d,'
                  b'"start":%.6f,"async":%s}\n' % (seq, str(list(tensor.shape)).encode(), str(tensor.dtype)[6:].encode(),
                                                  tensor.numel() * tensor.element_size(), time.monotonic(),
                                                  b"true" if async_op else b"false"))
    try:
        return plain(tensor, op, group, async_op)
    finally:
        os.write(_fd, b'{"seq":%d,"group":"world","end":%.6f}\n' % (seq, time.monotonic()))


def _per_call(fn, n):
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(tiny)
    return (time.perf_counter() - t0) / n
'''


def report(samples: dict[str, list[float]], ref: str, unit: float, unit_name: str, extra: dict | None = None) -> None:
    base = samples[ref]
    for name, xs in samples.items():
        diff = statistics.median(x - b for x, b in zip(xs, base))
        line = (f"  {name:28} median {statistics.median(xs) * unit:8.1f} {unit_name}   "
                f"minus {ref} (same round) {diff * unit:+8.1f} {unit_name}")
        if extra:
            line += f"   CPU {statistics.median(extra[name]):.2f} s ({statistics.median(c - b for c, b in zip(extra[name], extra[ref])) * 1e3:+.0f} ms)"
        print(line)


LEDGER_VARIANTS = ["plain", "as_installed", "to_devnull", "fast_path"]


def ledger_ablation(rounds: int, rng: random.Random, calls: int = 1000) -> None:
    pool = start_pool(2, ledger_on=False)
    try:
        check(pool.run(RANK_SETUP))
        names = list(LEDGER_VARIANTS)
        samples: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(rounds):
            rng.shuffle(names)
            for name in names:
                result = check(pool.run(f"cl.publish('t', _per_call({name}, {calls}))"))
                samples[name].append(result.published["t"][0])
        print(f"1-float all_reduce inside a rank, 2 ranks, time per call ({calls} calls per sample):")
        report({n: samples[n] for n in LEDGER_VARIANTS}, "plain", 1e6, "us")
    finally:
        pool.stop()


@contextlib.contextmanager
def without(*, refresh: bool = False, watchdog: bool = False):
    orig_refresh, orig_watchdog = ProcessTree.refresh, torchrun_mod._start_watchdog
    if refresh:
        ProcessTree.refresh = lambda self: None  # kill_all still finds every process by its launch mark
    if watchdog:
        torchrun_mod._start_watchdog = lambda *args: subprocess.Popen(["sleep", "600"])
    try:
        yield
    finally:
        ProcessTree.refresh, torchrun_mod._start_watchdog = orig_refresh, orig_watchdog


def oneshot_ablation(rounds: int, rng: random.Random, warm_up: bool = True) -> None:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="why_cells_"))
    script = tmp / "script.py"
    script.write_text(ONE_SHOT)

    def bare():
        proc = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(script)],
                              env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, cwd=tmp)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def library(**kwargs):
        def run():
            with without(**kwargs):
                assert torchrun_mod.run_torchrun(ONE_SHOT, 2).ok
        return run

    variants = {"bare torchrun": bare, "run_torchrun": library(), "without tree refresh": library(refresh=True),
                "without watchdog": library(watchdog=True), "without both": library(refresh=True, watchdog=True)}
    if not warm_up:  # --smoke: "without both" goes through both patches; the single ones add nothing to check
        del variants["without tree refresh"], variants["without watchdog"]
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for run in variants.values() if warm_up else ():
        run()  # warm-up
    for _ in range(rounds):
        names = list(variants)
        rng.shuffle(names)
        for name in names:
            cpu0, t0 = children_cpu_s() + self_cpu_s(), time.perf_counter()
            variants[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(children_cpu_s() + self_cpu_s() - cpu0)
    shutil.rmtree(tmp, ignore_errors=True)
    print("one-shot 4 MiB all_reduce script, 2 ranks, wall per launch; CPU = whole launch tree + this process:")
    report(wall, "bare torchrun", 1e3, "ms", extra=cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--quick", action="store_true")
    speed.add_argument("--smoke", action="store_true", help="each variant once: checks the script runs")
    parser.add_argument("parts", nargs="*", help="ledger, oneshot (default: both)")
    args = parser.parse_args()
    args.parts = args.parts or ["ledger", "oneshot"]
    if set(args.parts) - {"ledger", "oneshot"}:
        parser.error("parts are: ledger, oneshot")
    rng = random.Random(0)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    if "ledger" in args.parts:
        ledger_ablation(1 if args.smoke else 6 if args.quick else 20, rng, calls=10 if args.smoke else 1000)
    if "oneshot" in args.parts:
        oneshot_ablation(1 if args.smoke else 3 if args.quick else 8, rng, warm_up=not args.smoke)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
