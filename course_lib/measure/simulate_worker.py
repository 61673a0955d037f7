"""What runs where FSDP2 runs: the Llama sharding and memory helpers, and the simulation worker.

`shard_llama`, `memory_of` and `make_optimizer` run unchanged on real gloo
ranks (tests/test_simulate.py) and inside `python -m
course_lib.measure.simulate_worker`, where each configuration joins torch's fake
process group (FakeProcessGroup: a collective returns at once and sends
nothing) as one rank of `world_size`, builds the model on the meta device,
shards it with `fully_shard`, and runs one training step under
FakeTensorMode (shapes and dtypes, no memory). The step's collectives are
recorded by the collective ledger (rank/ledger.py), the recorder every real
rank runs. Same code on both sides is why the simulated bytes can be trusted.
Kept out of the notebook kernel on purpose: a fake *default* process group
must never leak into it, nor the ledger's wrapping of torch.distributed.

    echo '[{"model": "llama-7b", "config": {...}, "world_size": 8, "ranks": [0, 7], "precision": "bf16-mixed",
            "optimizer": "adam", "step_every_rank": false}]' | python -m course_lib.measure.simulate_worker
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

from ..rank import ledger
from ..vocabulary import DEFAULT_PRECISION, LOW_PRECISION_DTYPES, OPTIMIZERS, canonical_op

__all__ = ["llama_config", "make_optimizer", "memory_of", "shard_llama"]

_HF_NAMES = {"hidden": "hidden_size", "layers": "num_hidden_layers", "vocab": "vocab_size",
             "intermediate": "intermediate_size", "heads": "num_attention_heads",
             "kv_heads": "num_key_value_heads", "tied_embeddings": "tie_word_embeddings"}
RESULT_MARK = "COURSE_SIMULATION_RESULT "
# A file the worker appends one line to as each job ends, for the caller's progress line (simulate.py).
ENV_PROGRESS_FILE = "COURSE_SIMULATION_PROGRESS_FILE"
_STEP_TOKENS = 8  # the fake batch: 1 sequence of 8 tokens (activations are not what is measured)


def llama_config(config: dict) -> Any:
    """A `transformers.LlamaConfig` from short names (hidden, layers, ...) or LlamaConfig's own."""
    from transformers import LlamaConfig

    return LlamaConfig(**{_HF_NAMES.get(key, key): value for key, value in config.items()})


def shard_llama(model: Any, mesh: Any, *, precision: str = DEFAULT_PRECISION) -> Any:
    """`fully_shard` each decoder layer, then the root (embeddings, final norm, lm_head): torchtitan's order."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh}
    if precision in LOW_PRECISION_DTYPES:
        # torchtitan's default: compute and all-gather in 16 bits, reduce gradients in fp32.
        # The sharded parameters stay fp32: they are the master weights.
        low = getattr(torch, LOW_PRECISION_DTYPES[precision])
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def make_optimizer(params: Any, optimizer: str) -> Any:
    """The torch optimizer behind a name in `vocabulary.OPTIMIZERS` (lr 1e-3; momentum 0.9)."""
    import torch

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, not {optimizer!r}")
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if optimizer == "sgd-momentum" else 0.0)


def _local(tensor: Any) -> Any:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _nbytes(tensor: Any) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def _state_tensors(optimizer: Any, param: Any) -> list:
    """The per-element state of `param`: DTensors sharded like it (Adam's scalar `step` is a plain tensor)."""
    state = optimizer.state.get(param, {}) if optimizer is not None else {}
    return [value for value in state.values() if hasattr(value, "to_local")]


def memory_of(model: Any, optimizer: Any = None) -> dict[str, int]:
    """This rank's bytes of local parameter shards, gradient shards and optimizer state: plain ints."""
    params = list(model.parameters())
    return {
        "params": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_nbytes(s) for p in params for s in _state_tensors(optimizer, p)),
    }


# --- the worker process ------------------------------------------------------------------------


def _simulate_rank(job: dict, rank: int, step: bool, recorded: ledger.LedgerReader) -> dict:
    """One rank of one configuration, in this (throw-away) process: fake group, meta model, fully_shard.

    `recorded`: the reader of this process's ledger; the step's collectives are its new entries.
    """
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaForCausalLM

    world_size = job["world_size"]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_config(job["config"]))
        out = {"num_params": sum(p.numel() for p in model.parameters())}
        shard_llama(model, mesh, precision=job["precision"])
        out["params"] = memory_of(model)["params"]  # meta shards know their shape and dtype
        out["numels"] = {name: _local(p).numel() for name, p in model.named_parameters()}
        if not step:
            return out
        # Fake tensors from here: FSDP's real code runs and allocates nothing. (Non-fake inputs
        # allowed: to_empty reads the meta shards, which are real meta tensors, not fake ones.)
        before = len(recorded.read())
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            optimizer = make_optimizer(model.parameters(), job["optimizer"])
            input_ids = torch.zeros(1, _STEP_TOKENS, dtype=torch.long)
            model(input_ids=input_ids, labels=input_ids).loss.backward()
            optimizer.step()
        # The ledger records input bytes; an all-gather's output is world_size times its input.
        calls = [(canonical_op(e["op"]), e["bytes"]) for e in recorded.read()[before:]]
        per_param = {}
        for name, p in model.named_parameters():
            states = _state_tensors(optimizer, p)
            numel = _local(p).numel()
            # Gradients and state are sharded exactly like their parameter: the other ranks' rest on this.
            if _local(p.grad).numel() != numel or any(_local(s).numel() != numel for s in states):
                raise RuntimeError(f"{name}: gradient or optimizer state not sharded like the parameter")
            per_param[name] = (_local(p.grad).element_size(), sum(_local(s).element_size() for s in states))
        return out | memory_of(model, optimizer) | {"per_param": per_param, "collectives": calls}
    finally:
        dist.destroy_process_group()


def _simulate_job(job: dict, recorded: ledger.LedgerReader) -> dict:
    started, cpu_started = time.perf_counter(), time.process_time()
    result = {"param_bytes": {}, "grad_bytes": {}, "optimizer_bytes": {}, "stepped_ranks": []}
    stepped = None
    for rank in job["ranks"]:
        step = stepped is None or job["step_every_rank"]
        one = _simulate_rank(job, rank, step, recorded)
        if step:
            # FSDP pads every shard to one size, so every rank issues the same collectives.
            if stepped is not None and one["collectives"] != stepped["collectives"]:
                raise RuntimeError(f"rank {rank} issued other collectives than rank {result['stepped_ranks'][0]}")
            stepped = one
            result["stepped_ranks"].append(rank)
            result["collectives"] = one["collectives"]
            grads, state = one["grads"], one["optimizer"]
        else:  # local numels from this rank's own fully_shard, element sizes from the stepped rank
            grads = sum(n * stepped["per_param"][name][0] for name, n in one["numels"].items())
            state = sum(n * stepped["per_param"][name][1] for name, n in one["numels"].items())
        result["param_bytes"][rank] = one["params"]
        result["grad_bytes"][rank], result["optimizer_bytes"][rank] = grads, state
        result["num_params"] = one["num_params"]
    return result | {"elapsed_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu_started}


def main() -> None:
    """`python -m course_lib.measure.simulate_worker` < jobs.json: one result line on stdout, or a traceback and exit 1."""
    jobs = json.load(sys.stdin)
    with tempfile.TemporaryDirectory(prefix="course-simulation-") as folder:
        # Once per process: the ledger wraps torch.distributed's functions once and numbers calls per
        # group across every fake group this process creates; each step reads only its new entries.
        path = os.path.join(folder, "ledger.jsonl")
        ledger.install(path)
        recorded = ledger.LedgerReader(path)
        results = []
        for job in jobs:
            results.append(_simulate_job(job, recorded))
            if os.environ.get(ENV_PROGRESS_FILE):
                with open(os.environ[ENV_PROGRESS_FILE], "a") as progress:
                    progress.write(json.dumps({"model": job["model"], "world_size": job["world_size"]}) + "\n")
    print(RESULT_MARK + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
