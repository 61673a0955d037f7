"""How long the scale-by-simulation table takes: Llama-2 7B and 70B under FSDP2 at 8, 64 and 1024 ranks.

    .venv/bin/python bench/bench_simulate.py [--repeat 1] [--processes 1 2] [--smoke]

Run it from the repository root. Goal (issue 5): the whole 2 x 3 table in
<= 60 s on 2 cores, wall clock, as `cl.simulate_table()` costs it in a
notebook: fresh subprocesses (2 by default on 2 cores; `--processes 1 2`
times both), each importing torch + transformers once, then per configuration
rank 0 with a fake training step and the last rank sharded only. Prints the total, each configuration's share, and the per-rank memory
it found, so a slow run can be told from a wrong one.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from course_lib.measure.simulate import LLAMA_CONFIGS, simulate_many  # noqa: E402
from course_lib.units import decimal_bytes  # noqa: E402

WORLD_SIZES = (8, 64, 1024)
# --smoke: the same path on a Llama small enough to take seconds (tests/test_bench.py runs it).
SMOKE_CONFIG = dict(hidden=16, layers=1, vocab=32, intermediate=24, heads=2, kv_heads=1)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="how many times to run the whole table")
    parser.add_argument("--processes", type=int, nargs="*", default=[None],
                        help="worker processes to time (default: the library's choice)")
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama at 2 and 4 ranks: checks the script runs")
    args = parser.parse_args()
    if args.smoke:
        jobs = [dict(config=SMOKE_CONFIG, world_size=n, ranks=(0, -1)) for n in (2, 4)]
    else:
        jobs = [dict(config=model, world_size=n, ranks=(0, -1)) for model in LLAMA_CONFIGS for n in WORLD_SIZES]
    for run, processes in ((run, p) for run in range(args.repeat) for p in args.processes):
        started, children = time.perf_counter(), _children_cpu_s()
        results = simulate_many(jobs, processes=processes, timeout_s=600)
        total, cpu = time.perf_counter() - started, _children_cpu_s() - children
        print(f"run {run + 1}, processes={processes or 'default'}: {total:.1f} s wall, {cpu:.1f} s CPU "
              f"(all workers) for {len(jobs)} configurations; load average now {os.getloadavg()[0]:.1f}")
        for r in results:
            memory = ", ".join(f"rank {rank}: {decimal_bytes(r.total_bytes(rank), significant=4)}"
                               for rank in r.param_bytes)
            print(f"  {r.model:10s} N={r.world_size:5d}  {r.elapsed_s:5.1f} s wall {r.cpu_s:5.1f} s CPU  {memory}  "
                  f"{len(r.collectives)} collectives/step")
    print("goal: <= 60 s wall for the table on an otherwise idle 2-core machine (CPU time is the steadier number)")


if __name__ == "__main__":
    main()
