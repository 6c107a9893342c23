"""The attention hook: explicit attention for caches that ask for their weights.

mlx-lm's attention modules call `scaled_dot_product_attention` from
`mlx_lm.models.base` (each model module imports that name). The hook replaces
that name in the model's modules with a function that talks to caches by what
they do, never by their class:

- a cache whose `wants_weights` is True gets the attention computed explicitly
  (same output as mlx-lm's fused or quantized path, within float tolerance) and its
  weights, averaged over the query heads that share each KV head (GQA), handed to
  `cache.receive_weights(weights)`. A cache's own `weights_reduce` attribute, where it
  has one, overrides the hook's reduction ("mean", "max"; "none": every query head's
  weights `[B, Hq, N, L]`, reduced by the cache itself). One decode query per head without a
  mask, for a cache whose `native_ops` is True, is attended by one C++ op with the same
  output and mean weights (`h2o_fn.metal_ops.cpu_step.attention`). A cache with
  `scored_queries(N)` = M < N (a prompt chunk scored by its last M queries) gets the
  weights of those M only, `[B, H, M, L]`, and the output from mlx-lm's own attention:
  memory linear in the chunk, not quadratic;
- a cache whose `proxy_queries()` gives rows `[B, H, P, D]` (a key-scored decode token:
  its key as a query) gets, on the CPU, the attention computed explicitly with those
  rows in the same product as the model's queries (the keys are read once for both),
  and their logits `[B, H, P, L]` handed to `cache.receive_proxy(logits)`; up to
  FUSED_UP_TO keys mlx-lm's own attention gives the output and the rows' logits are a
  product of their own (the explicit attention's extra primitives cost more there); above
  that, for a `native_ops` cache without a mask, the same C++ op as above with the rows. On a GPU
  mlx-lm's fused attention is faster than an explicit one, so the hook falls through and
  the cache scores the key itself (as it does with attention sinks);
- a cache with an `attention_mask(N, mask)` method may replace the mask mlx-lm built
  once per forward pass from layer 0 (layers whose kept rows differ from layer 0's), also
  by a mask per KV head `[B, H, 1, N, L]` (heads holding reserved slots);
- a cache with `weights_per_slice` = W (an int) is attended a slice of queries at a time,
  each slice evaluated before the next, so that at most about W weights `[B, Hq, S, L]`
  are alive instead of the whole pass's `[B, Hq, N, L]` (attention is separable by
  query: the output is the same); `receive_weights` is then called once per slice (for
  caches whose every query scores: `scored_queries` counts a slice's queries, not the pass's);
- every other cache falls through to the original function untouched.

`query_scoring(model)` installs it for a `with` block and always removes it;
`install_query_hook` / `remove_query_hook` are the explicit pair for long-lived
servers. Hooks are per Python module, so they affect every model instance of that
architecture in the process (and fall through for every cache that asks nothing).

Example:
    >>> import mlx.core as mx
    >>> from mlx_lm.models import llama
    >>> from h2o_fn.adapters.attention import query_scoring, is_hooked
    >>> args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1,
    ...     intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
    ...     rms_norm_eps=1e-5, vocab_size=50)
    >>> model = llama.Model(args)
    >>> with query_scoring(model):
    ...     is_hooked(model)
    True
    >>> is_hooked(model)
    False
"""

import contextlib
import sys
from typing import Callable, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from h2o_fn import storage
from h2o_fn.metal_ops import cpu_step
from h2o_fn.softmax import softmax

NAME = "scaled_dot_product_attention"
# key-scored decode on the CPU: up to this many keys, mlx's fused attention plus the proxy rows'
# own product beats one explicit attention over both (BENCHMARKS.md, "Decode at every budget")
FUSED_UP_TO = 512
REDUCE = {"mean": mx.mean, "max": mx.max}  # over the query heads sharing a KV head


def attention_with_weights(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: Union[None, str, mx.array] = None,
    sinks: Optional[mx.array] = None,
    bits: Optional[int] = None,
    group_size: int = 64,
) -> Tuple[mx.array, mx.array]:
    """Attention output and its weights, computed explicitly in float32.

    Args:
      queries: `[B, Hq, N, D]`; keys `[B, H, L, D]`, values `[B, H, L, Dv]` with Hq a
        multiple of H (GQA); with `bits`, mx.quantize's triples of those (multiplied
        where they lie, as mlx-lm's quantized attention does).
      mask: None, "causal" (query i sees keys up to L - N + i), a boolean array
        (True = attend) or an additive array, broadcastable to `[B, Hq, N, L]`.
      sinks: optional `[Hq]` logits of an attention sink that takes mass but has no value.

    Returns:
      output `[B, Hq, N, Dv]` in the queries' dtype, weights `[B, Hq, N, L]` float32.
    """
    H = storage.parts(keys)[0].shape[1]
    logits = storage.matmul_t(_query_rows(queries, scale, H), keys, bits, group_size)
    return _attend(queries.shape, queries.dtype, logits, values, mask, sinks, bits, group_size)


def attention_with_proxy(queries: mx.array, keys, values, scale: float, mask: Union[None, str, mx.array],
                         rows: mx.array, bits: Optional[int] = None, group_size: int = 64):
    """`attention_with_weights`' output, and the logits of `rows` `[B, H, P, D]` (float32,
    already scaled) against the same keys, `[B, H, P, L]` float32: one product with the
    keys gives both, so the keys are read once."""
    Hq, N = queries.shape[1:3]
    R = Hq // rows.shape[1] * N  # the query rows; the values are multiplied by their weights only
    logits = storage.matmul_t(mx.concatenate([_query_rows(queries, scale, rows.shape[1]), rows], axis=2),
                              keys, bits, group_size)
    out = _attend(queries.shape, queries.dtype, logits[:, :, :R], values, mask, None, bits, group_size)[0]
    return out, logits[:, :, R:]


def _query_rows(queries: mx.array, scale: float, H: int) -> mx.array:
    """`[B, Hq, N, D]` queries -> `[B, H, rep N, D]` float32 times `scale`: the rep query
    heads of a KV head as rows of one product (broadcasting the keys over rep instead
    costs ~1.7x on mlx's CPU, which materialises the broadcast)."""
    B, Hq, N, D = queries.shape
    if Hq % H:
        raise ValueError(f"{Hq} query heads is invalid for {H} KV heads: expected a multiple")
    return (queries.astype(mx.float32) * scale).reshape(B, H, Hq // H * N, D)


def _attend(shape, dtype, logits, values, mask, sinks, bits, group_size):
    """(output `[B, Hq, N, Dv]`, weights `[B, Hq, N, L]`) from the query rows' logits
    `[B, H, rep N, L]` (queries of `shape` and `dtype`)."""
    B, Hq, N, _ = shape
    H, L = logits.shape[1], logits.shape[-1]
    rep = Hq // H
    logits = logits.reshape(B, H, rep, N, L)
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
        weights = softmax(mx.concatenate([sink, logits], axis=-1))[..., 1:]
    else:
        weights = softmax(logits)  # h2o_fn.softmax: mlx's CPU exp is slow
    out = storage.matmul(weights.reshape(B, H, rep * N, L), values, bits, group_size)  # [B, H, rep N, Dv]
    return out.reshape(B, Hq, N, -1).astype(dtype), weights.reshape(B, Hq, N, L)


def _by_kv_head(mask: mx.array, H: int, rep: int) -> mx.array:
    """A mask broadcastable to `[B, Hq, N, L]` -> broadcastable to `[B, H, rep, N, L]`. A 5-D
    mask is already per KV head (`[B, H, 1, N, L]`: a cache whose heads hold reserved slots)."""
    if mask.ndim == 5:
        return mask
    if mask.ndim >= 3 and mask.shape[-3] == H * rep and H * rep > 1:
        return mask.reshape(*mask.shape[:-3], H, rep, *mask.shape[-2:])
    return mx.expand_dims(mask, -3) if mask.ndim >= 3 else mask


def for_queries(mask, Hq: int, quantized: bool = False):
    """A mask as mlx-lm's attention takes it: a per-KV-head mask `[B, H, 1, N, L]` becomes
    `[B, Hq, N, L]` (query head q reads KV head q // (Hq / H)), or `[B, H, N, L]` for its
    quantized attention (which groups the query heads by KV head itself); any other mask
    is returned as it is."""
    if isinstance(mask, mx.array) and mask.ndim == 5:
        return mask[:, :, 0] if quantized else mx.repeat(mask[:, :, 0], Hq // mask.shape[1], axis=1)
    return mask


def _last_rows(mask, M: int):
    """The mask of the last M queries ("causal" stays causal: it is relative to the end)."""
    if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] > 1:
        return mask[..., -M:, :]
    return mask


def per_kv_head(weights: mx.array, H: int, reduce: str = "mean") -> mx.array:
    """`[B, Hq, N, L]` weights -> `[B, H, N, L]`: query heads q // (Hq / H) share KV head h."""
    B, Hq, N, L = weights.shape
    return REDUCE[reduce](weights.reshape(B, H, Hq // H, N, L), axis=2)


def _proxy_of(cache, queries, keys, sinks):
    """The cache's key-proxy rows where attending explicitly pays (on the CPU, no sink) and
    they fit the product (the keys' heads, the queries' width), else None. `keys`: a store."""
    if sinks is not None or mx.default_device() != mx.cpu or not hasattr(cache, "proxy_queries"):
        return None
    rows = cache.proxy_queries()
    if rows is None or rows.shape[1] != storage.parts(keys)[0].shape[1] or rows.shape[3] != queries.shape[3]:
        return None
    return rows


def _slice_mask(mask, N: int, L: int, a: int, b: int):
    """The mask of queries a..b-1 of N (over L keys): "causal" becomes the boolean rows it means."""
    if isinstance(mask, str):
        return mx.arange(L - N + a, L - N + b)[:, None] >= mx.arange(L)[None]
    if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] == N:
        return mask[..., a:b, :]
    return mask


def _in_slices(attend, queries, keys, mask, most: int):
    """`attend(queries, mask)` for S queries at a time, S the most whose weights `[B, Hq, S, L]`
    number at most `most` (at least 1), each slice evaluated before the next (so one slice's
    logits and weights are alive at a time), outputs joined along the queries: attention is
    separable by query, so the output is the same."""
    (B, Hq, N), L = queries.shape[:3], storage.parts(keys)[0].shape[2]
    S = max(most // (B * Hq * L), 1)
    if N <= S:
        return attend(queries, mask)
    outs = []
    for a in range(0, N, S):
        b = min(a + S, N)
        outs.append(attend(queries[:, :, a:b], _slice_mask(mask, N, L, a, b)))
        mx.eval(outs[-1])
    return mx.concatenate(outs, axis=2)


def _hooked(original, reduce: str, queries, keys, values, cache, scale, mask, sinks):
    """The hook's attention for one cache, its own mask already applied (`_hook`)."""
    # keys and values as given to attention: arrays, or mx.quantize's triples (a list from some caches)
    k, v = (tuple(x) if isinstance(x, list) else x for x in (keys, values))
    wants, proxy = getattr(cache, "wants_weights", False), _proxy_of(cache, queries, k, sinks)
    if (wants or proxy is not None) and cache.can_take(keys):
        bits = getattr(cache, "bits", None)
        group = getattr(cache, "group_size", 64) if bits else 64  # an unquantized H2O cache raises for both
        mlx_lm_attention = lambda: original(queries, keys, values, cache=cache, scale=scale,  # noqa: E731
                                            mask=for_queries(mask, queries.shape[1], bits is not None),
                                            sinks=sinks)
        if not wants:
            if storage.parts(k)[0].shape[2] <= FUSED_UP_TO:
                out, logits = mlx_lm_attention(), storage.matmul_t(proxy, k, bits, group)
            elif mask is None and getattr(cache, "native_ops", False) and cpu_step.attends(queries, k, v, bits):
                out, _, logits = cpu_step.attention(queries, k, v, scale, proxy)  # the line below as one C++ op
            else:
                out, logits = attention_with_proxy(queries, k, v, scale, mask, proxy, bits, group)
            cache.receive_proxy(logits)
            return out
        N = queries.shape[2]
        M = cache.scored_queries(N) if hasattr(cache, "scored_queries") else N
        how = getattr(cache, "weights_reduce", reduce)  # "none": every query head's weights
        if M == N and mask is None and sinks is None and how == "mean" and getattr(cache, "native_ops", False) \
                and cpu_step.attends(queries, k, v, bits):  # the lines below as one C++ op
            out, weights = cpu_step.attention(queries, k, v, scale)
            cache.receive_weights(weights)
            return out
        if M < N:  # mlx-lm's attention for the output, explicit weights of the M that score
            out = mlx_lm_attention()
            weights = attention_with_weights(queries[:, :, N - M :], k, v, scale, _last_rows(mask, M), sinks,
                                             bits, group)[1]
        else:
            out, weights = attention_with_weights(queries, k, v, scale, mask, sinks, bits, group)
        cache.receive_weights(weights if how == "none" else per_kv_head(weights, cache.kv_heads, how))
        return out
    return original(queries, keys, values, cache=cache, scale=scale,
                    mask=for_queries(mask, queries.shape[1], hasattr(cache, "bits")), sinks=sinks)


def _hook(original, reduce: str):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        own_mask = getattr(cache, "attention_mask", None)
        if own_mask is not None:
            mask = own_mask(queries.shape[2], mask)
        attend = lambda q, m: _hooked(original, reduce, q, keys, values, cache, scale, m, sinks)  # noqa: E731
        most = getattr(cache, "weights_per_slice", None)
        if most is not None:  # memory of one slice's weights, not the pass's
            return _in_slices(attend, queries, keys, mask, most)
        return attend(queries, mask)

    scaled_dot_product_attention.h2o_original = original
    scaled_dot_product_attention.h2o_reduce = reduce
    return scaled_dot_product_attention


def _checked(reduce: str) -> str:
    if reduce not in REDUCE:
        raise ValueError(f"reduce={reduce!r} is invalid: expected one of {sorted(REDUCE)}")
    return reduce


def hooked(original: Callable, reduce: str = "mean") -> Callable:
    """`original` (an attention function with mlx-lm's signature) with the hook around it: what
    `install_query_hook` puts in a model's modules, for a caller that runs caches without a
    model (`bench profile`'s layer chain)."""
    return _hook(original, _checked(reduce))


def model_modules(model: nn.Module):
    """The Python modules defining the model's layers that import the attention function."""
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    return [sys.modules[n] for n in sorted(names) if n in sys.modules and hasattr(sys.modules[n], NAME)]


def install_query_hook(model: nn.Module, reduce: str = "mean") -> int:
    """Hook the attention call of every module the model's layers come from. Idempotent.

    `reduce` combines the weights of the query heads that share a KV head (GQA):
    "mean" (the default) or "max" (an ablation in BENCHMARKS.md). A module already
    hooked keeps its hook: remove it first to change `reduce`.

    Returns the number of modules hooked: 0 when the model never calls
    `mlx_lm.models.base.scaled_dot_product_attention` (nothing can see its weights).
    """
    _checked(reduce)
    modules = model_modules(model)
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


@contextlib.contextmanager
def query_scoring(model: nn.Module, reduce: str = "mean"):
    """`with query_scoring(model):` the hook is installed inside the block and removed
    after it (also on error), unless it was already installed before the block."""
    was_hooked = is_hooked(model)
    install_query_hook(model, reduce)
    try:
        yield model
    finally:
        if not was_hooked:
            remove_query_hook(model)
