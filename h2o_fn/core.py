"""The pure H2O core: `init`, `step`, `absorb`, `evict` and their building blocks.

Every function takes an `H2OState` and returns a new one; nothing is mutated.
Shapes: B batch rows, H KV heads, C = config.capacity slots (budget + evict_every), D head_dim,
N chunk tokens.

Per token t (one (b, h) row; S = the kept set):
  1. weights w_j over S (key proxy: softmax_j(K_j . k_t / sqrt(D)) in float32,
     or the model's own attention weights for scoring="query");
  2. s_j <- decay * s_j + w_j;
  3. admit t with s_t = 0 (key) or its own weight (query);
  4. if |S| > budget, evict the unprotected token with the lowest (score, position);
     sinks (p < n_sink) and the grace window (p > t - grace) are protected.

Weights are sanitised before they are added: NaN, +-inf and negative entries
count as 0, so scores stay finite and >= 0 whatever the keys hold.

Batch rows count on their own (`length`, `seen` are `[B]`). A row can sit a token
out: `alive` `[B]` (one token) or `n_alive` `[B]` (the first n_alive[b] tokens of a
chunk are real, the rest padding): padding is never kept, never scores and never
decays anyone's score. With `config.kv_bits` the rows are stored quantized and
scoring reads them dequantized (a token's key counts as its stored value).

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn import H2OConfig, init, step, kept_positions
    >>> cfg = H2OConfig(budget=8, n_sink=2, grace=2)
    >>> state = init(cfg, batch=1, n_heads=2, head_dim=16)
    >>> for _ in range(20):
    ...     kv = mx.random.normal((1, 2, 1, 16)).astype(mx.float16)
    ...     state = step(state, kv, kv, cfg)
    >>> kept_positions(state).shape, state.length.tolist(), state.seen.tolist()
    ((1, 2, 9), [8], [20])
"""

import functools
from typing import Callable, Optional

import mlx.core as mx

from . import storage
from .config import H2OConfig
from .state import H2OState

INT32_MAX = 2**31 - 1

# argmin(scores [B,H,C] f32, positions [B,H,C] i32, newest [B] or [] i32, n_sink, grace) -> [B,H] i32
Argmin = Callable[..., mx.array]


def init(
    config: H2OConfig, batch: int, n_heads: int, head_dim: int, dtype=mx.float16,
    value_dim: Optional[int] = None,
) -> H2OState:
    """An empty state: keys `[B, H, C, D]`, values `[B, H, C, value_dim or D]`, every slot free.

    With `config.kv_bits` each store is mx.quantize's triple (head_dim and value_dim
    must split into groups of `config.kv_group_size`).
    """
    shape = (batch, n_heads, config.capacity)
    bits, group = config.kv_bits, config.kv_group_size
    return H2OState(
        keys=storage.empty(shape, head_dim, dtype, bits, group),
        values=storage.empty(shape, value_dim or head_dim, dtype, bits, group),
        scores=mx.zeros(shape, dtype=mx.float32),
        positions=mx.full(shape, -1, dtype=mx.int32),
        length=mx.zeros((batch,), dtype=mx.int32),
        seen=mx.zeros((batch,), dtype=mx.int32),
    )


def _knob(x, dtype=mx.int32) -> mx.array:
    """A config number as a computed 0-d array, not a literal. mx.compile names a fused
    kernel after its literals' digits run together (mlx 0.32: n_sink=1, grace=10 reads as
    n_sink=11, grace=0), and caches kernels by name across processes (/tmp/mlx), so two
    configs would share one kernel; a computed scalar is read at run time instead."""
    return x if isinstance(x, mx.array) else mx.array([x], dtype=dtype).reshape(())


def _per_row(x: mx.array, ndim: int = 3) -> mx.array:
    """A `[B]` array shaped to broadcast against `[B, ...]` of `ndim` axes ([] stays [])."""
    return x.reshape(x.shape[0], *([1] * (ndim - 1))) if x.ndim == 1 else x


def evictable(positions: mx.array, newest: mx.array, n_sink: int, grace: int) -> mx.array:
    """The protection rule: held tokens that are neither sinks (p < n_sink) nor in the
    grace window (p > newest - grace). Free slots (p = -1) never qualify (n_sink >= 0).

    `newest` is `[]` or per row `[B]` (for `positions` `[B, ...]`)."""
    return (positions >= _knob(n_sink)) & (positions <= _per_row(newest, positions.ndim) - _knob(grace))


def protected_argmin(
    scores: mx.array, positions: mx.array, newest: mx.array, n_sink: int, grace: int
) -> mx.array:
    """The slot to free per (b, h): lowest (score, position) among unprotected tokens.

    Args:
      scores: `[B, H, C]` float32. NaN orders as -inf (a corrupt score goes first).
      positions: `[B, H, C]` int32, -1 for a free slot (never chosen).
      newest: `[]` or `[B]` int32, the newest absorbed position t (per row).
      n_sink, grace: positions `< n_sink` and `> t - grace` are protected.

    Returns:
      `[B, H]` int32 slot index, or -1 where no slot is evictable.

    This is the spec of the fused kernel in `h2o_fn.metal_ops`: comparisons only.

    Example:
        >>> import mlx.core as mx
        >>> s = mx.array([[[0.5, 0.1, 0.1, 0.0]]])
        >>> p = mx.array([[[0, 3, 1, 5]]], dtype=mx.int32)
        >>> protected_argmin(s, p, mx.array([5], dtype=mx.int32), 1, 1).tolist()  # 5 is in grace
        [[2]]
    """
    candidate = evictable(positions, newest, n_sink, grace)
    key = mx.where(candidate, mx.where(mx.isnan(scores), -mx.inf, scores), mx.inf)
    tied = candidate & (key == mx.min(key, axis=-1, keepdims=True))
    slot = mx.argmin(mx.where(tied, positions, INT32_MAX), axis=-1).astype(mx.int32)  # unique positions
    return mx.where(mx.any(candidate, axis=-1), slot, -1)


def clean_weights(weights: mx.array) -> mx.array:
    """Weights as float32 with NaN, +-inf and negative entries set to 0."""
    w = _f32(weights)
    return mx.where((w > 0) & (w < mx.inf), w, 0.0)


def key_weights(state: H2OState, queries: mx.array, config: H2OConfig) -> mx.array:
    """Key-as-query proxy weights of `queries` `[B, H, N, D]` over the valid slots.

    Returns `[B, H, N, C]` float32 softmax weights (0 on free slots; all 0 when S is empty).

    Example:
        >>> import mlx.core as mx
        >>> from h2o_fn import H2OConfig, init, absorb, key_weights
        >>> cfg = H2OConfig(budget=8, n_sink=1, grace=1)
        >>> s = absorb(init(cfg, 1, 1, 4), mx.ones((1, 1, 3, 4)), mx.ones((1, 1, 3, 4)), cfg)
        >>> key_weights(s, mx.ones((1, 1, 1, 4)), cfg)[0, 0, 0, :4].tolist()
        [0.3333333432674408, 0.3333333432674408, 0.3333333432674408, 0.0]
    """
    return _proxy_weights(_dense(state.keys, config), state.positions >= 0, queries)


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


def _dense(store, config: H2OConfig) -> mx.array:
    return storage.dense(store, config.kv_bits, config.kv_group_size)


def stored_rows(rows: mx.array, like, config: H2OConfig):
    """New rows `[B, H, N, D]` as a store would hold them: cast to its dtype, quantized
    when `config.kv_bits` (a store or its arrays only give the dtype)."""
    return storage.quantize(_as(rows, storage.dtype_of(like)), config.kv_bits, config.kv_group_size)


def _scored(keys: mx.array, like, config: H2OConfig) -> mx.array:
    """The keys as scoring sees them: as given, or their stored (dequantized) values."""
    if config.kv_bits is None:
        return keys
    return _dense(stored_rows(keys, like, config), config)


def admit(state: H2OState, key: mx.array, value: mx.array, config: H2OConfig,
          alive: Optional[mx.array] = None) -> H2OState:
    """Write one token `[B, H, 1, D]` into the first free slot with score 0.

    Needs a free slot (`length <= budget`, true after every `step`/`evict`). The
    result may hold budget + 1 tokens: `settle` (or `accumulate` then `evict`)
    finishes the step. Rows where `alive` `[B]` is False take nothing (the row is
    written into the free slot, which stays free).
    """
    return _admit(state, key, value, config, alive)[0]


def _admit(state: H2OState, key, value, config, alive):
    """`admit`, also returning the `[B, H, C]` mask of the slots free before it."""
    free = state.positions < 0
    slot = mx.argmax(free, axis=-1)  # [B, H]
    here = mx.arange(state.positions.shape[-1]) == slot[..., None]
    add = 1
    if alive is not None:
        here = here & _per_row(alive)
        add = alive.astype(mx.int32)
    index = slot[..., None, None]
    return H2OState(  # a free slot already scores 0
        keys=storage.write(state.keys, index, stored_rows(key, state.keys, config)),
        values=storage.write(state.values, index, stored_rows(value, state.values, config)),
        scores=state.scores,
        positions=mx.where(here, _per_row(state.seen), state.positions),
        length=state.length + add,
        seen=state.seen + add,
    ), free


def accumulate(state: H2OState, weights: mx.array, config: H2OConfig,
               alive: Optional[mx.array] = None) -> H2OState:
    """Decay then add: s_j <- decay * s_j + w_j on valid slots. `weights` `[B, H, C]`.

    Rows where `alive` `[B]` is False keep their scores (padding decays nothing).
    """
    valid = state.positions >= 0
    new = _knob(config.decay, mx.float32) * state.scores + clean_weights(weights)
    if alive is not None:
        new = mx.where(_per_row(alive), new, state.scores)
    return state._replace(scores=mx.where(valid, new, 0.0))


def evict(state: H2OState, config: H2OConfig, argmin: Argmin = protected_argmin) -> H2OState:
    """Evict one token per (b, h) of every row that holds more than `budget` tokens.

    After `admit` a state holds at most budget + 1 tokens, so one eviction always
    brings it down to budget (staged `evict_every` tokens are absorbed, not evicted
    here). The freed slot keeps its stale key/value rows.
    """
    over = state.length > _knob(config.budget)  # [B]
    slot = argmin(state.scores, state.positions, state.seen - 1, config.n_sink, config.grace)
    drop = (mx.arange(state.positions.shape[-1]) == slot[..., None]) & _per_row(over)
    return state._replace(
        scores=mx.where(drop, 0.0, state.scores),
        positions=mx.where(drop, -1, state.positions),
        length=state.length - over.astype(mx.int32),
    )


def settle(admitted: H2OState, weights: mx.array, config: H2OConfig,
           argmin: Argmin = protected_argmin, alive: Optional[mx.array] = None) -> H2OState:
    """The rest of a step once its weights `[B, H, C]` (over the admitted state's slots)
    are known: decay-add them, then evict down to budget."""
    return evict(accumulate(admitted, weights, config, alive), config, argmin)


def step(
    state: H2OState,
    key: mx.array,
    value: mx.array,
    config: H2OConfig,
    weights: Optional[mx.array] = None,
    argmin: Argmin = protected_argmin,
    alive: Optional[mx.array] = None,
) -> H2OState:
    """One token `[B, H, 1, D]`: weights, decay-add, admit, evict.

    Args:
      weights: `[B, H, 1, C + 1]` for `scoring="query"` (refused for "key"): column
        j < C is the token in slot j of `state`, column C the new token itself.
      alive: optional `[B]` bool; False rows take no token (padding).

    After it, the token's key/value rows sit in the state's stores even if an older
    token was just evicted, so `storage.head(keys, length + 1)` of the state before
    the step, admitted, is exactly S_{t-1} + {t}: what this token's attention sees.
    """
    _check_chunk(state, key, value, config, n=1)
    _check_weights(state, key, config, weights)
    # admit first: the weights then read the written keys (the new token masked out),
    # so MLX can write the row into the old buffer instead of copying the cache
    admitted, free_before = _admit(state, key, value, config, alive)
    if weights is not None:
        first_free = mx.argmax(free_before, axis=-1)[..., None]
        own = mx.arange(free_before.shape[-1]) == first_free
        w = mx.where(own, weights[..., 0, -1:], weights[..., 0, :-1])
        return settle(admitted, w, config, argmin, alive)
    w = _proxy_weights(_dense(admitted.keys, config), ~free_before, _scored(key, state.keys, config))
    if alive is not None:
        return settle(admitted, w[..., 0, :], config, argmin, alive)
    # proxy weights are exactly 0 on free slots and on the new token: no mask needed
    decayed = _knob(config.decay, mx.float32) * admitted.scores
    return evict(admitted._replace(scores=decayed + w[..., 0, :]), config, argmin)


@functools.lru_cache(maxsize=None)
def compiled_step(config: H2OConfig, argmin: Argmin = protected_argmin):
    """`step` for a fixed config under `mx.compile`: `fn(state, key, value, weights=None,
    alive=None)`, one trace per input shape and per which optional arrays are given.

    Example:
        >>> import mlx.core as mx
        >>> from h2o_fn import H2OConfig, init, compiled_step
        >>> cfg = H2OConfig(budget=4, n_sink=1, grace=1)
        >>> fast, s = compiled_step(cfg), init(cfg, 1, 1, 8)
        >>> for _ in range(6):
        ...     s = fast(s, mx.ones((1, 1, 1, 8)), mx.ones((1, 1, 1, 8)))
        >>> s.length.tolist(), s.seen.tolist()
        ([4], [6])
    """

    def one(state, key, value, weights=None, alive=None):
        return step(state, key, value, config, weights, argmin, alive)

    return mx.compile(one)


@functools.lru_cache(maxsize=None)
def compiled_admit(config: H2OConfig):
    """`admit` for a fixed config under `mx.compile`: `fn(state, key, value)`."""
    return mx.compile(lambda state, key, value: admit(state, key, value, config))


@functools.lru_cache(maxsize=None)
def compiled_settle(config: H2OConfig, argmin: Argmin = protected_argmin):
    """`settle` for a fixed config under `mx.compile`: `fn(admitted, weights, alive=None)`."""
    return mx.compile(lambda admitted, weights, alive=None: settle(admitted, weights, config, argmin, alive))


@functools.lru_cache(maxsize=None)
def compiled_absorb(config: H2OConfig, argmin: Argmin = protected_argmin):
    """`absorb` (oneshot prefill: no sync) under `mx.compile`: `fn(state, keys, values,
    weights=None, n_alive=None)`, one trace per chunk length. Greedy prefill reads the
    length back, so it is returned uncompiled."""
    def chunk(state, keys, values, weights=None, n_alive=None):
        return absorb(state, keys, values, config, weights, argmin, n_alive)

    return chunk if config.prefill == "greedy" else mx.compile(chunk)


def absorb(
    state: H2OState,
    keys: mx.array,
    values: mx.array,
    config: H2OConfig,
    weights: Optional[mx.array] = None,
    argmin: Argmin = protected_argmin,
    n_alive: Optional[mx.array] = None,
) -> H2OState:
    """Absorb a chunk of N tokens `[B, H, N, D]`; the result holds at most `budget`.

    Args:
      weights: `[B, H, N, C + N]` attention weights of the chunk's queries, required
        for `scoring="query"` and refused for "key". Column j < C is the token in
        slot j of `state` (ignored where the slot is free); column C + i is chunk
        token i (ignored where i > the query's own index). Those of the last
        M = `scored_queries(N, config, n_alive)` queries alone, `[B, H, M, C + N]`,
        are enough (the others do not score): memory linear in N, not quadratic.
      n_alive: optional `[B]` int32: row b's first n_alive[b] tokens are real, the
        rest is padding (never kept, never scored, decays nothing). Default: all N.

    `config.prefill`:
      "greedy": exactly N single-token steps (one weight pass while nothing can be
        evicted, token by token after). Reads `state.length` once (one sync).
      "oneshot": all weights at once (query i sees S and the chunk up to i), scores
        s <- decay^n s + sum_i decay^(n-1-i) w_i (n = the row's real tokens), then the
        lowest (score, position) unprotected tokens are evicted down to budget.
        Survivors are stored sorted by position. Fixed shapes, no sync: compiles.
        A chunk of more than `config.window` tokens (a prompt; every chunk when window is
        0) is compressed as SnapKV does: with window > 0 it sums only its last `window`
        queries' weights (the question), and with pool > 1 the eviction ranking (not the
        stored score) takes the best score within +-pool//2 positions (`pooled`: spans
        survive together). Greedy prefill ignores both: it has no chunk-level decision.

    Example:
        >>> import mlx.core as mx
        >>> from h2o_fn import H2OConfig, init, absorb
        >>> cfg = H2OConfig(budget=4, n_sink=1, grace=1)
        >>> kv = mx.random.normal((2, 1, 6, 8))
        >>> s = absorb(init(cfg, 2, 1, 8), kv, kv, cfg, n_alive=mx.array([6, 2]))
        >>> s.length.tolist(), s.seen.tolist()
        ([4, 2], [6, 2])
    """
    n = _check_chunk(state, keys, values, config)
    _check_weights(state, keys, config, weights, n_alive)
    if n_alive is not None and (n_alive.ndim != 1 or n_alive.shape[0] != keys.shape[0]):
        raise ValueError(f"n_alive shape {tuple(n_alive.shape)} is invalid: expected [B={keys.shape[0]}]")
    if config.prefill == "oneshot":
        return _absorb_oneshot(state, keys, values, config, weights, n_alive)
    return _absorb_greedy(state, keys, values, config, weights, argmin, n_alive, n)


def rewind(state: H2OState, n: int) -> H2OState:
    """Forget the n newest tokens of every row; only meaningful while nothing has been evicted.

    Their slots are freed (they are the last n of each row's valid prefix). The scores
    of the tokens that stay keep the mass the forgotten tokens gave them: under decay
    it cannot be subtracted exactly.
    """
    gone = state.positions >= _per_row(state.seen) - n
    return state._replace(
        scores=mx.where(gone, 0.0, state.scores),
        positions=mx.where(gone, -1, state.positions),
        length=state.length - n,
        seen=state.seen - n,
    )


def kept_positions(state: H2OState) -> mx.array:
    """Kept positions per (b, h), ascending, padded with -1 at the end: `[B, H, C]` int32.

    Example:
        >>> import mlx.core as mx
        >>> from h2o_fn import H2OConfig, init, absorb, kept_positions
        >>> cfg = H2OConfig(budget=4, n_sink=1, grace=1, decay=1.0)
        >>> kv = mx.zeros((1, 1, 7, 2))
        >>> kept_positions(absorb(init(cfg, 1, 1, 2), kv, kv, cfg)).tolist()  # early tokens gather mass
        [[[0, 1, 2, 6, -1]]]
    """
    p = mx.sort(mx.where(state.positions < 0, INT32_MAX, state.positions), axis=-1)
    return mx.where(p == INT32_MAX, -1, p)


# ---------------------------------------------------------------- checks


def _check_chunk(state: H2OState, keys: mx.array, values: mx.array, config: H2OConfig,
                 n: Optional[int] = None) -> int:
    B, H, _ = state.positions.shape
    widths = (("keys", keys, storage.width(state.keys, config.kv_bits)),
              ("values", values, storage.width(state.values, config.kv_bits)))
    for name, x, D in widths:
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


def scored_queries(N: int, config: H2OConfig, n_alive: Optional[mx.array] = None) -> int:
    """How many of a chunk's last queries `absorb` reads the weights of: `config.window`
    for a oneshot chunk longer than the window whose rows are all real (SnapKV's prompt
    window), else all N. Weights `[B, H, M, C + N]` of those M queries are enough.

    Example:
        >>> from h2o_fn import H2OConfig
        >>> scored_queries(2048, H2OConfig(scoring="query", window=48)), scored_queries(32, H2OConfig(window=48))
        (48, 32)
    """
    if config.prefill == "oneshot" and 0 < config.window < N and n_alive is None:
        return config.window
    return N


def _check_weights(state: H2OState, keys: mx.array, config: H2OConfig, weights, n_alive=None) -> None:
    if (weights is None) != (config.scoring == "key"):
        raise ValueError(
            f"got weights={None if weights is None else tuple(weights.shape)} with "
            f"config.scoring={config.scoring!r}: expected weights [B, H, N, C + N] exactly "
            "when scoring='query'"
        )
    if weights is not None:
        B, H, N = keys.shape[:3]
        rows = {N, scored_queries(N, config, n_alive)}
        if weights.ndim != 4 or tuple(weights.shape[:2]) != (B, H) or weights.shape[2] not in rows or \
                weights.shape[3] != state.positions.shape[-1] + N:
            M = " or ".join(str(m) for m in sorted(rows))
            raise ValueError(f"weights shape {tuple(weights.shape)} is invalid: expected "
                             f"({B}, {H}, {M}, {state.positions.shape[-1] + N})")


# ---------------------------------------------------------------- chunk helpers


def _alive_mask(N: int, n_alive: Optional[mx.array]) -> Optional[mx.array]:
    """`[B, 1, N]` bool: chunk token i of row b is real; None when every token is."""
    return None if n_alive is None else (mx.arange(N) < n_alive[:, None])[:, None, :]


def _chunk_weights(state, keys, chunk_store, config, weights, n_alive, first: int = 0) -> mx.array:
    """`[B, H, N - first, C + N]` float32 weights of the chunk's queries first..N-1: slots
    then chunk tokens (first > 0 only with query weights of those rows and no padding).

    Key proxy: token i sees S and chunk tokens before it. Query: also itself.
    Padding neither sees (its row is 0) nor is seen (its column is 0).
    """
    B, H, N, _ = keys.shape
    C = state.positions.shape[-1]
    M = N - first
    row, col = mx.arange(first, N)[:, None], mx.arange(N)[None]
    own = (col <= row) if weights is not None else (col < row)  # key proxy: not itself
    visible = mx.concatenate(
        [mx.broadcast_to((state.positions >= 0)[..., None, :], (B, H, M, C)),
         mx.broadcast_to(own, (B, H, M, N))],
        axis=-1,
    )
    alive = _alive_mask(N, n_alive)
    if alive is not None:
        real = alive[..., :, None] & mx.concatenate(
            [mx.ones((B, 1, 1, C), dtype=mx.bool_), alive[..., None, :]], axis=-1)
        visible = visible & real
    if weights is None:
        k = _f32(keys if config.kv_bits is None else _dense(chunk_store, config))
        # slots and chunk apart: concatenating the keys would copy all C stored rows
        logits = mx.concatenate([k @ _f32(_dense(state.keys, config)).swapaxes(-1, -2),
                                 k @ k.swapaxes(-1, -2)], axis=-1) * keys.shape[-1] ** -0.5
        weights = mx.softmax(mx.where(visible, logits, -mx.inf), axis=-1, precise=True)
    return clean_weights(mx.where(visible, weights, 0.0))


def _decayed_sum(w: mx.array, decay: float, n_alive: Optional[mx.array], first: int = 0) -> mx.array:
    """sum_i decay^(n-1-i) w[..., i - first, :] over i = first..N-1, for `w`
    `[B, H, N - first, M]` -> `[B, H, M]`.

    n = N, or per row n_alive (padding rows of `w` are 0 already)."""
    N = first + w.shape[2]
    last = _knob(N - 1, mx.float32) if n_alive is None else _per_row(n_alive - 1, 2)
    exponent = mx.maximum(last - mx.arange(first, N, dtype=mx.float32), 0.0)  # [N - first] or [B, N - first]
    powers = mx.power(_knob(decay, mx.float32), _f32(exponent))
    powers = powers[:, None] if powers.ndim == 1 else powers[:, None, :, None]
    return (powers * w).sum(axis=2)


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

    `k` and `newest` are `[]` or per row `[B]`. Equals k successive `protected_argmin`
    evictions: removing a token never changes the other scores, so the i-th single
    eviction takes the i-th lowest.
    """
    candidate = evictable(positions, newest, n_sink, grace)
    last = mx.array(2**32 - 1, mx.uint32).astype(mx.uint64)
    key = mx.where(candidate, _sort_key(scores, positions), (last << 32) | last)
    rank = mx.argsort(mx.argsort(key, axis=-1), axis=-1)
    return candidate & (rank < _per_row(k, positions.ndim))


def pooled(scores: mx.array, positions: mx.array, pool: int) -> mx.array:
    """Each held token's score raised to the highest score within +-pool//2 positions
    (SnapKV's pooling: a span survives together). `[B, H, M]` in and out; free slots as given.

    Example:
        >>> import mlx.core as mx
        >>> s = mx.array([[[0.1, 0.9, 0.2, 0.0]]])
        >>> p = mx.array([[[3, 4, 6, -1]]], dtype=mx.int32)
        >>> [round(x, 3) for x in pooled(s, p, 3)[0, 0].tolist()]  # 6 is 2 away from 4
        [0.9, 0.9, 0.2, 0.0]
    """
    r = pool // 2
    order = mx.argsort(mx.where(positions >= 0, positions, INT32_MAX), axis=-1)
    s = mx.take_along_axis(scores, order, axis=-1)
    p = mx.take_along_axis(positions, order, axis=-1)
    s = mx.where(p >= 0, s, -mx.inf)
    M = s.shape[-1]
    best = s
    for d in range(1, r + 1):
        for shift in (d, -d):  # neighbours d slots away in position order
            pad = [(0, 0)] * (s.ndim - 1) + ([(shift, 0)] if shift > 0 else [(0, -shift)])
            lo, hi = (0, M) if shift > 0 else (-shift, M - shift)
            near_s = mx.pad(s, pad, constant_values=-mx.inf)[..., lo:hi]
            near_p = mx.pad(p, pad, constant_values=-INT32_MAX)[..., lo:hi]
            best = mx.maximum(best, mx.where(mx.abs(near_p - p) <= _knob(r), near_s, -mx.inf))
    back = mx.take_along_axis(best, mx.argsort(order, axis=-1), axis=-1)
    return mx.where(positions >= 0, back, scores)


def _absorb_oneshot(state, keys, values, config, weights, n_alive) -> H2OState:
    B, H, N, _ = keys.shape
    real = mx.broadcast_to(_knob(N), (B,)) if n_alive is None else _as(n_alive, mx.int32)
    chunk_keys = stored_rows(keys, state.keys, config)
    first = 0 if weights is None else N - weights.shape[2]  # query weights of the last rows only
    w = _chunk_weights(state, keys, chunk_keys, config, weights, n_alive, first)
    long_chunk = N > config.window  # a prompt: scored by its last queries, ranked by spans
    if config.window and long_chunk:
        w = mx.where(mx.arange(first, N)[:, None] >= (real - _knob(config.window))[:, None, None, None], w, 0.0)
    mass = _decayed_sum(w, config.decay, n_alive, first)  # [B, H, C + N]
    if n_alive is None:
        faded = _knob(config.decay ** N, mx.float32) * state.scores
    else:
        faded = state.scores * _per_row(mx.power(_knob(config.decay, mx.float32), _f32(real)))
    scores = mass + mx.concatenate([faded, mx.zeros((B, H, N))], axis=-1)
    pool = None
    if config.pool > 1 and long_chunk:  # a row is long by its real tokens, not the padded N
        pool = real > _knob(config.window)
    return _keep_best(state, chunk_keys, stored_rows(values, state.values, config), scores, real, pool, config)


def _keep_best(state, chunk_keys, chunk_values, scores, real, pool, config) -> H2OState:
    """Admit a chunk (stored rows `[B, H, N, D]`, the first `real[b]` real) with `scores`
    `[B, H, C + N]` (slots, then chunk tokens), evict the lowest (score, position)
    unprotected down to budget, and store the survivors first, sorted by position.
    `pool` `[B]` bool: rows whose ranking takes the best score within +-pool//2 positions
    (None: no row)."""
    B, H, N = scores.shape[0], scores.shape[1], scores.shape[2] - state.positions.shape[-1]
    C = config.capacity
    arange = mx.arange(N, dtype=mx.int32)
    chunk_positions = mx.where(arange < real[:, None], state.seen[:, None] + arange, -1)  # [B, N]
    positions = mx.concatenate(
        [state.positions, mx.broadcast_to(chunk_positions[:, None], (B, H, N))], axis=-1
    )
    scores = mx.where(positions >= 0, scores, 0.0)
    total = state.length + real
    newest = state.seen + real - 1
    rank = scores
    if pool is not None:
        rank = mx.where(_per_row(pool), pooled(scores, positions, config.pool), scores)
    budget = _knob(config.budget)
    gone = evict_lowest(rank, positions, total - budget, newest, config.n_sink, config.grace)
    keep = (positions >= 0) & ~gone
    order = mx.argsort(mx.where(keep, positions, INT32_MAX), axis=-1)[..., :C]  # survivors first
    kept = mx.take_along_axis(keep, order, axis=-1)
    return H2OState(
        keys=storage.take(storage.concat(state.keys, chunk_keys), order),
        values=storage.take(storage.concat(state.values, chunk_values), order),
        scores=mx.where(kept, mx.take_along_axis(scores, order, axis=-1), 0.0),
        positions=mx.where(kept, mx.take_along_axis(positions, order, axis=-1), -1),
        length=mx.minimum(total, budget).astype(mx.int32),
        seen=state.seen + real,
    )


def absorb_scored(state: H2OState, keys: mx.array, values: mx.array, scores: mx.array,
                  config: H2OConfig) -> H2OState:
    """Absorb a chunk `[B, H, N, D]` whose scores come from elsewhere (a prompt-scoring
    pass such as `h2o_fn.retention`), then evict down to budget by the usual rule.

    Args:
      scores: `[B, H, C + N]` float32: column j < C is the new score of the token in slot
        j of `state` (ignored where the slot is free), column C + i that of chunk token i.
        Sanitised like weights (NaN, inf and negatives count as 0); nothing is decayed.

    The lowest (score, position) unprotected tokens are evicted (sinks and the grace
    window before the chunk's last position are protected; with `config.pool > 1` the
    ranking takes the best score within +-pool//2 positions), and the survivors are
    stored first, sorted by position. `config.scoring`, `prefill` and `window` do not
    apply: the scores are given.

    Example:
        >>> import mlx.core as mx
        >>> from h2o_fn import H2OConfig, init, absorb_scored, kept_positions
        >>> cfg = H2OConfig(budget=3, n_sink=1, grace=1)
        >>> kv = mx.zeros((1, 1, 6, 4))
        >>> s = mx.array([[[0.0] * cfg.capacity + [0.0, 0.1, 0.9, 0.2, 0.3, 0.0]]])
        >>> kept_positions(absorb_scored(init(cfg, 1, 1, 4), kv, kv, s, cfg))[0, 0].tolist()
        [0, 2, 5, -1]
    """
    N = _check_chunk(state, keys, values, config)
    expected = (*keys.shape[:2], state.positions.shape[-1] + N)
    if tuple(scores.shape) != expected:
        raise ValueError(f"scores shape {tuple(scores.shape)} is invalid: expected {expected} "
                         "(the state's slots, then the chunk's tokens)")
    real = mx.broadcast_to(_knob(N), (keys.shape[0],))
    pool = mx.broadcast_to(mx.array(True), (keys.shape[0],)) if config.pool > 1 else None
    return _keep_best(state, stored_rows(keys, state.keys, config), stored_rows(values, state.values, config),
                      clean_weights(scores), real, pool, config)


def _absorb_greedy(state, keys, values, config, weights, argmin, n_alive, N) -> H2OState:
    C = config.capacity
    lengths = state.length.tolist()
    n0 = 0
    if n_alive is None and len(set(lengths)) == 1:  # equal rows: one pass while none can evict
        n0 = min(N, max(config.budget - lengths[0], 0))
    if n0 > 0:  # rows written after the valid prefix
        length = lengths[0]
        w0 = None if weights is None else mx.concatenate(
            [weights[:, :, :n0, :C], weights[:, :, :n0, C : C + n0]], axis=-1
        )
        head = keys[:, :, :n0]
        chunk_keys = stored_rows(head, state.keys, config)
        mass = _decayed_sum(_chunk_weights(state, head, chunk_keys, config, w0, None), config.decay, None)
        scores = mx.where(state.positions >= 0, (config.decay ** n0) * state.scores + mass[..., :C], 0.0)
        stop = length + n0
        state = H2OState(
            keys=storage.put(state.keys, chunk_keys, length),
            values=storage.put(state.values, stored_rows(values[:, :, :n0], state.values, config), length),
            scores=mx.concatenate([scores[..., :length], mass[..., C:], scores[..., stop:]], axis=-1),
            positions=mx.concatenate(
                [state.positions[..., :length],
                 mx.broadcast_to((state.seen[:, None] + mx.arange(n0, dtype=mx.int32))[:, None],
                                 (*keys.shape[:2], n0)),
                 state.positions[..., stop:]],
                axis=-1,
            ),
            length=state.length + n0,
            seen=state.seen + n0,
        )
    one = compiled_step(config, argmin)
    column = None
    if weights is not None:  # which weight column holds each slot's token
        slot = mx.arange(C)
        start = lengths[0] if n0 else 0
        column = mx.where(slot < start, slot, C + slot - start)
        column = mx.broadcast_to(mx.where(slot < start + n0, column, slot), state.positions.shape)
    for i in range(n0, N):
        alive = None if n_alive is None else (i < n_alive)
        w = None
        if column is not None:
            w = mx.concatenate([mx.take_along_axis(weights[:, :, i], column, axis=-1),
                                weights[:, :, i, C + i : C + i + 1]], axis=-1)[:, :, None]
        state = one(state, keys[:, :, i : i + 1], values[:, :, i : i + 1], w, alive)
        if column is not None:
            newest = (state.positions == _per_row(state.seen) - 1)
            if alive is not None:
                newest = newest & _per_row(alive)
            column = mx.where(newest, C + i, column)
    return state
