"""Tiny random-weight mlx-lm models built from their ModelArgs (no downloads)."""

import importlib

import mlx.core as mx

COMMON = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=101)

ARCHS = {
    "llama": ("llama", dict(model_type="llama", rope_theta=10000.0)),
    "mistral": ("llama", dict(model_type="mistral", rope_theta=1e6, rope_traditional=False)),
    "qwen2": ("qwen2", dict(model_type="qwen2", rope_theta=1e6, max_position_embeddings=4096,
                            tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(model_type="qwen3", head_dim=16, max_position_embeddings=4096,
                            tie_word_embeddings=True, rope_theta=1e6)),
    # gemma3: 2 sliding-window layers of 8 tokens, then a global layer
    "gemma3": ("gemma3_text", dict(model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16,
                                   sliding_window=8, sliding_window_pattern=3, num_hidden_layers=3,
                                   num_key_value_heads=1)),
}


def tiny_model(arch: str, seed: int = 0, dtype=mx.float32, **overrides):
    """`arch` with random weights; `overrides` change ModelArgs fields (e.g. hidden_size)."""
    module, extra = ARCHS[arch]
    lib = importlib.import_module(f"mlx_lm.models.{module}")
    args = lib.ModelArgs.from_dict({**COMMON, **extra, **overrides})
    mx.random.seed(seed)
    model = lib.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model
