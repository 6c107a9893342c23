"""Prefill: a chunk of N tokens absorbed at once, evicted down to budget.

`absorb` (greedy: N exact steps; oneshot: one weight pass, then the lowest
(score, position) unprotected tokens evicted together), `absorb_scored` (scores
from a prompt-scoring pass) and `pooled` (SnapKV's spans). Shapes: B batch rows,
H KV heads, C = budget + room slots (`init`), D head_dim, N chunk tokens.

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn import H2OConfig, init
    >>> from h2o_fn.prefill import absorb
    >>> cfg = H2OConfig(budget=4, n_sink=1, grace=1)
    >>> kv = mx.random.normal((1, 1, 9, 8))
    >>> s = absorb(init(cfg, 1, 1, 8), kv, kv, cfg)
    >>> s.length.tolist(), s.seen.tolist()
    ([4], [9])
"""

import functools
from typing import Optional

import mlx.core as mx

from . import storage
from .arrays import INT32_MAX, as_dtype, dense, f32, knob, per_row, slot_order, stored_rows, times_rows
from .checks import check_chunk, check_staged_logits, check_weights
from .config import H2OConfig
from .core import compiled_step, rewind
from .prompt import Prompt
from .rule import Argmin, evict_lowest, protected_argmin
from .scoring import clean_weights, proxy_softmax, scored_queries
from .softmax import softmax
from .state import FREE, RESERVED, H2OState
from .storage import DENSE, Storage


@functools.lru_cache(maxsize=None)
def compiled_absorb(config: H2OConfig, argmin: Argmin = protected_argmin, prompt: Prompt = Prompt(),
                    kv: Storage = DENSE):
    """`absorb` (oneshot prefill: no sync) under `mx.compile`: `fn(state, keys, values,
    weights=None, n_alive=None)`, one trace per chunk length. Greedy prefill reads the
    length back, so it is returned uncompiled."""
    def chunk(state, keys, values, weights=None, n_alive=None):
        return absorb(state, keys, values, config, weights, argmin, n_alive, prompt, kv)

    return chunk if config.prefill == "greedy" else mx.compile(chunk)


@functools.lru_cache(maxsize=None)
def compiled_absorb_staged(config: H2OConfig, prompt: Prompt = Prompt(), kv: Storage = DENSE):
    """`absorb_staged` under `mx.compile`: `fn(state, keys, values, weights=None, logits=None)`,
    one trace per number of staged tokens and per which optional arrays are given."""
    def staged(state, keys, values, weights=None, logits=None):
        return absorb_staged(state, keys, values, config, weights, prompt, kv, logits)

    return mx.compile(staged)


def absorb(
    state: H2OState,
    keys: mx.array,
    values: mx.array,
    config: H2OConfig,
    weights: Optional[mx.array] = None,
    argmin: Argmin = protected_argmin,
    n_alive: Optional[mx.array] = None,
    prompt: Prompt = Prompt(),
    kv: Storage = DENSE,
) -> H2OState:
    """Absorb a chunk of N tokens `[B, H, N, D]`; the result holds at most `budget`.

    Args:
      weights: `[B, H, N, C + N]` attention weights of the chunk's queries, required
        for `scoring="query"` and refused for "key". Column j < C is the token in
        slot j of `state` (ignored where the slot is free); column C + i is chunk
        token i (ignored where i > the query's own index). Those of the last
        M = `scored_queries(N, config, n_alive, prompt)` queries alone, `[B, H, M, C + N]`,
        are enough (the others do not score): memory linear in N, not quadratic.
      n_alive: optional `[B]` int32: row b's first n_alive[b] tokens are real, the
        rest is padding (never kept, never scored, decays nothing). Default: all N.
      prompt: how oneshot prefill scores a long chunk (`h2o_fn.Prompt`; default: every
        query scores, no pooling).
      kv: how the state stores rows (`init`'s `h2o_fn.Storage`).

    `config.prefill`:
      "greedy": exactly N single-token steps (one weight pass while nothing can be
        evicted, token by token after). Reads `state.length` once (one sync).
      "oneshot": all weights at once (query i sees S and the chunk up to i), scores
        s <- decay^n s + sum_i decay^(n-1-i) w_i (n = the row's real tokens), then the
        lowest (score, position) unprotected tokens are evicted down to budget.
        Survivors are stored sorted by position. Fixed shapes, no sync: compiles.
        A chunk of more than `prompt.window` tokens (a prompt; every chunk when window is
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
    n = check_chunk(state, keys, values, kv)
    check_weights(state, keys, config, weights, n_alive, prompt)
    if n_alive is not None and (n_alive.ndim != 1 or n_alive.shape[0] != keys.shape[0]):
        raise ValueError(f"n_alive shape {tuple(n_alive.shape)} is invalid: expected [B={keys.shape[0]}]")
    if config.prefill == "oneshot":
        return _absorb_oneshot(state, keys, values, config, weights, n_alive, prompt, kv)
    return _absorb_greedy(state, keys, values, config, weights, argmin, n_alive, n, kv)


def admit_chunk(state: H2OState, keys: mx.array, values: mx.array, start: int, kv: Storage = DENSE) -> H2OState:
    """Write a chunk `[B, H, N, D]` into slots [start, start + N) of every row and head, which
    must be free, with score 0 (`settle_chunk` scores it): `absorb`'s result when it evicts
    nothing, laid out as decode leaves it instead of sorted. A state nothing else holds is
    written where it lies, where `absorb` gathers every row into new arrays: continuing a
    held conversation with a short turn costs the turn's rows, not a copy of the cache.

    Example:
        >>> import mlx.core as mx
        >>> from h2o_fn import H2OConfig, init, absorb, kept_positions
        >>> cfg = H2OConfig(budget=8, n_sink=1, grace=1)
        >>> kv = mx.ones((1, 1, 3, 4))
        >>> s = admit_chunk(absorb(init(cfg, 1, 1, 4), kv, kv, cfg), kv, kv, start=3)
        >>> kept_positions(s)[0, 0].tolist()[:6], s.length.tolist()
        ([0, 1, 2, 3, 4, 5], [6])
    """
    N = check_chunk(state, keys, values, kv)
    B, H, C = state.positions.shape
    if not 0 <= start <= C - N:
        raise ValueError(f"start={start} is invalid for a chunk of {N} in {C} slots: expected 0..{C - N}")
    at = mx.array([start])
    new = mx.broadcast_to((state.seen[:, None] + mx.arange(N))[:, None], (B, H, N)).astype(mx.int32)
    return H2OState(
        keys=storage.put(state.keys, stored_rows(keys, state.keys, kv), start),
        values=storage.put(state.values, stored_rows(values, state.values, kv), start),
        scores=state.scores,  # free slots score 0
        positions=mx.slice_update(state.positions, new, at, axes=(2,)),
        length=state.length + N,
        seen=state.seen + N,
    )


def settle_chunk(admitted: H2OState, keys: mx.array, config: H2OConfig, start: int,
                 weights: Optional[mx.array] = None, prompt: Prompt = Prompt(), kv: Storage = DENSE) -> H2OState:
    """The scores `absorb` (oneshot) gives a chunk `[B, H, N, D]` that `admit_chunk` wrote at
    [start, start + N), when nothing is evicted (length <= budget: the caller's to ensure).

    Args:
      weights: query scoring, `[B, H, M, C]` attention weights of the chunk's last M queries
        over the admitted state's slots (the chunk's own at [start, start + N), causal),
        M as `absorb` takes them; None: the key proxy's, computed here.
    """
    N, C = keys.shape[2], admitted.positions.shape[-1]
    slots = mx.arange(C)
    own = (slots >= start) & (slots < start + N)  # [C]: the chunk's slots
    before = admitted._replace(positions=mx.where(own, FREE, admitted.positions), length=admitted.length - N,
                               seen=admitted.seen - N)
    if weights is not None:  # -> absorb's layout (the chunk's slots are free in `before`: ignored there)
        weights = mx.concatenate([weights, weights[..., start : start + N]], axis=-1)
    chunk_keys = stored_rows(keys, admitted.keys, kv)
    scores = _oneshot_scores(before, keys, chunk_keys, config, weights, None, prompt, kv)[0]  # [B, H, C + N]
    moved = mx.where(own, C + slots - start, slots)  # slot j's column in absorb's layout
    scores = mx.take_along_axis(scores, mx.broadcast_to(moved, scores.shape[:-1] + (C,)), axis=-1)
    return admitted._replace(scores=mx.where(admitted.positions >= 0, scores, 0.0))


def _alive_mask(N: int, n_alive: Optional[mx.array]) -> Optional[mx.array]:
    """`[B, 1, N]` bool: chunk token i of row b is real; None when every token is."""
    return None if n_alive is None else (mx.arange(N) < n_alive[:, None])[:, None, :]


def _chunk_weights(state, keys, chunk_store, kv, weights, n_alive, first: int = 0) -> mx.array:
    """`[B, H, N - first, C + N]` float32 weights of the chunk's queries first..N-1: slots
    then chunk tokens (first > 0 only without padding; with query scoring, `weights` are
    those rows').

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
        k = f32(keys if kv.bits is None else dense(chunk_store, kv))
        q = k[:, :, first:]
        # slots and chunk apart: concatenating the keys would copy all C stored rows
        logits = mx.concatenate([times_rows(q, state.keys, kv), q @ k.swapaxes(-1, -2)],
                                axis=-1) * keys.shape[-1] ** -0.5
        weights = softmax(mx.where(visible, logits, -mx.inf))
    return clean_weights(mx.where(visible, weights, 0.0))


def _decayed_sum(w: mx.array, decay: float, n_alive: Optional[mx.array], first: int = 0) -> mx.array:
    """sum_i decay^(n-1-i) w[..., i - first, :] over i = first..N-1, for `w`
    `[B, H, N - first, M]` -> `[B, H, M]`.

    n = N, or per row n_alive (padding rows of `w` are 0 already)."""
    N = first + w.shape[2]
    last = knob(N - 1, mx.float32) if n_alive is None else per_row(n_alive - 1, 2)
    exponent = mx.maximum(last - mx.arange(first, N, dtype=mx.float32), 0.0)  # [N - first] or [B, N - first]
    powers = mx.power(knob(decay, mx.float32), f32(exponent))
    powers = powers[:, None] if powers.ndim == 1 else powers[:, None, :, None]
    return (powers * w).sum(axis=2)


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
            best = mx.maximum(best, mx.where(mx.abs(near_p - p) <= knob(r), near_s, -mx.inf))
    back = mx.take_along_axis(best, mx.argsort(order, axis=-1), axis=-1)
    return mx.where(positions >= 0, back, scores)


def _absorb_oneshot(state, keys, values, config, weights, n_alive, prompt, kv) -> H2OState:
    chunk_keys = stored_rows(keys, state.keys, kv)
    scores, real, pool = _oneshot_scores(state, keys, chunk_keys, config, weights, n_alive, prompt, kv)
    return _keep_best(state, chunk_keys, stored_rows(values, state.values, kv), scores, real, pool, config)


def _oneshot_scores(state, keys, chunk_keys, config, weights, n_alive, prompt, kv):
    """(scores `[B, H, C + N]` of the slots then the chunk's tokens, real tokens `[B]`, and
    pooling: None, or (the rows ranked by pooled scores `[B]` bool, the pool)): oneshot's
    rule, before any eviction."""
    B, H, N, _ = keys.shape
    real = mx.broadcast_to(knob(N), (B,)) if n_alive is None else as_dtype(n_alive, mx.int32)
    # only the last scored_queries rows score (a prompt's window): the key proxy computes
    # no other row's weights, and query weights may cover those rows alone
    first = N - (scored_queries(N, config, n_alive, prompt) if weights is None else weights.shape[2])
    w = _chunk_weights(state, keys, chunk_keys, kv, weights, n_alive, first)
    long_chunk = N > prompt.window  # a prompt: scored by its last queries, ranked by spans
    if prompt.window and long_chunk:
        w = mx.where(mx.arange(first, N)[:, None] >= (real - knob(prompt.window))[:, None, None, None], w, 0.0)
    mass = _decayed_sum(w, config.decay, n_alive, first)  # [B, H, C + N]
    if n_alive is None:
        faded = knob(config.decay ** N, mx.float32) * state.scores
    else:
        faded = state.scores * per_row(mx.power(knob(config.decay, mx.float32), f32(real)))
    return mass + mx.concatenate([faded, mx.zeros((B, H, N))], axis=-1), real, _pooling(real, N, prompt)


def absorb_staged(state: H2OState, keys: mx.array, values: mx.array, config: H2OConfig,
                  weights: Optional[mx.array] = None, prompt: Prompt = Prompt(),
                  kv: Storage = DENSE, logits: Optional[mx.array] = None) -> H2OState:
    """The N newest tokens of `state`, already admitted unscored (staged decode: `admit` N
    times, `[B, H, N, D]` their keys and values), scored and evicted as the oneshot chunk
    they are: the kept positions and scores of `absorb(rewind(state, N), keys, values)`.

    Rows stay where they are: only survivors in slots >= budget move, into the slots
    freed below it (at most C - budget rows written per (b, h), where `absorb` rewrites
    all C), so the valid slots stay the prefix `[0, length)`, not sorted by position.
    Needs every row's valid slots within `[0, length + 1)` before staging, as decode
    steps and absorb leave them. `weights` as for `absorb` (scoring="query").

    `logits` (scoring="key", oneshot prefill): optional `[B, H, N, C]` float32, staged token
    i's key as stored over sqrt(D) against every slot's key of `state` (the attention hook
    computes them in attention's own product as each token is staged); the key proxy then
    reads no key. Token i's weights are their softmax over the slots holding tokens before
    it (`_staged_proxy_scores`): the same chunk's weights, in another order of sums.

    Example:
        >>> import mlx.core as mx
        >>> from h2o_fn import H2OConfig, admit, init
        >>> from h2o_fn.prefill import absorb_staged
        >>> cfg = H2OConfig(budget=4, n_sink=1, grace=1)
        >>> kv = mx.random.normal((1, 1, 6, 8))
        >>> s = init(cfg, 1, 1, 8, room=2)  # two tokens judged at a time
        >>> for t in range(6):
        ...     s = admit(s, kv[:, :, t : t + 1], kv[:, :, t : t + 1])
        ...     if t % 2:
        ...         s = absorb_staged(s, kv[:, :, t - 1 : t + 1], kv[:, :, t - 1 : t + 1], cfg)
        >>> s.length.tolist(), (s.positions[0, 0] >= 0).tolist()
        ([4], [True, True, True, True, False, False])
    """
    N = check_chunk(state, keys, values, kv)
    base = rewind(state, N)
    check_weights(base, keys, config, weights, prompt=prompt)
    if logits is not None:
        check_staged_logits(state, keys, config, logits)
        scores, pool = _staged_proxy_scores(base, state.positions, logits, config, prompt)
        return _evict_in_place(state, scores, pool, config)
    chunk_keys = stored_rows(keys, state.keys, kv)
    scores, _, pool = _oneshot_scores(base, keys, chunk_keys, config, weights, None, prompt, kv)
    C = state.positions.shape[-1]
    staged = state.positions - per_row(base.seen)  # staged token i sits where this is i
    chunk = mx.take_along_axis(scores[..., C:], mx.clip(staged, 0, N - 1), axis=-1)
    slot_scores = mx.where(staged >= 0, chunk, scores[..., :C])
    return _evict_in_place(state, mx.where(state.positions >= 0, slot_scores, 0.0), pool, config)


def _staged_proxy_scores(base: H2OState, positions: mx.array, logits: mx.array, config: H2OConfig,
                         prompt: Prompt):
    """(scores `[B, H, C]` over the slots of positions `[B, H, C]`, pooling as in
    `_oneshot_scores`) of N staged tokens from their proxy `logits` `[B, H, N, C]` over those
    slots: token i (position base.seen + i) weighs the held tokens before it."""
    N = logits.shape[2]
    first = N - scored_queries(N, config, None, prompt)
    before = per_row(base.seen, 4) + mx.arange(first, N)[:, None]  # [B, 1, N - first, 1]: token i's position
    visible = (positions[:, :, None] >= 0) & (positions[:, :, None] < before)
    mass = _decayed_sum(proxy_softmax(f32(logits[:, :, first:]), visible), config.decay, None, first)
    faded = knob(config.decay ** N, mx.float32) * base.scores  # base: the staged tokens' slots score 0
    real = mx.broadcast_to(knob(N), (logits.shape[0],))
    return mx.where(positions >= 0, faded + mass, 0.0), _pooling(real, N, prompt)


def _pooling(real: mx.array, N: int, prompt: Prompt):
    """None, or (the rows `[B]` ranked by pooled scores, the pool): a long chunk, a prompt,
    is ranked by spans (SnapKV) in the rows whose real tokens (not the padded N) outnumber the window."""
    if prompt.pool > 1 and N > prompt.window:
        return real > knob(prompt.window), prompt.pool
    return None


def _survivors(scores, positions, total, newest, pool, config, at_most=None) -> mx.array:
    """`[B, H, M]` bool: the held tokens that stay when rows of `total` `[B]` tokens are
    evicted down to budget by the lowest (score, position) unprotected (`evict_lowest`);
    with `pool` = (rows `[B]` bool, width), those rows rank by `pooled` scores."""
    rank = scores if pool is None else mx.where(per_row(pool[0]), pooled(scores, positions, pool[1]), scores)
    gone = evict_lowest(rank, positions, total - knob(config.budget), newest, config.n_sink, config.grace,
                        at_most=at_most)
    return ((positions >= 0) & ~gone) | (positions == RESERVED)  # reserved slots stay where they are


def _evict_in_place(state, scores, pool, config) -> H2OState:
    """`state` over budget (its new tokens admitted) with `scores` `[B, H, C]`: evict the
    lowest (score, position) unprotected down to budget, then move the survivors of slots
    >= budget into the freed slots below it (`storage.write`: those rows only)."""
    positions, C, budget = state.positions, state.positions.shape[-1], config.budget
    keep = _survivors(scores, positions, state.length, state.seen - 1, pool, config, at_most=C - budget)
    length = mx.minimum(state.length, knob(budget)).astype(mx.int32)
    hole = ~keep & (mx.arange(C) < per_row(length))  # [B, H, C]
    mover = keep[..., budget:]  # [B, H, C - budget]: every kept row up there moves (length <= budget)
    hole_rank, mover_rank = mx.cumsum(hole, axis=-1), mx.cumsum(mover, axis=-1)
    match = hole[..., None, :] & (hole_rank[..., None, :] == mover_rank[..., :, None])  # [B, H, C - budget, C]
    tail = mx.arange(budget, C, dtype=mx.int32)
    dst = mx.where(mover, mx.argmax(match, axis=-1).astype(mx.int32), tail)[..., None]  # [B, H, C - budget, 1]
    stays = keep & (mx.arange(C) < budget)

    def moved(x, empty):
        return mx.put_along_axis(mx.where(stays, x, empty), dst[..., 0], mx.where(mover, x[..., budget:], empty),
                                 axis=-1)

    return H2OState(
        keys=storage.write(state.keys, dst, storage.slot_range(state.keys, budget)),
        values=storage.write(state.values, dst, storage.slot_range(state.values, budget)),
        scores=moved(scores, 0.0),
        positions=moved(positions, -1),
        length=length,
        seen=state.seen,
    )


def _keep_best(state, chunk_keys, chunk_values, scores, real, pool, config) -> H2OState:
    """Admit a chunk (stored rows `[B, H, N, D]`, the first `real[b]` real) with `scores`
    `[B, H, C + N]` (slots, then chunk tokens), evict the lowest (score, position)
    unprotected down to budget, and store the survivors first, sorted by position.
    `pool`: None, or (rows `[B]` bool, width): rows whose ranking takes the best score
    within +-width//2 positions."""
    B, H, N = scores.shape[0], scores.shape[1], scores.shape[2] - state.positions.shape[-1]
    C = state.positions.shape[-1]
    arange = mx.arange(N, dtype=mx.int32)
    chunk_positions = mx.where(arange < real[:, None], state.seen[:, None] + arange, -1)  # [B, N]
    positions = mx.concatenate(
        [state.positions, mx.broadcast_to(chunk_positions[:, None], (B, H, N))], axis=-1
    )
    scores = mx.where(positions >= 0, scores, 0.0)
    total = state.length + real
    budget = knob(config.budget)
    keep = _survivors(scores, positions, total, state.seen + real - 1, pool, config)
    order = mx.argsort(slot_order(mx.where(keep, positions, FREE)), axis=-1)[..., :C]  # survivors first
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
                  config: H2OConfig, prompt: Prompt = Prompt(), kv: Storage = DENSE) -> H2OState:
    """Absorb a chunk `[B, H, N, D]` whose scores come from elsewhere (a prompt-scoring
    pass such as `h2o_fn.retention`), then evict down to budget by the usual rule.

    Args:
      scores: `[B, H, C + N]` float32: column j < C is the new score of the token in slot
        j of `state` (ignored where the slot is free), column C + i that of chunk token i.
        Sanitised like weights (NaN, inf and negatives count as 0); nothing is decayed.

    The lowest (score, position) unprotected tokens are evicted (sinks and the grace
    window before the chunk's last position are protected; with `prompt.pool > 1` the
    ranking takes the best score within +-pool//2 positions), and the survivors are
    stored first, sorted by position. `config.scoring`, `prefill` and `prompt.window` do
    not apply: the scores are given.

    Example:
        >>> import mlx.core as mx
        >>> from h2o_fn import H2OConfig, init, absorb_scored, kept_positions
        >>> cfg = H2OConfig(budget=3, n_sink=1, grace=1)
        >>> kv = mx.zeros((1, 1, 6, 4))
        >>> s = mx.array([[[0.0] * (cfg.budget + 1) + [0.0, 0.1, 0.9, 0.2, 0.3, 0.0]]])
        >>> kept_positions(absorb_scored(init(cfg, 1, 1, 4), kv, kv, s, cfg))[0, 0].tolist()
        [0, 2, 5, -1]
    """
    N = check_chunk(state, keys, values, kv)
    expected = (*keys.shape[:2], state.positions.shape[-1] + N)
    if tuple(scores.shape) != expected:
        raise ValueError(f"scores shape {tuple(scores.shape)} is invalid: expected {expected} "
                         "(the state's slots, then the chunk's tokens)")
    real = mx.broadcast_to(knob(N), (keys.shape[0],))
    pool = (mx.broadcast_to(mx.array(True), (keys.shape[0],)), prompt.pool) if prompt.pool > 1 else None
    return _keep_best(state, stored_rows(keys, state.keys, kv), stored_rows(values, state.values, kv),
                      clean_weights(scores), real, pool, config)


def _absorb_greedy(state, keys, values, config, weights, argmin, n_alive, N, kv) -> H2OState:
    C = state.positions.shape[-1]
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
        chunk_keys = stored_rows(head, state.keys, kv)
        mass = _decayed_sum(_chunk_weights(state, head, chunk_keys, kv, w0, None), config.decay, None)
        scores = mx.where(state.positions >= 0, (config.decay ** n0) * state.scores + mass[..., :C], 0.0)
        stop = length + n0
        state = H2OState(
            keys=storage.put(state.keys, chunk_keys, length),
            values=storage.put(state.values, stored_rows(values[:, :, :n0], state.values, kv), length),
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
    one = compiled_step(config, argmin, kv)
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
            newest = (state.positions == per_row(state.seen) - 1)
            if alive is not None:
                newest = newest & per_row(alive)
            column = mx.where(newest, C + i, column)
    return state
