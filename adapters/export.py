"""Re-lay a compressed prompt cache as mlx-lm's plain `KVCache`s, for unmodified mlx-lm.

After `cache_prompt` every head of an H2O layer keeps the same number K of tokens, at
scattered positions. A `KVCache` has one position per row, shared by the heads, so each
head's kept keys (sorted by position) are re-rotated to positions 0..K-1 with
`h2o_fn.remap`, and the cache's offset becomes K. Distances between a later query and a
kept key shrink (the gaps of evicted tokens close): that is the cost, measured in
BENCHMARKS.md before this is offered anywhere.

Only plain RoPE (`mlx.nn.RoPE`) models whose every layer is H2O can be re-laid.
"""

from typing import Any, List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from h2o_fn import remap

from .cache import H2OKVCache


def _rope(layer: nn.Module) -> nn.RoPE:
    rope = getattr(getattr(layer, "self_attn", None), "rope", None)
    if type(rope) is not nn.RoPE:
        raise ValueError(f"layer rope {type(rope).__name__} is not supported: expected mlx.nn.RoPE "
                         "(plain rotary positions) to re-rotate kept keys")
    return rope


def to_kvcache(model: nn.Module, cache: List[Any]) -> List[KVCache]:
    """Every H2O layer's kept rows as a `KVCache` at consecutive positions 0..K-1.

    Raises ValueError when a layer is not H2O, its heads keep different counts, or the
    model's rotary embedding is not `mlx.nn.RoPE`."""
    out = []
    for i, (c, layer) in enumerate(zip(cache, model.layers)):
        if not isinstance(c, H2OKVCache) or c.core_state is None:
            raise ValueError(f"layer {i} holds {type(c).__name__}: expected a filled H2OKVCache in every layer")
        rope = _rope(layer)
        keys, values = c.kept_rows()
        state = c.core_state
        counts = set(mx.sum(state.positions >= 0, axis=-1).reshape(-1).tolist())
        if len(counts) != 1:
            raise ValueError(f"layer {i} heads keep {sorted(counts)} tokens: expected one count to share rows")
        K = counts.pop()
        keys, values = keys[:, :, :K], values[:, :, :K]
        positions = state.positions[..., :K]
        target = mx.broadcast_to(mx.arange(K), positions.shape)
        kv = KVCache()
        kv.keys = remap(keys, positions, target, dims=rope.dims, base=rope.base,
                        traditional=rope.traditional, scale=rope.scale)
        kv.values, kv.offset = values, K
        out.append(kv)
    return out
