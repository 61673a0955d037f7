"""04.memory_per_rank: the bytes a rank holds after one step of FSDP1, predicted from the shapes.

The learner's function gets each unit's parameter shapes, a `ShardingStrategy` name, the world size and an
optimizer name, and returns {"parameters", "gradients", "optimizer"} in bytes. On the ranks the driver
builds a model of those shapes, wraps it in FSDP1 with that strategy, runs one step of that optimizer under
`course_lib.measure.memory.measure_step` and sends back both: the judges compare the prediction with what
the rank measured (its own storages after `optimizer.step()`), and name the usual mistakes: no padding,
SHARD_GRAD_OP's parameters kept whole, NO_SHARD's gradients sharded, Adam's state as one tensor, Adam's
`step` counted per original parameter.
"""

from __future__ import annotations

import math

from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import FSDP1_OPS, FSDP_PRELOAD

__all__ = ["CATEGORIES", "MEMORY", "OPTIMIZERS", "STRATEGIES", "UNITS_2", "UNITS_3", "memory_reference"]

CATEGORIES = ("parameters", "gradients", "optimizer")
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
# course_lib.vocabulary's names: Adam (exp_avg, exp_avg_sq, a float32 step), SGD(momentum=0.9) (momentum_buffer), SGD.
OPTIMIZERS = ("adam", "sgd-momentum", "sgd")
FLOAT32 = 4
STEP_BYTES = 4  # Adam's `step`: a float32 scalar tensor per parameter it updates (torch/optim/adam.py)

# units[0]: the root's own parameters; each other entry: one wrapped submodule (its own FlatParameter).
UNITS_2 = [[(4, 4), (5,)], [(6, 5), (6,)], [(3, 3)]]  # 21, 36, 9 elements: two units need padding on 2 ranks
UNITS_3 = [[(8, 5), (8,)], [(10, 4), (10,)], [(7, 7), (7,)], [(2, 2)]]  # 48, 50, 56, 4: three need it on 3


def _numels(units: list) -> list[int]:
    return [sum(math.prod(shape) for shape in shapes) for shapes in units]


def memory_reference(units: list, strategy: str, world_size: int, optimizer: str, *, padding: bool = True,
                     shard_params: tuple = ("FULL_SHARD", "SHARD_GRAD_OP"),
                     shard_grads: tuple = ("FULL_SHARD", "SHARD_GRAD_OP"), adam_tensors: int = 2,
                     adam_step: bool = True, step_per_param: bool = False) -> dict[str, int]:
    """The bytes of each category after a step, from the shapes; the keywords give the usual mistakes.

    Each unit is one FlatParameter: its elements, padded to a multiple of the ranks it is sharded over, split
    evenly (`course_lib.theory.fsdp1_flat_shards`); NO_SHARD shards over 1 rank. float32 throughout.
    """
    numels = [n for n in _numels(units) if n]

    def held(sharded: bool) -> int:
        group = world_size if sharded else 1
        return sum(-(-n // group) if padding else n // group for n in numels)

    params, grads = held(strategy in shard_params), held(strategy in shard_grads)
    state = held(strategy in ("FULL_SHARD", "SHARD_GRAD_OP"))
    steps = sum(len(shapes) for shapes in units if shapes) if step_per_param else len(numels) * adam_step
    optimizer_bytes = {"adam": adam_tensors * FLOAT32 * state + STEP_BYTES * steps,
                       "sgd-momentum": FLOAT32 * state, "sgd": 0}[optimizer]
    return {"parameters": FLOAT32 * params, "gradients": FLOAT32 * grads, "optimizer": optimizer_bytes}


ADAM_ONE_TENSOR = "Adam's state counted as one tensor per parameter: it keeps two (exp_avg and exp_avg_sq) and a step"
# (what the learner may have done, the reference's keywords)
MISTAKES = (
    ("no padding: a FlatParameter is padded to a multiple of the world size before it is split, so each rank's "
     "piece holds ceil(elements / N)", {"padding": False}),
    ("SHARD_GRAD_OP's parameters counted whole: between steps (after optimizer.step()) it keeps only each rank's "
     "shard, as FULL_SHARD does; it differs while the step runs", {"shard_params": ("FULL_SHARD",)}),
    ("NO_SHARD's gradients counted sharded: NO_SHARD all-reduces every gradient (DDP), so each rank holds all of "
     "them", {"shard_grads": ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")}),
    ("NO_SHARD counted sharded: it shards nothing", {"shard_params": STRATEGIES, "shard_grads": STRATEGIES}),
    *((ADAM_ONE_TENSOR, {"adam_tensors": 1, "adam_step": step}) for step in (True, False)),
    ("Adam's step left out: a float32 scalar tensor per parameter it updates", {"adam_step": False}),
    ("Adam's step counted per original parameter: the optimizer sees one parameter per FlatParameter, so one "
     "step each", {"step_per_param": True}),
)


def _cases(n: int, units: list, setups: list[tuple[str, str]]) -> list[dict[int, tuple]]:
    return [{r: (units, strategy, optimizer) for r in range(n)} for strategy, optimizer in setups]


def _label(outcome: RunOutcome, case: int) -> str:
    units, strategy, optimizer = outcome.inputs[case][0]
    return (f"case {case + 1} of {len(outcome.inputs)} ({strategy}, {optimizer}, units of "
            f"{', '.join(map(str, _numels(units)))} elements, world_size={outcome.nproc})")


def _diagnosis(category: str, got: int, units: list, strategy: str, world_size: int, optimizer: str) -> str:
    for words, keywords in MISTAKES:
        wrong = memory_reference(units, strategy, world_size, optimizer, **keywords)
        right = memory_reference(units, strategy, world_size, optimizer)
        if wrong[category] == got != right[category]:
            return f": {words}"
    if category == "optimizer" and optimizer == "sgd" and got:
        return ": torch.optim.SGD without momentum keeps no state"
    if category == "optimizer" and optimizer == "sgd-momentum" and got == 0:
        return ": SGD with momentum keeps a momentum buffer the size of each parameter it updates"
    return ""


def _judge(category: str):
    def judge(outcome: RunOutcome) -> list[str]:
        for case, by_rank in enumerate(outcome.results):
            units, strategy, optimizer = outcome.inputs[case][0]
            for rank, result in sorted(by_rank.items()):
                got, measured = result.output["answer"], result.output["measured"][category]
                where = f"rank {rank}, {_label(outcome, case)}"
                if not isinstance(got, dict):
                    return [f"{where}: memory_per_rank returned {got}, expected a dict of {', '.join(CATEGORIES)} "
                            "(ints, bytes)"]
                if category not in got:
                    return [f"{where}: no {category!r} in the dict returned ({', '.join(map(repr, got)) or 'empty'})"]
                if got[category] == measured:
                    continue
                hint = _diagnosis(category, got[category], units, strategy, outcome.nproc, optimizer)
                return [f"{where}: {category} {got[category]} B, the rank measured {measured} B{hint}"]
        return []

    judge.__doc__ = f"the {category} bytes returned equal what each rank measured after the step"
    return judge


SETUPS_2 = [("FULL_SHARD", "adam"), ("SHARD_GRAD_OP", "sgd-momentum"), ("NO_SHARD", "adam")]
SETUPS_3 = [("FULL_SHARD", "sgd-momentum"), ("SHARD_GRAD_OP", "adam"), ("NO_SHARD", "sgd")]


def _items(n: int) -> tuple[Item, ...]:
    what = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer state"}
    return tuple(Item(f"{what[c]} per rank after the step, FULL_SHARD, SHARD_GRAD_OP and NO_SHARD ({n} ranks)", 1,
                      _judge(c)) for c in CATEGORIES)


MEMORY = Exercise(
    id="04.memory_per_rank",
    function="memory_per_rank",
    signature=("memory_per_rank(units: list[list[tuple[int, ...]]], strategy: str, world_size: int, "
               "optimizer: str) -> dict[str, int]"),
    driver="fsdp_memory",
    allowed_ops=FSDP1_OPS | {"all_reduce"},  # NO_SHARD all-reduces the gradients
    preload=FSDP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: _cases(n, UNITS_2, SETUPS_2), _items(2), timeout_s=20),
        RunSpec(3, lambda n: _cases(n, UNITS_3, SETUPS_3), _items(3), timeout_s=20),
    ),
    hints=(
        "Reread lesson 04, section 4 'The FlatParameter: flattened, padded, split' and section 5 'Sharding "
        "strategies' (what each strategy keeps between steps, and the memory table).",
        "No torch call is needed: model torch.distributed.fsdp.ShardingStrategy (FULL_SHARD, SHARD_GRAD_OP, "
        "NO_SHARD) and the state torch.optim.Adam and torch.optim.SGD keep per parameter they update; math.prod "
        "counts a shape's elements.",
        "Per unit: count its elements, pad them to a multiple of the ranks the strategy shards over, and take one "
        "rank's piece; parameters and gradients are such pieces in float32, and the optimizer's state is kept "
        "per FlatParameter it updates, not per original parameter.",
    ),
)
