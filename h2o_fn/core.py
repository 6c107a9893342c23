"""The pure H2O core: `init`, `step`, `absorb`, `evict` and their building blocks.

Every function takes an `H2OState` and returns a new one; nothing is mutated.
Shapes: B batch rows, H KV heads, C = budget + 1 slots, D head_dim, N chunk tokens.

Per token t (one (b, h) row; S = the kept set):
  1. weights w_j over S (key proxy: softmax_j(K_j . k_t / sqrt(D)) in float32,
     or the model's own attention weights for scoring="query");
  2. s_j <- decay * s_j + w_j;
  3. admit t with s_t = 0 (key) or its own weight (query);
  4. if |S| > budget, evict the unprotected token with the lowest (score, position);
     sinks (p < n_sink) and the grace window (p > t - grace) are protected.

Weights are sanitised before they are added: NaN, +-inf and negative entries
count as 0, so scores stay finite and >= 0 whatever the keys hold.

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn import H2OConfig, init, step, kept_positions
    >>> cfg = H2OConfig(budget=8, n_sink=2, grace=2)
    >>> state = init(cfg, batch=1, n_heads=2, head_dim=16)
    >>> for _ in range(20):
    ...     kv = mx.random.normal((1, 2, 1, 16)).astype(mx.float16)
    ...     state = step(state, kv, kv, cfg)
    >>> kept_positions(state).shape
    (1, 2, 9)
"""

import functools
from typing import Callable, Optional

import mlx.core as mx

from .config import H2OConfig
from .state import H2OState

INT32_MAX = 2**31 - 1

# argmin(scores [B,H,C] f32, positions [B,H,C] i32, newest [] i32, n_sink, grace) -> [B,H] i32
Argmin = Callable[..., mx.array]


def init(
    config: H2OConfig, batch: int, n_heads: int, head_dim: int, dtype=mx.float16
) -> H2OState:
    """An empty state: keys/values `[B, H, C, D]` zeros, every slot free."""
    shape = (batch, n_heads, config.capacity)
    return H2OState(
        keys=mx.zeros((*shape, head_dim), dtype=dtype),
        values=mx.zeros((*shape, head_dim), dtype=dtype),
        scores=mx.zeros(shape, dtype=mx.float32),
        positions=mx.full(shape, -1, dtype=mx.int32),
        length=mx.array(0, dtype=mx.int32),
        seen=mx.array(0, dtype=mx.int32),
    )


def protected_argmin(
    scores: mx.array, positions: mx.array, newest: mx.array, n_sink: int, grace: int
) -> mx.array:
    """The slot to free per (b, h): lowest (score, position) among unprotected tokens.

    Args:
      scores: `[B, H, C]` float32. NaN orders as -inf (a corrupt score goes first).
      positions: `[B, H, C]` int32, -1 for a free slot (never chosen).
      newest: `[]` int32, the newest absorbed position t.
      n_sink, grace: positions `< n_sink` and `> t - grace` are protected.

    Returns:
      `[B, H]` int32 slot index, or -1 where no slot is evictable.

    This is the spec of the fused kernel in `h2o_fn.metal_ops`: comparisons only.
    """
    candidate = (positions >= n_sink) & (positions <= newest - grace)
    key = mx.where(candidate, mx.where(mx.isnan(scores), -mx.inf, scores), mx.inf)
    tied = candidate & (key == mx.min(key, axis=-1, keepdims=True))
    slot = mx.argmin(mx.where(tied, positions, INT32_MAX), axis=-1).astype(mx.int32)  # unique positions
    return mx.where(mx.any(candidate, axis=-1), slot, -1)


def clean_weights(weights: mx.array) -> mx.array:
    """Weights as float32 with NaN, +-inf and negative entries set to 0."""
    w = _f32(weights)
    return mx.where((w > 0) & (w < mx.inf), w, 0.0)


def key_weights(state: H2OState, queries: mx.array) -> mx.array:
    """Key-as-query proxy weights of `queries` `[B, H, N, D]` over the valid slots.

    Returns `[B, H, N, C]` float32 softmax weights (0 on free slots; all 0 when S is empty).
    """
    return _proxy_weights(state.keys, state.positions >= 0, queries)


def _proxy_weights(keys: mx.array, visible: mx.array, queries: mx.array) -> mx.array:
    """softmax over visible slots (`[B, H, C]` bool) of keys . queries / sqrt(D), float32.

    Hidden slots get exactly 0 (exp(-inf)); an all-hidden row's NaNs are cleaned to 0.
    """
    scale = queries.shape[-1] ** -0.5
    logits = (_f32(queries) * scale) @ _f32(keys).swapaxes(-1, -2)
    w = mx.softmax(mx.where(visible[..., None, :], logits, -mx.inf), axis=-1, precise=True)
    return mx.nan_to_num(w, nan=0.0)  # softmax gives [0, 1] or NaN (no valid slot, NaN keys)


def _as(x: mx.array, dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)


def _f32(x: mx.array) -> mx.array:
    return _as(x, mx.float32)


def admit(state: H2OState, key: mx.array, value: mx.array) -> H2OState:
    """Write one token `[B, H, 1, D]` into the first free slot with score 0.

    Needs a free slot (`length <= budget`, true after every `step`/`evict`). The
    result may hold budget + 1 tokens: `accumulate` then `evict` finish the step.
    """
    return _admit(state, key, value)[0]


def _admit(state: H2OState, key: mx.array, value: mx.array):
    """`admit`, also returning the `[B, H, C]` mask of the slots free before it."""
    free = state.positions < 0
    slot = mx.argmax(free, axis=-1)  # [B, H]
    here = mx.arange(state.positions.shape[-1]) == slot[..., None]
    index = slot[..., None, None]
    return H2OState(  # a free slot already scores 0
        keys=mx.put_along_axis(state.keys, index, _as(key, state.keys.dtype), axis=2),
        values=mx.put_along_axis(state.values, index, _as(value, state.values.dtype), axis=2),
        scores=state.scores,
        positions=mx.where(here, state.seen, state.positions),
        length=state.length + 1,
        seen=state.seen + 1,
    ), free


def accumulate(state: H2OState, weights: mx.array, config: H2OConfig) -> H2OState:
    """Decay then add: s_j <- decay * s_j + w_j on valid slots. `weights` `[B, H, C]`."""
    valid = state.positions >= 0
    return state._replace(scores=mx.where(valid, config.decay * state.scores + clean_weights(weights), 0.0))


def _decay_add(state: H2OState, weights: mx.array, config: H2OConfig) -> H2OState:
    """decay * s + w where free slots already hold s = 0 and w = 0 (no mask needed)."""
    return state._replace(scores=config.decay * state.scores + weights)


def evict(state: H2OState, config: H2OConfig, argmin: Argmin = protected_argmin) -> H2OState:
    """Evict one token per (b, h) if the state holds more than `budget` tokens.

    A state holds at most budget + 1 tokens (C slots), so one eviction always
    brings it down to budget. The freed slot keeps its stale key/value rows.
    """
    over = state.length > config.budget
    slot = argmin(state.scores, state.positions, state.seen - 1, config.n_sink, config.grace)
    drop = (mx.arange(state.positions.shape[-1]) == slot[..., None]) & over
    return state._replace(
        scores=mx.where(drop, 0.0, state.scores),
        positions=mx.where(drop, -1, state.positions),
        length=state.length - over.astype(mx.int32),
    )


def step(
    state: H2OState,
    key: mx.array,
    value: mx.array,
    config: H2OConfig,
    argmin: Argmin = protected_argmin,
) -> H2OState:
    """One token `[B, H, 1, D]` with key-proxy scoring: weights, decay-add, admit, evict.

    After it, the token's key/value rows sit in the state's keys/values even if
    an older token was just evicted, so `keys[..., :min(seen, C), :]` is exactly
    S_{t-1} + {t}: what this token's attention must see.
    """
    if config.scoring != "key":
        raise ValueError(
            f"step computes key-proxy weights but config.scoring={config.scoring!r}; "
            "expected 'key' (for 'query' use absorb(..., weights=) or admit/accumulate/evict)"
        )
    _check_chunk(state, key, value, n=1)
    # admit first: the weights then read the written keys (the new token masked out),
    # so MLX can write the row into the old buffer instead of copying the cache
    state, free_before = _admit(state, key, value)
    weights = _proxy_weights(state.keys, ~free_before, key)[..., 0, :]  # over S_{t-1}
    return evict(_decay_add(state, weights, config), config, argmin)


@functools.lru_cache(maxsize=None)
def compiled_step(config: H2OConfig, argmin: Argmin = protected_argmin):
    """`step` for a fixed config under `mx.compile` (one trace per input shape)."""
    return mx.compile(lambda state, key, value: step(state, key, value, config, argmin))


def absorb(
    state: H2OState,
    keys: mx.array,
    values: mx.array,
    config: H2OConfig,
    weights: Optional[mx.array] = None,
    argmin: Argmin = protected_argmin,
) -> H2OState:
    """Absorb a chunk of N tokens `[B, H, N, D]`; the result holds at most `budget`.

    Args:
      weights: `[B, H, N, C + N]` attention weights of the chunk's queries, required
        for `scoring="query"` and refused for "key". Column j < C is the token in
        slot j of `state` (ignored where the slot is free); column C + i is chunk
        token i (ignored where i > the query's own index).

    `config.prefill`:
      "greedy": exactly N single-token steps (one weight pass while nothing can be
        evicted, token by token after). Reads `state.length` once (one sync).
      "oneshot": all weights at once (query i sees S and the chunk up to i), scores
        s <- decay^N s + sum_i decay^(N-1-i) w_i, then the lowest (score, position)
        unprotected tokens are evicted down to budget. Survivors are stored sorted
        by position. Fixed shapes, no sync: compiles.
    """
    n = _check_chunk(state, keys, values)
    if (weights is None) != (config.scoring == "key"):
        raise ValueError(
            f"absorb got weights={None if weights is None else tuple(weights.shape)} with "
            f"config.scoring={config.scoring!r}: expected weights [B, H, N, C + N] exactly "
            "when scoring='query'"
        )
    if weights is not None:
        expected = (*keys.shape[:3], config.capacity + n)
        if tuple(weights.shape) != expected:
            raise ValueError(f"weights shape {tuple(weights.shape)} is invalid: expected {expected}")
    if config.prefill == "oneshot":
        return _absorb_oneshot(state, keys, values, config, weights)
    return _absorb_greedy(state, keys, values, config, weights, argmin)


def rewind(state: H2OState, n: int) -> H2OState:
    """Forget the n newest tokens; only meaningful while nothing has been evicted.

    Their slots are freed (they are the last n of the valid prefix). The scores of
    the tokens that stay keep the mass the forgotten tokens gave them: under decay
    it cannot be subtracted exactly.
    """
    gone = state.positions >= state.seen - n
    return state._replace(
        scores=mx.where(gone, 0.0, state.scores),
        positions=mx.where(gone, -1, state.positions),
        length=state.length - n,
        seen=state.seen - n,
    )


def kept_positions(state: H2OState) -> mx.array:
    """Kept positions per (b, h), ascending, padded with -1 at the end: `[B, H, C]` int32."""
    p = mx.sort(mx.where(state.positions < 0, INT32_MAX, state.positions), axis=-1)
    return mx.where(p == INT32_MAX, -1, p)


# ---------------------------------------------------------------- chunk helpers


def _check_chunk(state: H2OState, keys: mx.array, values: mx.array, n: Optional[int] = None) -> int:
    B, H, _, D = state.keys.shape
    for name, x in (("keys", keys), ("values", values)):
        if x.ndim != 4 or x.shape[0] != B or x.shape[1] != H or x.shape[3] != D:
            raise ValueError(
                f"{name} shape {tuple(x.shape)} is invalid: expected [B={B}, H={H}, N, D={D}]"
            )
    if keys.shape[2] != values.shape[2]:
        raise ValueError(f"keys have {keys.shape[2]} tokens but values have {values.shape[2]}")
    N = keys.shape[2]
    if N == 0:
        raise ValueError("empty chunk: expected N >= 1 tokens")
    if n is not None and N != n:
        raise ValueError(f"keys shape {tuple(keys.shape)} is invalid: expected {n} token(s)")
    return N


def _chunk_weights(state: H2OState, keys: mx.array, weights: Optional[mx.array]) -> mx.array:
    """`[B, H, N, C + N]` float32 weights of the chunk's queries: slots then chunk tokens.

    Key proxy: token i sees S and chunk tokens before it. Query: also itself.
    """
    B, H, N, _ = keys.shape
    C = state.positions.shape[-1]
    row, col = mx.arange(N)[:, None], mx.arange(N)[None]
    own = (col <= row) if weights is not None else (col < row)  # key proxy: not itself
    visible = mx.concatenate(
        [mx.broadcast_to((state.positions >= 0)[..., None, :], (B, H, N, C)),
         mx.broadcast_to(own, (B, H, N, N))],
        axis=-1,
    )
    if weights is None:
        k = keys.astype(mx.float32)
        stored = mx.concatenate([state.keys.astype(mx.float32), k], axis=2)
        logits = (k @ stored.swapaxes(-1, -2)) * keys.shape[-1] ** -0.5
        weights = mx.softmax(mx.where(visible, logits, -mx.inf), axis=-1, precise=True)
    return clean_weights(mx.where(visible, weights, 0.0))


def _decayed_sum(w: mx.array, decay: float) -> mx.array:
    """sum_i decay^(N-1-i) w[..., i, :] for `w` `[B, H, N, M]` -> `[B, H, M]`."""
    N = w.shape[2]
    powers = mx.power(mx.array(decay, dtype=mx.float32), mx.arange(N - 1, -1, -1).astype(mx.float32))
    return (powers[:, None] * w).sum(axis=2)


def _sort_key(scores: mx.array, positions: mx.array) -> mx.array:
    """uint64 keys ordering (score, position) lexicographically; NaN as -inf, -0.0 as 0.0."""
    s = mx.where(mx.isnan(scores), -mx.inf, scores)
    s = mx.where(s == 0, 0.0, s).astype(mx.float32)
    bits = mx.view(s, mx.uint32)
    flip = mx.where(bits >= 2**31, mx.array(2**32 - 1, mx.uint32), mx.array(2**31, mx.uint32))
    return ((bits ^ flip).astype(mx.uint64) << 32) | positions.astype(mx.uint64)


def evict_lowest(scores: mx.array, positions: mx.array, k: mx.array, newest: mx.array,
                 n_sink: int, grace: int) -> mx.array:
    """Mask `[B, H, M]` of the k lowest (score, position) unprotected tokens per (b, h).

    Equals k successive `protected_argmin` evictions: removing a token never
    changes the other scores, so the i-th single eviction takes the i-th lowest.
    """
    candidate = (positions >= n_sink) & (positions <= newest - grace)
    last = mx.array(2**32 - 1, mx.uint32).astype(mx.uint64)
    key = mx.where(candidate, _sort_key(scores, positions), (last << 32) | last)
    rank = mx.argsort(mx.argsort(key, axis=-1), axis=-1)
    return candidate & (rank < k)


def _absorb_oneshot(state, keys, values, config, weights) -> H2OState:
    N, C = keys.shape[2], config.capacity
    w = _chunk_weights(state, keys, weights)
    mass = _decayed_sum(w, config.decay)  # [B, H, C + N]
    B, H = keys.shape[:2]
    positions = mx.concatenate(
        [state.positions, mx.broadcast_to(state.seen + mx.arange(N, dtype=mx.int32), (B, H, N))],
        axis=-1,
    )
    old = mx.concatenate([(config.decay ** N) * state.scores, mx.zeros((B, H, N))], axis=-1)
    scores = mx.where(positions >= 0, old + mass, 0.0)
    total = state.length + N
    newest = state.seen + N - 1
    gone = evict_lowest(scores, positions, total - config.budget, newest, config.n_sink, config.grace)
    keep = (positions >= 0) & ~gone
    order = mx.argsort(mx.where(keep, positions, INT32_MAX), axis=-1)[..., :C]  # survivors first
    kept = mx.take_along_axis(keep, order, axis=-1)

    def gather(x, y):
        return mx.take_along_axis(mx.concatenate([x, y.astype(x.dtype)], axis=2), order[..., None], axis=2)

    return H2OState(
        keys=gather(state.keys, keys),
        values=gather(state.values, values),
        scores=mx.where(kept, mx.take_along_axis(scores, order, axis=-1), 0.0),
        positions=mx.where(kept, mx.take_along_axis(positions, order, axis=-1), -1),
        length=mx.minimum(total, config.budget).astype(mx.int32),
        seen=state.seen + N,
    )


def _absorb_greedy(state, keys, values, config, weights, argmin) -> H2OState:
    N, C = keys.shape[2], config.capacity
    length = state.length.item()
    n0 = min(N, max(config.budget - length, 0))
    if n0 > 0:  # nothing can be evicted: one weight pass, rows written after the valid prefix
        w0 = None if weights is None else mx.concatenate(
            [weights[:, :, :n0, :C], weights[:, :, :n0, C : C + n0]], axis=-1
        )
        mass = _decayed_sum(_chunk_weights(state, keys[:, :, :n0], w0), config.decay)
        scores = mx.where(state.positions >= 0, (config.decay ** n0) * state.scores + mass[..., :C], 0.0)
        stop = length + n0
        state = H2OState(
            keys=_put_rows(state.keys, keys[:, :, :n0], length),
            values=_put_rows(state.values, values[:, :, :n0], length),
            scores=mx.concatenate([scores[..., :length], mass[..., C:], scores[..., stop:]], axis=-1),
            positions=mx.concatenate(
                [state.positions[..., :length],
                 mx.broadcast_to(state.seen + mx.arange(n0, dtype=mx.int32), (*keys.shape[:2], n0)),
                 state.positions[..., stop:]],
                axis=-1,
            ),
            length=state.length + n0,
            seen=state.seen + n0,
        )
    if weights is None:
        one = compiled_step(config, argmin)
        for i in range(n0, N):
            state = one(state, keys[:, :, i : i + 1], values[:, :, i : i + 1])
        return state
    # query weights: track which weight column each slot's token has
    slot = mx.arange(C)
    column = mx.where(slot < length, slot, C + slot - length)
    column = mx.broadcast_to(mx.where(slot < length + n0, column, slot), state.positions.shape)
    for i in range(n0, N):
        state = admit(state, keys[:, :, i : i + 1], values[:, :, i : i + 1])
        column = mx.where(state.positions == state.seen - 1, C + i, column)
        state = accumulate(state, mx.take_along_axis(weights[:, :, i], column, axis=-1), config)
        state = evict(state, config, argmin)
    return state


def _put_rows(x: mx.array, rows: mx.array, start: int) -> mx.array:
    """`x` `[B, H, C, D]` with rows `[B, H, n, D]` written at slots [start, start + n)."""
    return mx.slice_update(x, rows.astype(x.dtype), mx.array([start]), axes=(2,))
