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
