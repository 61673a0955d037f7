"""The tiny Llama that lessons 06-07 and launch/train.py share: the same weights and tokens in every process."""

import torch

from course_lib.models import LLAMA_CONFIG, make_llama, make_tokens


def test_make_llama_is_the_same_model_every_call_and_tp_divides_its_heads():
    first, second = make_llama(), make_llama()
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(make_llama(seed=1).lm_head.weight, first.lm_head.weight)
    # TP over 2 ranks splits query heads and KV heads (grouped-query attention) evenly.
    assert LLAMA_CONFIG["num_attention_heads"] % 2 == 0 and LLAMA_CONFIG["num_key_value_heads"] % 2 == 0
    assert first.config.num_hidden_layers == LLAMA_CONFIG["num_hidden_layers"]


def test_make_tokens_is_seeded_and_in_the_vocabulary():
    tokens = make_tokens()
    assert tokens.shape == (8, 16) and torch.equal(tokens, make_tokens())
    assert 0 <= tokens.min() and tokens.max() < LLAMA_CONFIG["vocab_size"]
    assert not torch.equal(tokens, make_tokens(seed=4))


def test_rank_batch_slices_make_batch_in_rank_order():
    from course_lib.models import make_batch, rank_batch

    whole = make_batch()
    for world in (1, 2, 4):
        parts = [rank_batch(rank, world) for rank in range(world)]
        assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
        assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
    assert rank_batch(1, 2, n=64)[0].shape == (32, 8)
    import pytest
    with pytest.raises(ValueError, match="do not split evenly"):
        rank_batch(0, 3)


def test_shard_model_makes_each_block_and_the_root_a_unit_on_one_rank(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from course_lib.models import make_model, shard_model

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = make_model()
        assert shard_model(model, init_device_mesh("cpu", (1,)), reshard_after_forward=False) is model
        units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        assert units == ["", "1", "2"]
        assert model[1]._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None   # False: kept gathered
    finally:
        dist.destroy_process_group()
