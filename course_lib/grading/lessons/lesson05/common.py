"""What lesson 05's exercises share: the models and batches, one process's reference, how FSDP2 cuts rows,
and the words the judges use for them.

Every run shards over a mesh of the CPU (gloo). The models are `course_lib.models.ToyModel` (Blocks and a
head) and small `nn.Linear`s, weights drawn here, in the checker's process, from a fixed seed. The references
are one process, computed here without torch.distributed; each rank's part is its dim-0 rows, as FSDP2 cuts
them (`shard_rows`).
"""

from __future__ import annotations

from ....theory import chunk_sizes, fsdp2_padded_shard_numel
from ...compare import first_difference
# One process's tolerances, learning rate, batches, weights and SGD are lesson 04's.
from ..lesson04.common import ATOL, LR, RTOL, sgd_reference
from ..lesson04.common import draw_batch as batch
from ..lesson04.common import draw_weights as weights_of

__all__ = ["ATOL", "FSDP2_OPS", "FSDP2_PRELOAD", "LR", "RTOL", "TOY_2", "TOY_3", "all_gather_elements", "batch",
           "expected_placements", "floats", "rows_text", "rows_wrong", "sgd_reference", "shard_rows", "toy",
           "toy_weights", "weights_of"]

# What fully_shard calls: on CPU with torch 2.13 and 2.15 the *_single forms; elsewhere their older spellings.
FSDP2_OPS = frozenset({"all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single"})
# fully_shard, DTensor and DeviceMesh (about 0.8 s a process), and torch._dynamo, which the first fully_shard
# imports (2.4 s for 2 ranks at once on 2 cores, 215 modules).
FSDP2_PRELOAD = ("torch._dynamo", "torch.distributed.fsdp")
TOY_2 = {"dim": 8, "hidden": 13, "layers": 2, "out": 5}  # ToyModel's defaults: 503 parameters
TOY_3 = {"dim": 8, "hidden": 13, "layers": 3, "out": 5}  # on 4 ranks: the head's 5 rows are 2, 2, 1 and 0


def shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the dim-0 rows FSDP2 gives `rank` of a parameter with `rows` rows: torch.chunk's
    pieces, ceil(rows / world_size) each, the last ones shorter or empty (theory.chunk_sizes)."""
    sizes = chunk_sizes(rows, world_size)
    start = min(rank * sizes[0], rows)
    return start, start + sizes[rank]


def all_gather_elements(shapes: list, world_size: int) -> int:
    """Elements one rank hands to a group's all-gather: each parameter's shard padded to ceil(rows / N) rows
    (theory.fsdp2_padded_shard_numel)."""
    return sum(fsdp2_padded_shard_numel(tuple(shape), world_size) for shape in shapes)


def rows_text(count: int) -> str:
    return f"{count} row{'s' * (count != 1)}"


def floats(nbytes: int) -> str:
    """A float32 tensor's bytes, and its elements: "476 B = 119 floats"."""
    return f"{nbytes} B = {nbytes // 4} floats"


def toy(sizes: dict, weights: dict):
    """ToyModel(**sizes) holding `weights`: one process's model."""
    from .drivers import toy_from_weights

    return toy_from_weights(sizes, weights)


def toy_weights(sizes: dict, seed: int) -> dict:
    from ....models import ToyModel

    return weights_of(lambda: ToyModel(**sizes), seed)


def rows_wrong(got, full, rank: int, n: int, name: str, *, index: int | None = None) -> str:
    """"" if `got` equals the rows of `full` that piece `index` (default: `rank`) of `n` holds; else which rows
    of `name` differ, and how."""
    start, stop = shard_rows(full.shape[0], n, rank if index is None else index)
    wrong = first_difference(got, full[start:stop], rtol=RTOL, atol=ATOL)
    if not wrong:
        return ""
    rows = f"rows {start} to {stop - 1}" if stop > start else "no rows (an empty shard)"
    return f"its shard of {name} ({rows} of {full.shape[0]}) {wrong}"


def expected_placements(described: dict, n: int) -> str:
    """What is wrong with one parameter's description (drivers.placements_of), "" if it is a DTensor
    sharded on dim 0 over a 1-D CPU mesh of all `n` ranks."""
    if described["type"] != "DTensor":
        return f"is a {described['type']} on {described['device']}, not a DTensor: fully_shard did not shard it"
    if described["placements"] != ["Shard(dim=0)"]:
        return (f"has placements ({', '.join(described['placements'])},), expected (Shard(dim=0),) on a 1-D mesh "
                "(a 2-D mesh replicates over its first dimension: HSDP)")
    if described["mesh_ranks"] != list(range(n)):
        return f"is sharded over ranks {described['mesh_ranks']}, expected all {n} ranks {list(range(n))}"
    if described["device"] != "cpu":
        return f"is on the {described['device']} device, expected the CPU"
    return ""
