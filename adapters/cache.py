"""H2OKVCache and BatchH2OKVCache: the H2O core behind mlx-lm's cache protocol.

One cache per attention layer. mlx-lm rotates queries and keys with
`cache.offset` (absolute tokens seen), so kept keys keep the rotation of their
own position and every query-key distance stays exact. Shapes: B batch rows,
H KV heads, C = budget + evict_every slots, D head_dim, N new tokens.

`update_and_fetch(keys, values)` returns the attention view of the core
(`h2o_fn.view`: the kept rows plus the N new tokens); the stored state is
evicted down to budget inside `update_and_fetch` for key scoring, and when the
attention hook hands over the weights for query scoring. The adapter holds no
algorithm: it calls the core and mirrors counts as Python ints, so decoding
never forces an evaluation.

`BatchH2OKVCache` is the same cache for mlx-lm's batch generator (`merge`,
`prepare`, `finalize`, `filter`, `extend`, `extract`): rows of different
lengths, right padding never kept, scored or attended.

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn import H2OConfig
    >>> from h2o_fn.adapters.cache import H2OKVCache
    >>> cache = H2OKVCache(H2OConfig(budget=8, n_sink=1, grace=2))
    >>> for _ in range(3):
    ...     k, v = cache.update_and_fetch(mx.zeros((1, 2, 5, 16)), mx.zeros((1, 2, 5, 16)))
    >>> cache.tokens_kept, cache.tokens_seen, k.shape
    (8, 15, (1, 2, 13, 16))
"""

import json
from typing import List, NamedTuple, Optional, Sequence

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from h2o_fn import H2OConfig, H2OState, core, retention, state_nbytes, storage, view
from h2o_fn.metal_ops import protected_argmin

# What make_h2o_cache and H2OKVCache use without a config, chosen from BENCHMARKS.md
# (quality first, then speed; its "Streaming perplexity", "Sweep" and pass-key tables
# hold the figures): true-query scoring with oneshot prefill, and a prompt longer than
# 48 tokens compressed by its last 48 queries with spans of 15 kept together (chunks of
# 16, as in streaming, are not compressed that way).
DEFAULT_CONFIG = H2OConfig(scoring="query", prefill="oneshot", window=48, pool=15)


class Pending(NamedTuple):
    """Query scoring: what the weights of this forward pass complete."""

    state: H2OState  # decode: the state with the token admitted; chunk: the state before it
    keys: Optional[mx.array]  # [B, H, N, Dk] chunk tokens (None for one decode token)
    values: Optional[mx.array]  # [B, H, N, Dv]
    rows: int  # slots in the view (the weights cover rows + N - 1 columns)
    alive: Optional[mx.array]  # decode: [B] bool; chunk: [B] int32 real tokens; None: all
    staged: bool = False  # decode: a staged token (evict_every > 1), weights kept for the chunk


class Step(NamedTuple):
    """What one update started from, for caches that follow this one in lockstep."""

    positions: mx.array  # [B, H, C] the slot layout the view was built on
    seen: List[int]  # per row, tokens before the update
    counts: List[int]  # per row, real tokens in the update
    rows: int  # slots in the view


class H2OKVCache(_BaseCache):
    """A fixed-budget KV cache that evicts the lowest-scoring unprotected token.

    Args:
      config: the eviction policy (default `DEFAULT_CONFIG`: true-query scoring, which
        needs the attention hook: `make_h2o_cache` installs it).
      argmin: the eviction op: `h2o_fn.metal_ops.protected_argmin` by default (the
        fused kernel on an Apple or NVIDIA GPU, the core's pure MLX path elsewhere).
    """

    step = 256  # mlx-lm's KVCache growth step; H2O allocates its C slots once

    def __init__(self, config: Optional[H2OConfig] = None, argmin=protected_argmin):
        self.config = config or DEFAULT_CONFIG
        self.argmin = argmin
        self._core: Optional[H2OState] = None
        self._seen: List[int] = []  # per row: tokens absorbed (the row's next position)
        self._lengths: List[int] = []  # per row: tokens kept (== core length)
        self._pending: Optional[Pending] = None
        self._view = None  # what the last update returned (for layers that share this KV)
        self._rows = 0  # slots in that view
        self._followed = False  # a lockstep follower reads what the last update started from:
        self._before: Optional[Step] = None  # (see h2o_fn.adapters.lockstep)
        self._staged: List[tuple] = []  # evict_every > 1: decode (keys, values) not yet scored
        self._staged_w: List[mx.array] = []  # ... their weights, [B, H, 1, C + k] (query scoring)
        self._staged_from: Optional[mx.array] = None  # [B] seen when the first was staged

    # ------------------------------------------------------------ mlx-lm protocol

    @property
    def offset(self) -> int:
        """Tokens seen: the absolute position of the next token."""
        return self._seen[0] if self._seen else 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store `keys`/`values` `[B, H, N, D]`; return the view `[B, H, L, D]` for attention
        (L = kept rows + N; stores are mx.quantize triples with `kv_bits`)."""
        if self._pending is not None:
            raise RuntimeError(
                f"{type(self).__name__}(scoring='query') got new tokens before the attention "
                "weights of the previous ones: the attention hook is missing. Build the cache "
                "with make_h2o_cache(model, config), which installs it."
            )
        self._check(keys, values)
        B, H, N, D = keys.shape
        self._start(keys, values)
        real = self._real_tokens(N)  # per row; None: all N
        alive = None if real is None else mx.array(real, dtype=mx.int32)
        rows = view.rows_for(self._lengths, self.config.capacity)
        state, cfg = self._core, self.config
        if N == 1 and cfg.evict_every > 1 and alive is None:
            out = self._stage(keys, values, rows)
        elif N == 1:
            one = None if alive is None else alive.astype(mx.bool_)
            if cfg.scoring == "key":
                self._core = core.compiled_step(cfg, self.argmin)(state, keys, values, None, one)
                out = view.view(self._core, rows)
            else:  # admit now (the view reads the written row), settle when the weights come
                admitted = (core.compiled_admit(cfg)(state, keys, values) if one is None
                            else core.admit(state, keys, values, cfg, one))
                self._pending = Pending(admitted, None, None, rows, one)
                out = view.view(admitted, rows)
        else:
            if self._staged:  # a chunk after staged decode tokens: score those first
                self._flush()
                state, rows = self._core, view.rows_for(self._lengths, cfg.capacity)
            out = view.chunk_view(state, keys, values, cfg, rows)
            if cfg.scoring == "key":
                self._core = core.absorb(state, keys, values, cfg, argmin=self.argmin, n_alive=alive)
                mx.eval(self._core)  # as in receive_weights: one layer's chunk at a time
            else:
                self._pending = Pending(state, keys, values, rows, alive)
        counts = real or [N] * B
        if self._followed:
            self._before = Step(state.positions, list(self._seen), counts, rows)
        self._seen = [s + n for s, n in zip(self._seen, counts)]
        self._lengths = [min(k + n, cfg.budget + len(self._staged)) for k, n in zip(self._lengths, counts)]
        self._view, self._rows = out, rows
        return out

    def _stage(self, keys: mx.array, values: mx.array, rows: int):
        """evict_every = k > 1: a decode token is admitted unscored (a row write, the view as
        usual); once k are staged they are scored and evicted as one oneshot chunk (the
        prefill rule), with their own attention weights for query scoring."""
        if not self._staged:
            self._staged_from = mx.array(self._seen, dtype=mx.int32)
        admitted = core.compiled_admit(self.config)(self._core, keys, values)
        self._staged.append((keys, values))
        if self.config.scoring == "key":
            self._core = admitted
            if len(self._staged) == self.config.evict_every:
                self._flush()
        else:
            self._pending = Pending(admitted, None, None, rows, None, staged=True)
        return view.view(admitted, rows)

    def _staged_chunk(self):
        """The staged decode tokens' keys and values `[B, H, j, D]`, as one chunk."""
        return (mx.concatenate([k for k, _ in self._staged], axis=2),
                mx.concatenate([v for _, v in self._staged], axis=2))

    def _unstaged(self):
        """(the state before staging, the staged tokens' keys and values as a chunk)."""
        return (core.rewind(self._core, len(self._staged)), *self._staged_chunk())

    def _flush(self) -> None:
        """Score and evict the staged decode tokens now (before a chunk, a save, a merge)."""
        if not self._staged:
            return
        self._require_settled("flush")
        base, chunk_k, chunk_v = self._unstaged()
        weights = None
        if self.config.scoring == "query":
            weights = mx.concatenate(self._staged_w, axis=2)[..., : self.config.capacity + len(self._staged)]
        self._core = core.compiled_absorb(self.config, self.argmin)(base, chunk_k, chunk_v, weights)
        self._lengths = [min(k, self.config.budget) for k in self._lengths]
        self._staged, self._staged_w = [], []

    def keys_and_values(self):
        """The rows the last update returned: what a layer sharing this KV attends to."""
        if self._view is None:
            raise RuntimeError(f"{type(self).__name__} holds no tokens yet: nothing to share")
        return self._view

    # ------------------------------------------------------------ caches in lockstep

    def follow(self, followed: bool = True) -> None:
        """Record, at each update, what it started from (`last_update`): for caches that lay
        their rows out as this one does (h2o_fn.adapters.lockstep)."""
        self._followed = followed

    def last_update(self) -> Optional[Step]:
        """What the last update started from (positions, tokens seen, counts, view rows);
        None unless `follow()` was called before it."""
        return self._before

    def seen_rows(self) -> List[int]:
        """Tokens seen per batch row (empty before the first update)."""
        return list(self._seen)

    @property
    def keys(self):
        """The stored key rows (all C slots; a store), for models that read a cache's
        arrays directly (DeepSeek sparse attention ties its caches with mx.depends)."""
        return None if self._core is None else self._core.keys

    @keys.setter
    def keys(self, store):
        if self._core is not None:
            self._core = self._core._replace(keys=store)

    @property
    def values(self):
        return None if self._core is None else self._core.values

    @values.setter
    def values(self, store):
        if self._core is not None:
            self._core = self._core._replace(values=store)

    # ------------------------------------------------------------ the hook's protocol

    @property
    def wants_weights(self) -> bool:
        """True while the attention weights of the last tokens are awaited."""
        return self._pending is not None

    @property
    def kv_heads(self) -> int:
        return self._core.positions.shape[1] if self._core is not None else 0

    def can_take(self, keys) -> bool:
        """Whether attention over `keys` gives weights this cache can use: the rows it
        returned, on its own KV heads (or any heads, when it holds one latent head)."""
        k = storage.parts(keys)[0] if isinstance(keys, (tuple, list)) else keys
        p = self._pending
        L = p.rows + (0 if p.keys is None else p.keys.shape[2] - 1)
        return k.shape[2] == L and (k.shape[1] == self.kv_heads or self.kv_heads == 1)

    def scored_queries(self, N: int) -> int:
        """How many of the last tokens' N queries the awaited weights must cover: a prompt
        chunk is scored by its last `window` queries only (`core.scored_queries`)."""
        p = self._pending
        if p is None or p.keys is None:
            return N
        return core.scored_queries(N, self.config, p.alive)

    def receive_weights(self, weights: mx.array) -> None:
        """Attention weights `[B, H, M, L]` (GQA-reduced) over the rows last returned, of the
        last M = `scored_queries(N)` queries."""
        p = self._pending
        if p is None:
            raise RuntimeError(f"{type(self).__name__} got attention weights but has no tokens waiting")
        B, H = p.state.positions.shape[:2]
        N = 1 if p.keys is None else p.keys.shape[2]  # new tokens in the view
        M = self.scored_queries(N)
        if tuple(weights.shape) not in {(B, H, m, p.rows + N - 1) for m in (M, N)}:
            rows = f"{M} or {N}" if M < N else f"{N}"
            raise ValueError(f"weights shape {tuple(weights.shape)} is invalid: expected ({B}, {H}, {rows}, "
                             f"{p.rows + N - 1})")
        self._pending = None
        if p.staged:  # kept for the chunk that scores the staged tokens
            self._core = p.state
            self._staged_w.append(view.staged_weights(weights, p.state, self._staged_from,
                                                      self.config.evict_every))
            if len(self._staged) == self.config.evict_every:
                self._flush()
        elif p.keys is None:
            settle = core.compiled_settle(self.config, self.argmin)
            self._core = settle(p.state, view.decode_weights(weights, p.state), p.alive)
        else:
            w = view.view_weights(p.state, weights, p.rows)
            self._core = core.absorb(p.state, p.keys, p.values, self.config, w, self.argmin, p.alive)
            mx.eval(self._core)  # a chunk: left lazy, every layer's chunk rows would live until the pass ends

    def attention_mask(self, N: int, mask):
        """The mask this layer needs: mlx-lm builds one per forward pass from layer 0's
        cache; a layer that keeps a different number of rows (per-layer budgets) gets its own."""
        if isinstance(mask, mx.array) and mask.shape[-1] != self._rows + N - 1:
            return self.make_mask(N, return_array=True)
        return mask

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """None for one token of equal rows; causal over kept + N rows for a chunk."""
        if window_size is not None:
            raise ValueError(
                f"{type(self).__name__} got window_size={window_size}: sliding-window layers must "
                "keep their own bounded cache (make_h2o_cache leaves them alone)"
            )
        kept = max(self._lengths, default=0)
        if len(set(self._lengths)) > 1:  # rows of a batch at different lengths
            rows = view.rows_for(self._lengths, self.config.capacity)
            return view.view_mask(mx.array(self._lengths, dtype=mx.int32), rows, N)
        if N == 1:  # as mlx-lm's KVCache: one token sees everything, even with return_array
            return None
        if return_array:
            return create_causal_mask(N, offset=kept)
        return "causal"

    def size(self) -> int:
        return max(self._lengths, default=0)

    def empty(self) -> bool:
        return self._core is None

    @property
    def nbytes(self) -> int:
        """Bytes really stored: key and value rows (packed when quantized), scores,
        positions and counters, for all C slots."""
        return 0 if self._core is None else state_nbytes(self._core)

    @property
    def bits(self) -> int:
        """mlx-lm routes attention to its quantized path when a cache has `bits`: only a
        cache that stores quantized rows has it (AttributeError otherwise)."""
        if self.config.kv_bits is None:
            raise AttributeError(f"{type(self).__name__} stores unquantized rows (kv_bits=None)")
        return self.config.kv_bits

    @property
    def group_size(self) -> int:
        if self.config.kv_bits is None:
            raise AttributeError(f"{type(self).__name__} stores unquantized rows (kv_bits=None)")
        return self.config.kv_group_size

    def is_trimmable(self) -> bool:
        """Trimming is exact only while nothing has been evicted (staged tokens count as held)."""
        self._require_settled("trim")
        return self._lengths == self._seen

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        self._flush()  # nothing was evicted, so scoring the staged tokens evicts nothing either
        n = min(n, min(self._seen, default=0))
        if n and self._core is not None:
            self._core = core.rewind(self._core, n)
        self._seen = [s - n for s in self._seen]
        self._lengths = [k - n for k in self._lengths]
        self._view = None
        return n

    @property
    def meta_state(self) -> str:
        """The config as JSON: what `state` cannot hold as arrays."""
        return json.dumps(self.config._asdict())

    @property
    def state(self):
        """(keys, values, scores, positions, length, seen, staged keys, staged values, staged
        weights, staged from, meta_state) for save/load and for `mx.eval` (mlx-lm evaluates
        `c.state` between prompt chunks: it reads, it never changes the cache).

        Arrays first (a store is an array or mx.quantize's triple; the staged decode tokens
        of evict_every > 1, `[B, H, j, D]`, None when none); mlx-lm 0.32 saves only `state`,
        so the config string travels as its last element.
        """
        self._require_settled("save")
        arrays = (None,) * 6 if self._core is None else tuple(self._core)
        staged = (None,) * 4
        if self._staged:
            staged = (*self._staged_chunk(),
                      mx.concatenate(self._staged_w, axis=2) if self._staged_w else None,
                      self._staged_from)
        return (*arrays, *staged, self.meta_state)

    @state.setter
    def state(self, v):
        *arrays, meta = v
        self.__init__(H2OConfig(**json.loads(meta)))
        if arrays[0] is None:
            return
        keys, values = (tuple(x) if isinstance(x, (list, tuple)) else x for x in arrays[:2])
        self._core = H2OState(keys, values, *arrays[2:6])
        self._seen, self._lengths = self._core.seen.tolist(), self._core.length.tolist()
        staged_k, staged_v, staged_w, self._staged_from = arrays[6:10]
        if staged_k is not None:
            j = staged_k.shape[2]
            self._staged = [(staged_k[:, :, i : i + 1], staged_v[:, :, i : i + 1]) for i in range(j)]
            self._staged_w = [] if staged_w is None else [staged_w[:, :, i : i + 1] for i in range(j)]

    @classmethod
    def merge(cls, caches: Sequence["H2OKVCache"]) -> "BatchH2OKVCache":
        """One batch cache from per-prompt caches (mlx-lm's batch generator): rows are
        stacked as they are, no padding (each row keeps its own length)."""
        strangers = sorted({type(c).__name__ for c in caches if not isinstance(c, H2OKVCache)})
        if strangers:
            raise ValueError(
                f"cannot batch H2O caches with {strangers}: build every prompt cache with "
                "make_h2o_cache(model, ...), or call use_h2o(model, ...) so that mlx-lm builds them"
            )
        configs = {c.config for c in caches}
        if len(configs) != 1:
            raise ValueError(f"cannot merge H2O caches of different configs: {sorted(map(str, configs))}")
        for c in caches:
            c._settle_all("merge")
        batch = BatchH2OKVCache(caches[0].config, caches[0].argmin)
        held = [c for c in caches if c._core is not None]
        if held:
            like = held[0]._core
            H, C = like.positions.shape[1:]
            Dk, Dv = storage.width(like.keys, batch.config.kv_bits), storage.width(like.values, batch.config.kv_bits)
            dtype = storage.dtype_of(like.keys)
            states = [c._core if c._core is not None else core.init(batch.config, 1, H, Dk, dtype, Dv)
                      for c in caches]
            batch._core = _stack(states)
            batch._seen = [s for c in caches for s in (c._seen or [0])]
            batch._lengths = [k for c in caches for k in (c._lengths or [0])]
        else:
            batch._rows_waiting = len(caches)
        return batch

    # ------------------------------------------------------------ what H2O adds

    def _start(self, keys: mx.array, values: mx.array) -> None:
        """The empty state on the first tokens `[B, H, N, D]` (their dtype and widths)."""
        if self._core is None:
            B, H, _, D = keys.shape
            self._core = core.init(self.config, B, H, D, dtype=keys.dtype, value_dim=values.shape[3])
            self._seen, self._lengths = [0] * B, [0] * B

    def kept_rows(self) -> tuple:
        """`(keys, values)` `[B, H, K, D]` of the kept tokens, dense (dequantized with
        kv_bits) and sorted by position (`compact` first); K = tokens_kept."""
        self.compact()
        K, cfg = self.tokens_kept, self.config
        return tuple(storage.dense(storage.head(s, K), cfg.kv_bits, cfg.kv_group_size)
                     for s in (self._core.keys, self._core.values))

    def compact(self) -> None:
        """Lay the kept rows out first, sorted by position (`view.compact`); nothing kept
        or scored changes. `cache_prompt` then reads the kept rows as one block."""
        self._settle_all("compact")
        if self._core is not None:
            self._core = view.compact(self._core)

    def absorb_scored(self, keys: mx.array, values: mx.array, scores: mx.array, rows: int) -> None:
        """A chunk `[B, H, N, D]` scored by a prompt-scoring pass (`cache_prompt`), evicted
        down to budget at once: `scores` `[B, H, rows + N]` over this cache's first `rows`
        slots then the chunk (`retention.chunk_scores`, `core.absorb_scored`)."""
        self._settle_all("absorb a scored chunk")
        self._check(keys, values)
        N = keys.shape[2]
        self._start(keys, values)
        scores = retention.chunk_scores(self._core, scores, rows)
        self._core = core.absorb_scored(self._core, keys, values, scores, self.config)
        self._seen = [s + N for s in self._seen]
        self._lengths = [min(k + N, self.config.budget) for k in self._lengths]
        self._view = None

    @property
    def tokens_kept(self) -> int:
        return max(self._lengths, default=0)

    @property
    def tokens_seen(self) -> int:
        return max(self._seen, default=0)

    @property
    def compression_ratio(self) -> float:
        """Tokens seen per token kept (1.0 until the first eviction)."""
        return self.tokens_seen / self.tokens_kept if self.tokens_kept else 1.0

    @property
    def core_state(self) -> Optional[H2OState]:
        """The pure state, for inspection (`h2o_fn.kept_positions(cache.core_state)`)."""
        self._require_settled("inspect")
        return self._core

    # ------------------------------------------------------------ helpers

    def _real_tokens(self, N: int) -> Optional[List[int]]:
        """Real tokens per row in this chunk (None: all N), counted as taken."""
        return self._peek_real(N)

    def _peek_real(self, N: int) -> Optional[List[int]]:
        """Real tokens per row the next chunk of N would have. A single cache pads nothing."""
        del N
        return None

    def next_step(self, B: int, H: int, N: int) -> Step:
        """What the next update of N tokens will start from (for a follower that takes its
        tokens before this cache does): the settled layout, counts and view rows."""
        self._require_settled("lead")
        if self._core is None:
            positions = mx.full((B, H, self.config.capacity), -1, dtype=mx.int32)
            seen, lengths = [0] * B, [0] * B
        else:
            positions, seen, lengths = self._core.positions, list(self._seen), self._lengths
        counts = self._peek_real(N) or [N] * len(seen)
        return Step(positions, seen, counts, view.rows_for(lengths, self.config.capacity))

    def _settle_all(self, what: str) -> None:
        """No weights pending, and staged decode tokens scored (evict_every > 1)."""
        self._require_settled(what)
        self._flush()

    def _require_settled(self, what: str) -> None:
        if self._pending is not None:
            raise RuntimeError(
                f"cannot {what} {type(self).__name__}: the attention weights of its last "
                f"{1 if self._pending.keys is None else self._pending.keys.shape[2]} token(s) never "
                "arrived (query scoring needs the attention hook; see make_h2o_cache)"
            )

    def _check(self, keys: mx.array, values: mx.array) -> None:
        if keys.ndim != 4 or values.ndim != 4:
            raise ValueError(
                f"keys/values of shapes {tuple(keys.shape)}/{tuple(values.shape)} are invalid: "
                "expected [B, H, N, D]"
            )
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"keys {tuple(keys.shape)} and values {tuple(values.shape)} disagree: expected "
                "the same [B, H, N] (head_dim may differ)"
            )
        if keys.shape[2] == 0:
            raise ValueError("empty chunk: expected N >= 1 new tokens")
        if keys.dtype != values.dtype:
            raise ValueError(f"keys dtype {keys.dtype} != values dtype {values.dtype}")
        if self._core is not None:
            B, H = self._core.positions.shape[:2]
            Dk, Dv = (storage.width(x, self.config.kv_bits) for x in (self._core.keys, self._core.values))
            if (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3]) != (B, H, Dk, Dv):
                raise ValueError(
                    f"keys/values shapes {tuple(keys.shape)}/{tuple(values.shape)} are invalid: this "
                    f"cache holds [B={B}, H={H}, *, Dk={Dk}] / [.., Dv={Dv}] (fixed after the first call)"
                )
            dtype = storage.dtype_of(self._core.keys)
            if keys.dtype != dtype:
                raise ValueError(f"keys dtype {keys.dtype} is invalid: this cache holds {dtype}")


class BatchH2OKVCache(H2OKVCache):
    """H2O for mlx-lm's batch generator: rows of their own lengths and positions.

    `offset` is `[B]` (each row's next position, for RoPE); chunks may end in right
    padding announced by `prepare(lengths=..., right_padding=...)`: those tokens are
    never kept, scored or attended by real tokens. Left padding is refused (mlx-lm
    0.32's generator never asks for it; `merge` needs none).
    """

    def __init__(self, config: Optional[H2OConfig] = None, argmin=protected_argmin):
        super().__init__(config, argmin)
        self._to_come: Optional[List[int]] = None  # real prompt tokens still to come per row
        self._rows_waiting = 0  # rows of a merged batch whose caches were all empty

    @property
    def offset(self) -> mx.array:
        return mx.array(self._seen or [0] * self._rows_waiting, dtype=mx.int32)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self._rows_waiting and keys.shape[0] != self._rows_waiting:
            raise ValueError(f"keys shape {tuple(keys.shape)} is invalid: this batch has "
                             f"{self._rows_waiting} rows")
        self._rows_waiting = 0
        return super().update_and_fetch(keys, values)

    def _real_tokens(self, N: int) -> Optional[List[int]]:
        real = self._peek_real(N)
        if self._to_come is not None:
            self._to_come = [r - N for r in self._to_come]
        return real

    def _peek_real(self, N: int) -> Optional[List[int]]:
        if self._to_come is None:
            return None
        real = [max(0, min(N, r)) for r in self._to_come]
        return None if real == [N] * len(real) else real

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        """mlx-lm's batch generator announces a prompt chunk: `lengths` real tokens per
        row, then `right_padding` pad tokens (never kept, scored or attended)."""
        if left_padding is not None and any(int(p) for p in left_padding):
            raise ValueError(
                f"{type(self).__name__} got left_padding={list(left_padding)}: expected none "
                "(rows keep their own lengths; pad on the right with prepare(lengths=...))"
            )
        if right_padding is not None and max(right_padding) > 0:
            if lengths is None:
                raise ValueError("prepare(right_padding=...) needs lengths= (real tokens per row)")
            self._to_come = [int(n) for n in lengths]

    def finalize(self):
        """The padded prompt is done: later tokens are all real."""
        self._to_come = None

    def filter(self, batch_indices):
        """Keep only the rows `batch_indices` (in that order); staged decode tokens stay staged."""
        self._require_settled("filter")
        idx = [int(i) for i in batch_indices]
        if self._core is not None:
            self._take_rows(self, idx)
        else:
            self._rows_waiting = len(idx)
        self._view = None

    def _take_rows(self, out: H2OKVCache, idx: List[int]) -> H2OKVCache:
        """Rows `idx` of this batch (state, staged tokens and their weights) into `out`."""
        rows = mx.array(idx)
        c = self._core
        out._core = H2OState(storage.select(c.keys, rows), storage.select(c.values, rows),
                             *(x[rows] for x in c[2:]))
        out._staged = [(k[rows], v[rows]) for k, v in self._staged]
        out._staged_w = [w[rows] for w in self._staged_w]
        out._staged_from = None if self._staged_from is None else self._staged_from[rows]
        out._seen = [self._seen[i] for i in idx]
        out._lengths = [self._lengths[i] for i in idx]
        return out

    def extend(self, other: "BatchH2OKVCache"):
        """Append the rows of `other` (same config)."""
        if other.config != self.config:
            raise ValueError(f"cannot extend a batch of {self.config} with one of {other.config}")
        self._settle_all("extend")
        other._settle_all("extend")
        merged = H2OKVCache.merge([*self._rows_as_caches(), *other._rows_as_caches()])
        self._core, self._seen, self._lengths = merged._core, merged._seen, merged._lengths
        self._rows_waiting = merged._rows_waiting
        self._view = None

    def extract(self, idx: int) -> H2OKVCache:
        """Row `idx` as a single-prompt cache (its staged decode tokens stay staged)."""
        self._require_settled("extract")
        out = H2OKVCache(self.config, self.argmin)
        return out if self._core is None else self._take_rows(out, [idx])

    def _rows_as_caches(self) -> List[H2OKVCache]:
        n = len(self._seen) if self._core is not None else self._rows_waiting
        return [self.extract(i) for i in range(n)]

def _stack(states: List[H2OState]) -> H2OState:
    """States of one row each, as one batch (every field joined along B)."""
    return H2OState(
        storage.stack([s.keys for s in states]),
        storage.stack([s.values for s in states]),
        *(mx.concatenate([getattr(s, f) for s in states], axis=0) for f in H2OState._fields[2:]),
    )


# mlx-lm's load_prompt_cache (and CacheList) look classes up by name in its cache module
mlx_cache.H2OKVCache = H2OKVCache
mlx_cache.BatchH2OKVCache = BatchH2OKVCache
