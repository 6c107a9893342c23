"""Budgets where the scores are: one total budget spread over layers and heads by the scores.

A uniform cache keeps `budget` tokens in every layer and KV head. On natural text a few
heads (the ones that copy from the context) need most of a prompt and most heads need a
handful of tokens, so a fixed share per head keeps an arbitrary part of what the copying
heads read. KVzip (Kim et al., 2025) and Ada-KV (Feng et al., 2024) select across heads
instead: the `total` best-scored tokens of every layer and head together. Here:

- `select`: scores `[B, H, M_l]` per layer (a prompt-scoring pass's, `h2o_fn.retention`)
  -> keep masks, the `total[b]` highest (score, position) of each batch row over every
  layer and head, sinks (positions < n_sink) first;
- `absorb_selected`: one layer's state and chunk laid out as its keep mask says: every
  head's kept tokens by position, then reserved slots up to `held` (the layer's most
  kept tokens), so all heads of the layer occupy `held` slots and a head that kept n
  tokens has held - n reserved ones (`h2o_fn.state.RESERVED`). Set the layer's budget to
  held + t and every head takes t new tokens before the rule evicts again; after that
  each head keeps the tokens it has, not a uniform share;
- `widen`: `extra` reserved slots added to every head: rows whose layer budgets differ
  (caches compressed from different prompts) share one batch at the larger budget and
  each keeps its own;
- `tokens` / `reserved`: `[B, H]` counts.

Twins of the same names live in `h2o_fn.reference`.

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn import H2OConfig, init
    >>> from h2o_fn.budgets import absorb_selected, select, tokens
    >>> cfg = H2OConfig(budget=4, n_sink=1, grace=1)
    >>> kv = mx.zeros((1, 2, 6, 4))
    >>> s = init(cfg, 1, 2, 4)
    >>> scores = mx.array([[[0.0] * 5 + [1, .9, .1, .1, .1, .1], [0.0] * 5 + [1, .1, .1, .1, .1, .8]]])
    >>> positions = mx.concatenate([s.positions, mx.broadcast_to(mx.arange(6), (1, 2, 6))], axis=-1)
    >>> keep = select([scores], [positions], mx.array([5]), n_sink=1)[0]
    >>> mx.sum(keep, axis=-1).tolist()      # ties at 0.1: the later position, then the earlier head
    [[3, 2]]
    >>> new = absorb_selected(s, kv, kv, scores, keep, held=3, capacity=6)
    >>> new.positions.tolist(), tokens(new).tolist()
    ([[[0, 1, 5, -1, -1, -1], [0, 5, -2, -1, -1, -1]]], [[3, 2]])
"""

from typing import List, Optional, Sequence

import mlx.core as mx

from . import storage
from .arrays import knob, slot_order, stored_rows
from .checks import check_chunk
from .rule import _sort_key
from .scoring import clean_weights
from .state import FREE, RESERVED, H2OState
from .storage import DENSE, Storage


def tokens(state: H2OState) -> mx.array:
    """Tokens kept per (b, h): `[B, H]` int32."""
    return mx.sum(state.positions >= 0, axis=-1).astype(mx.int32)


def reserved(state: H2OState) -> mx.array:
    """Reserved slots per (b, h): `[B, H]` int32."""
    return mx.sum(state.positions == RESERVED, axis=-1).astype(mx.int32)


def select(scores: Sequence[mx.array], positions: Sequence[mx.array], total: mx.array, n_sink: int,
           cap: Optional[int] = None) -> List[mx.array]:
    """Keep masks `[B, H, M_l]` per layer: each batch row's `total[b]` best tokens over every
    layer and head together.

    Args:
      scores: per layer `[B, H, M_l]` float32 (sanitised: NaN, inf and negatives count as 0).
      positions: per layer `[B, H, M_l]` int32: the token's position, < 0 where there is none
        (free or reserved slots: never kept).
      total: `[B]` (or `[]`) int32, tokens to keep per batch row, summed over layers and heads.
      n_sink: positions < n_sink are kept first (in every layer and head), within `total`.
      cap: at most this many tokens per head (its own best, in the same order); None: no
        bound, so one head may keep all it holds. A head's slots follow the layer's fullest
        head, so `cap` bounds the bytes a selection can take.

    The order is the eviction rule's, turned round: the highest (score, position) is kept
    first; among equal (score, position) the earlier layer, then the earlier head. A row
    with fewer tokens than `total` keeps them all.
    """
    if cap is not None and cap < 1:
        raise ValueError(f"cap={cap} is invalid: expected None or >= 1 tokens per head")
    if len(scores) != len(positions) or not scores:
        raise ValueError(f"{len(scores)} score arrays and {len(positions)} position arrays are invalid: "
                         "expected one of each per layer, at least one layer")
    B = scores[0].shape[0]
    keys, shapes = [], []
    for s, p in zip(scores, positions):
        if s.shape != p.shape or s.shape[0] != B:
            raise ValueError(f"scores {tuple(s.shape)} and positions {tuple(p.shape)} are invalid: expected "
                             f"the same [B={B}, H, M] in every layer")
        rank = mx.where(p < knob(n_sink), mx.inf, clean_weights(s))
        key = mx.where(p >= 0, _sort_key(rank, p), mx.zeros(p.shape, mx.uint64))  # 0: below any token
        if cap is not None and cap < s.shape[-1]:  # only each head's best `cap` can be kept
            key = mx.where(key >= mx.sort(key, axis=-1)[..., -cap:][..., :1], key, mx.zeros_like(key))
        keys.append(key.reshape(B, -1))
        shapes.append(s.shape)
    flat = mx.concatenate(keys, axis=-1)  # [B, sum of H * M_l], layer-major, then head, then slot
    n = flat.shape[-1]
    want = mx.clip(mx.broadcast_to(mx.array(total, dtype=mx.int32), (B,)), 1, n)
    cut = mx.take_along_axis(mx.sort(flat, axis=-1), (n - want)[:, None], axis=-1)  # [B, 1]: the total-th best
    above = flat > cut
    tied = flat == cut
    need = want[:, None] - mx.sum(above, axis=-1, keepdims=True)
    keep = (above | (tied & (mx.cumsum(tied, axis=-1) <= need))) & (flat > 0)
    out, start = [], 0
    for shape in shapes:
        size = shape[1] * shape[2]
        out.append(keep[:, start : start + size].reshape(shape))
        start += size
    return out


def absorb_selected(state: H2OState, keys: mx.array, values: mx.array, scores: mx.array, keep: mx.array,
                    held: int, capacity: int, kv: Storage = DENSE) -> H2OState:
    """One layer's state and a chunk `[B, H, N, D]` reduced to the tokens `keep` chooses.

    Args:
      scores: `[B, H, C + N]` float32: column j < C is the score of the token in slot j of
        `state`, column C + i that of chunk token i (sanitised like weights); a kept token
        keeps its score.
      keep: `[B, H, C + N]` bool, the same columns (`select`); never a free or reserved slot.
      held: slots every head occupies afterwards, at least the most tokens any head keeps:
        a head's kept tokens by position, then reserved slots up to `held`.
      capacity: slots of the result (> held); the layer's budget should then be held + t
        for t new tokens before the next eviction, capacity = budget + room.

    Returns a state with `length = held` in every row and `seen` advanced by N. Reserved
    slots of `state` are dropped (the selection lays out every head afresh).
    """
    N = check_chunk(state, keys, values, kv)
    C = state.positions.shape[-1]
    if tuple(scores.shape) != (*keys.shape[:2], C + N) or tuple(keep.shape) != tuple(scores.shape):
        raise ValueError(f"scores {tuple(scores.shape)} / keep {tuple(keep.shape)} are invalid: expected "
                         f"{(*keys.shape[:2], C + N)} (the state's slots, then the chunk's tokens)")
    if not 1 <= held < capacity or held > C + N:
        raise ValueError(f"held={held}, capacity={capacity} are invalid: expected 1 <= held < capacity and "
                         f"held <= {C + N} (slots plus chunk tokens)")
    B, H = keys.shape[:2]
    chunk = mx.broadcast_to((state.seen[:, None] + mx.arange(N, dtype=mx.int32))[:, None], (B, H, N))
    positions = mx.concatenate([state.positions, chunk], axis=-1)
    keep = keep & (positions >= 0)
    order = mx.argsort(slot_order(mx.where(keep, positions, FREE)), axis=-1)[..., :held]
    n = mx.sum(keep, axis=-1, keepdims=True)
    token = mx.arange(held) < n  # [B, H, held]
    pad = capacity - held

    def rows(old, new):
        taken = storage.take(storage.concat(old, stored_rows(new, old, kv)), order)
        empty = storage.empty((B, H, pad), storage.width(old, kv.bits), storage.dtype_of(old), kv.bits,
                              kv.group_size)
        return storage.concat(taken, empty)

    return H2OState(
        keys=rows(state.keys, keys),
        values=rows(state.values, values),
        scores=mx.pad(mx.where(token, mx.take_along_axis(clean_weights(scores), order, axis=-1), 0.0),
                      [(0, 0), (0, 0), (0, pad)]),
        positions=mx.pad(mx.where(token, mx.take_along_axis(positions, order, axis=-1), RESERVED),
                         [(0, 0), (0, 0), (0, pad)], constant_values=FREE),
        length=mx.full((B,), held, dtype=mx.int32),
        seen=state.seen + N,
    )


def widen(state: H2OState, extra: int) -> H2OState:
    """`extra` more slots in every head, all reserved: each row's occupied slots (its tokens
    then its reserved ones, compacted) grow by `extra`, so at a budget `extra` larger every
    head keeps what it kept before. Rows of layer budgets b_i batch at max b_i this way."""
    if extra < 0:
        raise ValueError(f"extra={extra} is invalid: expected >= 0")
    if extra == 0:
        return state
    order = mx.argsort(slot_order(state.positions), axis=-1)
    C = state.positions.shape[-1]
    j = mx.arange(C + extra)
    length = state.length[:, None, None]
    band = (j >= length) & (j < length + extra)
    src = mx.take_along_axis(order, mx.broadcast_to(mx.where(j < length, j, mx.maximum(j - extra, 0)),
                                                    (*order.shape[:2], C + extra)), axis=-1)
    return H2OState(
        keys=storage.take(state.keys, src),
        values=storage.take(state.values, src),
        scores=mx.where(band, 0.0, mx.take_along_axis(state.scores, src, axis=-1)),
        positions=mx.where(band, RESERVED, mx.take_along_axis(state.positions, src, axis=-1)),
        length=state.length + extra,
        seen=state.seen,
    )
