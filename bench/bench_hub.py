"""A class on one machine: what launch/hub's JupyterHub costs per learner, to size a workshop machine.

    sudo .venv/bin/python bench/bench_hub.py [--rounds 3] [--smoke]

Run it as root (the hub makes a Unix user per learner) from the repository root, with the proxy
installed (`make install`). About 4 min on 2 cores (--smoke: every part once, about 2.5 min).
In ONE run, on one hub with three learners signed in:

1. The first 2-rank `%%torchrun` cell of a fresh kernel (ranks import torch: the cell a learner
   meets first and the most CPU a simple cell takes), one learner alone against three learners
   sending it at the same moment; the two alternate in a new random order each round. The ratio is
   per round: the three learners' median time / the lone learner's time. Also the CPU seconds the
   learner's processes used for the lone cell.
2. Memory per learner while lesson 02's and lesson 05's first 4-rank cells run (read from the
   notebooks), alone: every process of the learner's Unix user (their server, kernel, torchrun and
   its ranks), sampled every 0.1 s; the peak of the summed RSS (shared pages counted once per
   process: an upper bound) and of the summed PSS (shared pages split between the processes that
   map them: what the machine holds).

The sizing printed at the end: GiB per learner is the larger peak PSS; learners per core is
WAIT / (CPU seconds of the lone first cell), WAIT = --wait-s (default 15 s): k learners starting that
cell at the same moment on C cores need about k * cpu CPU seconds, done in k * cpu / C seconds at best;
that stays under WAIT while k / C <= WAIT / cpu. CPU seconds, unlike wall times, hardly depend on the
other load on the machine; the ratio of part 1 does (a machine already busy hides the extra learners).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import pwd
import random
import statistics
import sys
import tempfile
import threading
import time

import nbformat
import psutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launch" / "hub"))

from hub_client import Hub, Traversable, blocked_dirs, course_paths, proxy_command, remove_user  # noqa: E402

LEARNERS = ["benchhub-a", "benchhub-b", "benchhub-c"]
PASSWORD = "bench-a-closed-room"
FIRST_CELL = """%%torchrun -n 2
import torch, torch.distributed as dist
import course_lib as cl
cl.init()
t = torch.ones(1)
dist.all_reduce(t)
print(t.item())
dist.destroy_process_group()
"""


def lesson_cell(notebook: str) -> str:
    """The notebook's first `%%torchrun -n 4` cell, as the lesson has it."""
    for cell in nbformat.read(ROOT / "notebooks" / notebook, 4).cells:
        if cell.cell_type == "code" and cell.source.startswith("%%torchrun -n 4"):
            return cell.source
    raise SystemExit(f"bench_hub: no %%torchrun -n 4 cell in {notebook}")


def cpu_seconds(uid: int) -> float:
    """CPU seconds used so far by the living processes of `uid` and their reaped children."""
    total = 0.0
    for proc in psutil.process_iter(["uids", "cpu_times"]):
        if proc.info["uids"] and proc.info["uids"].real == uid and proc.info["cpu_times"]:
            times = proc.info["cpu_times"]
            total += times.user + times.system + times.children_user + times.children_system
    return total


class MemorySampler:
    """Peaks of the summed RSS and PSS of one user's processes, sampled every 0.1 s in a thread."""

    def __init__(self, uid: int):
        self.uid, self.peak_rss, self.peak_pss = uid, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            rss = pss = 0
            for proc in psutil.process_iter(["uids"]):
                if not (proc.info["uids"] and proc.info["uids"].real == self.uid):
                    continue
                try:
                    full = proc.memory_full_info()
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                rss, pss = rss + full.rss, pss + full.pss
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.stop.wait(0.1)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


async def first_cell(hub: Hub, name: str) -> tuple[float, float]:
    """Seconds the first 2-rank cell of a fresh kernel takes (the extension already loaded), and the CPU
    seconds the learner's processes used meanwhile (the kernel has reaped torchrun, which reaped its ranks)."""
    uid = pwd.getpwnam(name).pw_uid
    kernel = hub.new_kernel(name)
    try:
        await kernel.run("%load_ext course_lib")
        used, started = cpu_seconds(uid), time.monotonic()
        _, _, error = await kernel.run(FIRST_CELL)
        took, cpu = time.monotonic() - started, cpu_seconds(uid) - used
        if error:
            raise SystemExit(f"bench_hub: {name}'s first cell failed: {error}")
        return took, cpu
    finally:
        await kernel.close()
        kernel.shutdown()


async def together(hub: Hub) -> list[float]:
    return [took for took, _ in await asyncio.gather(*(first_cell(hub, name) for name in LEARNERS))]


async def memory_of(hub: Hub, uid: int, cell: str) -> tuple[int, int, float]:
    kernel = hub.new_kernel(LEARNERS[0])
    try:
        await kernel.run("%load_ext course_lib")
        started = time.monotonic()
        with MemorySampler(uid) as sampler:
            _, _, error = await kernel.run(cell)
        if error:
            raise SystemExit(f"bench_hub: the lesson's cell failed: {error}")
        return sampler.peak_rss, sampler.peak_pss, time.monotonic() - started
    finally:
        await kernel.close()
        kernel.shutdown()


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="every part once (numbers mean little)")
    parser.add_argument("--wait-s", type=float, default=15.0,
                        help="the longest a first cell may take when every learner starts it at once (sizing)")
    args = parser.parse_args()
    rounds = 1 if args.smoke else args.rounds
    if os.geteuid() != 0:
        raise SystemExit("bench_hub: run it as root: the hub makes a Unix user per learner")
    if proxy_command() is None:
        raise SystemExit("bench_hub: no configurable-http-proxy: `make install` installs it with npm")
    load = os.getloadavg()[0]
    print(f"bench_hub: {os.cpu_count()} cores, {gib(psutil.virtual_memory().total)}, load {load:.1f} at the start")

    for name in LEARNERS:
        remove_user(name)
    hub = Hub(pathlib.Path(tempfile.mkdtemp(prefix="bench_hub_")), PASSWORD)
    with Traversable(blocked_dirs(course_paths())):
        try:
            hub.start()
            for name in LEARNERS:
                assert hub.sign_in(name), hub.log()[-2000:]
                hub.start_server(name)
            for name in LEARNERS:
                hub.wait_ready(name)
            uid = pwd.getpwnam(LEARNERS[0]).pw_uid

            lone, lone_cpu, ratios, crowd = [], [], [], []
            for _ in range(rounds):
                for part in random.sample(["alone", "together"], 2):
                    if part == "alone":
                        took, cpu = asyncio.run(first_cell(hub, LEARNERS[0]))
                        lone.append(took)
                        lone_cpu.append(cpu)
                    else:
                        crowd.append(asyncio.run(together(hub)))
                ratios.append(statistics.median(crowd[-1]) / lone[-1])
            print("\n1. first 2-rank %%torchrun cell of a fresh kernel (s)")
            for i in range(rounds):
                print(f"   round {i + 1}: alone {lone[i]:.1f} (CPU {lone_cpu[i]:.1f}); three at once "
                      + ", ".join(f"{t:.1f}" for t in crowd[i]) + f"; ratio {ratios[i]:.2f}")
            ratio, wall, cpu = statistics.median(ratios), statistics.median(lone), statistics.median(lone_cpu)
            print(f"   median ratio, three learners at once / one alone: {ratio:.2f}")

            print("\n2. memory of one learner (server + kernel + torchrun + ranks), peak while the cell runs")
            peaks = {}
            for notebook in ("02_ddp.ipynb", "05_fsdp2.ipynb"):
                rss, pss, took = asyncio.run(memory_of(hub, uid, lesson_cell(notebook)))
                peaks[notebook] = pss
                print(f"   {notebook} first 4-rank cell: RSS sum {gib(rss)}, PSS sum {gib(pss)} ({took:.1f} s)")

            per_learner = max(peaks.values())
            print(f"\nsizing: {per_learner / (1 << 30):.2f} GiB per learner (the larger peak PSS); "
                  f"{args.wait_s / cpu:.1f} learners per core ({args.wait_s:g} s / {cpu:.1f} CPU s of a first cell; "
                  f"alone it took {wall:.1f} s)")
            print(f"load {os.getloadavg()[0]:.1f} at the end")
            for name in LEARNERS:
                hub.stop_server(name)
        finally:
            hub.stop()
            for name in LEARNERS:
                remove_user(name)


if __name__ == "__main__":
    main()
