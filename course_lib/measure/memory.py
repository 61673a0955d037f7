"""Memory per rank through one training step, measured and predicted, for DDP, ZeRO-1, FSDP1 and FSDP2.

On a rank, `measure_step(model, optimizer, batch, loss_fn, strategy=...)` runs
one step (zero_grad, forward, backward, optimizer.step) and returns plain data:
bytes per category after each phase ("init", "forward", "backward", "step")
and at the peak. Two sources, kept apart:

- exact counts from the objects: the rank's own parameter storage (FSDP1: the
  FlatParameter shard with its padding; FSDP2: the padded shard behind each
  DTensor), its gradients, the optimizer's state tensors, and communication
  buffers that live across phases (DDP's gradient buckets, which its
  all-reduce reads; FSDP's all-gathered parameters of the root unit, which it
  keeps from forward to backward);
- torch's own tracker (`FSDPMemTracker` for FSDP2, `MemTracker` otherwise),
  which sees every tensor an op makes inside it: activations, temporaries and
  the peak. Under CUDA the allocator's `memory_allocated` is recorded as well.

In the kernel, `predict_step(named_shapes(model), units=..., strategy=...)`
gives the exact bytes the first step should show from the shapes alone
(`course_lib.theory`), and ZeRO's padding-free formula beside them;
`draw.memory.show_memory` draws both.
"""

from __future__ import annotations

import gc
import math
import re
from typing import Any, Callable, Sequence

from .. import theory
from ..vocabulary import OPTIMIZER_STATES, STRATEGIES, ZERO_STAGES
from .sharding import fsdp2_param_groups

__all__ = ["CATEGORIES", "EXACT", "PHASES", "measure_step", "named_shapes", "predict_step", "unit_prefixes",
           "zero1_partition"]

PHASES = ("init", "forward", "backward", "step")
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers", "other")
EXACT = ("parameters", "gradients", "optimizer", "buffers")  # counted from objects and predicted exactly
STEP_BYTES = 4  # Adam's `step` is a float32 scalar tensor per parameter (torch/optim/adam.py)

# torch's tracker categories (`_MemRefType`, `_FSDPRefType` values) mapped to ours.
_TRACKER_MAP = {
    "Parameter": "parameters", "Sharded Param": "parameters", "Gradient": "gradients",
    "Sharded Grad": "gradients", "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Unsharded Param": "buffers", "Unsharded Grad": "buffers",
    "All Gather": "buffers", "Reduce Scatter": "buffers",
}


# ---------------------------------------------------------------- exact counts (rank side)

def _local(t: Any) -> Any:
    """The tensor whose storage holds `t` on this rank (a DTensor's local shard)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _storages(tensors: Any) -> dict[int, int]:
    """{storage: bytes} of the distinct storages behind `tensors`: views of one buffer count once."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            st = _local(t).untyped_storage()
            seen[st.data_ptr() or id(st)] = st.nbytes()
    return seen


def _storage_bytes(tensors: Any) -> int:
    return sum(_storages(tensors).values())


CUDA_BLOCK = 512  # the CUDA caching allocator's smallest block; torch's MemTracker rounds each storage up to it


def allocator_rounding(sizes: list[int], block: int = CUDA_BLOCK) -> int:
    """Bytes that rounding each of `sizes` up to a multiple of `block` adds: 508 for [4, 1024]."""
    return sum(-n % block for n in sizes)


def _fsdp2_params(model: Any) -> list:
    """FSDP2's per-parameter records (`FSDPParam`) of every `fully_shard`-ed module, or []."""
    return [fsdp_param for module in model.modules() for group in fsdp2_param_groups(module)
            for fsdp_param in group.fsdp_params]


def _exact(model: Any, optimizer: Any, strategy: str) -> dict[str, int]:
    """Parameters, gradients, optimizer state and live communication buffers of this rank, in bytes."""
    if strategy == "fsdp2":
        # The padded shard (`_sharded_param_data`) backs the DTensor: count it, padding included.
        shards = [fp.sharded_param for fp in _fsdp2_params(model)]
        gathered = [fp._unsharded_param for fp in _fsdp2_params(model) if hasattr(fp, "_unsharded_param")]
        # reshard_after_forward=<int>: after forward each parameter is kept sharded over fewer ranks,
        # in a tensor FSDP2 allocates during forward (torch's tracker files it under activations).
        post_forward = [fp._sharded_post_forward_param_data for fp in _fsdp2_params(model)
                        if getattr(fp, "_sharded_post_forward_param_data", None) is not None]
    else:
        params = list(model.parameters())
        # FSDP1: the FlatParameter may point at the gathered flat tensor; its shard stays in _local_shard.
        shards = [getattr(p, "_local_shard", p) for p in params]
        gathered = [p._full_param_padded for p in params if hasattr(p, "_full_param_padded")]
        post_forward = []
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer here
    states = [v for state in inner.state.values() for v in state.values() if hasattr(v, "untyped_storage")]
    buffers = _storage_bytes(gathered) + _storage_bytes(post_forward)
    grads = [p.grad for p in (model.parameters() if strategy != "fsdp2" else shards)]
    if strategy in ("ddp", "zero1") and hasattr(model, "_get_ddp_logging_data"):
        # DDP's reducer allocates its buckets in C++; it records their sizes in bytes.
        buckets = sum(int(n) for n in re.findall(r"\d+", str(model._get_ddp_logging_data().get("bucket_sizes", ""))))
        if model.gradient_as_bucket_view:
            # Each .grad is a view into its bucket, counted under "gradients" once it exists (after
            # backward): only the bucket bytes that hold no gradient yet are counted here.
            buckets = max(0, buckets - _storage_bytes(grads))
        buffers += buckets
    # The rounding torch's tracker adds to these storages on CUDA (not in the exact counts): see measure_step.
    sizes = [n for tensors in (shards, grads, states, gathered, post_forward) for n in _storages(tensors).values()]
    return {"parameters": _storage_bytes(shards), "gradients": _storage_bytes(grads),
            "optimizer": _storage_bytes(states), "buffers": buffers, "rounding": allocator_rounding(sizes),
            "seen_as_activations": _storage_bytes(post_forward)}


def _tracker_snapshot(tracker: Any, kind: str = "current") -> dict[str, int]:
    """The tracker's snapshot summed over devices, with torch's category names ("Total" included)."""
    out: dict[str, int] = {}
    for dev_snap in tracker.get_tracker_snapshot(kind).values():
        for key, nbytes in dev_snap.items():
            name = getattr(key, "value", key)
            out[name] = out.get(name, 0) + int(nbytes)
    return {k: v for k, v in out.items() if v or k == "Total"} or {"Total": 0}


def _categories(raw: dict[str, int], strategy: str, exact_params: int) -> dict[str, int]:
    """A tracker snapshot in our categories. Tracker names we do not map go to "other"."""
    out = dict.fromkeys(CATEGORIES, 0)
    for name, nbytes in raw.items():
        if name != "Total":
            category = _TRACKER_MAP.get(name, "other")
            if strategy == "fsdp1" and name == "Gradient":
                category = "buffers"  # FSDP1: the unsharded gradients, the reduce-scatter's input
            out[category] += nbytes
    if strategy == "fsdp1":
        # MemTracker labels FSDP1's gathered flat parameters "Parameter": the excess over the shard.
        extra = max(0, out["parameters"] - exact_params)
        out["parameters"] -= extra
        out["buffers"] += extra
    out["total"] = raw.get("Total", sum(out.values()))
    return out


def measure_step(model: Any, optimizer: Any, batch: tuple, loss_fn: Callable, *, strategy: str) -> dict:
    """Run one training step on this rank and return its memory, phase by phase (plain data).

    `batch` is (inputs, targets); the step is `optimizer.zero_grad(set_to_none=True)`,
    `loss_fn(model(inputs), targets).backward()`, `optimizer.step()`. Per phase:
    exact bytes of "parameters", "gradients", "optimizer", "buffers"; "activations"
    as torch's tracker counts them; "other" what the tracker holds beyond those
    (temporaries; 0 when it has not yet seen a buffer the objects hold).
    "peak" is the tracker's snapshot at its highest total, in our categories.

    NOTE: "other" is not reproducible on gloo: a finished collective's work
    object may still hold its buffer for a moment (seen: 1024 B of FSDP2
    all-gather output on some ranks, some runs). On CUDA the tracker rounds
    each storage up to 512 B, as the caching allocator does; the exact
    categories are never rounded, so the rounding of their storages is taken
    out of "other" and reported per phase as `cuda_rounding` (else an "other"
    of ~3 KiB appears at init, which is only rounding). `allocated`/`max_allocated`:
    the CUDA allocator's view.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    # The garbage collector frees reference cycles (FSDP's hooks hold their modules) whenever its
    # allocation count says so; when that falls inside the step, the tracker's peak moves (seen:
    # 25,452 B instead of 24,076 for one wrap policy of lesson 04, depending on what ran before).
    # Collect first and pause it during the step: the peak then depends on this step alone.
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    inputs, targets = batch
    device = inputs.device
    cuda = device.type == "cuda"
    if strategy == "fsdp2":
        tracker = FSDPMemTracker(model, optimizer)  # knows FSDP2's sharded/unsharded params and buffers
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)  # created before the tracker: register them
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    phases, raw, allocated, rounding = {}, {}, {}, {}

    def record(phase: str) -> None:
        exact = _exact(model, optimizer, strategy)
        block_rounding = exact.pop("rounding")
        relabelled = exact.pop("seen_as_activations")  # counted in "buffers" above, not twice
        rounding[phase] = block_rounding if cuda else 0
        raw[phase] = _tracker_snapshot(tracker)
        seen = _categories(raw[phase], strategy, exact["parameters"])
        activations = max(0, seen["activations"] - relabelled)
        named = sum(exact.values()) + activations + rounding[phase]
        phases[phase] = {**exact, "activations": activations, "other": max(0, seen["total"] - named)}
        if cuda:
            torch.cuda.synchronize(device)
            allocated[phase] = torch.cuda.memory_allocated(device)

    try:
        with tracker:
            record("init")
            loss = loss_fn(model(inputs), targets)
            record("forward")
            loss.backward()
            record("backward")
            optimizer.step()
            record("step")
    finally:
        if collecting:
            gc.enable()
    peak_raw = _tracker_snapshot(tracker, "peak")
    return {
        "rank": dist.get_rank(), "world_size": dist.get_world_size(), "strategy": strategy,
        "device": str(device), "tracker": type(tracker).__name__, "loss": float(loss.detach()),
        "phases": phases, "peak": _categories(peak_raw, strategy, phases["init"]["parameters"]),
        "gradient_as_bucket_view": bool(getattr(model, "gradient_as_bucket_view", False)),
        "tracker_phases": raw, "tracker_peak": peak_raw,
        "allocated": allocated or None,
        "cuda_rounding": rounding if cuda else None,
        "max_allocated": torch.cuda.max_memory_allocated(device) if cuda else None,
    }


# ---------------------------------------------------------------- predictions (kernel side)

def named_shapes(model: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of an unwrapped model, in `named_parameters()` order."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def unit_prefixes(model: Any, unit_type: type) -> list[str]:
    """Names of the submodules of type `unit_type`, in module order: the FSDP units wrapped per layer."""
    return [name for name, module in model.named_modules() if name and isinstance(module, unit_type)]


def zero1_partition(numels: list[int], world_size: int) -> list[list[int]]:
    """Indices of the parameters each rank's ZeroRedundancyOptimizer updates (and keeps state for).

    torch's `_partition_parameters`: largest first (stable sort), each to the
    rank with the fewest elements so far (the first such rank on a tie).
    """
    sizes, ranks = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(numels)), key=lambda j: numels[j], reverse=True):
        rank = sizes.index(min(sizes))
        ranks[rank].append(i)
        sizes[rank] += numels[i]
    return ranks


def _units(shapes: list[tuple[str, tuple[int, ...]]], units: list[str]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Parameters grouped by FSDP unit (the innermost prefix that owns them); the root unit last."""
    groups: list[list] = [[] for _ in range(len(units) + 1)]
    for name, shape in shapes:
        owners = [i for i, prefix in enumerate(units) if name.startswith(prefix + ".")]
        groups[max(owners, key=lambda i: len(units[i])) if owners else -1].append((name, shape))
    return [g for g in groups[:-1] if g] + [groups[-1]]


def predict_step(shapes: list[tuple[str, tuple[int, ...]]], *, strategy: str, world_size: int, rank: int,
                 units: Sequence[str] = (), optimizer: str = "adam", element_size: int = 4,
                 gradient_as_bucket_view: bool = False) -> dict:
    """Exact bytes `measure_step` should find on `rank` in a first step, from the parameter shapes.

    `shapes`: `named_shapes(model)`; `units`: FSDP's wrapped submodules
    (`unit_prefixes(model, Block)`), the rest is the root unit. Parameters are
    the same in every phase; gradients appear in backward; optimizer state in
    step; buffers are DDP's buckets (all phases) or the root unit's gathered
    parameters, which FSDP keeps from forward into backward. With DDP's
    `gradient_as_bucket_view=True` the gradients are views into the buckets: from
    backward on, the buckets' bytes are the gradients' and count once. "theory" is
    ZeRO's formula (`theory.zero_memory_per_rank`), which ignores padding and buffers.
    """
    if strategy not in STRATEGIES or optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown strategy {strategy!r} or optimizer {optimizer!r}")
    numels = [math.prod(shape) for _, shape in shapes]
    states, step = OPTIMIZER_STATES[optimizer] * element_size, STEP_BYTES if optimizer == "adam" else 0
    groups = _units(shapes, list(units))
    buckets = gathered = 0
    if strategy in ("ddp", "zero1"):
        params = grads = buckets = sum(numels) * element_size
        mine = zero1_partition(numels, world_size)[rank] if strategy == "zero1" else range(len(numels))
        opt = sum(numels[i] * states + step for i in mine)
    elif strategy == "fsdp1":
        # One FlatParameter per unit that has parameters; its shard (padding included) is the same size everywhere.
        flat = [theory.fsdp1_flat_shards([(n, math.prod(s)) for n, s in g], world_size, element_size=element_size)[rank]
                for g in groups if g]
        params = grads = sum(f.shard_numel for f in flat) * element_size
        opt = sum(f.shard_numel * states + step for f in flat)
        gathered = flat[-1].shard_numel * world_size * element_size if groups[-1] else 0
    else:  # fsdp2: the padded shard for parameters and gradients, the real local shape for optimizer state
        params = grads = sum(theory.fsdp2_padded_shard_numel(s, world_size) for _, s in shapes) * element_size
        opt = sum(math.prod(theory.fsdp2_local_shape(s, world_size, rank)) * states + step for _, s in shapes)
        root = sum(theory.fsdp2_padded_shard_numel(s, world_size) for _, s in groups[-1])
        gathered = root * world_size * element_size  # the root's all-gather output, padding included
    base = {"parameters": params, "gradients": 0, "optimizer": 0, "buffers": buckets}
    phases = {"init": dict(base), "forward": {**base, "buffers": buckets + gathered},
              "backward": {**base, "gradients": grads}, "step": {**base, "gradients": grads, "optimizer": opt}}
    if gradient_as_bucket_view and strategy in ("ddp", "zero1"):
        for phase in ("backward", "step"):
            phases[phase]["buffers"] = 0
    zero = theory.zero_memory_per_rank(sum(numels), world_size, stage=ZERO_STAGES[strategy], precision="fp32",
                                       optimizer=optimizer)
    return {"strategy": strategy, "rank": rank, "world_size": world_size, "phases": phases,
            "gradient_as_bucket_view": gradient_as_bucket_view and strategy in ("ddp", "zero1"),
            "theory": {"parameters": zero.params, "gradients": zero.grads, "optimizer": zero.optimizer}}
