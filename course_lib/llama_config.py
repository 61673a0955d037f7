"""The tiny Llama's sizes (`course_lib.models.make_llama`), in a module that imports nothing: launch/train.py checks
its flags against them before torch is imported."""

LLAMA_CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
