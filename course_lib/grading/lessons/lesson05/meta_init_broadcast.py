"""05.meta_init_broadcast: a model built on the meta device, sharded, given memory, filled from rank 0, its
buffer that no state dict holds computed again.

Judged: build() ran on the meta device and the model's parameters are Shard(0) DTensors on the CPU; each
rank's rows equal rank 0's state dict; the buffers (one in the state dict, one computed, persistent=False) and
the output equal one process's. The usual mistakes are named: built on the CPU, `reset_parameters` on the
shards (every rank draws the same rows), no `broadcast_from_rank0` (the other ranks have `{}`), the computed
buffer left as `to_empty` left it, or computed before `to_empty`.
"""

from __future__ import annotations

from ...compare import each_result, first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ATOL, FSDP2_OPS, FSDP2_PRELOAD, RTOL, TOY_2, TOY_3, expected_placements, rows_wrong, weights_of

__all__ = ["META_INIT"]

HINTS = (
    "Reread lesson 05's in-depth appendix (notebooks/05_appendix_in_depth.ipynb), section 2 'Meta-device init: the "
    "same shard on every rank (CPU mesh)'; then what state_dict() holds of a buffer registered persistent=False.",
    "torch.device('meta') as a context manager, fully_shard, nn.Module.to_empty(device=...), "
    "set_model_state_dict with StateDictOptions from torch.distributed.checkpoint.state_dict; model.named_buffers().",
    "Build under the meta device so that no rank holds the whole model, shard it, give it memory on the default "
    "group's device, load the full state dict on every rank telling the loader that only rank 0 holds it; then "
    "fill, on every rank, what no state dict carries: memory given by to_empty holds no values.",
)

def _model(sizes: dict, weights: dict | None = None):
    """buffered_model(sizes) holding `weights` (a state dict): one process's model."""
    from .drivers import buffered_model

    model = buffered_model(sizes)
    if weights is not None:
        model.load_state_dict(weights)
    return model


def _meta_case(n: int, sizes: dict, weights_seed: int, seed: int) -> dict[int, tuple]:
    """Rank 0 gets the full state dict drawn from `weights_seed` (scale.shift drawn too), the others {}; every
    rank the same `seed` and the same 3 rows of inputs."""
    import torch

    weights = weights_of(lambda: _model(sizes), weights_seed)
    generator = torch.Generator().manual_seed(weights_seed)
    weights["scale.shift"] = torch.randn(sizes["dim"], generator=generator)
    inputs = torch.randn(3, sizes["dim"], generator=generator)
    return {r: (sizes, weights if r == 0 else {}, seed, inputs) for r in range(n)}


def _meta_label(outcome: RunOutcome, case: int) -> str:
    sizes = outcome.inputs[case][0][0]
    return f"case {case + 1} of {len(outcome.inputs)} (BufferedModel with {sizes['layers']} Blocks)"


def _built_on_meta(outcome: RunOutcome) -> list[str]:
    """build() ran once, on the meta device; the returned model's parameters are DTensors Shard(0) over all
    ranks, on the CPU (to_empty gave them memory)."""
    for case, rank, result in each_result(outcome):
        where = f"rank {rank}, {_meta_label(outcome, case)}"
        built = result.output["built_on"]
        if built != ["meta"]:
            if not built:
                return [f"{where}: build() was not called: build the model with it, under torch.device('meta')"]
            if built[0] != "meta":
                return [f"{where}: build() made the parameters on the {built[0]} device, so every rank held and "
                        "initialised the whole model; call it inside `with torch.device('meta'):`"]
            return [f"{where}: build() was called {len(built)} times, expected once"]
        if "returned" in result.output:
            return [f"{where}: the function returned a {result.output['returned']}, expected the sharded model"]
        for name, described in result.output["params"].items():
            if described["device"] == "meta":
                return [f"{where}: {name} is still on the meta device (no memory): call "
                        "model.to_empty(device=...) after fully_shard, on the default group's device (the CPU under gloo)"]
            wrong = expected_placements(described, outcome.nproc)
            if wrong:
                return [f"{where}: {name} {wrong}"]
    return []


def _same_on_every_rank(by_rank: dict, name: str) -> bool:
    """Whether every rank's shard of `name` starts with the same values (as far as the shortest, non-empty, goes):
    what ranks that drew their shards from one random state hold."""
    import torch

    shards = [result.output["shards"][name].flatten() for result in by_rank.values() if "shards" in result.output]
    shards = [s for s in shards if s.numel()]
    length = min((s.numel() for s in shards), default=0)
    return len(shards) > 1 and all(torch.equal(s[:length], shards[0][:length]) for s in shards[1:])


def _loaded_from_rank_0(outcome: RunOutcome) -> list[str]:
    """Every rank's rows of every parameter equal the same rows of the model rank 0's state dict holds (one
    process, drawn from the seed)."""
    for case, by_rank in enumerate(outcome.results):
        sizes, weights = outcome.inputs[case][0][:2]
        expected = dict(_model(sizes, weights).named_parameters())
        for rank, result in sorted(by_rank.items()):
            where = f"rank {rank}, {_meta_label(outcome, case)}"
            if "shards" not in result.output:
                return [f"{where}: the function returned a {result.output['returned']}, expected the sharded model"]
            for name, full in expected.items():
                wrong = rows_wrong(result.output["shards"][name], full.detach(), rank, outcome.nproc, name)
                if not wrong:
                    continue
                hint = ""
                if _same_on_every_rank(by_rank, name):
                    hint = (f": every rank's shard of {name} starts with the same values. reset_parameters() on a "
                            "sharded model draws each rank's rows from the same random state, so the ranks hold "
                            "copies of one shard, not the rows of the one-process model; load rank 0's state dict "
                            "instead")
                return [f"{where}: {wrong}{hint}"]
    return []


def _buffers(outcome: RunOutcome) -> list[str]:
    """Every rank's buffers equal one process's (scale.shift from rank 0's state dict, scale.freq computed as
    __init__ computes it), and so does the model's output on the same inputs."""
    for case, rank, result in each_result(outcome):
        sizes, weights = outcome.inputs[case][0][:2]
        where = f"rank {rank}, {_meta_label(outcome, case)}"
        if "buffers" not in result.output:
            return [f"{where}: the function returned a {result.output['returned']}, expected the sharded model"]
        model = _model(sizes, weights)
        for name, want in model.named_buffers():
            got = result.output["buffers"].get(name)
            if got is None:
                return [f"{where}: the model has no buffer {name}"]
            wrong = first_difference(got, want, rtol=RTOL, atol=ATOL)
            if not wrong:
                continue
            if name == "scale.freq":
                return [f"{where}: {name} {wrong}: a buffer registered with persistent=False is in no state dict, so "
                        "loading rank 0's leaves it as to_empty left it: memory without values (or values computed "
                        "on the meta device, which to_empty then replaced); compute it again on every rank, after "
                        "to_empty, as Scale.__init__ does"]
            return [f"{where}: {name} {wrong}: it is in rank 0's state dict; load it with the parameters"]
        got = result.output["outputs"]
        inputs = outcome.inputs[case][0][3]
        wrong = first_difference(got, model(inputs).detach(), rtol=RTOL, atol=ATOL)
        if wrong:
            return [f"{where}: the model's output on the checker's 3 rows: {wrong}"]
    return []


META_OPS = FSDP2_OPS | {"broadcast", "broadcast_object_list", "scatter"}

META_INIT = Exercise(
    id="05.meta_init_broadcast",
    hints=HINTS,
    function="init_sharded",
    signature="init_sharded(build: Callable[[], torch.nn.Module], full_state: dict) -> FSDPModule",
    driver="fsdp2_meta_init",
    # broadcast and broadcast_object_list: what broadcast_from_rank0 calls. scatter: what loading a full state
    # dict without it calls on rank 0 (distribute_tensor), allowed so that such an answer gets torch's words.
    allowed_ops=META_OPS,
    preload=FSDP2_PRELOAD + ("torch.distributed.checkpoint.state_dict",),
    runs=(
        RunSpec(2, lambda n: [_meta_case(n, TOY_2, 57, 157)],
                (Item("built on the meta device, every parameter Shard(0) on the CPU (2 ranks)", 1, _built_on_meta),
                 Item("every rank's rows equal rank 0's state dict (2 ranks)", 1, _loaded_from_rank_0),
                 Item("both buffers and the output equal one process's (2 ranks)", 1, _buffers)),
                timeout_s=10),
        RunSpec(4, lambda n: [_meta_case(n, TOY_3, 58, 158)],
                (Item("built on the meta device, every parameter Shard(0) on the CPU (4 ranks)", 1, _built_on_meta),
                 Item("every rank's rows equal rank 0's state dict (4 ranks)", 1, _loaded_from_rank_0),
                 Item("both buffers and the output equal one process's (4 ranks)", 1, _buffers)),
                timeout_s=10),
    ),
)
