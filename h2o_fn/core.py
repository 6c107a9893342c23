"""The pure H2O core, token by token: `init`, `admit`, `step`, `settle`, `settle_key`, `rewind`.

Every function takes an `H2OState` and returns a new one; nothing is mutated. The
rest of the core sits beside it, one module per concern, each with its plain twin
under the same name in `h2o_fn.reference`: `rule` (protection and the victim:
`evict`, `protected_argmin`, the fused kernel's spec), `scoring` (weights and
`accumulate`), `prefill` (`absorb`, `absorb_scored`: a chunk at once); `arrays` and
`checks` hold what they share.
Shapes: B batch rows, H KV heads, C = budget + room slots (`init`'s room), D head_dim,
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
decays anyone's score. With `kv=Storage(bits)` (`h2o_fn.Storage`) the rows are stored
quantized and scoring reads them dequantized (a token's key counts as its stored value).

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
from typing import Optional

import mlx.core as mx

from . import storage
from .arrays import INT32_MAX, knob, newest_slots, per_row, scored_rows, stored_rows
from .checks import check_chunk, check_kv, check_weights
from .config import H2OConfig
from .rule import Argmin, evict, protected_argmin
from .scoring import accumulate, proxy_softmax, proxy_weights
from .state import FREE, H2OState
from .storage import DENSE, Storage


def init(
    config: H2OConfig, batch: int, n_heads: int, head_dim: int, dtype=mx.float16,
    value_dim: Optional[int] = None, room: int = 1, kv: Storage = DENSE,
) -> H2OState:
    """An empty state: keys `[B, H, C, D]`, values `[B, H, C, value_dim or D]`, every slot free.

    C = budget + room: a step needs one slot beyond the budget (the token being judged);
    absorbing k staged decode tokens at once (`absorb_staged`) needs k.
    With `kv.bits` each store is mx.quantize's triple (head_dim and value_dim must
    split into groups of `kv.group_size`).
    """
    if isinstance(room, bool) or not isinstance(room, int) or room < 1:
        raise ValueError(f"room={room!r} is invalid: expected an int >= 1 (slots beyond the budget)")
    storage.check(kv)
    shape = (batch, n_heads, config.budget + room)
    return H2OState(
        keys=storage.empty(shape, head_dim, dtype, kv.bits, kv.group_size),
        values=storage.empty(shape, value_dim or head_dim, dtype, kv.bits, kv.group_size),
        scores=mx.zeros(shape, dtype=mx.float32),
        positions=mx.full(shape, -1, dtype=mx.int32),
        length=mx.zeros((batch,), dtype=mx.int32),
        seen=mx.zeros((batch,), dtype=mx.int32),
    )


def admit(state: H2OState, key: mx.array, value: mx.array, kv: Storage = DENSE,
          alive: Optional[mx.array] = None) -> H2OState:
    """Write one token `[B, H, 1, D]` into the first free slot with score 0.

    Needs a free slot (`length <= budget`, true after every `step`/`evict`). The
    result may hold budget + 1 tokens: `settle` (or `accumulate` then `evict`)
    finishes the step. Rows where `alive` `[B]` is False take nothing (the row is
    written into the free slot, which stays free). The rule plays no part: only how
    rows are stored (`kv`).
    """
    check_kv(state, kv)
    return _admit(state, key, value, kv, alive)[0]


def _admit(state: H2OState, key, value, kv, alive):
    """`admit`, also returning the `[B, H, C]` mask of the slots free before it."""
    free = state.positions == FREE
    slot = mx.argmax(free, axis=-1, keepdims=True)  # [B, H, 1]
    here = mx.arange(state.positions.shape[-1]) == slot
    add = 1
    if alive is not None:
        here = here & per_row(alive)
        add = alive.astype(mx.int32)
    index = slot[..., None]
    return H2OState(  # a free slot already scores 0
        keys=storage.write(state.keys, index, stored_rows(key, state.keys, kv)),
        values=storage.write(state.values, index, stored_rows(value, state.values, kv)),
        scores=state.scores,
        positions=mx.where(here, per_row(state.seen), state.positions),
        length=state.length + add,
        seen=state.seen + add,
    ), free


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
    kv: Storage = DENSE,
) -> H2OState:
    """One token `[B, H, 1, D]`: weights, decay-add, admit, evict.

    Args:
      weights: `[B, H, 1, C + 1]` for `scoring="query"` (refused for "key"): column
        j < C is the token in slot j of `state`, column C the new token itself.
      alive: optional `[B]` bool; False rows take no token (padding).
      kv: how the state stores rows (`init`'s).

    After it, the token's key/value rows sit in the state's stores even if an older
    token was just evicted, so `storage.head(keys, length + 1)` of the state before
    the step, admitted, is exactly S_{t-1} + {t}: what this token's attention sees.
    """
    check_chunk(state, key, value, kv, n=1)
    check_weights(state, key, config, weights)
    # admit first: the weights then read the written keys (the new token masked out),
    # so MLX can write the row into the old buffer instead of copying the cache
    admitted, free_before = _admit(state, key, value, kv, alive)
    if weights is not None:
        first_free = mx.argmax(free_before, axis=-1)[..., None]
        own = mx.arange(free_before.shape[-1]) == first_free
        w = mx.where(own, weights[..., 0, -1:], weights[..., 0, :-1])
        return settle(admitted, w, config, argmin, alive)
    w = proxy_weights(admitted.keys, state.positions >= 0, scored_rows(key, state.keys, kv), kv)
    return _by_key(admitted, w[..., 0, :], config, argmin, alive)


def settle_key(admitted: H2OState, key: mx.array, config: H2OConfig, argmin: Argmin = protected_argmin,
               alive: Optional[mx.array] = None, kv: Storage = DENSE,
               logits: Optional[mx.array] = None) -> H2OState:
    """The rest of a key-scored step once `admit` wrote the token `[B, H, 1, D]`: its key
    (as stored) scores the tokens kept before it, then decay-add and evict. `step` with
    scoring="key" is `admit` then this; an adapter that attends between the two calls it.

    Args:
      logits: optional `[B, H, C]` float32, the key against every slot's key over sqrt(D),
        where attention already computed them in its own product (the attention hook);
        only the slots the proxy sees are read. None: computed here from `key`.

    Example:
        >>> import mlx.core as mx
        >>> from h2o_fn import H2OConfig, absorb, admit, init, settle_key, step
        >>> cfg = H2OConfig(budget=4, n_sink=1, grace=1)
        >>> s = absorb(init(cfg, 1, 2, 8), mx.random.normal((1, 2, 6, 8)), mx.zeros((1, 2, 6, 8)), cfg)
        >>> k = mx.random.normal((1, 2, 1, 8))
        >>> a, b = step(s, k, k, cfg), settle_key(admit(s, k, k), k, cfg)
        >>> mx.array_equal(a.positions, b.positions).item(), mx.allclose(a.scores, b.scores).item()
        (True, True)
    """
    check_kv(admitted, kv)
    visible = (admitted.positions >= 0) & ~newest_slots(admitted.positions, admitted.seen, alive)
    if logits is None:
        w = proxy_weights(admitted.keys, visible, scored_rows(key, admitted.keys, kv), kv)[..., 0, :]
    else:
        w = proxy_softmax(logits, visible)
    return _by_key(admitted, w, config, argmin, alive)


def _by_key(admitted, w, config, argmin, alive):
    """Settle `admitted` with the key proxy's weights `w` `[B, H, C]` (0 on unseen slots)."""
    if alive is not None:
        return settle(admitted, w, config, argmin, alive)
    # proxy weights are exactly 0 on free slots and on the new token: no mask needed
    decayed = knob(config.decay, mx.float32) * admitted.scores
    return evict(admitted._replace(scores=decayed + w), config, argmin)


@functools.lru_cache(maxsize=None)
def compiled_step(config: H2OConfig, argmin: Argmin = protected_argmin, kv: Storage = DENSE):
    """`step` for a fixed config, op and storage under `mx.compile`: `fn(state, key, value, weights=None,
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
        return step(state, key, value, config, weights, argmin, alive, kv)

    return mx.compile(one)


@functools.lru_cache(maxsize=None)
def compiled_settle_key(config: H2OConfig, argmin: Argmin = protected_argmin, kv: Storage = DENSE):
    """`settle_key` for a fixed config, op and storage under `mx.compile`: `fn(admitted, key, alive=None,
    logits=None)`."""
    return mx.compile(lambda admitted, key, alive=None, logits=None: settle_key(
        admitted, key, config, argmin, alive, kv, logits))


@functools.lru_cache(maxsize=None)
def compiled_admit(kv: Storage = DENSE):
    """`admit` for a fixed storage under `mx.compile`: `fn(state, key, value)`."""
    return mx.compile(lambda state, key, value: admit(state, key, value, kv))


@functools.lru_cache(maxsize=None)
def compiled_settle(config: H2OConfig, argmin: Argmin = protected_argmin):
    """`settle` for a fixed config under `mx.compile`: `fn(admitted, weights, alive=None)`."""
    return mx.compile(lambda admitted, weights, alive=None: settle(admitted, weights, config, argmin, alive))


def rewind(state: H2OState, n: int) -> H2OState:
    """Forget the n newest tokens of every row; only meaningful while nothing has been evicted.

    Their slots are freed (they are the last n of each row's valid prefix). The scores
    of the tokens that stay keep the mass the forgotten tokens gave them: under decay
    it cannot be subtracted exactly.
    """
    gone = state.positions >= per_row(state.seen) - n
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
