"""course_lib.vocabulary: one table of names, checked against what this torch actually has and does.

Single process, no process group: the names are compared with torch.distributed's
functions, the C++ ProcessGroup's methods, CommDebugMode's op lists and the
torch optimizers, so a spelling torch adds, renames or drops fails here first.
"""

import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as cpp

from course_lib import theory
from course_lib.measure.simulate_worker import make_optimizer
from course_lib.vocabulary import (
    CANONICAL_OPS, DATA_FLOWS, FSDP_ALL_GATHER_OP, FSDP_REDUCE_SCATTER_OP, LOW_PRECISION_DTYPES, METHODS_SINCE, OPS_SINCE,
    OPTIMIZER_STATES, OPTIMIZERS, PRECISIONS, PROCESS_GROUP_METHODS, RECEIVES, RECORDED_OPS, SENDS, STAGE_LABELS,
    STRATEGIES, ZERO_STAGES, _CANONICAL, canonical_op, data_flow, process_group_methods, zero_stage,
)

TORCH_VERSION = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
PG_METHODS = {method for methods in PROCESS_GROUP_METHODS.values() for method in methods}


def _comm_debug_mode_ops() -> set[str]:
    """Every op name CommDebugMode can report in this torch (its dispatcher and functional collectives)."""
    from torch.distributed.tensor.debug import _comm_mode

    names = {str(op) for op in _comm_mode.c10d_collective_ops}
    names |= {str(op) for op in _comm_mode.NATIVE_TO_PY_MAPPING.values()}
    assert names, "CommDebugMode's op lists moved: update this test"
    return names


def test_canonical_op_is_idempotent_and_canonical_names_are_their_own():
    for spelling in _CANONICAL:
        name = canonical_op(spelling)
        assert name in CANONICAL_OPS, spelling
        assert canonical_op(name) == name, spelling
    assert len(set(CANONICAL_OPS)) == len(CANONICAL_OPS)
    assert canonical_op("no_such_collective") == "no_such_collective"


def test_the_flat_collectives_have_their_torch_2_13_names():
    for spelling in ("all_gather_into_tensor", "_all_gather_base", "_allgather_base", "c10d._allgather_base_",
                     "c10d_functional.all_gather_into_tensor", "all_gather_single"):
        assert canonical_op(spelling) == "all_gather_single", spelling
        assert data_flow(spelling) == "all_gather", spelling  # drawn like the list form
    for spelling in ("reduce_scatter_tensor", "_reduce_scatter_base", "c10d._reduce_scatter_base_"):
        assert canonical_op(spelling) == "reduce_scatter_single" and data_flow(spelling) == "reduce_scatter"
    assert canonical_op("alltoall_base") == "all_to_all_single" and data_flow("alltoall") == "all_to_all"
    assert canonical_op("allreduce") == canonical_op("c10d.allreduce_") == "all_reduce"
    assert data_flow("barrier") is None and data_flow("send") is None and data_flow("no_such") is None


def test_every_canonical_name_is_a_torch_function_or_a_process_group_method():
    for name in CANONICAL_OPS:
        exists = hasattr(dist, name) or hasattr(cpp.ProcessGroup, name)
        if name in OPS_SINCE and TORCH_VERSION < OPS_SINCE[name]:
            assert not exists, f"{name} exists before {OPS_SINCE[name]}: correct OPS_SINCE"
            continue
        assert exists, name


def test_every_recorded_op_exists_in_this_torch_and_has_a_course_name():
    for name in RECORDED_OPS:
        assert canonical_op(name) in CANONICAL_OPS, name
        if name in OPS_SINCE and TORCH_VERSION < OPS_SINCE[name]:
            assert not hasattr(dist, name), f"{name} exists before {OPS_SINCE[name]}: correct OPS_SINCE"
            continue
        assert callable(getattr(dist, name, None)), f"torch {torch.__version__} has no dist.{name}"
    assert {canonical_op(name) for name in OPS_SINCE} <= set(CANONICAL_OPS)  # a course name, or a spelling of one
    # FSDP's ops are recorded under the name the lessons and theory use.
    assert {FSDP_ALL_GATHER_OP, FSDP_REDUCE_SCATTER_OP} <= set(RECORDED_OPS) & set(CANONICAL_OPS)
    assert set(SENDS) | set(RECEIVES) <= set(RECORDED_OPS)


def test_every_op_comm_debug_mode_reports_has_a_course_name():
    for name in _comm_debug_mode_ops():
        assert canonical_op(name) != name and canonical_op(name) in CANONICAL_OPS, name


def test_every_c10d_dispatcher_op_has_a_course_name():
    ops = [name for name in dir(torch.ops.c10d) if name not in ("_dir", "name") and not name.startswith("__")]
    assert "allreduce_" in ops
    for op in ops:
        assert canonical_op(f"c10d.{op}") in CANONICAL_OPS, op


def test_process_group_methods_are_the_ones_this_torch_has():
    for method in PG_METHODS:
        if method in METHODS_SINCE and TORCH_VERSION < METHODS_SINCE[method]:
            assert not hasattr(cpp.ProcessGroup, method), f"{method} exists before {METHODS_SINCE[method]}"
            continue
        assert hasattr(cpp.ProcessGroup, method), method
    # Every collective-looking method of the C++ group is listed (a learner could call it directly).
    looks_collective = re.compile(r"gather|scatter|reduce|all|broadcast|barrier|send|recv")
    methods = {m for m in dir(cpp.ProcessGroup) if looks_collective.search(m) and not m.startswith("__")}
    assert methods - PG_METHODS == set(), "new ProcessGroup methods: add them to PROCESS_GROUP_METHODS"
    for method in PG_METHODS:
        assert canonical_op(method) in PROCESS_GROUP_METHODS, method


def test_process_group_methods_behind_each_call():
    assert process_group_methods("isend") == ("send",)
    assert process_group_methods("irecv") == process_group_methods("recv") == ("recv", "recv_anysource")
    assert process_group_methods("all_gather_into_tensor") == ("all_gather_single", "_allgather_base")
    assert process_group_methods("all_reduce") == ("allreduce",)
    assert process_group_methods("batch_isend_irecv") == ()


def test_data_flows_are_the_drawable_ones():
    flows = {data_flow(name) for name in CANONICAL_OPS} - {None}
    assert flows == set(DATA_FLOWS)


def test_colours_and_theory_use_course_names():
    from course_lib.draw.comm import OP_COLORS

    for op in OP_COLORS:
        assert op in CANONICAL_OPS and canonical_op(op) == op, op
    for stage in range(4):
        assert set(theory.zero_step_sent_bytes(1.0, 1.0, 4, stage=stage)) <= set(DATA_FLOWS)
    for phase in theory.tp_layer_comm(1, 8, 16, 2, sequence_parallel=True).values():
        assert {op for op, _ in phase} <= set(DATA_FLOWS)
    units = [[(8, 4)], [(5,)]]
    assert {op for op, _ in theory.fsdp2_step_collectives(units, 2)} == {FSDP_ALL_GATHER_OP, FSDP_REDUCE_SCATTER_OP}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_state_counts_are_what_torch_keeps(optimizer):
    param = torch.nn.Parameter(torch.ones(3, 2))
    param.grad = torch.ones(3, 2)
    opt = make_optimizer([param], optimizer)
    opt.step()
    shaped_like_param = [v for v in opt.state[param].values() if torch.is_tensor(v) and v.shape == param.shape]
    assert len(shaped_like_param) == OPTIMIZER_STATES[optimizer]
    assert theory.bytes_per_param(precision="fp32", optimizer=optimizer).optimizer == 4 * OPTIMIZER_STATES[optimizer]
    with pytest.raises(ValueError):
        make_optimizer([param], "lion")


def test_precisions_name_torch_dtypes_and_theory_knows_them():
    assert PRECISIONS[0] == "fp32" and set(PRECISIONS[1:]) == set(LOW_PRECISION_DTYPES)
    for precision in PRECISIONS:
        per = theory.bytes_per_param(precision=precision, optimizer="adam")
        element = getattr(torch, LOW_PRECISION_DTYPES.get(precision, "float32")).itemsize
        assert per.params == per.grads == element
    with pytest.raises(ValueError, match="precision must be one of"):
        theory.bytes_per_param(precision="fp8-mixed")


def test_strategies_and_their_zero_stages():
    assert set(STRATEGIES) <= set(ZERO_STAGES)
    assert [zero_stage(s) for s in STRATEGIES] == [0, 1, 3, 3]
    assert [zero_stage(label) for label in STAGE_LABELS] == [0, 1, 2, 3]
    assert zero_stage("zero-2") == zero_stage("ZeRO_2") == zero_stage("zero2") == 2
    assert zero_stage("fsdp") == 3
    with pytest.raises(ValueError, match="strategy must be one of"):
        zero_stage("pipeline")


def test_vocabulary_imports_no_torch():
    # Every rank imports it (through the ledger) before it may need torch.
    code = "import sys, course_lib.vocabulary; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"
