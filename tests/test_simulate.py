"""course_lib.measure.simulate: FSDP2 memory and traffic simulated on a fake process group equal a real gloo run.

One torchrun launch per world size (2 and 4) shards a tiny Llama whose sizes
do not divide by 4 (hidden 18, intermediate 37, vocab 101, k/v 6 rows: at 4
ranks the last rank holds shorter shards, one of them empty) with
`fully_shard`, in fp32 and in bf16-mixed, runs one Adam step, and publishes
its bytes; the ledger holds its collectives. ONE `simulate_many` call
simulates the same configurations (every rank stepped) and Llama-2-7B at 8
ranks; every byte must agree, the collectives the simulation's ledger saw
with those of the real ranks' ledgers, and match course_lib.theory computed
from the shapes. The 7B run, at the default precision, must also agree with
`memory_explorer` at its defaults. The table's timing lives in
bench/bench_simulate.py, not here.
"""

import gc
import math
import warnings

import pytest

from course_lib import theory
from course_lib.draw.figures import png_bytes
from course_lib.draw.simulation import show_simulation
from course_lib.draw.widgets import memory_explorer
from course_lib.launcher.torchrun import run_torchrun
from course_lib.measure.simulate import (
    LABEL, LLAMA_CONFIGS, SimulationError, result_rows, simulate_fsdp2, simulate_many,
)
from course_lib.vocabulary import DEFAULT_PRECISION, FSDP_ALL_GATHER_OP, FSDP_REDUCE_SCATTER_OP, canonical_op

TINY = dict(hidden=18, layers=2, vocab=101, intermediate=37, heads=3, kv_heads=1)
WORLD_SIZES = [2, 4]
PRECISIONS = ["fp32", "bf16-mixed"]

SCRIPT = f"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaForCausalLM
import course_lib as cl
from course_lib.measure.simulate_worker import llama_config, make_optimizer, memory_of, shard_llama

info = cl.init(timeout_s=60)
mesh = init_device_mesh("cpu", (info.world_size,))
for precision in {PRECISIONS!r}:
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config({TINY!r}))
    layers = [[list(p.shape) for p in layer.parameters()] for layer in model.model.layers]
    in_layers = {{id(p) for layer in model.model.layers for p in layer.parameters()}}
    root = [list(p.shape) for p in model.parameters() if id(p) not in in_layers]
    shard_llama(model, mesh, precision=precision)
    optimizer = make_optimizer(model.parameters(), "adam")
    input_ids = torch.randint(0, {TINY["vocab"]}, (2, 8))
    dist.barrier()  # ledger marker: the step starts
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    dist.barrier()  # ledger marker: the step ended
    cl.publish(precision.replace("-", "_"), {{"units": layers + [root], "memory": memory_of(model, optimizer)}})
dist.destroy_process_group()
"""


def llama_units(*, hidden, layers, vocab, intermediate, heads, kv_heads):
    """Each fully_shard unit's parameter shapes, decoder layers in order then the root (HF LlamaForCausalLM)."""
    head_dim = hidden // heads
    layer = [(heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden),
             (hidden, heads * head_dim), (intermediate, hidden), (intermediate, hidden), (hidden, intermediate),
             (hidden,), (hidden,)]
    return [layer] * layers + [[(vocab, hidden), (hidden,), (vocab, hidden)]]


def local_bytes(units, world_size, rank, element_size=4):
    return sum(math.prod(theory.fsdp2_local_shape(shape, world_size, rank)) * element_size
               for unit in units for shape in unit)


@pytest.fixture(scope="module")
def simulated():
    """Every simulation of this file, from one call: tiny at 2 and 4 ranks (both precisions, every rank
    stepped; and at 4 as the table runs it: default precision, only rank 0 stepped), 7B at 8 ranks (default)."""
    jobs = [dict(config=TINY, world_size=n, ranks="all", precision=p, step_every_rank=True)
            for n in WORLD_SIZES for p in PRECISIONS]
    jobs += [dict(config=TINY, world_size=4, ranks=(0, -1)), dict(config="llama-7b", world_size=8, ranks=(0, -1))]
    results = simulate_many(jobs, timeout_s=240)
    tiny = {(r.world_size, r.precision): r for r in results[:-2]}
    return tiny, results[-1], results[-2]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}ranks")
def real(request):
    result = run_torchrun(SCRIPT, request.param, timeout_s=240)
    assert result.ok, "\n".join(result.stderr.values()) or result.agent_output
    return result


def ledger_steps(entries):
    """Every call (the course's op name, input bytes) between each pair of barriers: one list per step."""
    barriers = [i for i, e in enumerate(entries) if e["op"] == "barrier"]
    return [[(canonical_op(e["op"]), e["bytes"]) for e in entries[a + 1:b]]
            for a, b in zip(barriers[::2], barriers[1::2])]


def test_simulation_equals_real_fsdp2_run(real, simulated):
    n = real.nproc
    units = llama_units(**TINY)
    for step, precision in enumerate(PRECISIONS):
        sim = simulated[0][(n, precision)]
        assert sim.label == LABEL and sim.stepped_ranks == list(range(n))
        assert sim.num_params == theory.llama_param_count(**TINY)
        for rank in range(n):
            published = real.results[precision.replace("-", "_")][rank]
            assert published["units"] == [[list(s) for s in unit] for unit in units]  # llama_units is HF's Llama
            measured = published["memory"]
            assert (sim.param_bytes[rank], sim.grad_bytes[rank], sim.optimizer_bytes[rank]) == (
                measured["params"], measured["grads"], measured["optimizer"]), (precision, rank)
            # The fake step issued exactly the real step's calls, in order, as both ranks' ledgers saw them.
            assert sim.collectives == ledger_steps(real.ledgers[rank])[step], (precision, rank)
        # Sharded fp32 master weights in both precisions, exact from the shapes, padding included.
        assert sim.param_bytes == {r: local_bytes(units, n, r) for r in range(n)}
        assert sim.grad_bytes == sim.param_bytes  # FSDP2 keeps gradients sharded, in the fp32 of the shards
        assert sim.optimizer_bytes == {r: 2 * sim.param_bytes[r] for r in range(n)}  # Adam: exp_avg, exp_avg_sq
    fp32, mixed = simulated[0][(n, "fp32")], simulated[0][(n, "bf16-mixed")]
    assert {op for op, _ in fp32.collectives} == {FSDP_ALL_GATHER_OP, FSDP_REDUCE_SCATTER_OP}
    assert fp32.collectives == theory.fsdp2_step_collectives(
        units, n, element_size=4, inputs_require_grad=True)  # the embedding's output needs a gradient
    # bf16-mixed all-gathers 2-byte parameters and reduce-scatters fp32 gradients (reduce_dtype).
    assert mixed.all_gather_bytes * 2 == fp32.all_gather_bytes
    assert mixed.reduce_scatter_bytes == fp32.reduce_scatter_bytes
    if n == 4:
        assert fp32.param_bytes[3] < fp32.param_bytes[0]  # the sizes pad: the last rank's shards are shorter
        # As the table runs: rank 0 stepped, the last rank only sharded, its grads/state sized from its shards.
        table_like = simulated[2]
        assert table_like.precision == DEFAULT_PRECISION == "bf16-mixed"
        assert table_like.stepped_ranks == [0] and table_like.collectives == mixed.collectives
        for rank in (0, 3):
            measured = real.results["bf16_mixed"][rank]["memory"]
            assert (table_like.param_bytes[rank], table_like.grad_bytes[rank], table_like.optimizer_bytes[rank]) == (
                measured["params"], measured["grads"], measured["optimizer"])


def _bf16_mixed(collectives):
    """FSDP2's step in bf16-mixed from its fp32 one: all-gathers of 2-byte parameters, fp32 reduce-scatters."""
    return [(op, nbytes // 2 if op == FSDP_ALL_GATHER_OP else nbytes) for op, nbytes in collectives]


def test_llama_7b_on_8_ranks_is_exact_and_labelled_simulated(simulated):
    import torch.distributed as dist

    sim = simulated[1]
    config = LLAMA_CONFIGS["llama-7b"]
    units = llama_units(**config)
    assert sim.precision == DEFAULT_PRECISION  # as the table runs it
    assert sim.num_params == theory.llama_param_count(**config) == 6_738_415_616
    assert sim.stepped_ranks == [0] and sorted(sim.param_bytes) == [0, 7]
    for rank in (0, 7):
        assert sim.param_bytes[rank] == local_bytes(units, 8, rank)
        assert sim.grad_bytes[rank] == sim.param_bytes[rank]
        assert sim.optimizer_bytes[rank] == 2 * sim.param_bytes[rank]
    assert math.isclose(sim.param_bytes[0], 6.74e9 * 4 / 8, rel_tol=1e-3)
    # Every 7B dimension divides by 8: no padding, so ZeRO-3's formula is exact here.
    assert sim.total_bytes(7) == theory.zero_memory_per_rank(sim.num_params, 8, stage=3).total
    assert sim.collectives == _bf16_mixed(theory.fsdp2_step_collectives(
        units, 8, element_size=4, inputs_require_grad=True))
    assert "simulated" in sim.label and "fake process group" in sim.label
    assert not dist.is_initialized()  # the fake group lived and died in the subprocess


def test_memory_explorer_and_simulation_agree_at_their_defaults(simulated):
    """The same model, world size and (default) precision: the same bytes per rank, to the byte."""
    sim = simulated[1]
    explorer = memory_explorer(num_params=sim.num_params, world_size=8)  # defaults, as a learner calls both
    assert explorer.data["precision"] == sim.precision == DEFAULT_PRECISION
    assert f", {DEFAULT_PRECISION}, adam" in explorer.text.splitlines()[0]
    header = show_simulation(result_rows(sim))[0]["lines"][0]
    assert header.startswith(f"SIMULATED, {DEFAULT_PRECISION} (bf16 all-gathers, fp32 reduce-scatters) + adam:")
    zero3 = explorer.data["memory"]["ZeRO-3/FSDP"]
    # No tolerance: every 7B dimension divides by 8, so FSDP2 pads nothing (with padding the last
    # rank would hold less and the others up to N-1 rows per parameter more than total/N).
    for rank in (0, 7):
        assert sim.total_bytes(rank) == zero3["total"]  # 16 bytes per parameter / 8
    # The same 16 bytes, split differently: ZeRO counts 2-byte weights and gradients and an fp32
    # master copy in the optimizer (2 + 2 + 12); FSDP2's fp32 shards ARE the master weights, its
    # gradient shards fp32 (reduce_dtype), Adam's states 8 (4 + 4 + 8).
    assert (sim.param_bytes[0], sim.grad_bytes[0]) == (2 * zero3["params"], 2 * zero3["grads"])
    assert sim.optimizer_bytes[0] == zero3["optimizer"] - 4 * sim.num_params / 8
    # Traffic differs for two stated reasons, exactly: FSDP2 reduce-scatters fp32 gradients (ZeRO's
    # formula 2-byte ones: half), and keeps the root (embeddings, norm, lm_head) gathered after
    # forward, so backward re-gathers only the decoder layers.
    sent = {flow: sum(theory.ring_all_gather_bytes(8 * n, 8) if op == FSDP_ALL_GATHER_OP
                      else theory.ring_reduce_scatter_bytes(n, 8) for op, n in sim.collectives if op == flow)
            for flow in (FSDP_ALL_GATHER_OP, FSDP_REDUCE_SCATTER_OP)}
    formula = explorer.data["comm"]["ZeRO-3/FSDP"]
    assert sent[FSDP_REDUCE_SCATTER_OP] == pytest.approx(2 * formula["reduce_scatter"], rel=1e-12)
    root_numel = sum(math.prod(shape) for shape in llama_units(**LLAMA_CONFIGS["llama-7b"])[-1])
    assert sent[FSDP_ALL_GATHER_OP] == pytest.approx(
        formula["all_gather"] - theory.ring_all_gather_bytes(2 * root_numel, 8), rel=1e-12)


def test_rows_and_figure_show_what_was_simulated(simulated):
    tiny, llama, _ = simulated
    results = [tiny[(2, "fp32")], tiny[(4, "fp32")], llama]
    rows = [row for result in results for row in result_rows(result)]
    assert all(row["simulated"] for row in rows) and len(rows) == 2 + 4 + 2
    row = next(r for r in rows if r["model"] == "llama-7b" and r["rank"] == 0)
    assert row["total_bytes"] == llama.total_bytes(0)
    # An all-gather's output is 8 inputs; a reduce-scatter's input is what the ledger records.
    assert row["sent_bytes"] == round(sum(
        theory.ring_all_gather_bytes(8 * nbytes, 8) if op == FSDP_ALL_GATHER_OP
        else theory.ring_reduce_scatter_bytes(nbytes, 8) for op, nbytes in llama.collectives))
    with warnings.catch_warnings():
        gc.collect()  # not a ResourceWarning for a file an earlier test left to the collector
        warnings.simplefilter("error")
        data, fig = show_simulation(rows)
        assert png_bytes(fig).startswith(b"\x89PNG")
    assert data["title"].startswith("SIMULATED") and data["label"] == LABEL
    assert data["memory"]["custom, first rank"] == [(2, tiny[(2, "fp32")].total_bytes(0)),
                                                   (4, tiny[(4, "fp32")].total_bytes(0))]
    assert data["memory"]["custom, last rank"] == [(2, tiny[(2, "fp32")].total_bytes(1)),
                                                  (4, tiny[(4, "fp32")].total_bytes(3))]
    assert "llama-7b, last rank" not in data["memory"]  # 7B at 8 ranks: no padding, one line
    assert data["sent"]["llama-7b"] == [(8, row["sent_bytes"])]
    assert data["lines"][0].startswith("SIMULATED") and len(data["lines"]) == 1 + len(rows)
    assert "llama-7b on    8 ranks, rank    0: " in data["lines"][-2]


def test_failures_are_one_line_errors():
    with pytest.raises(ValueError):
        simulate_fsdp2(TINY, world_size=2, precision="fp8")
    with pytest.raises(SimulationError, match=r"no configuration finished within 0.5 s") as deadline:
        simulate_fsdp2("llama-70b", world_size=8, timeout_s=0.5)
    assert "\n" not in str(deadline.value)
    with pytest.raises(SimulationError, match=r"simulation failed \(exit 1\): .*Error") as failed:
        simulate_fsdp2(dict(TINY, intermediate=-1), world_size=2, timeout_s=120)
    assert "\n" not in str(failed.value)


def test_memory_axis_has_labels_within_one_decade():
    # One configuration (as `simulate_table(models=("llama-7b",), world_sizes=(8,))` gives): 13.5 GB
    # and the 80 GB line share one decade, where a log axis has no labelled major tick.
    rows = [dict(model="llama-7b", world_size=8, rank=rank, precision="bf16-mixed", optimizer="adam",
                 total_bytes=13_477_000_000, sent_bytes=46_710_000_000) for rank in (0, 7)]
    _, fig = show_simulation(rows)
    fig.draw_without_rendering()
    memory_ax = fig.axes[0]
    shown = [t.get_text() for t in memory_ax.get_yticklabels(which="both") if t.get_text()
             and memory_ax.get_ylim()[0] <= t.get_position()[1] <= memory_ax.get_ylim()[1]]
    assert {"20 GB", "40 GB", "80 GB"} <= set(shown), shown
