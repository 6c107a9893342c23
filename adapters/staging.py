"""Staged decode (`evict_every = k > 1`): decode tokens written unscored, judged k at a time.

A wrapper around the core's state with a state of its own, as optax's `MultiSteps`
wraps an optimizer: each decode token is admitted into a free slot (a row write; the
attention view is as usual) and remembered in a `Staged`; once k are staged they are
scored and evicted as one oneshot chunk (the prefill rule, `Policy.absorb_staged`) from
the state they were admitted onto, with their own attention weights for query scoring,
and for key scoring with the proxy's logits that attention computed beside its own.

Shapes: B batch rows, H KV heads, C = budget + k slots (`Policy.init(room=k)`), D head_dim, j staged tokens.

Example:
    >>> import mlx.core as mx
    >>> import h2o_fn
    >>> from h2o_fn.adapters import staging
    >>> p = h2o_fn.policy(h2o_fn.H2OConfig(budget=4, n_sink=1, grace=1))
    >>> state, staged = p.init(1, 1, 8, room=2), staging.Staged()  # k = 2
    >>> for t in range(6):
    ...     kv = mx.ones((1, 1, 1, 8))
    ...     staged = staging.stage(staged, kv, kv, [t])
    ...     state = p.admit(state, kv, kv)
    ...     if staging.full(staged, 2):
    ...         state, staged = staging.flush(state, staged, p), staging.Staged()
    >>> state.length.tolist(), state.seen.tolist()
    ([4], [6])
"""

import functools
from typing import NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx

from h2o_fn import H2OState, Policy, capacity, view


class Staged(NamedTuple):
    """The decode tokens admitted since the last eviction, not yet scored."""

    keys: Tuple[mx.array, ...] = ()  # each [B, H, 1, Dk]
    values: Tuple[mx.array, ...] = ()  # each [B, H, 1, Dv]
    weights: Tuple[mx.array, ...] = ()  # query scoring: each [B, H, 1, C + k] (view.staged_weights)
    start: Optional[mx.array] = None  # [B] tokens seen when the first was staged
    logits: Tuple[mx.array, ...] = ()  # key scoring, from the hook: each [B, H, 1, C], the proxy's over the slots


def check_every(k) -> int:
    """`k` as an `evict_every`, or a ValueError naming it: an int >= 1 (1: every token)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"evict_every={k!r} is invalid: expected an int >= 1 (1: every token)")
    return k


def stage(staged: Staged, keys: mx.array, values: mx.array, seen: Sequence[int]) -> Staged:
    """`staged` with one more decode token `[B, H, 1, D]`; `seen` per row, before it."""
    start = mx.array(list(seen), dtype=mx.int32) if staged.start is None else staged.start
    return staged._replace(keys=(*staged.keys, keys), values=(*staged.values, values), start=start)


def with_weights(staged: Staged, weights: mx.array, admitted: H2OState, k: int) -> Staged:
    """`staged` with the last token's attention weights `[B, H, 1, span]` over the view of
    `admitted`, laid out as the row of the chunk of k that will score them."""
    w = _compiled_staged_weights(k)(weights, admitted.positions, staged.start)
    return staged._replace(weights=(*staged.weights, w))


def with_logits(staged: Staged, logits: mx.array, admitted: H2OState) -> Staged:
    """`staged` with the last token's key-proxy logits `[B, H, 1, span]` over the view of
    `admitted` (attention's own product, through the hook), as `[B, H, 1, C]` over its slots."""
    return staged._replace(logits=(*staged.logits, view.decode_weights(logits, admitted)[:, :, None]))


@functools.lru_cache(maxsize=None)
def _compiled_staged_weights(k: int):
    """`view.staged_weights` as one compiled call (eager, its handful of small ops cost
    more in dispatch than in arithmetic, once per layer and token)."""
    def laid_out(weights, positions, start):
        return view.staged_weights(weights, positions, start, k)

    return mx.compile(laid_out)


def full(staged: Staged, k: int) -> bool:
    """Whether k tokens are staged (time to score them)."""
    return len(staged.keys) == k


def chunk(staged: Staged) -> Tuple[mx.array, mx.array]:
    """The staged tokens' keys and values `[B, H, j, D]`, as one chunk."""
    return mx.concatenate(staged.keys, axis=2), mx.concatenate(staged.values, axis=2)


def flush(state: H2OState, staged: Staged, policy: Policy) -> H2OState:
    """`state` (the staged tokens admitted) with the staged tokens scored and evicted down
    to budget as one chunk from the state before them (`Policy.absorb_staged`: the rows
    stay in their slots; only survivors above budget move into the freed slots). Key
    scoring reads the proxy's logits where attention gave them for every staged token, else
    it multiplies the keys itself."""
    weights = logits = None
    if policy.config.scoring == "query":
        weights = mx.concatenate(staged.weights, axis=2)[..., : capacity(state) + len(staged.keys)]
    elif len(staged.logits) == len(staged.keys):
        logits = mx.concatenate(staged.logits, axis=2)
    return policy.absorb_staged(state, *chunk(staged), weights, logits)


def take(staged: Staged, batch: mx.array) -> Staged:
    """Batch rows `batch` `[b]` of every staged array."""
    return Staged(tuple(k[batch] for k in staged.keys), tuple(v[batch] for v in staged.values),
                  tuple(w[batch] for w in staged.weights), None if staged.start is None else staged.start[batch],
                  tuple(x[batch] for x in staged.logits))


def to_arrays(staged: Staged) -> tuple:
    """(keys, values, weights, start): `[B, H, j, D]` twice, `[B, H, j, C + k]` and `[B]`,
    each None when absent (for a cache's `state`). The key proxy's logits are left out:
    the flush after a load multiplies the keys itself (the same weights)."""
    if not staged.keys:
        return (None,) * 4
    weights = mx.concatenate(staged.weights, axis=2) if staged.weights else None
    return (*chunk(staged), weights, staged.start)


def from_arrays(keys, values, weights, start) -> Staged:
    """The inverse of `to_arrays`."""
    if keys is None:
        return Staged()
    j = range(keys.shape[2])
    return Staged(tuple(keys[:, :, i : i + 1] for i in j), tuple(values[:, :, i : i + 1] for i in j),
                  () if weights is None else tuple(weights[:, :, i : i + 1] for i in j), start)
