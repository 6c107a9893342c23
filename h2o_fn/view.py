"""The attention view: the key and value rows one forward pass attends to, its mask, and
its weights mapped back to slots. The slot layout is the core's; an adapter only slices.

Words: a *row* is one token's key or value vector; a *batch row* is one sequence b of
B; the view's *span* is how many of the state's C slots it covers.

For N new tokens of a state the view is its first `span` slots, with the chunk's first
token already written into the slot it will take (the first free one), then chunk
tokens 1..N-1:

    column j < span        slot j (for batch row b, slots j <= length[b] are real)
    column span + i - 1    chunk token i >= 1

`span = min(max_b length[b] + 1, C)`: every kept token of every batch row, plus the
slot of the newest. Below budget the valid slots are the prefix `[0, length[b])` and
the new token goes to slot length[b]; at budget one slot is free and the new token
fills it, so all C slots are real. With equal batch rows the mask is plain causal with
offset span - 1 (mlx-lm's "causal"); batch rows of different lengths need `view_mask`.

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn import H2OConfig, init, absorb, capacity
    >>> from h2o_fn.view import chunk_view, span_for, view_mask
    >>> cfg = H2OConfig(budget=4, n_sink=1, grace=1)
    >>> kv = mx.random.normal((2, 1, 3, 8))
    >>> s = absorb(init(cfg, 2, 1, 8), kv, kv, cfg, n_alive=mx.array([3, 1]))
    >>> span = span_for([3, 1], capacity(s))
    >>> k, v = chunk_view(s, kv[:, :, :2], kv[:, :, :2], span)
    >>> span, k.shape
    (4, (2, 1, 5, 8))
    >>> view_mask(s.length, span, 2)[:, 0].astype(mx.int32).tolist()
    [[[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], [[1, 1, 0, 0, 0], [1, 1, 0, 0, 1]]]
"""

from typing import Sequence, Tuple

import mlx.core as mx

from . import storage
from .arrays import scored_rows, slot_order
from .core import INT32_MAX, admit, stored_rows
from .scoring import proxy_rows
from .state import FREE, H2OState
from .storage import DENSE, Storage


def span_for(lengths: Sequence[int], capacity: int) -> int:
    """Slots a view spans for batch rows of these lengths: max length + 1, at most C."""
    return min(max(lengths) + 1, capacity)


def view(state: H2OState, span: int) -> Tuple[storage.Store, storage.Store]:
    """The first `span` slots of keys and values (no copy): the decode view of a state
    whose newest token is already admitted (after `step` or `admit`)."""
    return storage.head(state.keys, span), storage.head(state.values, span)


def chunk_view(state: H2OState, keys: mx.array, values: mx.array, span: int,
               kv: Storage = DENSE) -> Tuple[storage.Store, storage.Store]:
    """The view of chunk `[B, H, N, D]` over `state`: `[B, H, span + N - 1, D]` (stores).

    Chunk token 0 is written into the slot it will take; tokens 1..N-1 follow, as the
    state would store them (`kv`: quantized when `kv.bits`).
    """
    first = admit(state, keys[:, :, :1], values[:, :, :1], kv)
    k, v = view(first, span)
    if keys.shape[2] == 1:
        return k, v
    return (storage.concat(k, stored_rows(keys[:, :, 1:], state.keys, kv)),
            storage.concat(v, stored_rows(values[:, :, 1:], state.values, kv)))


def compact(state: H2OState) -> H2OState:
    """The same state with every row's kept tokens in its first slots, sorted by position,
    then its reserved slots, then the free ones: what oneshot prefill leaves, and what decode
    evictions scatter. Nothing kept, scored or counted changes.

    Example:
        >>> import mlx.core as mx
        >>> from h2o_fn import H2OConfig, init
        >>> s = init(H2OConfig(budget=3, n_sink=0, grace=0), 1, 1, 2)
        >>> s = s._replace(positions=mx.array([[[5, -1, 2, 7]]], dtype=mx.int32))
        >>> compact(s).positions.tolist()
        [[[2, 5, 7, -1]]]
    """
    order = mx.argsort(slot_order(state.positions), axis=-1)
    return state._replace(
        keys=storage.take(state.keys, order), values=storage.take(state.values, order),
        scores=mx.take_along_axis(state.scores, order, axis=-1),
        positions=mx.take_along_axis(state.positions, order, axis=-1),
    )


def view_weights(state: H2OState, weights: mx.array, span: int) -> mx.array:
    """Weights `[B, H, N, span + N - 1]` over a `chunk_view` of `state` -> the core's
    `[B, H, N, C + N]` layout (slots of `state`, then chunk tokens), for `absorb`/`step`."""
    B, H, N, _ = weights.shape
    C = state.positions.shape[-1]
    slots = mx.pad(weights[..., :span], [(0, 0), (0, 0), (0, 0), (0, C - span)])
    first_free = mx.argmax(state.positions == FREE, axis=-1)[..., None, None]  # chunk token 0 sat here
    token0 = mx.take_along_axis(slots, mx.broadcast_to(first_free, (B, H, N, 1)), axis=-1)
    return mx.concatenate([slots, token0, weights[..., span:]], axis=-1)


def decode_weights(weights: mx.array, admitted: H2OState) -> mx.array:
    """Weights `[B, H, 1, span]` over the decode view of `admitted` (its first span
    slots) -> `[B, H, C]` over its slots (0 beyond), for `settle` (or logits, for `settle_key`)."""
    return _over_slots(weights, admitted.positions.shape[-1])


def proxy_query(admitted: H2OState, key: mx.array, kv: Storage = DENSE) -> mx.array:
    """An admitted decode token's key `[B, H, 1, D]` as the key proxy's query over its view:
    float32, as stored, times 1/sqrt(D). Its logits against the view's keys, mapped back
    by `decode_weights`, are the logits `settle_key` takes."""
    return proxy_rows(scored_rows(key, admitted.keys, kv))


def slot_weights(weights: mx.array, C: int) -> mx.array:
    """`[B, H, M, L]` weights over a view that is a state's first L slots (a decode view, or
    a chunk written into the room: `prefill.admit_chunk`) -> `[B, H, M, C]` (0 beyond)."""
    if weights.shape[-1] == C:  # a full state's decode view: nothing to pad
        return weights
    return mx.pad(weights, [(0, 0), (0, 0), (0, 0), (0, C - weights.shape[-1])])


def _over_slots(weights: mx.array, C: int) -> mx.array:
    """`[B, H, 1, span]` weights over a view's first span slots -> `[B, H, C]` (0 beyond)."""
    return slot_weights(weights, C)[:, :, 0]


def relayout(store: storage.Store, positions_from: mx.array, positions_to: mx.array) -> storage.Store:
    """Rows of `store` (slot i holds position positions_from[..., i], `[B, H, M]`) moved to
    the layout `positions_to` `[B, H, C]`: slot j gets the row of position
    positions_to[..., j] (stale data where it is -1 or absent). For caches that keep
    another cache's positions in lockstep (mlx-lm's `CacheList` members)."""
    match = positions_from[..., None, :] == positions_to[..., :, None]  # [B, H, C, M]
    found = match & (positions_to >= 0)[..., None]
    return storage.take(store, mx.argmax(found, axis=-1))


def staged_weights(weights: mx.array, positions: mx.array, base_seen: mx.array, k: int) -> mx.array:
    """A staged decode token's weights `[B, H, 1, span]` over the view of the state it was
    admitted into (slot positions `[B, H, C]`; its first span slots hold the kept tokens
    and the tokens staged so far) -> the row of the core's `[B, H, 1, C + k]` chunk layout
    relative to the state before staging: slot columns as they are (staged tokens' slots
    are free there, so ignored), and column C + i the weight on the i-th staged token
    (position base_seen[b] + i; 0 if not staged yet)."""
    slots = _over_slots(weights, positions.shape[-1])  # [B, H, C]
    target = base_seen[:, None, None] + mx.arange(k)  # [B, 1, k]
    where = positions[..., None, :] == target[..., None]  # [B, H, k, C]
    staged = mx.sum(mx.where(where, slots[..., None, :], 0.0), axis=-1)  # [B, H, k]
    return mx.concatenate([slots, staged], axis=-1)[:, :, None]


def view_mask(lengths: mx.array, span: int, N: int) -> mx.array:
    """`[B, 1, N, span + N - 1]` bool, True = attend: query i of batch row b sees slots
    j <= lengths[b] (kept, plus chunk token 0) and chunk tokens 1..i."""
    j = mx.arange(span + N - 1)
    i = mx.arange(N)[:, None]
    slot_ok = (j < span)[None, None] & (j[None, None] <= lengths[:, None, None])  # [B, 1, L]
    chunk_ok = (j >= span) & (j - span + 1 <= i)  # [N, L]
    return (slot_ok | chunk_ok[None])[:, None]
