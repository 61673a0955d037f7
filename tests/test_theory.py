"""The formulas module: known values from the papers, hand-worked layouts, invariants.

Single process, no process group. The layouts are checked against real FSDP1
and FSDP2 runs in the sharding tests; here they are checked against cases
small enough to work out by hand, and against invariants any layout must keep.
"""

import pytest
import torch

from course_lib import theory
from course_lib.models import toy_model

GB = 1e9


def test_bytes_per_param_follows_zero_accounting():
    mixed_adam = theory.bytes_per_param(precision="bf16-mixed", optimizer="adam")
    assert (mixed_adam.params, mixed_adam.grads, mixed_adam.optimizer, mixed_adam.total) == (2, 2, 12, 16)
    assert theory.bytes_per_param(precision="fp16-mixed", optimizer="adam") == mixed_adam
    assert theory.bytes_per_param(precision="fp32", optimizer="adam").total == 4 + 4 + 8
    assert theory.bytes_per_param(precision="fp32", optimizer="sgd").total == 8
    assert theory.bytes_per_param(precision="bf16-mixed", optimizer="sgd-momentum").total == 2 + 2 + 4 + 4
    with pytest.raises(ValueError):
        theory.bytes_per_param(precision="int4")


def test_zero_stages_reproduce_the_papers_7_5b_example():
    # ZeRO paper, Figure 1: psi = 7.5B parameters, K = 12, N_d = 64 data-parallel ranks.
    psi = 7_500_000_000
    per_stage = [theory.zero_memory_per_rank(psi, 64, stage=s).total / GB for s in range(4)]
    assert per_stage[0] == 120.0
    assert [round(x, 1) for x in per_stage[1:]] == [31.4, 16.6, 1.9]
    stage2 = theory.zero_memory_per_rank(psi, 64, stage=2)
    assert (stage2.params, stage2.grads, stage2.optimizer) == (2 * psi, 2 * psi / 64, 12 * psi / 64)
    assert theory.zero_memory_per_rank(psi, 1, stage=3).total == per_stage[0] * GB  # one rank: nothing to share


def test_chunk_sizes_match_torch_chunk():
    assert theory.chunk_sizes(503, 2) == [252, 251]
    assert theory.chunk_sizes(8, 4) == [2, 2, 2, 2]  # divisible: equal, no padding
    assert theory.chunk_sizes(5, 4) == [2, 2, 1, 0]  # fewer chunks than ranks
    assert theory.chunk_sizes(6, 4) == [2, 2, 2, 0]  # ceil(6/4) = 2 leaves rank 3 nothing
    assert theory.chunk_sizes(2, 4) == [1, 1, 0, 0]  # n < N
    for n in range(0, 20):
        for world in range(1, 6):
            pieces = [c.numel() for c in torch.arange(n).chunk(world)] if n else []
            assert theory.chunk_sizes(n, world) == pieces + [0] * (world - len(pieces)), (n, world)


def test_fsdp1_hand_worked_layouts():
    # 5 + 3 elements over 4 ranks, no alignment: chunks of 2, "a" ends inside rank 2's shard.
    shards = theory.fsdp1_flat_shards([("a", 5), ("b", 3)], 4)
    assert [s.pieces for s in shards] == [[("a", 0, 2)], [("a", 2, 4)], [("a", 4, 5), ("b", 0, 1)], [("b", 1, 3)]]
    assert [s.padding for s in shards] == [0, 0, 0, 0]
    # One 5-element parameter over 4 ranks: chunks 2, 2, 1 and none; FSDP pads each to 2.
    shards = theory.fsdp1_flat_shards([("w", 5)], 4)
    assert [(s.start, s.end, s.numel, s.padding) for s in shards] == [
        (0, 2, 2, 0), (2, 4, 2, 0), (4, 5, 1, 1), (5, 5, 0, 2)]
    assert shards[3].pieces == []
    # use_orig_params, fp32: "b" must start on a 16-byte (4-element) boundary: a 0..5, 3 padding, b 8..11,
    # then 1 more so 12 divides by 4 ranks. Chunks of 3: [a a a] [a a .] [. . b] [b b .].
    shards = theory.fsdp1_flat_shards([("a", 5), ("b", 3)], 4, use_orig_params=True)
    assert [s.pieces for s in shards] == [[("a", 0, 3)], [("a", 3, 5)], [("b", 0, 1)], [("b", 1, 3)]]
    assert [(s.numel, s.align_padding, s.padding) for s in shards] == [(3, 0, 0), (2, 1, 0), (1, 2, 0), (2, 1, 0)]
    # bf16 aligns to 8 elements: a 0..9, 7 padding, b 16..19, +1 to 20, chunks of 5 (fp32 would give 16, chunks of 4).
    assert theory.fsdp1_flat_shards([("a", 9), ("b", 3)], 4, use_orig_params=True, element_size=2)[0].shard_numel == 5
    assert theory.fsdp1_flat_shards([("a", 9), ("b", 3)], 4, use_orig_params=True)[0].shard_numel == 4


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_fsdp1_shards_cover_every_element_once(world_size, use_orig_params):
    model = toy_model()
    units = [  # one unit for the whole model, and the per-Block wrapping's units
        [(n, p.numel()) for n, p in model.named_parameters()],
        [(n, p.numel()) for n, p in model.blocks[0].named_parameters()],
        [(n, p.numel()) for n, p in model.head.named_parameters()],
    ]
    for named_numels in units:
        shards = theory.fsdp1_flat_shards(named_numels, world_size, use_orig_params=use_orig_params)
        assert [s.rank for s in shards] == list(range(world_size))
        assert len({s.shard_numel for s in shards}) == 1  # every rank holds the same size
        assert shards[0].start == 0 and all(a.end == b.start for a, b in zip(shards, shards[1:]))
        # Tail padding only on the last ranks, and only what torch.chunk left short.
        paddings = [s.padding for s in shards]
        assert paddings == sorted(paddings)
        assert all(s.end - s.start + s.padding == s.shard_numel for s in shards)
        if use_orig_params:
            assert all(p == 0 for p in paddings)  # the FlatParameter itself was padded to divide
            assert shards[-1].end % world_size == 0
        else:
            assert all(s.align_padding == 0 for s in shards)
            assert shards[-1].end == sum(n for _, n in named_numels)
        # Concatenating the pieces walks every parameter from its first to its last element, in order.
        walked = [piece for s in shards for piece in s.pieces]
        expected_walk = [name for name, _ in named_numels]
        assert [n for i, (n, _, _) in enumerate(walked) if i == 0 or walked[i - 1][0] != n] == expected_walk
        for name, numel in named_numels:
            ranges = [(first, last) for n, first, last in walked if n == name]
            assert ranges[0][0] == 0 and ranges[-1][1] == numel
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:]))
        assert sum(s.numel for s in shards) == sum(n for _, n in named_numels)


def test_fsdp2_shapes_and_padded_shards():
    assert [theory.fsdp2_local_shape((13, 8), 2, r) for r in range(2)] == [(7, 8), (6, 8)]
    assert [theory.fsdp2_local_shape((5,), 4, r) for r in range(4)] == [(2,), (2,), (1,), (0,)]
    assert [theory.fsdp2_local_shape((3, 4), 4, r) for r in range(4)] == [(1, 4)] * 3 + [(0, 4)]
    assert theory.fsdp2_padded_shard_numel((13, 8), 2) == 7 * 8
    assert theory.fsdp2_padded_shard_numel((8, 13), 4) == 2 * 13
    assert theory.fsdp2_padded_shard_numel((5,), 4) == 2
    for shape in [(13, 8), (8, 13), (5,), (5, 8), (1, 3)]:
        for world in (1, 2, 3, 4, 8):
            locals_ = [torch.Size(theory.fsdp2_local_shape(shape, world, r)).numel() for r in range(world)]
            assert sum(locals_) == torch.Size(shape).numel()
            assert max(locals_) == theory.fsdp2_padded_shard_numel(shape, world)


def test_ddp_step_bytes_is_every_gradient_once():
    model = toy_model()
    assert theory.ddp_step_bytes([p.numel() for p in model.parameters()]) == {"all_reduce": 503 * 4}
    assert theory.ddp_step_bytes([10, 6], element_size=2) == {"all_reduce": 32}


def test_fsdp2_step_collectives_for_the_toy_model():
    model = toy_model()
    units = [[tuple(p.shape) for p in block.parameters()] for block in model.blocks]
    units.append([tuple(p.shape) for p in model.head.parameters()])
    # 2 ranks: a block's padded shards are 7x8 + 7 + 4x13 + 4 = 119 floats, 476 B; the root's
    # (head 5x8 + 5) 3x8 + 3 = 27 floats, 108 B. Reduce-scatters take N times that.
    ag_root, ag_block, rs_root, rs_block = ("all_gather_single", 108), ("all_gather_single", 476), \
        ("reduce_scatter_single", 216), ("reduce_scatter_single", 952)
    assert theory.fsdp2_step_collectives(units, 2) == [
        ag_root, ag_block, ag_block,  # forward: root first, then the blocks
        ag_block, ag_block,  # backward: block 1 again, block 0 prefetched; the root stayed unsharded
        rs_block, rs_root, rs_block,  # block 1, then the end-of-backward callback: root, block 0
    ]
    assert theory.fsdp2_step_collectives(units, 2, reshard_after_forward=False) == [
        ag_root, ag_block, ag_block, rs_block, rs_root, rs_block]
    assert theory.fsdp2_step_collectives(units, 2, inputs_require_grad=True)[-3:] == [rs_block, rs_block, rs_root]
    assert theory.fsdp2_step_collectives(units, 1) == []
    # Three blocks: backward interleaves one prefetch ahead of each reduce-scatter.
    ops = [op[0][0] for op in theory.fsdp2_step_collectives(units[:1] * 3 + units[-1:], 4)]
    assert ops == list("aaaa" "aa" "r" "a" "r" "rr")


def test_ring_bytes():
    assert [theory.ring_all_reduce_bytes(1000, n) for n in (1, 2, 4)] == [0, 1000, 1500]
    assert [theory.ring_all_gather_bytes(1000, n) for n in (1, 2, 4)] == [0, 500, 750]
    assert [theory.ring_reduce_scatter_bytes(1000, n) for n in (1, 2, 4)] == [0, 500, 750]
    # 4 ranks, 1 ms per step, 1000 B/s: all-reduce 6 steps + 1500 B; all-gather 3 steps + 750 B.
    kw = {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1000.0}
    assert theory.ring_time_s("all_reduce", 1000, 4, **kw) == pytest.approx(0.006 + 1.5)
    assert theory.ring_time_s("all_gather", 1000, 4, **kw) == pytest.approx(0.003 + 0.75)
    assert theory.ring_time_s("reduce_scatter", 1000, 1, **kw) == 0
    with pytest.raises(ValueError):
        theory.ring_time_s("broadcast", 1000, 4, **kw)


def test_zero_stages_send_what_the_zero_paper_says():
    # 4 ranks, 1000 B of weights and of gradients (same dtype): DDP all-reduce 1500 B sent per rank.
    ddp = theory.zero_step_sent_bytes(1000, 1000, 4, stage=0)
    assert ddp == {"all_reduce": 1500}
    for stage in (1, 2):  # reduce-scatter 750 + all-gather 750: the same volume as DDP
        assert theory.zero_step_sent_bytes(1000, 1000, 4, stage=stage) == {"reduce_scatter": 750, "all_gather": 750}
    zero3 = theory.zero_step_sent_bytes(1000, 1000, 4, stage=3)
    assert zero3 == {"reduce_scatter": 750, "all_gather": 1500} and sum(zero3.values()) == 1.5 * ddp["all_reduce"]
    with pytest.raises(ValueError):
        theory.zero_step_sent_bytes(1000, 1000, 4, stage=4)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_ring_schedule_sums_on_every_rank(world_size):
    n = world_size
    data = [[(rank + 1) * 10 ** chunk for chunk in range(n)] for rank in range(n)]  # rank r, chunk c
    expected = [sum(data[r][c] for r in range(n)) for c in range(n)]
    schedule = theory.ring_all_reduce_schedule(n)
    assert len(schedule) == 2 * (n - 1)
    for step in schedule:
        assert sorted(src for src, _, _, _ in step) == list(range(n))  # everyone sends once ...
        assert sorted(dst for _, dst, _, _ in step) == list(range(n))  # ... and receives once
        sent = [(dst, chunk, phase, data[src][chunk]) for src, dst, chunk, phase in step]  # all at once
        for dst, chunk, phase, value in sent:
            data[dst][chunk] = data[dst][chunk] + value if phase == "reduce-scatter" else value
    assert data == [expected] * n
    # Each rank sent 2(N-1) chunks of 1/N of the tensor: the ring all-reduce formula.
    sent_chunks = sum(1 for step in schedule for src, *_ in step if src == 0)
    assert sent_chunks / n * 1000 == pytest.approx(theory.ring_all_reduce_bytes(1000, n))


def test_tp_layer_comm_with_and_without_sequence_parallel():
    b, s, h = 2, 16, 64
    nbytes = b * s * h * 2
    plain = theory.tp_layer_comm(b, s, h, 4)
    assert plain == {"forward": [("all_reduce", nbytes)] * 2, "backward": [("all_reduce", nbytes)] * 2}
    sp = theory.tp_layer_comm(b, s, h, 4, sequence_parallel=True)
    assert [op for op, _ in sp["forward"]] == ["all_gather", "reduce_scatter"] * 2 == [op for op, _ in sp["backward"]]
    ring = {"all_reduce": theory.ring_all_reduce_bytes, "all_gather": theory.ring_all_gather_bytes,
            "reduce_scatter": theory.ring_reduce_scatter_bytes}
    for phase in ("forward", "backward"):  # a ring sends the same bytes either way
        assert sum(ring[op](n, 4) for op, n in sp[phase]) == sum(ring[op](n, 4) for op, n in plain[phase])
    assert theory.tp_layer_comm(b, s, h, 1) == {"forward": [], "backward": []}


def test_llama_param_count_known_models():
    assert theory.llama_param_count(hidden=4096, layers=32, vocab=32000, intermediate=11008,
                                    heads=32, kv_heads=32) == 6_738_415_616
    assert theory.llama_param_count(hidden=8192, layers=80, vocab=32000, intermediate=28672,
                                    heads=64, kv_heads=8) == 68_976_648_192


@pytest.mark.parametrize("tied", [False, True])
def test_llama_param_count_matches_transformers(tied, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = dict(hidden=64, layers=3, vocab=101, intermediate=176, heads=8, kv_heads=2)  # GQA: 4 q heads per kv
    config = LlamaConfig(hidden_size=64, num_hidden_layers=3, vocab_size=101, intermediate_size=176,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=tied)
    with torch.device("meta"):  # shapes only: no memory, no download
        model = LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == theory.llama_param_count(**sizes, tied_embeddings=tied)
