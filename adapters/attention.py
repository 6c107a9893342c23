"""True-query scoring: an attention hook that hands the model's own weights to the cache.

mlx-lm's attention modules call `scaled_dot_product_attention` from
`mlx_lm.models.base` (each model module imports that name). The hook replaces
that name in the model's modules with a function that, for an `H2OKVCache`
waiting for weights, computes attention explicitly (same output as
`mx.fast.scaled_dot_product_attention` within float tolerance), averages the
weights over the query heads sharing each KV head (GQA) and hands them to the
cache. Every other cache falls through to the original function untouched.

Example:
    >>> from h2o_fn.adapters.attention import install_query_hook, remove_query_hook
    >>> install_query_hook(model)   # make_h2o_cache does this for scoring="query"
    >>> remove_query_hook(model)    # the model's modules are as before
"""

import sys
from typing import Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .mlx_lm import H2OKVCache

NAME = "scaled_dot_product_attention"


def attention_with_weights(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: Union[None, str, mx.array] = None,
    sinks: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """Attention output and its weights, computed explicitly in float32.

    Args:
      queries: `[B, Hq, N, D]`; keys, values: `[B, H, L, D]` with Hq a multiple of H (GQA).
      mask: None, "causal" (query i sees keys up to L - N + i), a boolean array
        (True = attend) or an additive array, broadcastable to `[B, Hq, N, L]`.
      sinks: optional `[Hq]` logits of an attention sink that takes mass but has no value.

    Returns:
      output `[B, Hq, N, D]` in the queries' dtype, weights `[B, Hq, N, L]` float32.
    """
    B, Hq, N, D = queries.shape
    H, L = keys.shape[1], keys.shape[2]
    if Hq % H:
        raise ValueError(f"{Hq} query heads is invalid for {H} KV heads: expected a multiple")
    rep = Hq // H
    q = (queries.astype(mx.float32) * scale).reshape(B, H, rep, N, D)
    logits = q @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)  # [B, H, rep, N, L]
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask={mask!r} is invalid: expected None, 'causal' or an array")
        mask = mx.arange(L - N, L)[:, None] >= mx.arange(L)[None]
    if mask is not None:
        mask = _by_kv_head(mask, H, rep)
        if mask.dtype == mx.bool_:
            logits = mx.where(mask, logits, -mx.inf)
        else:
            logits = logits + mask.astype(mx.float32)
    if sinks is not None:
        sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, H, rep, 1, 1), (B, H, rep, N, 1))
        weights = mx.softmax(mx.concatenate([sink, logits], axis=-1), axis=-1, precise=True)[..., 1:]
    else:
        weights = mx.softmax(logits, axis=-1, precise=True)
    out = weights @ values.astype(mx.float32)[:, :, None]  # [B, H, rep, N, D]
    return out.reshape(B, Hq, N, -1).astype(queries.dtype), weights.reshape(B, Hq, N, L)


def _by_kv_head(mask: mx.array, H: int, rep: int) -> mx.array:
    """A mask broadcastable to `[B, Hq, N, L]` -> broadcastable to `[B, H, rep, N, L]`."""
    if mask.ndim >= 3 and mask.shape[-3] == H * rep and H * rep > 1:
        return mask.reshape(*mask.shape[:-3], H, rep, *mask.shape[-2:])
    return mx.expand_dims(mask, -3) if mask.ndim >= 3 else mask


REDUCE = {"mean": mx.mean, "max": mx.max}  # over the query heads sharing a KV head


def _hook(original, reduce: str):
    combine = REDUCE[reduce]

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, H2OKVCache) and cache.wants_weights:
            out, weights = attention_with_weights(queries, keys, values, scale, mask, sinks)
            B, Hq, N, L = weights.shape
            H = keys.shape[1]
            cache.receive_weights(combine(weights.reshape(B, H, Hq // H, N, L), axis=2))
            return out
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.h2o_original = original
    return scaled_dot_product_attention


def model_modules(model: nn.Module):
    """The Python modules defining the model's layers that import the attention function."""
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    return [sys.modules[n] for n in sorted(names) if n in sys.modules and hasattr(sys.modules[n], NAME)]


def install_query_hook(model: nn.Module, reduce: str = "mean") -> int:
    """Hook the attention call of every module the model's layers come from. Idempotent.

    `reduce` combines the weights of the query heads that share a KV head (GQA):
    "mean" (DESIGN.md) or "max" (an ablation in BENCHMARKS.md). A module already
    hooked keeps its hook: remove it first to change `reduce`.

    Returns the number of modules hooked. Raises if the model never calls
    `mlx_lm.models.base.scaled_dot_product_attention` (true-query scoring cannot see it).
    """
    if reduce not in REDUCE:
        raise ValueError(f"reduce={reduce!r} is invalid: expected one of {sorted(REDUCE)}")
    modules = model_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} does not call mlx_lm.models.base.{NAME}: "
            "scoring='query' cannot see its attention weights (use scoring='key')"
        )
    for module in modules:
        fn = getattr(module, NAME)
        if not hasattr(fn, "h2o_original"):
            setattr(module, NAME, _hook(fn, reduce))
    return len(modules)


def remove_query_hook(model: nn.Module) -> None:
    """Put the original attention function back in the model's modules."""
    for module in model_modules(model):
        fn = getattr(module, NAME)
        if hasattr(fn, "h2o_original"):
            setattr(module, NAME, fn.h2o_original)


def is_hooked(model: nn.Module) -> bool:
    return any(hasattr(getattr(m, NAME), "h2o_original") for m in model_modules(model))


