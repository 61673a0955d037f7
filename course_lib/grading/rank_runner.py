"""One rank of a check run: load the learner's cell, call its function on this rank's cases.

The checker (checker.py) launches `main(job_dir)` on every rank with real
torchrun (gloo). Order matters, because from step 5 on the learner's code
shares this process:

1. read this rank's inputs and delete the file;
2. start the process group;
3. barrier: no rank goes on before every rank has deleted its inputs (so the
   learner's code cannot read another rank's inputs instead of communicating);
4. resource limits (CPU seconds, memory, bytes written to any file, which
   also caps output: a rank that prints megabytes is stopped by SIGXFSZ);
5. block the torch.distributed calls the exercise does not allow;
6. run the cell, find the function, call it through the exercise's driver per
   case, timing each case so the checker can split the ledger by case;
7. write the outputs with torch.save (atomically) for the checker, which loads
   them with weights_only=True.

Expected values never come here: the checker computes them in its own process.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import types

__all__ = ["main", "EXIT_NO_FUNCTION"]

EXIT_NO_FUNCTION = 3  # the cell ran but defines no function of the expected name


def _limit(kind: int, value: int) -> None:
    """Set soft and hard limit: an unprivileged process cannot raise a hard limit again."""
    soft, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


def _apply_limits(job: dict) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used_cpu = int(usage.ru_utime + usage.ru_stime) + 1
    _limit(resource.RLIMIT_CPU, used_cpu + int(job["cpu_s"]))
    # Memory a rank really uses (RLIMIT_DATA: heap and private writable mappings), not its address
    # space: a CUDA build of torch reserves tens of GiB it never touches (PROT_NONE), and under
    # RLIMIT_AS every rank died before the learner's code ran.
    _limit(resource.RLIMIT_DATA, int(job["memory_bytes"]))
    _limit(resource.RLIMIT_FSIZE, int(job["file_bytes"]))


def _block_ops(exercise_id: str, allowed: list[str]) -> None:
    """Replace each torch.distributed call the exercise does not allow by one that says so.

    Covers `dist.*`, `distributed_c10d.*` and the C++ group methods behind them
    (`vocabulary.PROCESS_GROUP_METHODS`: a learner could call those directly), except
    the methods an allowed call needs; not torch.ops.c10d.* (dispatcher ops), which
    the checker's ledger rules catch instead (checker.py).
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch._C import _distributed_c10d as cpp

    from ..vocabulary import PROCESS_GROUP_METHODS, RECORDED_OPS, process_group_methods

    allowed_text = ", ".join(allowed)

    def refusal(name: str):
        def refused(*args, **kwargs):
            raise RuntimeError(f"{exercise_id} may use only {allowed_text}: {name} is not allowed here")

        return refused

    for name in RECORDED_OPS:
        if name not in allowed:
            setattr(c10d, name, refusal(f"dist.{name}"))
            if hasattr(dist, name):
                setattr(dist, name, refusal(f"dist.{name}"))
    needed = {method for name in allowed for method in process_group_methods(name)}
    for cls in (cpp.ProcessGroup, cpp.Backend):
        for method in (m for methods in PROCESS_GROUP_METHODS.values() for m in methods):
            if method not in needed and hasattr(cls, method):
                setattr(cls, method, refusal(f"ProcessGroup.{method}"))


def _load_function(path: str, function: str, exercise_id: str):
    with open(path) as handle:
        source = handle.read()
    module = types.ModuleType("submission")
    module.__file__ = "<cell>"
    sys.modules["submission"] = module
    exec(compile(source, "<cell>", "exec"), module.__dict__)
    fn = module.__dict__.get(function)
    if not callable(fn):
        print(f"{exercise_id}: the cell defines no function named {function}", file=sys.stderr, flush=True)
        sys.exit(EXIT_NO_FUNCTION)
    return fn


def main(job_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from .. import rank as rank_env
    from .drivers import DRIVERS

    with open(os.path.join(job_dir, "job.json")) as handle:
        job = json.load(handle)
    rank = int(os.environ["RANK"])
    inputs_path = os.path.join(job_dir, f"inputs.rank{rank}.pt")
    cases = torch.load(inputs_path, weights_only=True)
    os.unlink(inputs_path)

    rank_env.init(timeout_s=float(job["timeout_s"]))
    dist.barrier()
    _apply_limits(job)
    if job["allowed_ops"] is not None:
        _block_ops(job["exercise"], job["allowed_ops"])

    fn = _load_function(os.path.join(job_dir, "submission.py"), job["function"], job["exercise"])
    driver = DRIVERS[job["driver"]]
    outputs, spans = [], []
    for args in cases:
        started = time.monotonic()
        outputs.append(driver(fn, *args))
        spans.append((started, time.monotonic()))

    final = os.path.join(job_dir, f"outputs.rank{rank}.pt")
    torch.save({"outputs": outputs, "spans": spans}, final + ".tmp")
    os.replace(final + ".tmp", final)
    if dist.is_initialized():
        dist.destroy_process_group()
