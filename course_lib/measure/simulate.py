"""Scale by simulation: FSDP2's per-rank memory and per-step traffic for real Llama sizes, on no hardware.

`simulate_fsdp2("llama-70b", world_size=1024)` starts a fresh
`python -m course_lib.measure.simulate_worker` that joins torch's *fake* process
group as one rank of 1024 (FakeProcessGroup: every collective returns at once,
nothing is sent), builds the model on the meta device (shapes, no storage),
applies `fully_shard` to each decoder layer then the root as a real run does,
and reads each parameter's local shard (`DTensor.to_local()`): exact per-rank
bytes, padding included. The first simulated rank then runs one training
step under FakeTensorMode (tensors with shapes and dtypes, no memory): FSDP2
issues its real all-gathers (forward, and the backward re-gather) and
reduce-scatters (gradients), which the collective ledger records with their
input bytes as on a real rank, and the optimizer creates its state, whose
local bytes are read.

Never in the kernel: a fake *default* process group would make later cells
"communicate" with nobody. Fresh subprocesses (two on a 2-core machine) share
the configurations of a call: each imports torch and transformers once and
re-creates the fake group for every rank it simulates. Activations are not
simulated: they depend on the batch, not on FSDP. The results say
"simulated" in their label and their table rows; `course_lib.draw.simulation`
draws them under a SIMULATED title.

Checked against reality in tests/test_simulate.py: the same helpers
(`shard_llama`, `memory_of`, `make_optimizer`) run a tiny Llama with padded
shards on 2 and 4 real gloo ranks, and every byte agrees, the real ranks'
ledgers included.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from ..vocabulary import DEFAULT_PRECISION, OPTIMIZERS, PRECISIONS, data_flow
from . import simulate_worker
from .simulate_worker import ENV_PROGRESS_FILE, RESULT_MARK

# (configurations done, configurations in all, the one just done, e.g. "llama-7b on 8 ranks")
ProgressCallback = Callable[[int, int, str], None]

__all__ = [
    "GPU_BYTES", "LABEL", "LLAMA_CONFIGS", "SimulationError", "SimulationResult", "result_rows", "simulate_fsdp2",
    "simulate_many", "simulate_table",
]

LABEL = "simulated (fake process group, meta tensors): no real memory or network used"

# Llama-2 sizes, named as theory.llama_param_count's arguments (untied embeddings).
LLAMA_CONFIGS: dict[str, dict[str, int]] = {
    "llama-7b": dict(hidden=4096, layers=32, vocab=32000, intermediate=11008, heads=32, kv_heads=32),
    "llama-70b": dict(hidden=8192, layers=80, vocab=32000, intermediate=28672, heads=64, kv_heads=8),
}
GPU_BYTES = 80e9  # one H100's memory, the reference line of the figure


class SimulationError(RuntimeError):
    """The simulation subprocess failed or ran past its deadline; the message is one line."""


@dataclasses.dataclass
class SimulationResult:
    """Per-rank bytes of one configuration, and the collectives of one training step (same on every rank)."""

    label: str
    model: str
    config: dict
    world_size: int
    precision: str
    optimizer: str
    num_params: int
    param_bytes: dict[int, int]  # rank -> bytes of its local parameter shards
    grad_bytes: dict[int, int]
    optimizer_bytes: dict[int, int]  # per-element state (Adam: exp_avg, exp_avg_sq); scalar `step` counters left out
    stepped_ranks: list[int]  # ranks that ran the fake step; the others' grads/state follow their shard shapes
    collectives: list[tuple[str, int]]  # (op, input bytes) in call order, as the ledger records them (canonical names)
    elapsed_s: float  # wall time of this configuration in the subprocess
    cpu_s: float = 0.0  # its CPU time (on a busy machine, the steadier number)

    def total_bytes(self, rank: int) -> int:
        return self.param_bytes[rank] + self.grad_bytes[rank] + self.optimizer_bytes[rank]

    def _input_bytes(self, flow: str) -> int:
        return sum(nbytes for op, nbytes in self.collectives if data_flow(op) == flow)

    @property
    def all_gather_bytes(self) -> int:
        """Input bytes of this rank's all-gathers per step (forward + backward re-gather), as a ledger counts."""
        return self._input_bytes("all_gather")

    @property
    def reduce_scatter_bytes(self) -> int:
        """Input bytes of this rank's reduce-scatters per step (full-size gradients in, a shard out)."""
        return self._input_bytes("reduce_scatter")

    @property
    def sent_bytes(self) -> int:
        """Bytes each rank sends per step on a ring: (N-1)/N of each all-gather's output and reduce-scatter's input.

        An all-gather's output is its input (this rank's padded shard) from each of the N ranks.
        """
        from ..theory import ring_all_gather_bytes, ring_reduce_scatter_bytes

        n, sent = self.world_size, 0.0
        for op, nbytes in self.collectives:
            if data_flow(op) == "all_gather":
                sent += ring_all_gather_bytes(nbytes * n, n)
            elif data_flow(op) == "reduce_scatter":
                sent += ring_reduce_scatter_bytes(nbytes, n)
            else:  # FSDP2's step issues only these two
                raise ValueError(f"sent_bytes: no ring formula here for {op}")
        return round(sent)


def _job(config: dict | str, world_size: int, ranks, precision: str, optimizer: str, step_every_rank: bool) -> dict:
    name, config = (config, LLAMA_CONFIGS[config]) if isinstance(config, str) else ("custom", dict(config))
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    if precision not in PRECISIONS or optimizer not in OPTIMIZERS:
        raise ValueError(f"precision must be one of {PRECISIONS} and optimizer one of {OPTIMIZERS}")
    wanted = range(world_size) if ranks == "all" else ranks
    ranks = list(dict.fromkeys(r % world_size for r in wanted))  # -1 is the last rank; each rank once
    return dict(model=name, config=config, world_size=world_size, ranks=ranks, precision=precision,
                optimizer=optimizer, step_every_rank=step_every_rank)


def _worker_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               OMP_NUM_THREADS="1")  # fake tensors compute nothing: no thread pool to start
    package_parent = str(pathlib.Path(__file__).resolve().parents[2])  # this course_lib, installed or not
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p)
    return env


def _one_line_error(returncode: int, stderr: str) -> str:
    # The last line of a traceback names the exception; torch prefixes a fake rank's lines with "[rankN]: ".
    errors = [line.split("]: ", 1)[-1] for line in stderr.splitlines() if line.strip()]
    return f"simulation failed (exit {returncode}): {errors[-1] if errors else 'no output'}"


def _follow_progress(procs: list, progress_files: list[pathlib.Path], total: int, timeout_s: float,
                     on_progress: ProgressCallback | None) -> bool:
    """Until every worker has exited, call `on_progress` once per job a worker finishes; False (and return at
    once) when `timeout_s` pass without one finishing: a loaded machine's slow run keeps going, a hang stops."""
    seen = [0] * len(progress_files)  # lines already reported, per worker
    deadline = time.monotonic() + timeout_s
    while True:
        running = any(proc.poll() is None for proc, _, _ in procs)
        for index, path in enumerate(progress_files):
            lines = [line for line in (path.read_text().splitlines() if path.exists() else [])
                     if line.endswith("}")]  # a line being written is not counted yet
            for line in lines[seen[index]:]:
                seen[index] += 1
                deadline = time.monotonic() + timeout_s
                if on_progress is not None:
                    job = json.loads(line)
                    on_progress(sum(seen), total, f"{job['model']} on {job['world_size']} ranks")
        if not running:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)


def _run_workers(batches: list[list[dict]], timeout_s: float,
                 on_progress: ProgressCallback | None = None) -> list[list[dict]]:
    """Each batch in its own fresh `python -m course_lib.measure.simulate_worker`, all at once.

    Any failure, `timeout_s` without a job finishing, or a Ctrl-C stops every worker; a failure becomes a
    one-line error.
    `on_progress(done, total, what)` is called as each job ends, in the order they end.
    """
    procs, files = [], []
    progress_dir = tempfile.TemporaryDirectory(prefix="course-simulation-progress-")
    progress_files = [pathlib.Path(progress_dir.name, f"worker{i}.jsonl") for i in range(len(batches))]
    try:
        for batch, progress_file in zip(batches, progress_files):
            stdin, stdout, stderr = (tempfile.TemporaryFile("w+") for _ in range(3))  # files: no pipe to fill
            files += [stdin, stdout, stderr]
            json.dump(batch, stdin)
            stdin.seek(0)
            env = _worker_env() | {ENV_PROGRESS_FILE: str(progress_file)}
            procs.append((subprocess.Popen([sys.executable, "-m", simulate_worker.__name__], stdin=stdin,
                                           stdout=stdout, stderr=stderr, env=env, text=True),
                          stdout, stderr))
        if not _follow_progress(procs, progress_files, sum(len(b) for b in batches), timeout_s, on_progress):
            raise SimulationError(f"no configuration finished within {timeout_s:g} s (stopped)")
        outputs = []
        for proc, stdout, stderr in procs:  # every worker has exited
            stdout.seek(0)
            stderr.seek(0)
            lines = [line for line in stdout.read().splitlines() if line.startswith(RESULT_MARK)]
            if proc.returncode != 0 or not lines:
                raise SimulationError(_one_line_error(proc.returncode, stderr.read()))
            outputs.append(json.loads(lines[-1][len(RESULT_MARK):]))
        return outputs
    finally:
        for proc, _, _ in procs:  # nothing left running, whatever happened
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for handle in files:
            handle.close()
        progress_dir.cleanup()


def _layers(config: dict) -> int:
    return config.get("layers", config.get("num_hidden_layers", 32))


def simulate_many(jobs: list[dict], *, processes: int | None = None, timeout_s: float = 120.0,
                  on_progress: ProgressCallback | None = None) -> list[SimulationResult]:
    """Several configurations, shared among `processes` fresh subprocesses (default: 2 where 2 cores are).

    `on_progress(done, total, what)` is called as each configuration ends (simulate_table prints a line).

    Each job is a dict of `simulate_fsdp2`'s arguments. A worker imports torch and transformers once
    (about 5 s) and then runs its jobs one after the other; the fake step costs about the number of
    decoder layers, so jobs go, longest first, to the worker with the least work so far.
    """
    specs = [_job(j["config"], j["world_size"], j.get("ranks", (0, -1)), j.get("precision", DEFAULT_PRECISION),
                  j.get("optimizer", "adam"), j.get("step_every_rank", False)) for j in jobs]
    processes = max(1, min(processes or min(2, os.cpu_count() or 1), len(specs)))
    batches: list[list[int]] = [[] for _ in range(processes)]
    for index in sorted(range(len(specs)), key=lambda i: -_layers(specs[i]["config"])):
        min(batches, key=lambda b: sum(_layers(specs[i]["config"]) for i in b)).append(index)
    outputs: dict[int, dict] = {}
    for batch, outs in zip(batches, _run_workers([[specs[i] for i in b] for b in batches], timeout_s, on_progress)):
        outputs.update(zip(batch, outs))
    results = []
    for index, spec in enumerate(specs):
        out = outputs[index]
        per_rank = {key: {int(r): v for r, v in out[key].items()}  # JSON made the ranks strings
                    for key in ("param_bytes", "grad_bytes", "optimizer_bytes")}
        results.append(SimulationResult(
            label=LABEL, model=spec["model"], config=spec["config"], world_size=spec["world_size"],
            precision=spec["precision"], optimizer=spec["optimizer"], num_params=out["num_params"], **per_rank,
            stepped_ranks=out["stepped_ranks"], collectives=[tuple(c) for c in out["collectives"]],
            elapsed_s=out["elapsed_s"], cpu_s=out["cpu_s"]))
    return results


def simulate_fsdp2(config: dict | str, *, world_size: int, ranks=(0, -1), precision: str = DEFAULT_PRECISION,
                   optimizer: str = "adam", step_every_rank: bool = False,
                   timeout_s: float = 120.0) -> SimulationResult:
    """Simulate FSDP2 (`fully_shard` per decoder layer, then the root) of a Llama `config` at `world_size`.

    `config`: a name in LLAMA_CONFIGS or a dict (hidden, layers, vocab, intermediate, heads, kv_heads, or
    LlamaConfig's own names). `ranks`: indices (-1 is the last rank, where the padding lands) or "all".
    `precision`: `vocabulary.DEFAULT_PRECISION` ("bf16-mixed"), as `theory` and `memory_explorer`
    default to: bf16 all-gathers, fp32 reduce-scatters (`shard_llama`); 16 bytes of model state per
    parameter with Adam, as ZeRO counts, but held as fp32 shards (4, the master weights), fp32
    gradient shards (4) and Adam's states (8) where ZeRO counts 2 + 2 + 12.
    The first of them runs a fake training step (collectives, gradients, optimizer state); the others
    only shard, their gradients and state sized like their shards, unless `step_every_rank`.
    """
    job = dict(config=config, world_size=world_size, ranks=ranks, precision=precision, optimizer=optimizer,
               step_every_rank=step_every_rank)
    return simulate_many([job], processes=1, timeout_s=timeout_s)[0]


def result_rows(result: SimulationResult) -> list[dict]:
    """One plain row per simulated rank: bytes of params, grads, optimizer state, and per-step traffic."""
    return [dict(model=result.model, world_size=result.world_size, rank=rank, precision=result.precision,
                 optimizer=result.optimizer, num_params=result.num_params, param_bytes=result.param_bytes[rank],
                 grad_bytes=result.grad_bytes[rank], optimizer_bytes=result.optimizer_bytes[rank],
                 total_bytes=result.total_bytes(rank), all_gather_bytes=result.all_gather_bytes,
                 reduce_scatter_bytes=result.reduce_scatter_bytes, sent_bytes=result.sent_bytes, simulated=True)
            for rank in sorted(result.param_bytes)]


def simulate_table(models=("llama-7b", "llama-70b"), world_sizes=(8, 64, 1024), *, ranks=(0, -1),
                   precision: str = DEFAULT_PRECISION, optimizer: str = "adam", processes: int | None = None,
                   timeout_s: float = 120.0) -> list[dict]:
    """Rows of `result_rows` for every model at every world size (see `simulate_many`)."""
    jobs = [dict(config=model, world_size=n, ranks=ranks, precision=precision, optimizer=optimizer)
            for model in models for n in world_sizes]
    # The cell shows nothing else until the table: say what runs and for about how long (bench/bench_simulate.py).
    print(f"simulating {len(jobs)} configurations, each in a process of its own: about a minute on 2 cores ...",
          flush=True)
    started = time.monotonic()

    def show(done: int, total: int, what: str) -> None:
        # A line per configuration as it ends (which ends first varies: nbval's sanitizer drops these lines).
        print(f"simulated {done}/{total}: {what} ({time.monotonic() - started:.0f} s)", flush=True)

    results = simulate_many(jobs, processes=processes, timeout_s=timeout_s, on_progress=show)
    return [row for result in results for row in result_rows(result)]
