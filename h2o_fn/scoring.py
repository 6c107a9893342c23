"""How tokens earn their scores: attention weights, sanitised, decayed and added.

The key proxy (`key_weights`: softmax of the kept keys against a query, in float32)
or the model's own attention weights (scoring="query", handed in by an adapter);
`accumulate` decays the scores and adds the weights; `scored_queries` says which
queries of a chunk score. Shapes: B batch rows, H KV heads, N queries, C slots, D head_dim.

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn.scoring import clean_weights
    >>> clean_weights(mx.array([0.5, -1.0, float("nan"), float("inf")])).tolist()
    [0.5, 0.0, 0.0, 0.0]
"""

from typing import Optional

import mlx.core as mx

from . import storage
from .arrays import f32, knob, per_row, times_rows
from .config import H2OConfig
from .prompt import Prompt
from .softmax import ranking_softmax
from .state import H2OState
from .storage import DENSE, Storage


def clean_weights(weights: mx.array) -> mx.array:
    """Weights as float32 with NaN, +-inf and negative entries set to 0."""
    w = f32(weights)
    return mx.where((w > 0) & (w < mx.inf), w, 0.0)


def key_weights(state: H2OState, queries: mx.array, kv: Storage = DENSE) -> mx.array:
    """Key-as-query proxy weights of `queries` `[B, H, N, D]` over the valid slots.

    Returns `[B, H, N, C]` float32 softmax weights (0 on free slots; all 0 when S is empty).
    `kv`: how the state stores its keys (quantized keys are read as stored).

    Example:
        >>> import mlx.core as mx
        >>> from h2o_fn import H2OConfig, init, absorb, key_weights
        >>> cfg = H2OConfig(budget=8, n_sink=1, grace=1)
        >>> s = absorb(init(cfg, 1, 1, 4), mx.ones((1, 1, 3, 4)), mx.ones((1, 1, 3, 4)), cfg)
        >>> key_weights(s, mx.ones((1, 1, 1, 4)))[0, 0, 0, :4].tolist()
        [0.3333333432674408, 0.3333333432674408, 0.3333333432674408, 0.0]
    """
    storage.check_store(state.keys, kv, "keys")
    return proxy_weights(state.keys, state.positions >= 0, queries, kv)


def proxy_weights(keys, visible: mx.array, queries: mx.array, kv: Storage) -> mx.array:
    """softmax over visible slots (`[B, H, C]` bool) of keys . queries / sqrt(D), float32,
    the keys a store `[B, H, C, D]` (quantized rows are read where they lie: `times_rows`).

    Hidden slots get exactly 0 (exp(-inf)); an all-hidden row's NaNs are cleaned to 0.
    """
    return proxy_softmax(times_rows(proxy_rows(queries), keys, kv), visible[..., None, :])


def proxy_rows(queries: mx.array) -> mx.array:
    """Queries `[..., N, D]` as the key proxy multiplies them with the keys: float32, times
    1/sqrt(D) (also what an adapter hands attention to compute the proxy's logits)."""
    return f32(queries) * queries.shape[-1] ** -0.5


def proxy_softmax(logits: mx.array, visible: mx.array) -> mx.array:
    """The key proxy's weights from its logits `[..., C]` (keys . query / sqrt(D)): softmax
    over the `visible` slots (broadcastable bool), exactly 0 elsewhere, 0 where none is."""
    w = ranking_softmax(mx.where(visible, logits, -mx.inf))  # mlx's where that is faster, else our exp
    return mx.nan_to_num(w, nan=0.0)  # softmax gives [0, 1] or NaN (no valid slot, NaN keys)


def accumulate(state: H2OState, weights: mx.array, config: H2OConfig,
               alive: Optional[mx.array] = None) -> H2OState:
    """Decay then add: s_j <- decay * s_j + w_j on valid slots. `weights` `[B, H, C]`.

    Rows where `alive` `[B]` is False keep their scores (padding decays nothing).
    """
    valid = state.positions >= 0
    new = knob(config.decay, mx.float32) * state.scores + clean_weights(weights)
    if alive is not None:
        new = mx.where(per_row(alive), new, state.scores)
    return state._replace(scores=mx.where(valid, new, 0.0))


def scored_queries(N: int, config: H2OConfig, n_alive: Optional[mx.array] = None,
                   prompt: Prompt = Prompt()) -> int:
    """How many of a chunk's last queries `absorb` reads the weights of: `prompt.window`
    for a oneshot chunk longer than the window whose rows are all real (SnapKV's prompt
    window), else all N. Weights `[B, H, M, C + N]` of those M queries are enough.

    Example:
        >>> from h2o_fn import H2OConfig, Prompt
        >>> cfg, prompt = H2OConfig(scoring="query"), Prompt(window=48)
        >>> scored_queries(2048, cfg, prompt=prompt), scored_queries(32, cfg, prompt=prompt)
        (48, 32)
    """
    if config.prefill == "oneshot" and 0 < prompt.window < N and n_alive is None:
        return prompt.window
    return N
