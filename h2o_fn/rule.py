"""The eviction rule: which tokens are protected, and which one goes first.

Sinks (positions < n_sink) and the grace window (positions > newest - grace) are
protected; among the rest the lowest (score, position) goes first. `protected_argmin`
is the spec of the fused kernel in `h2o_fn.metal_ops` (`h2o_fn.reference` holds the
plain twin of `evict`). Shapes: B batch rows, H KV heads, C slots.

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn.rule import evictable
    >>> evictable(mx.array([[[0, 1, 2, 3, -1]]]), mx.array(3), 1, 1).tolist()
    [[[False, True, True, False, False]]]
"""

from typing import Callable, Optional

import mlx.core as mx

from .arrays import INT32_MAX, knob, per_row
from .config import H2OConfig
from .state import H2OState

# argmin(scores [B,H,C] f32, positions [B,H,C] i32, newest [B] or [] i32, n_sink, grace) -> [B,H] i32;
# an op may offer `argmin.victims(...)` with the same arguments -> its slot as a [B,H,C] bool mask
# (or None: use the slot), which `evict` prefers (`lowest`: fewer primitives than a slot index)
Argmin = Callable[..., mx.array]


def evictable(positions: mx.array, newest: mx.array, n_sink: int, grace: int) -> mx.array:
    """The protection rule: held tokens that are neither sinks (p < n_sink) nor in the
    grace window (p > newest - grace). Free slots (p = -1) never qualify (n_sink >= 0).

    `newest` is `[]` or per row `[B]` (for `positions` `[B, ...]`)."""
    return (positions >= knob(n_sink)) & (positions <= per_row(newest, positions.ndim) - knob(grace))


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
    candidate, tied = _lowest_scores(scores, positions, newest, n_sink, grace)
    slot = mx.argmin(mx.where(tied, positions, INT32_MAX), axis=-1).astype(mx.int32)  # unique positions
    return mx.where(mx.any(candidate, axis=-1), slot, -1)


def _lowest_scores(scores, positions, newest, n_sink: int, grace: int):
    """(`[B, H, C]` evictable, `[B, H, C]` evictable and holding the lowest score of its (b, h),
    NaN as -inf): the rule's first key, which `protected_argmin` and `lowest` break by position."""
    candidate = evictable(positions, newest, n_sink, grace)
    key = mx.where(candidate, mx.where(mx.isnan(scores), -mx.inf, scores), mx.inf)
    return candidate, candidate & (key == mx.min(key, axis=-1, keepdims=True))


def lowest(scores: mx.array, positions: mx.array, newest: mx.array, n_sink: int, grace: int) -> mx.array:
    """`[B, H, C]` bool: the slot `protected_argmin` picks per (b, h), as a mask (all False
    where no slot is evictable). The same rule with no slot index to build and compare: a
    decode step's eviction in half the primitives, which a CPU dispatches one at a time.

    Example:
        >>> import mlx.core as mx
        >>> s = mx.array([[[0.5, 0.1, 0.1, 0.0]]])
        >>> p = mx.array([[[0, 3, 1, 5]]], dtype=mx.int32)
        >>> lowest(s, p, mx.array([5], dtype=mx.int32), 1, 1).tolist()  # protected_argmin's slot 2
        [[[False, False, True, False]]]
    """
    tied = _lowest_scores(scores, positions, newest, n_sink, grace)[1]
    return tied & (positions == mx.min(mx.where(tied, positions, INT32_MAX), axis=-1, keepdims=True))


def evict(state: H2OState, config: H2OConfig, argmin: Argmin = protected_argmin) -> H2OState:
    """Evict one token per (b, h) of every row that holds more than `budget` tokens.

    After `admit` a state holds at most budget + 1 tokens, so one eviction always
    brings it down to budget (staged `evict_every` tokens are absorbed, not evicted
    here). The freed slot keeps its stale key/value rows.
    """
    over = state.length > knob(config.budget)  # [B]
    args = state.scores, state.positions, state.seen - 1, config.n_sink, config.grace
    victims = getattr(argmin, "victims", None)  # the op's victim as a mask, where it offers one
    drop = None if victims is None else victims(*args)
    if drop is None:
        drop = mx.arange(state.positions.shape[-1]) == argmin(*args)[..., None]
    drop = drop & per_row(over)
    return state._replace(
        scores=mx.where(drop, 0.0, state.scores),
        positions=mx.where(drop, -1, state.positions),
        length=state.length - over.astype(mx.int32),
    )


def _sort_key(scores: mx.array, positions: mx.array) -> mx.array:
    """uint64 keys ordering (score, position) lexicographically; NaN as -inf, -0.0 as 0.0."""
    s = mx.where(mx.isnan(scores), -mx.inf, scores)
    s = mx.where(s == 0, 0.0, s).astype(mx.float32)
    bits = mx.view(s, mx.uint32)
    flip = mx.where(bits >= 2**31, mx.array(2**32 - 1, mx.uint32), mx.array(2**31, mx.uint32))
    return ((bits ^ flip).astype(mx.uint64) << 32) | positions.astype(mx.uint64)


def evict_lowest(scores: mx.array, positions: mx.array, k: mx.array, newest: mx.array,
                 n_sink: int, grace: int, at_most: Optional[int] = None) -> mx.array:
    """Mask `[B, H, M]` of the k lowest (score, position) unprotected tokens per (b, h).

    `k` and `newest` are `[]` or per row `[B]`. Equals k successive `protected_argmin`
    evictions: removing a token never changes the other scores, so the i-th single
    eviction takes the i-th lowest. `at_most`: a bound on every k known when tracing
    (staged decode evicts at most evict_every), which selects with a partition and a sort
    of `at_most` keys instead of two sorts of M.
    """
    candidate = evictable(positions, newest, n_sink, grace)
    last = mx.array(2**32 - 1, mx.uint32).astype(mx.uint64)
    key = mx.where(candidate, _sort_key(scores, positions), (last << 32) | last)
    if at_most is None or at_most >= key.shape[-1]:
        rank = mx.argsort(mx.argsort(key, axis=-1), axis=-1)
        return candidate & (rank < per_row(k, positions.ndim))
    low = mx.argpartition(key, kth=at_most - 1, axis=-1)[..., :at_most]  # the at_most lowest, unordered
    low = mx.take_along_axis(low, mx.argsort(mx.take_along_axis(key, low, axis=-1), axis=-1), axis=-1)
    chosen = mx.broadcast_to(mx.arange(at_most) < per_row(k, positions.ndim), low.shape)
    return candidate & mx.put_along_axis(mx.zeros(key.shape, mx.bool_), low, chosen, axis=-1)


protected_argmin.victims = lowest
