"""CacheState: what one layer's H2O cache holds, and the pure transitions that move it.

`H2OKVCache` (h2o_fn.adapters.cache) is a shell that keeps a `CacheState` and calls
these functions; each takes a state (and the `Policy`) and returns a new one. The
state is the core's `H2OState` plus what the mlx-lm protocol adds around it: Python
mirrors of the per-row counts (so decoding never forces an evaluation), the tokens
whose attention weights are awaited (`Pending`, query scoring), the decode tokens
staged for `every` = k > 1 (`staging.Staged`) and, in a batch, the real tokens still
to come per row (right padding is never kept, scored or attended).

Shapes: B batch rows, H KV heads, C = budget + every slots, D head_dim, N new tokens.

Example:
    >>> import mlx.core as mx
    >>> import h2o_fn
    >>> from h2o_fn.adapters import cache_state
    >>> p = h2o_fn.policy(h2o_fn.H2OConfig(budget=8, n_sink=1, grace=2))
    >>> s = cache_state.CacheState()
    >>> for _ in range(3):
    ...     s, (k, v) = cache_state.update(s, p, mx.zeros((1, 2, 5, 16)), mx.zeros((1, 2, 5, 16)))
    >>> s.lengths, s.seen, k.shape
    ((8,), (15,), (1, 2, 13, 16))
"""

import json
from typing import List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from h2o_fn import H2OConfig, H2OState, Policy, Prompt, Storage, budgets, core, prefill, retention, scoring, storage, view
from h2o_fn.metal_ops import cpu_step
from h2o_fn.state import FREE, RESERVED

from . import staging


class Pending(NamedTuple):
    """What the weights of this forward pass complete: the model's attention weights (query
    scoring), or the key proxy's (`key` set: a decode token scored by its own key)."""

    state: H2OState  # decode: the state with the token admitted; chunk: the state before it
    keys: Optional[mx.array]  # [B, H, N, Dk] chunk tokens (None for one decode token)
    values: Optional[mx.array]  # [B, H, N, Dv]
    span: int  # slots in the view (the weights cover span + N - 1 columns)
    alive: Optional[mx.array]  # decode: [B] bool; chunk: [B] int32 real tokens; None: all
    staged: bool = False  # decode: a staged token (every > 1), weights kept for the chunk
    key: Optional[mx.array] = None  # key scoring: the token's key [B, H, 1, Dk] (the proxy's query)
    start: Optional[int] = None  # a chunk written into the room at slot `start` (`state`: after it)


class Step(NamedTuple):
    """What one update started from, for caches that follow this one in lockstep."""

    positions: mx.array  # [B, H, C] the slot layout the view was built on
    seen: List[int]  # per row, tokens before the update
    counts: List[int]  # per row, real tokens in the update
    span: int  # slots in the view


class CacheState(NamedTuple):
    """One layer's cache: the core's state and what mlx-lm's protocol needs around it (the
    counts as Python ints, so reading them never forces an evaluation)."""

    core: Optional[H2OState] = None  # None until the first tokens fix B, H, D and the dtype
    seen: Tuple[int, ...] = ()  # per row: tokens absorbed (the row's next position)
    lengths: Tuple[int, ...] = ()  # per row: tokens kept (core length, staged tokens included)
    pending: Optional[Pending] = None
    staged: staging.Staged = staging.Staged()
    to_come: Optional[Tuple[int, ...]] = None  # batch prompt: real tokens still to come per row
    waiting: int = 0  # batch rows of a batch merged from caches that were all empty
    span: int = 0  # slots in the last view
    followed: bool = False  # record `last` at each update (a lockstep leader)
    last: Optional[Step] = None  # what the last update started from (when followed)
    every: int = 1  # decode tokens judged at a time (`staging`); the core holds budget + every slots
    reserved: bool = False  # some head holds reserved slots (a selection's budgets): attention masks per head
    target: int = 0  # tokens per head a selection spreads over the layers (`cache_prompt`); 0: the config's budget
    head_mask: Optional[mx.array] = None  # [B, H, 1, N, L] bool: the last view's mask per KV head (when reserved)


def slots(s: CacheState, config: H2OConfig) -> int:
    """C: the core's slots per (b, h), budget + every (also before the first tokens)."""
    return config.budget + s.every


def update(s: CacheState, policy: Policy, keys: mx.array, values: mx.array):
    """Store `keys`/`values` `[B, H, N, D]`: (the new state, the view `[B, H, L, D]` for
    attention, L = view span + N - 1)."""
    s = settle_proxy(s, policy)
    if s.pending is not None:
        raise RuntimeError(
            "an H2O cache (scoring='query') got new tokens before the attention weights of the "
            "previous ones: the attention hook is missing. Build the cache with "
            "make_h2o_cache(model, config), which installs it."
        )
    check(s, policy.kv, keys, values)
    if keys.shape[2] == 1 and _plain(s):
        return _plain_decode(s, policy, keys, values)
    cfg = policy.config
    B, H, N, _ = keys.shape
    if s.waiting and B != s.waiting:
        raise ValueError(f"keys shape {tuple(keys.shape)} is invalid: this batch has {s.waiting} batch rows")
    real = real_tokens(s, N)
    alive = None if real is None else mx.array(real, dtype=mx.int32)
    s = _started(s, policy, keys, values)._replace(
        waiting=0, to_come=None if s.to_come is None else tuple(r - N for r in s.to_come))
    if N > 1:  # a chunk after staged decode tokens: score those first
        s = flush(s, policy)
    before, span = s, view.span_for(s.lengths, slots(s, cfg))
    if N == 1 and s.every > 1 and alive is None:
        s, out = _stage(s, policy, keys, values, span)
    elif N == 1:
        s, out = _decode(s, policy, keys, values, span, None if alive is None else alive.astype(mx.bool_))
    else:
        s, out = _chunk(s, policy, keys, values, span, alive)
    counts = real or [N] * B
    held = cfg.budget + len(s.staged.keys)
    last = Step(before.core.positions, list(before.seen), counts, span) if s.followed else None
    head_mask = view_head_mask(before, span, N) if s.reserved else None
    return s._replace(seen=tuple(a + n for a, n in zip(s.seen, counts)), span=span, last=last, head_mask=head_mask,
                      lengths=tuple(min(k + n, held) for k, n in zip(s.lengths, counts))), out


def _plain(s: CacheState) -> bool:
    """Whether a token for every row goes the decode loop's way: a started cache that judges
    each token at once, all rows real, unfollowed, without reserved slots."""
    return s.core is not None and s.every == 1 and s.to_come is None and not (s.waiting or s.followed or s.reserved)


def _plain_decode(s: CacheState, policy: Policy, keys: mx.array, values: mx.array):
    """`update` of one token `[B, H, 1, D]` on a `_plain` state: `_decode` (or, key-scored where
    `cpu_step.fused` says, the whole step as the C++ op) and the counts, the rest of `update`'s
    bookkeeping known (every row takes it, nothing staged or followed)."""
    span, held = view.span_for(s.lengths, slots(s, policy.config)), policy.config.budget + len(s.staged.keys)
    if cpu_step.fused(policy, s.core, span):  # the admitted rows stay where they are: the view is the admitted state's
        core = cpu_step.key_step(s.core, keys, values, policy.config, span)
        s, out = s._replace(core=core), view.view(core, span)
    else:
        s, out = _decode(s, policy, keys, values, span, None)
    return s._replace(seen=tuple(a + 1 for a in s.seen), lengths=tuple(min(k + 1, held) for k in s.lengths),
                      span=span, last=None, head_mask=None), out


def view_head_mask(s: CacheState, span: int, N: int) -> mx.array:
    """`[B, H, 1, N, span + N - 1]` bool, True = attend: the view's mask (`view.view_mask`: each
    batch row's slots, then the chunk causally) without the reserved slots of each KV head."""
    rows = view.view_mask(mx.array(s.lengths, dtype=mx.int32), span, N)[:, :, None]  # [B, 1, 1, N, L]
    held = s.core.positions[..., :span] != RESERVED  # [B, H, span]
    held = mx.pad(held, [(0, 0), (0, 0), (0, N - 1)], constant_values=True)[:, :, None, None]
    return rows & held


def _decode(s, policy, keys, values, span, alive):
    # the view reads the written row; three C++ primitives where built (`cpu_step.admit`), else compiled mlx ops
    admitted = cpu_step.admit(s.core, keys, values, policy.kv) if alive is None and cpu_step.native(policy) else \
        policy.admit(s.core, keys, values, alive)
    key = keys if policy.config.scoring == "key" else None  # the proxy: from the hook, else `settle_proxy`
    # the core moves on to the admitted state: nothing holds the state before it, so MLX writes
    # the row into its buffer instead of copying the stores (the settle may come a token later)
    return s._replace(core=admitted, pending=Pending(admitted, None, None, span, alive, key=key)), \
        view.view(admitted, span)


def _room(s: CacheState, policy: Policy, N: int, alive) -> Optional[int]:
    """The slot where a chunk of N real tokens goes in place (`prefill.admit_chunk`), when it
    fits every row's room (nothing evicted) and each head's slots hold tokens or reserved ones
    up to that slot, free after it (one evaluation of the layout); else None."""
    L = s.lengths[0] if s.lengths else 0
    if (alive is not None or policy.config.prefill != "oneshot" or len(set(s.lengths)) > 1
            or L + N > policy.config.budget):
        return None
    p = s.core.positions
    dense = mx.all(s.core.length == L) & mx.all(p[..., :L] != FREE) & mx.all(p[..., L:] == FREE)
    return L if dense.item() else None


def _chunk(s, policy, keys, values, span, alive):
    start = _room(s, policy, keys.shape[2], alive)
    if start is not None:  # written where it lies: the view is its slots, nothing is copied
        written = policy.admit_chunk(s.core, keys, values, start)
        out = view.view(written, start + keys.shape[2])
        if policy.config.scoring == "query":
            return s._replace(core=written, pending=Pending(written, keys, values, span, None, start=start)), out
        state = policy.settle_chunk(written, keys, start)
        mx.eval(state)
        return s._replace(core=state), out
    out = view.chunk_view(s.core, keys, values, span, policy.kv)
    if policy.config.scoring == "query":
        return s._replace(pending=Pending(s.core, keys, values, span, alive)), out
    state = policy.absorb(s.core, keys, values, None, alive)
    mx.eval(state)  # as in receive: one layer's chunk at a time
    return s._replace(core=state), out


def _stage(s, policy, keys, values, span):
    """every = k > 1: admit a decode token unscored (`staging`). Query scoring awaits its
    weights; key scoring (oneshot) offers its key to the hook for the proxy's logits."""
    cfg, admitted = policy.config, policy.admit(s.core, keys, values)
    s = s._replace(staged=staging.stage(s.staged, keys, values, s.seen))
    if cfg.scoring == "query":
        return s._replace(pending=Pending(admitted, None, None, span, None, staged=True)), view.view(admitted, span)
    if cfg.prefill == "oneshot":  # greedy judges each token after the evictions before it: no logits
        return s._replace(core=admitted, pending=Pending(admitted, None, None, span, None, staged=True, key=keys)), \
            view.view(admitted, span)
    s = s._replace(core=admitted)
    return _flush_when_full(s, policy), view.view(admitted, span)


def scored_queries(s: CacheState, policy: Policy, N: int) -> int:
    """How many of the last tokens' N queries the awaited weights must cover: a prompt
    chunk is scored by its last `window` queries only (`scoring.scored_queries`)."""
    p = s.pending
    if p is None or p.keys is None:
        return N
    return scoring.scored_queries(N, policy.config, p.alive, policy.prompt)


def kv_heads(s: CacheState) -> int:
    """KV heads of the stored rows (0 before the first tokens)."""
    return 0 if s.core is None else s.core.positions.shape[1]


def can_take(s: CacheState, keys) -> bool:
    """Whether attention over `keys` (an array or a store) gives the awaited weights: the
    view last returned, on the state's KV heads (or any heads, when it holds one latent head)."""
    k = storage.parts(keys)[0] if isinstance(keys, (tuple, list)) else keys
    p, H = s.pending, kv_heads(s)
    L = p.span + (0 if p.keys is None else p.keys.shape[2] - 1)
    return k.shape[2] == L and (k.shape[1] == H or H == 1)


def receive(s: CacheState, policy: Policy, weights: mx.array) -> CacheState:
    """The awaited attention weights `[B, H, M, L]` (GQA-reduced) over the view last
    returned, of the last M = `scored_queries(N)` queries: the pending update finished."""
    p = s.pending
    if p is None:
        raise RuntimeError("an H2O cache got attention weights but has no tokens waiting")
    B, H = p.state.positions.shape[:2]
    N = 1 if p.keys is None else p.keys.shape[2]  # new tokens in the view
    M = scored_queries(s, policy, N)
    if tuple(weights.shape) not in {(B, H, m, p.span + N - 1) for m in (M, N)}:
        queries = f"{M} or {N}" if M < N else f"{N}"
        raise ValueError(f"weights shape {tuple(weights.shape)} is invalid: expected ({B}, {H}, {queries}, "
                         f"{p.span + N - 1})")
    s = s._replace(pending=None)
    if p.staged:  # kept for the chunk that scores the staged tokens
        s = s._replace(core=p.state, staged=staging.with_weights(s.staged, weights, p.state, s.every))
        return _flush_when_full(s, policy)
    if p.keys is None:
        w = view.decode_weights(weights, p.state)
        if p.alive is None and cpu_step.native(policy):  # one C++ primitive instead of the core's ~20
            return s._replace(core=cpu_step.settle(p.state, w, policy.config))
        return s._replace(core=policy.settle(p.state, w, p.alive))
    if p.start is not None:  # the view was the written slots [0, start + N)
        state = policy.settle_chunk(p.state, p.keys, p.start, view.slot_weights(weights, p.state.positions.shape[-1]))
        mx.eval(state)
        return s._replace(core=state)
    state = policy.absorb(p.state, p.keys, p.values, view.view_weights(p.state, weights, p.span), p.alive)
    mx.eval(state)  # a chunk: left lazy, every layer's chunk rows would live until the pass ends
    return s._replace(core=state)


def proxy_queries(s: CacheState, policy: Policy) -> Optional[mx.array]:
    """The query row of the awaited key-scored decode token's proxy, for attention to compute
    beside its own queries: `[B, H, 1, Dk]` float32, scaled by 1/sqrt(Dk) (`view.proxy_query`);
    None unless such a token waits."""
    p = s.pending
    if p is None or p.key is None:
        return None
    if p.alive is None and cpu_step.native(policy) and cpu_step.reads_back(p.state, policy.kv):
        return cpu_step.newest_row(p.state)  # one C++ primitive instead of a quantize and a dequantize
    return view.proxy_query(p.state, p.key, policy.kv)


def receive_proxy(s: CacheState, policy: Policy, logits: mx.array) -> CacheState:
    """The proxy row's logits `[B, H, 1, span]` against the view last returned: the awaited
    key-scored token settled (`settle_key` with them)."""
    p = s.pending
    if p is None or p.key is None:
        raise RuntimeError("an H2O cache got key-proxy logits but has no key-scored token waiting")
    B, H = p.state.positions.shape[:2]
    if tuple(logits.shape) != (B, H, 1, p.span):
        raise ValueError(f"logits shape {tuple(logits.shape)} is invalid: expected ({B}, {H}, 1, {p.span})")
    if p.staged:  # kept for the chunk that scores the staged tokens
        s = s._replace(pending=None, staged=staging.with_logits(s.staged, logits, p.state))
        return _flush_when_full(s, policy)
    if p.alive is None and cpu_step.native(policy):  # one C++ primitive instead of the core's ~15
        return s._replace(core=cpu_step.settle_key(p.state, logits, policy.config), pending=None)
    return s._replace(core=policy.settle_key(p.state, p.key, p.alive, view.decode_weights(logits, p.state)),
                      pending=None)


def settle_proxy(s: CacheState, policy: Policy) -> CacheState:
    """The awaited key-scored token settled by the core's own key proxy (`settle_key`), when
    attention did not hand its logits over (no hook, a GPU, an attention sink). A staged
    token stays staged without logits: the flush multiplies the keys itself."""
    p = s.pending
    if p is None or p.key is None:
        return s
    if p.staged:
        s = s._replace(pending=None)
        return _flush_when_full(s, policy)
    return s._replace(core=policy.settle_key(p.state, p.key, p.alive), pending=None)


def _flush_when_full(s: CacheState, policy: Policy) -> CacheState:
    """`flush` once `every` decode tokens are staged (the last one scored or settled), else `s`."""
    return flush(s, policy) if staging.full(s.staged, s.every) else s


def flush(s: CacheState, policy: Policy) -> CacheState:
    """The staged decode tokens scored and evicted now (before a chunk, a save, a merge)."""
    if not s.staged.keys:
        return s
    require_settled(s, "flush")
    budget = policy.config.budget
    return s._replace(core=staging.flush(s.core, s.staged, policy), staged=staging.Staged(),
                      lengths=tuple(min(k, budget) for k in s.lengths))


def require_settled(s: CacheState, what: str) -> None:
    """Raise unless every awaited attention weight has arrived."""
    if s.pending is not None:
        n = 1 if s.pending.keys is None else s.pending.keys.shape[2]
        raise RuntimeError(
            f"cannot {what} an H2O cache: the attention weights of its last {n} token(s) never "
            "arrived (query scoring needs the attention hook; see make_h2o_cache)"
        )


def mask(s: CacheState, config: H2OConfig, N: int, return_array: bool = False):
    """The attention mask of N new tokens over the view: None for one token of equal batch
    rows (as mlx-lm's KVCache, even with return_array), causal over kept + N rows for a
    chunk, and per batch row when the batch rows keep different counts."""
    if len(set(s.lengths)) > 1:
        span = view.span_for(s.lengths, slots(s, config))
        return view.view_mask(mx.array(s.lengths, dtype=mx.int32), span, N)
    if N == 1:
        return None
    return create_causal_mask(N, offset=max(s.lengths, default=0)) if return_array else "causal"


def real_tokens(s: CacheState, N: int) -> Optional[List[int]]:
    """Real tokens per row the next chunk of N has (None: all N)."""
    if s.to_come is None:
        return None
    real = [max(0, min(N, r)) for r in s.to_come]
    return None if real == [N] * len(real) else real


def next_step(s: CacheState, config: H2OConfig, B: int, H: int, N: int) -> Step:
    """What the next update of N tokens will start from (for a follower that takes its
    tokens before the leader does): the settled layout, counts and view span."""
    require_settled(s, "lead")
    if s.core is None:
        positions, seen, lengths = mx.full((B, H, slots(s, config)), -1, dtype=mx.int32), [0] * B, [0] * B
    else:
        positions, seen, lengths = s.core.positions, list(s.seen), s.lengths
    counts = real_tokens(s, N) or [N] * len(seen)
    return Step(positions, seen, counts, view.span_for(lengths, slots(s, config)))


def trim(s: CacheState, n: int) -> Tuple[CacheState, int]:
    """Forget the n newest tokens while nothing was evicted: (the state, tokens trimmed)."""
    n = min(n, min(s.seen, default=0))
    state = core.rewind(s.core, n) if n and s.core is not None else s.core
    return s._replace(core=state, seen=tuple(a - n for a in s.seen), lengths=tuple(k - n for k in s.lengths)), n


def absorb_scored(s: CacheState, policy: Policy, keys: mx.array, values: mx.array, scores: mx.array,
                  span: int) -> CacheState:
    """A chunk `[B, H, N, D]` evicted down to budget by `scores` `[B, H, span + N]` over the
    first `span` slots then the chunk (`retention.chunk_scores`, `prefill.absorb_scored`)."""
    require_settled(s, "absorb a scored chunk")
    check(s, policy.kv, keys, values)
    N, budget = keys.shape[2], policy.config.budget
    s = _started(s, policy, keys, values)
    scores = retention.chunk_scores(s.core, scores, span)
    state = prefill.absorb_scored(s.core, keys, values, scores, policy.config, policy.prompt, policy.kv)
    return s._replace(core=state, seen=tuple(a + N for a in s.seen),
                      lengths=tuple(min(k + N, budget) for k in s.lengths))


def selection_inputs(s: CacheState, policy: Policy, keys: mx.array, values: mx.array, scores: mx.array,
                     span: int) -> Tuple[CacheState, mx.array, mx.array]:
    """What `budgets.select` reads of this layer for a chunk `[B, H, N, D]` scored by a
    prompt-scoring pass over the first `span` slots then the chunk (`scores` `[B, H, span + N]`):
    (the started state, scores `[B, H, C + N]` in the core's layout, positions `[B, H, C + N]`)."""
    require_settled(s, "select from a scored chunk")
    check(s, policy.kv, keys, values)
    s = _started(s, policy, keys, values)
    B, H, N = keys.shape[:3]
    chunk = mx.broadcast_to((s.core.seen[:, None] + mx.arange(N, dtype=mx.int32))[:, None], (B, H, N))
    return s, retention.chunk_scores(s.core, scores, span), mx.concatenate([s.core.positions, chunk], axis=-1)


def absorb_selected(s: CacheState, policy: Policy, keys: mx.array, values: mx.array, scores: mx.array,
                    keep: mx.array, held: int) -> CacheState:
    """A chunk `[B, H, N, D]` and the kept tokens reduced to `keep` `[B, H, C + N]` (a selection
    over every layer, `budgets.select`, on `selection_inputs`' scores): every head then occupies
    `held` slots (its tokens, then reserved ones) of `policy`'s budget + every; the policy's
    budget must exceed `held` (the tokens every head takes before the next eviction)."""
    N = keys.shape[2]
    state = budgets.absorb_selected(s.core, keys, values, scores, keep, held, slots(s, policy.config), policy.kv)
    return s._replace(core=state, seen=tuple(a + N for a in s.seen), lengths=(held,) * len(s.seen), reserved=True,
                      head_mask=None)


def kept_rows(s: CacheState, kv: Storage) -> tuple:
    """`(keys, values)` `[B, H, K, D]`: the first K = max length slots of each store, dense
    (dequantized when `kv.bits`). After `view.compact` they are the kept tokens by position."""
    K = max(s.lengths, default=0)
    return tuple(storage.dense(storage.head(x, K), kv.bits, kv.group_size)
                 for x in (s.core.keys, s.core.values))


def take_batch(s: CacheState, idx: Sequence[int]) -> CacheState:
    """Batch rows `idx` (in that order): state, staged tokens and their weights."""
    if s.core is None:
        return s._replace(waiting=len(idx))
    batch, c = mx.array(list(idx)), s.core
    state = H2OState(storage.select(c.keys, batch), storage.select(c.values, batch), *(x[batch] for x in c[2:]))
    return s._replace(core=state, staged=staging.take(s.staged, batch), seen=tuple(s.seen[i] for i in idx),
                      lengths=tuple(s.lengths[i] for i in idx),
                      to_come=None if s.to_come is None else tuple(s.to_come[i] for i in idx))


def stack(states: Sequence[CacheState], policy: Policy, budgets_of: Optional[Sequence[int]] = None) -> CacheState:
    """Settled single-prompt states as one batch, batch rows as they are (each keeps its length;
    an empty one becomes an empty row). `budgets_of`: each state's own layer budget, when they
    differ (caches shaped by different selections): a row below `policy`'s budget is widened
    by reserved slots (`budgets.widen`), so each keeps what it would keep alone."""
    if budgets_of is not None:
        states = [_widened(s, policy.config.budget - b) for s, b in zip(states, budgets_of)]
    every = {s.every for s in states}
    if len(every) != 1:
        raise ValueError(f"cannot stack cache states judging decode tokens {sorted(every)} at a time: "
                         "expected one evict_every")
    every = every.pop()
    held = [s.core for s in states if s.core is not None]
    if not held:
        return CacheState(waiting=len(states), every=every)
    H, Dk, Dv = held[0].positions.shape[1], *(storage.width(x, policy.kv.bits) for x in held[0][:2])
    dtype = storage.dtype_of(held[0].keys)
    cores = [s.core if s.core is not None else policy.init(1, H, Dk, dtype, Dv, every) for s in states]
    state = H2OState(storage.stack([c.keys for c in cores]), storage.stack([c.values for c in cores]),
                     *(mx.concatenate([getattr(c, f) for c in cores], axis=0) for f in H2OState._fields[2:]))
    return CacheState(state, tuple(a for s in states for a in (s.seen or (0,))),
                      tuple(k for s in states for k in (s.lengths or (0,))), every=every,
                      reserved=any(s.reserved for s in states), target=max(s.target for s in states))


def _widened(s: CacheState, extra: int) -> CacheState:
    """A settled `s` with `extra` reserved slots per head (`budgets.widen`)."""
    if extra == 0 or s.core is None:
        return s
    return s._replace(core=budgets.widen(s.core, extra), reserved=True, lengths=tuple(k + extra for k in s.lengths))


def to_arrays(s: CacheState) -> tuple:
    """(keys, values, scores, positions, length, seen, staged keys, staged values, staged
    weights, staged from): the core's arrays then `staging.to_arrays`, None when absent."""
    require_settled(s, "save")
    return (*((None,) * 6 if s.core is None else tuple(s.core)), *staging.to_arrays(s.staged))


def from_arrays(arrays: Sequence, every: int = 1) -> CacheState:
    """The inverse of `to_arrays` (a store may come back as a list); `every` as saved."""
    if arrays[0] is None:
        return CacheState(every=every)
    keys, values = (tuple(x) if isinstance(x, (list, tuple)) else x for x in arrays[:2])
    state = H2OState(keys, values, *arrays[2:6])
    return CacheState(state, tuple(state.seen.tolist()), tuple(state.length.tolist()),
                      staged=staging.from_arrays(*arrays[6:10]), every=every,
                      reserved=bool(mx.any(state.positions == RESERVED).item()))


def store(s: CacheState, name: str):
    """The core's "keys" or "values" store (all C slots), None before the first tokens."""
    return None if s.core is None else getattr(s.core, name)


def with_store(s: CacheState, name: str, x) -> CacheState:
    """`s` with the core's "keys" or "values" store replaced (nothing to replace when empty)."""
    return s if s.core is None else s._replace(core=s.core._replace(**{name: x}))


def meta(s: CacheState, policy: Policy) -> str:
    """The config's, the prompt's and the storage's fields (`kv_bits`, `kv_group_size`) and
    `evict_every` as one JSON object (a cache's `meta_state`: the object files held when
    all of them were the config's fields)."""
    return json.dumps({**policy.fields(), "evict_every": s.every, **({"target": s.target} if s.target else {})})


def from_meta(arrays: Sequence, meta_state: str) -> Tuple[H2OConfig, Prompt, Storage, CacheState]:
    """(config, prompt, storage, state) of a saved cache: `to_arrays`' arrays and `meta`'s JSON."""
    fields = json.loads(meta_state)
    every, target = fields.pop("evict_every", 1), fields.pop("target", 0)
    prompt = Prompt(**{f: fields.pop(f) for f in Prompt._fields if f in fields})
    kv = Storage(fields.pop("kv_bits", None), fields.pop("kv_group_size", 64))
    return H2OConfig(**fields), prompt, kv, from_arrays(arrays, every)._replace(target=target)


def _started(s: CacheState, policy: Policy, keys: mx.array, values: mx.array) -> CacheState:
    """The empty state on the first tokens `[B, H, N, D]` (their dtype and widths)."""
    if s.core is not None:
        return s
    B, H, _, D = keys.shape
    return s._replace(core=policy.init(B, H, D, keys.dtype, values.shape[3], s.every), seen=(0,) * B,
                      lengths=(0,) * B)


def check(s: CacheState, kv: Storage, keys: mx.array, values: mx.array) -> None:
    """Raise unless `keys`/`values` `[B, H, N, D]` fit each other and the state."""
    if keys.ndim != 4 or values.ndim != 4:
        raise ValueError(f"keys/values of shapes {tuple(keys.shape)}/{tuple(values.shape)} are invalid: "
                         "expected [B, H, N, D]")
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} disagree: expected "
                         "the same [B, H, N] (head_dim may differ)")
    if keys.shape[2] == 0:
        raise ValueError("empty chunk: expected N >= 1 new tokens")
    if keys.dtype != values.dtype:
        raise ValueError(f"keys dtype {keys.dtype} != values dtype {values.dtype}")
    if s.core is None:
        return
    B, H = s.core.positions.shape[:2]
    Dk, Dv = storage.width(s.core.keys, kv.bits), storage.width(s.core.values, kv.bits)
    if (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3]) != (B, H, Dk, Dv):
        raise ValueError(f"keys/values shapes {tuple(keys.shape)}/{tuple(values.shape)} are invalid: this "
                         f"cache holds [B={B}, H={H}, *, Dk={Dk}] / [.., Dv={Dv}] (fixed after the first call)")
    dtype = storage.dtype_of(s.core.keys)
    if keys.dtype != dtype:
        raise ValueError(f"keys dtype {keys.dtype} is invalid: this cache holds {dtype}")
