"""The course's names, in one place: collectives and every spelling of them, optimizers, precisions, strategies.

Pure data and tiny functions, no torch import: every rank imports this module
(the collective ledger, rank/ledger.py, records under these names). Everything
else that names a collective, an optimizer, a precision or a sharding strategy
imports the name from here, so a spelling torch adds or renames is fixed once.

Collectives. The course's name for a collective is torch 2.13's public
`torch.distributed` function (`all_gather_single`, `reduce_scatter_single`,
`all_to_all_single`, ...). Other spellings of the same call: older or
deprecated functions (`all_gather_into_tensor`, `_all_gather_base`), the C++
ProcessGroup methods the functions call (`allreduce`, `alltoall_base`),
CommDebugMode's dispatcher ops (`c10d.allreduce_`) and functional collectives
(`c10d_functional.all_reduce`). Two views of one table:

    canonical_op("all_gather_into_tensor") == "all_gather_single"   # the course's name
    data_flow("all_gather_into_tensor") == "all_gather"             # what moves where, as drawn
"""

from __future__ import annotations

__all__ = [
    "ALWAYS_ASYNC", "CANONICAL_OPS", "DATA_FLOWS", "DEFAULT_PRECISION", "FSDP_ALL_GATHER_OP", "FSDP_REDUCE_SCATTER_OP",
    "LOW_PRECISION_DTYPES", "METHODS_SINCE", "OPS_SINCE", "OPTIMIZERS", "OPTIMIZER_STATES", "PRECISIONS",
    "PROCESS_GROUP_METHODS", "RECEIVES", "RECORDED_OPS", "SENDS", "STAGE_LABELS", "STRATEGIES", "ZERO_STAGES",
    "canonical_op", "data_flow", "process_group_methods", "zero_stage",
]

# ---------------------------------------------------------------- collectives

# The eight data flows draw.collectives knows how to draw (which rank's values end up where).
DATA_FLOWS = ("broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter", "reduce_scatter", "all_to_all")

# One row per call: the course's name, its data flow (None: nothing drawn, or several tensors at
# once whose layout is not one flow), and its other spellings except ProcessGroup methods (below).
# Where torch has no public function (the coalesced flat forms), the name is the ProcessGroup method's.
_TABLE: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("all_reduce", "all_reduce", ("c10d.allreduce_", "c10d_functional.all_reduce")),
    ("all_reduce_coalesced", "all_reduce", ("c10d.allreduce_coalesced_", "c10d_functional.all_reduce_coalesced")),
    ("broadcast", "broadcast", ("c10d.broadcast_", "c10d_functional.broadcast")),
    ("reduce", "reduce", ("c10d.reduce_",)),
    ("all_gather", "all_gather", ("c10d.allgather_",)),
    ("all_gather_coalesced", None, ("c10d.allgather_coalesced_",)),
    # torch 2.13 renamed the flat all-gather; the old names are deprecated wrappers (FSDP2 calls the new one).
    ("all_gather_single", "all_gather", ("all_gather_into_tensor", "_all_gather_base", "c10d._allgather_base_",
                                         "c10d_functional.all_gather_into_tensor")),
    ("all_gather_single_coalesced", None, ("c10d.allgather_into_tensor_coalesced_",
                                           "c10d_functional.all_gather_into_tensor_coalesced")),
    ("gather", "gather", ("c10d.gather_",)),
    # torch 2.15 added a flat gather, spelled as the flat all-gather is.
    ("gather_single", "gather", ("gather_into_tensor",)),
    ("scatter", "scatter", ("c10d.scatter_",)),
    # "reducescatter": NCCL's ncclReduceScatter, as show_collective lower-cases it ("allreduce", "allgather"
    # and "alltoall" are ProcessGroup methods too).
    ("reduce_scatter", "reduce_scatter", ("c10d.reduce_scatter_", "reducescatter")),
    ("reduce_scatter_single", "reduce_scatter", ("reduce_scatter_tensor", "_reduce_scatter_base",
                                                 "c10d._reduce_scatter_base_", "c10d_functional.reduce_scatter_tensor")),
    ("reduce_scatter_single_coalesced", None, ("c10d.reduce_scatter_tensor_coalesced_",
                                               "c10d_functional.reduce_scatter_tensor_coalesced")),
    ("all_to_all", "all_to_all", ("c10d.alltoall_",)),
    ("all_to_all_single", "all_to_all", ("c10d.alltoall_base_", "c10d_functional.all_to_all_single")),
    ("barrier", None, ("c10d.barrier",)),
    ("monitored_barrier", None, ("c10d.monitored_barrier_",)),
    ("send", None, ("c10d.send",)),
    ("recv", None, ("c10d.recv_", "c10d.recv_any_source_")),
    ("isend", None, ()),
    ("irecv", None, ()),
    ("batch_isend_irecv", None, ()),
    # The object collectives pickle each object into a byte tensor and call the tensor collective.
    ("broadcast_object_list", "broadcast", ()),
    ("all_gather_object", "all_gather", ()),
    ("gather_object", "gather", ()),
    ("scatter_object_list", "scatter", ()),
)

CANONICAL_OPS = tuple(name for name, _, _ in _TABLE)

# The C++ ProcessGroup (and Backend) methods behind each call: the torch.distributed functions call
# these, and so could a learner, bypassing dist.* (grading/rank_runner.py blocks them too).
PROCESS_GROUP_METHODS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("allreduce",), "all_reduce_coalesced": ("allreduce_coalesced",),
    "all_gather": ("allgather",), "all_gather_coalesced": ("allgather_coalesced",),
    "all_gather_single": ("all_gather_single", "_allgather_base"),
    "all_gather_single_coalesced": ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"),
    "reduce_scatter": ("reduce_scatter",),
    "reduce_scatter_single": ("reduce_scatter_single", "_reduce_scatter_base"),
    "reduce_scatter_single_coalesced": ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"),
    "all_to_all": ("alltoall",), "all_to_all_single": ("all_to_all_single", "alltoall_base"),
    "broadcast": ("broadcast",), "reduce": ("reduce",), "gather": ("gather",), "scatter": ("scatter",),
    "gather_single": ("gather_single", "gather_into_tensor"),
    "barrier": ("barrier",), "monitored_barrier": ("monitored_barrier",),
    "send": ("send",), "recv": ("recv", "recv_anysource"),
}

# ProcessGroup methods an older torch lacks (torch 2.13 added the *_single spellings; before, only the
# older method of each pair existed): grading blocks the methods this torch has.
METHODS_SINCE = {name: (2, 13) for name in ("all_gather_single", "reduce_scatter_single", "all_to_all_single",
                                            "all_gather_single_coalesced", "reduce_scatter_single_coalesced")}
METHODS_SINCE.update({name: (2, 15) for name in ("gather_single", "gather_into_tensor")})  # the flat gather

# Point-to-point: the calls that hand a tensor to one other rank, and those that take one.
SENDS = ("send", "isend")
RECEIVES = ("recv", "irecv")
# Calls that return a work object whatever their arguments (the others only with async_op=True).
ALWAYS_ASYNC = ("isend", "irecv", "batch_isend_irecv")
_BLOCKING_FORM = {"isend": "send", "irecv": "recv"}  # same ProcessGroup method, waited for or not

# The torch.distributed functions the collective ledger wraps and records under their own name
# (rank/ledger.py). Both spellings of the flat forms: a program may call either, and FSDP1 and
# FSDP2 call the *_single ones (torch >= 2.13); without them FSDP traffic is invisible.
RECORDED_OPS = (
    "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "gather", "gather_into_tensor", "gather_single", "scatter", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
)
# Names an older torch lacks, and the torch version that has them: the ledger wraps what this torch
# has (tests/test_vocabulary.py checks every other name exists). On 2.11 the coalesced flat forms are
# only the ProcessGroup methods allgather_into_tensor_coalesced / reduce_scatter_tensor_coalesced.
OPS_SINCE = {"all_gather_single": (2, 13), "reduce_scatter_single": (2, 13),
             "gather_single": (2, 15), "gather_into_tensor": (2, 15),
             "all_gather_single_coalesced": (2, 13), "reduce_scatter_single_coalesced": (2, 13)}

# What FSDP2 (and FSDP1's reduce-scatter) call in torch 2.13, so the names a ledger records for them.
# NOTE: FSDP1 on CPU all-gathers with the list form, `dist.all_gather(tensor_list, shard)`.
FSDP_ALL_GATHER_OP = "all_gather_single"
FSDP_REDUCE_SCATTER_OP = "reduce_scatter_single"

_CANONICAL = {
    **{method: name for name, methods in PROCESS_GROUP_METHODS.items() for method in methods},
    **{alias: name for name, _, aliases in _TABLE for alias in (name, *aliases)},
}
_DATA_FLOW = {name: flow for name, flow, _ in _TABLE}


def canonical_op(name: str) -> str:
    """The course's name for a collective: `c10d._allgather_base_`, `all_gather_into_tensor` -> `all_gather_single`.

    Names it does not know come back unchanged.
    """
    return _CANONICAL.get(name, name)


def data_flow(name: str) -> str | None:
    """Which of `DATA_FLOWS` a call has, by any spelling: `all_gather_single` -> `all_gather`; None if none."""
    return _DATA_FLOW.get(canonical_op(name))


def process_group_methods(name: str) -> tuple[str, ...]:
    """The ProcessGroup methods `dist.<name>` calls: `isend` -> ("send",), `recv` -> ("recv", "recv_anysource")."""
    name = canonical_op(name)
    return PROCESS_GROUP_METHODS.get(_BLOCKING_FORM.get(name, name), ())


# ---------------------------------------------------------------- training set-ups

# Optimizers the formulas and the simulation know, and the state tensors each keeps per parameter,
# shaped like it (fp32): Adam exp_avg and exp_avg_sq, SGD's momentum buffer, plain SGD nothing.
OPTIMIZER_STATES = {"adam": 2, "sgd-momentum": 1, "sgd": 0}
OPTIMIZERS = tuple(OPTIMIZER_STATES)

# Mixed precision computes and all-gathers in a 16-bit dtype (torch's name here), while the
# sharded master weights stay fp32.
LOW_PRECISION_DTYPES = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}
PRECISIONS = ("fp32", *LOW_PRECISION_DTYPES)
# The one default of every memory formula, explorer and simulation, so their numbers compare:
# mixed-precision Adam, ZeRO's 16 bytes per parameter, as large models are trained.
DEFAULT_PRECISION = "bf16-mixed"

# ZeRO stages (arXiv:1910.02054): 0 replicates everything (DDP), 1 shards the optimizer state,
# 2 also the gradients, 3 also the parameters. Their labels in tables and figures, by stage:
STAGE_LABELS = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3/FSDP")
# The implementations measure.memory runs and predicts: DDP, ZeroRedundancyOptimizer, FSDP1, FSDP2.
STRATEGIES = ("ddp", "zero1", "fsdp1", "fsdp2")
# Every strategy name, and the ZeRO stage it implements.
ZERO_STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "fsdp1": 3, "fsdp2": 3}


def zero_stage(strategy: str) -> int:
    """The ZeRO stage of a strategy name or label: "fsdp2" -> 3, "zero-1" and "ZeRO-1" -> 1."""
    key = strategy.lower().replace("-", "").replace("_", "")
    labels = {label.lower().replace("-", ""): stage for stage, label in enumerate(STAGE_LABELS)}
    if key in ZERO_STAGES or key in labels:
        return ZERO_STAGES.get(key, labels.get(key))
    raise ValueError(f"strategy must be one of {sorted(ZERO_STAGES)} (or a label in {STAGE_LABELS}), "
                     f"not {strategy!r}")
