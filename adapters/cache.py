"""H2OKVCache and BatchH2OKVCache: the H2O core behind mlx-lm's cache protocol.

One cache per attention layer. mlx-lm rotates queries and keys with
`cache.offset` (absolute tokens seen), so kept keys keep the rotation of their
own position and every query-key distance stays exact. Shapes: B batch rows,
H KV heads, C = budget + evict_every slots, D head_dim, N new tokens.

The cache is a shell: it holds a `CacheState` (h2o_fn.adapters.cache_state) and a
`Policy` (the config and its eviction op) and moves the state with the pure
transitions of `cache_state`, which call the core. `update_and_fetch(keys, values)`
returns the attention view (`h2o_fn.view`: the kept rows plus the N new tokens);
the stored state is evicted down to budget inside `update_and_fetch` for key
scoring, and when the attention hook hands over the weights for query scoring.
Counts are mirrored as Python ints, so decoding never forces an evaluation.

`BatchH2OKVCache` is the same cache for mlx-lm's batch generator (`merge`,
`prepare`, `finalize`, `filter`, `extend`, `extract`): batch rows of different
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

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import _BaseCache

from h2o_fn import H2OConfig, H2OState, Policy, Prompt, Storage, budgets, state_nbytes, view
from h2o_fn.metal_ops import cpu_step, protected_argmin

from . import cache_state, staging
from .cache_state import CacheState, Pending, Step

__all__ = ["DEFAULT_CONFIG", "DEFAULT_PROMPT", "BatchH2OKVCache", "H2OKVCache", "HookProtocol", "Pending", "Step", "cache_policy",
           "config_for", "prompt_for", "recommended"]

# The recommended policy, chosen from BENCHMARKS.md (quality first, then speed; its
# "Streaming perplexity", "Sweep" and pass-key tables hold the figures): true-query scoring
# with oneshot prefill, and a prompt longer than 48 tokens compressed by its last 48
# queries with spans of 15 kept together (chunks of 16, as in streaming, are not
# compressed that way). The one source of every default: `make_h2o_cache`, `use_h2o`,
# `H2OKVCache`, the commands' flags and serve all read them (through `recommended`).
DEFAULT_CONFIG = H2OConfig(scoring="query", prefill="oneshot")
DEFAULT_PROMPT = Prompt(window=48, pool=15)


def recommended(budget: int = DEFAULT_CONFIG.budget) -> H2OConfig:
    """The recommended policy at `budget`: `DEFAULT_CONFIG.at_budget(budget)` (n_sink and
    grace shrink below 64 so that the budget holds them). `h2o-fn generate --budget N` runs it.

    Example:
        >>> recommended(256) == DEFAULT_CONFIG._replace(budget=256)
        True
        >>> recommended(32)
        H2OConfig(budget=32, n_sink=4, grace=8, decay=0.98, scoring='query', prefill='oneshot')
    """
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"budget={budget!r} is invalid: expected an int (tokens kept per layer and KV head)")
    return DEFAULT_CONFIG.at_budget(budget)


def config_for(config: Optional[H2OConfig] = None, budget: Optional[int] = None) -> H2OConfig:
    """The rule a cache takes: `config` exactly as given (every field, `scoring` included), or
    the recommended policy at `budget` (`recommended`; no budget: `DEFAULT_CONFIG`).

    Passing both is an error: a config already holds its budget (`config.at_budget(n)`
    rescales one). A config is a complete value, so a field left at `H2OConfig`'s own
    default (`scoring="key"`: the core alone has no queries) is used as given.
    """
    if config is None:
        return DEFAULT_CONFIG if budget is None else recommended(budget)
    if not isinstance(config, H2OConfig):
        hint = f"; for the recommended policy at a budget pass budget={config!r}" if isinstance(config, int) else ""
        raise TypeError(f"config={config!r} is a {type(config).__name__}: expected an h2o_fn.H2OConfig or None{hint}")
    if budget is not None:
        raise ValueError(f"got config={config} and budget={budget!r}: expected one of them (budget=N is the "
                         "recommended policy at N; a config holds its own budget: config.at_budget(N))")
    return config


def prompt_for(config: Optional[H2OConfig] = None, prompt: Optional[Prompt] = None) -> Prompt:
    """The prompt scoring a cache takes: `prompt`, else `DEFAULT_PROMPT`, whatever the config
    (the prompt scoring is a policy beside the rule: a config of your own keeps it).
    `config` is unused; it stays for the callers that pass it."""
    del config
    if prompt is None:
        return DEFAULT_PROMPT
    if not isinstance(prompt, Prompt):
        raise TypeError(f"prompt is a {type(prompt).__name__}: expected an h2o_fn.Prompt")
    return prompt


def cache_policy(config: Optional[H2OConfig] = None, argmin=protected_argmin, prompt: Optional[Prompt] = None,
                 kv_bits: Optional[int] = None, kv_group_size: int = 64, *, budget: Optional[int] = None) -> Policy:
    """The `Policy` a cache built with these arguments holds: `config_for(config, budget)`,
    `prompt_for(prompt)` (default `DEFAULT_PROMPT`) and `Storage(kv_bits, kv_group_size)`."""
    return Policy(config_for(config, budget), argmin, prompt_for(config, prompt), Storage(kv_bits, kv_group_size))


class HookProtocol(_BaseCache):
    """What the attention hook (h2o_fn.adapters.attention) asks of an H2O cache, answered
    from its `CacheState` (`self._s`) and `Policy` (`self.policy`): the weights it awaits
    (query scoring) or the key proxy it offers (key scoring), and the mask its layer needs."""

    wants_weights = property(lambda self: self._s.pending is not None and self._s.pending.key is None,
                             doc="True while the attention weights of the last tokens are awaited.")
    kv_heads = property(lambda self: cache_state.kv_heads(self._s))
    native_ops = property(lambda self: cpu_step.native(self.policy),
                          doc="True when its decode tokens run as C++ ops (h2o_fn.metal_ops.cpu_step): so may attention.")

    def can_take(self, keys) -> bool:
        """Whether attention over `keys` gives weights this cache can use (`cache_state.can_take`)."""
        return cache_state.can_take(self._s, keys)

    def scored_queries(self, N: int) -> int:
        """How many of the last tokens' N queries the awaited weights must cover."""
        return cache_state.scored_queries(self._s, self.policy, N)

    def receive_weights(self, weights: mx.array) -> None:
        """Attention weights `[B, H, M, L]` (GQA-reduced) over the rows last returned, of the
        last M = `scored_queries(N)` queries."""
        self._s = cache_state.receive(self._s, self.policy, weights)

    def proxy_queries(self) -> Optional[mx.array]:
        """The key proxy's query row `[B, H, 1, D]` while a key-scored decode token waits, else
        None (`cache_state.proxy_queries`): attention may compute its logits beside its own."""
        return cache_state.proxy_queries(self._s, self.policy)

    def receive_proxy(self, logits: mx.array) -> None:
        """The proxy row's logits `[B, H, 1, span]` over the rows last returned: the waiting token settled."""
        self._s = cache_state.receive_proxy(self._s, self.policy, logits)

    def attention_mask(self, N: int, mask):
        """The mask this layer needs: mlx-lm builds one per forward pass from layer 0's
        cache; a layer that keeps a different number of rows (per-layer budgets) gets its own,
        and a layer whose heads hold reserved slots (budgets across heads) one per KV head,
        `[B, H, 1, N, L]` (the hook hands it to mlx-lm's attention as `[B, Hq, N, L]`)."""
        if self._s.head_mask is not None:
            self._masked = True
            return self._s.head_mask
        if isinstance(mask, mx.array) and (mask.ndim == 5 or mask.shape[-1] != self._s.span + N - 1):
            return self.make_mask(N, return_array=True)
        return mask


class PromptAbsorption:
    """What `cache_prompt` (h2o_fn.adapters.retention) asks of an H2O cache: its kept rows
    as one block, and a scored chunk absorbed per head (`absorb_scored`) or by one selection
    across layers and heads (`select_inputs`, then `absorb_selected`)."""

    def kept_rows(self) -> tuple:
        """`(keys, values)` `[B, H, K, D]` of the kept tokens, dense and sorted by position
        (`compact` first, which moves rows); K = tokens_kept."""
        self.compact()
        return cache_state.kept_rows(self._s, self.policy.kv)

    def compact(self) -> None:
        """Lay the kept rows out first, sorted by position (`view.compact`); nothing kept
        or scored changes. `cache_prompt` then reads the kept rows as one block."""
        s = self.settled("compact")
        if s.core is not None:
            self._s = s._replace(core=view.compact(s.core))

    def absorb_scored(self, keys: mx.array, values: mx.array, scores: mx.array, span: int) -> None:
        """A chunk `[B, H, N, D]` evicted by a prompt-scoring pass's `scores` `[B, H, span + N]`
        (`cache_prompt`; `cache_state.absorb_scored`)."""
        self._s = cache_state.absorb_scored(self.settled("absorb a scored chunk"), self.policy, keys, values,
                                            scores, span)
        self._view = None

    def select_inputs(self, keys: mx.array, values: mx.array, scores: mx.array, span: int):
        """This layer's part of a selection across layers (`cache_prompt`): `(scores, positions)`
        `[B, H, C + N]` of its kept tokens then the chunk `[B, H, N, D]`, from a scoring pass's
        `scores` `[B, H, span + N]` (`cache_state.selection_inputs`)."""
        self._s, scores, positions = cache_state.selection_inputs(self.settled("select"), self.policy, keys,
                                                                  values, scores, span)
        return scores, positions

    def absorb_selected(self, keys: mx.array, values: mx.array, scores: mx.array, keep: mx.array, held: int,
                        budget: int) -> None:
        """The chunk and the kept tokens reduced to `keep` (`select_inputs`' columns, chosen by
        `h2o_fn.budgets.select` over every layer): every head occupies `held` slots (its tokens,
        then reserved ones), and the layer's budget becomes `budget` (> held): each head takes
        budget - held new tokens before the rule evicts within its own share again."""
        target = self._s.target or self.config.budget
        self.policy = self.policy._replace(config=self.config._replace(budget=budget))
        self._s = cache_state.absorb_selected(self._s, self.policy, keys, values, scores, keep, held)
        self._s = self._s._replace(target=target)
        self._view = None

    target_budget = property(lambda self: self._s.target or self.config.budget,
                             doc="Tokens per head a selection across layers spreads (`cache_prompt`): the "
                                 "budget the cache was built with, also after a selection reshaped it.")

    @property
    def tokens_per_head(self) -> List[List[int]]:
        """Tokens kept per batch row and KV head, `[B][H]` (reads the state: not for a decode loop)."""
        return [] if self._s.core is None else budgets.tokens(self._read().core).tolist()


class H2OKVCache(HookProtocol, PromptAbsorption):
    """A fixed-budget KV cache that evicts the lowest-scoring unprotected token.

    Args:
      config: the eviction rule, used as given (default: `recommended(budget)`; true-query
        scoring needs the attention hook: `make_h2o_cache` installs it).
      argmin: the eviction op (`h2o_fn.metal_ops.protected_argmin`: the fused kernel on a GPU).
      state: what the cache starts from (default: empty).
      evict_every: decode tokens judged at a time, k (`staging`: budget + k slots; default 1).
      prompt: how a prompt chunk is scored (`h2o_fn.Prompt`; default `prompt_for(config)`).
      kv_bits, kv_group_size: store the kept rows quantized, as mlx-lm's `QuantizedKVCache`
        (`h2o_fn.Storage`; default None: the model's dtype).
      budget: instead of `config`, the recommended policy at this budget (`recommended`).
      keeps_view: hold the last update's view for `keys_and_values()` (layers sharing KV;
        `make_h2o_cache` passes `shares_kv(model)`). After a chunk it copies every row.

    Reading the cache (`state`, `layer_state`, `core_state`, `is_trimmable()`) never changes
    it: a key-scored token waiting for attention's logits is settled on a copy (`_read`).
    """

    step = 256  # mlx-lm's KVCache growth step; H2O allocates its C slots once

    def __init__(self, config: Optional[H2OConfig] = None, argmin=protected_argmin,
                 state: Optional[CacheState] = None, evict_every: Optional[int] = None,
                 prompt: Optional[Prompt] = None, kv_bits: Optional[int] = None, kv_group_size: int = 64, *,
                 budget: Optional[int] = None, keeps_view: bool = True):
        self.policy = cache_policy(config, argmin, prompt, kv_bits, kv_group_size, budget=budget)
        self._s = _starting(state, evict_every)
        self.keeps_view = keeps_view
        self._view = None  # what the last update returned (for layers that share this KV)
        self._masked = True  # the last view's per-head mask was taken (heads with reserved slots)

    config = property(lambda self: self.policy.config)
    argmin = property(lambda self: self.policy.argmin)
    evict_every = property(lambda self: self._s.every, doc="Decode tokens judged at a time.")

    # ------------------------------------------------------------ mlx-lm protocol

    @property
    def offset(self) -> int:
        """Tokens seen: the absolute position of the next token."""
        return self._s.seen[0] if self._s.seen else 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store `[B, H, N, D]`; return the view `[B, H, span + N - 1, D]` (`cache_state.update`)."""
        if not self._masked:
            raise RuntimeError(
                "this H2O cache's heads hold budgets of their own (reserved slots, after cache_prompt's "
                "selection), so its attention needs a mask per KV head, which only the attention hook "
                "applies: the last forward pass ran without it. Install it with "
                "h2o_fn.adapters.attention.install_query_hook(model) (make_h2o_cache does)")
        self._s, out = cache_state.update(self._s, self.policy, keys, values)
        self._view = out if self.keeps_view else None
        self._masked = self._s.head_mask is None
        return out

    def keys_and_values(self):
        """The rows the last update returned: what a layer sharing this KV attends to."""
        if self._view is None:
            raise RuntimeError(f"{type(self).__name__} holds no view to share: " + (
                "no tokens yet" if self.keeps_view else "built with keeps_view=False (make_h2o_cache(model) "
                "keeps views for models whose layers share KV caches)"))
        return self._view

    keys = property(lambda self: cache_state.store(self._s, "keys"),
                    lambda self, x: setattr(self, "_s", cache_state.with_store(self._s, "keys", x)),
                    doc="The stored key rows (all C slots; a store), for models that read a cache's "
                        "arrays directly (DeepSeek sparse attention ties its caches with mx.depends).")
    values = property(lambda self: cache_state.store(self._s, "values"),
                      lambda self, x: setattr(self, "_s", cache_state.with_store(self._s, "values", x)),
                      doc="The stored value rows (all C slots; a store).")

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """None for one token of equal batch rows; causal over kept + N rows for a chunk."""
        if window_size is not None:
            raise ValueError(
                f"{type(self).__name__} got window_size={window_size}: sliding-window layers must "
                "keep their own bounded cache (make_h2o_cache leaves them alone)"
            )
        return cache_state.mask(self._s, self.config, N, return_array)

    def size(self) -> int:
        return self.tokens_kept

    def empty(self) -> bool:
        return self._s.core is None

    @property
    def nbytes(self) -> int:
        """Bytes really stored in all C slots: rows (packed when quantized), scores, positions, counts."""
        return 0 if self._s.core is None else state_nbytes(self._s.core)

    @property
    def bits(self) -> int:
        """Only with quantized rows (else AttributeError): mlx-lm then takes its quantized attention."""
        if self.policy.kv.bits is None:
            raise AttributeError(f"{type(self).__name__} stores unquantized rows (kv_bits=None)")
        return self.policy.kv.bits

    group_size = property(lambda self: self.bits and self.policy.kv.group_size)

    def is_trimmable(self) -> bool:
        """Whether nothing was evicted (staged tokens count as held); False, not an error,
        while attention weights are pending."""
        s = self._read()
        return s.pending is None and s.lengths == s.seen

    def trim(self, n: int) -> int:
        """Forget the n newest tokens while nothing was evicted (else 0); raises while weights are pending."""
        if not self.is_trimmable():
            self.ready("trim")  # raises while weights are pending
            return 0
        self.flush()  # nothing was evicted, so scoring the staged tokens evicts nothing either
        self._s, n = cache_state.trim(self._s, n)
        self._view = None
        return n

    meta_state = property(lambda self: cache_state.meta(self._s, self.policy),
                          doc="The policy's fields and evict_every as JSON: what `state` cannot hold as arrays.")

    @property
    def state(self):
        """`cache_state.to_arrays` then `meta_state` (mlx-lm 0.32 saves only `state`, so the
        config travels as its last element). mlx-lm evaluates `c.state` between prompt
        chunks: reading it changes nothing (`_read`). Raises while attention weights are pending."""
        return (*cache_state.to_arrays(self._read("save")), self.meta_state)

    @state.setter
    def state(self, v):
        *arrays, meta = v
        config, prompt, kv, state = cache_state.from_meta(arrays, meta)
        self.__init__(config, state=state, prompt=prompt, kv_bits=kv.bits, kv_group_size=kv.group_size,
                      keeps_view=getattr(self, "keeps_view", True))

    @classmethod
    def merge(cls, caches: Sequence["H2OKVCache"]) -> "BatchH2OKVCache":
        """One batch cache from per-prompt caches (mlx-lm's batch generator): their batch
        rows are stacked as they are, no padding (each keeps its own length)."""
        policy = _one_policy(caches)
        state = cache_state.stack([c.settled("merge") for c in caches], policy, [c.config.budget for c in caches])
        return cache_of(BatchH2OKVCache, policy, state, any(c.keeps_view for c in caches))

    # ------------------------------------------------------------ what H2O adds

    def flush(self) -> None:
        """Score and evict the staged decode tokens now (`evict_every` > 1)."""
        self._s = cache_state.flush(self.ready("flush"), self.policy)

    def ready(self, what: str) -> CacheState:
        """`_read(what)`, kept: for the methods that change the cache."""
        self._s = self._read(what)
        return self._s

    def _read(self, what: Optional[str] = None) -> CacheState:
        """The state as the next update sees it, a waiting key-scored token settled on a copy
        (`cache_state.settle_proxy`); with `what`, raises naming it while weights are pending."""
        s = cache_state.settle_proxy(self._s, self.policy)
        if what is not None:
            cache_state.require_settled(s, what)
        return s

    def settled(self, what: str) -> CacheState:
        """`ready`, and the staged tokens scored."""
        self.ready(what)
        self.flush()
        return self._s

    @property
    def tokens_kept(self) -> int:
        """Tokens kept: the longest row (with budgets across heads, the head holding the most)."""
        if not self._s.reserved or self._s.core is None:
            return max(self._s.lengths, default=0)
        return int(mx.max(budgets.tokens(self._read().core)).item())

    tokens_seen = property(lambda self: max(self._s.seen, default=0), doc="Tokens seen (the longest row).")

    compression_ratio = property(lambda self: self.tokens_seen / self.tokens_kept if self.tokens_kept else 1.0,
                                 doc="Tokens seen per token kept (1.0 until the first eviction).")

    @property
    def core_state(self) -> Optional[H2OState]:
        """The pure state (`h2o_fn.kept_positions(cache.core_state)`); raises while weights are pending."""
        return self._read("inspect").core

    # ------------------------------------------------------------ caches in lockstep

    def follow(self, followed: bool = True) -> None:
        """Record, at each update, what it started from (`layer_state.last`): for caches that
        lay their rows out as this one does (h2o_fn.adapters.lockstep)."""
        self._s = self._s._replace(followed=followed)

    @property
    def layer_state(self) -> CacheState:
        """The whole state (immutable; `core_state` is its core), as `_read` gives it."""
        return self._read()

    def settle(self) -> CacheState:
        """`ready` without the check: the layout this cache keeps, for `lockstep` followers."""
        self._s = self._read()
        return self._s


def _one_policy(caches: Sequence[H2OKVCache]) -> Policy:
    """The policy every cache of a batch shares (raises naming the caches that do not fit)."""
    strangers = sorted({type(c).__name__ for c in caches if not isinstance(c, H2OKVCache)})
    if strangers:
        raise ValueError(
            f"cannot batch H2O caches with {strangers}: build every prompt cache with "
            "make_h2o_cache(model, ...), or call use_h2o(model, ...) so that mlx-lm builds them"
        )
    configs = {(c.config._replace(budget=1 + c.config.n_sink + c.config.grace), c.policy.prompt, c.policy.kv,
                c.evict_every) for c in caches}
    if len(configs) != 1:
        given = {(c.config, c.policy.prompt, c.policy.kv, c.evict_every) for c in caches}
        raise ValueError(f"cannot merge H2O caches of different configs (config, prompt, storage, evict_every): "
                         f"{sorted(map(str, given))} (only their budgets may differ)")
    widest = max(caches, key=lambda c: c.config.budget)  # budgets differ only after selections: widen
    return widest.policy


def cache_of(cls, policy: Policy, state: CacheState, keeps_view: bool = True) -> H2OKVCache:
    """A cache of `cls` holding `state` under `policy` (the same arrays: nothing is copied)."""
    return cls(policy.config, policy.argmin, state=state, prompt=policy.prompt, kv_bits=policy.kv.bits,
               kv_group_size=policy.kv.group_size, keeps_view=keeps_view)


def _starting(state: Optional[CacheState], evict_every: Optional[int]) -> CacheState:
    """The state a cache starts from: `state`, or an empty one judging `evict_every` at a time."""
    if evict_every is not None:
        staging.check_every(evict_every)
    if state is None:
        return CacheState(every=evict_every or 1)
    if evict_every is not None and evict_every != state.every:
        raise ValueError(f"evict_every={evict_every} disagrees with the state's {state.every}")
    return state


class BatchH2OKVCache(H2OKVCache):
    """H2O for mlx-lm's batch generator: batch rows of their own lengths and positions.

    `offset` is `[B]` (each row's next position, for RoPE); chunks may end in right
    padding announced by `prepare(lengths=..., right_padding=...)`: those tokens are
    never kept, scored or attended by real tokens. Left padding is refused (mlx-lm
    0.32's generator never asks for it; `merge` needs none).
    """

    @property
    def offset(self) -> mx.array:
        return mx.array(self._s.seen or [0] * self._s.waiting, dtype=mx.int32)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        """mlx-lm's batch generator announces a prompt chunk: `lengths` real tokens per
        row, then `right_padding` pad tokens (never kept, scored or attended)."""
        if left_padding is not None and any(int(p) for p in left_padding):
            raise ValueError(
                f"{type(self).__name__} got left_padding={list(left_padding)}: expected none "
                "(batch rows keep their own lengths; pad on the right with prepare(lengths=...))"
            )
        if right_padding is not None and max(right_padding) > 0:
            if lengths is None:
                raise ValueError("prepare(right_padding=...) needs lengths= (real tokens per row)")
            self._s = self._s._replace(to_come=tuple(int(n) for n in lengths))

    def finalize(self):
        """The padded prompt is done: later tokens are all real."""
        self._s = self._s._replace(to_come=None)

    def filter(self, batch_indices):
        """Keep only the batch rows `batch_indices` (in that order); staged decode tokens stay staged."""
        self._s = cache_state.take_batch(self.ready("filter"), [int(i) for i in batch_indices])
        self._view = None

    def extend(self, other: "BatchH2OKVCache"):
        """Append the batch rows of `other` (same policy)."""
        rows = [r for c in (self, other) for r in c.unbatched()]
        self.policy = _one_policy(rows)  # raises unless only their budgets differ
        states = [r.settled("extend") for r in rows]
        self._s = cache_state.stack(states, self.policy, [r.config.budget for r in rows])._replace(
            followed=self._s.followed)
        self._view = None

    def extract(self, idx: int) -> H2OKVCache:
        """Batch row `idx` as a single-prompt cache (its staged decode tokens stay staged)."""
        row = cache_state.take_batch(self.ready("extract"), [idx])
        state = CacheState(every=self.evict_every) if self._s.core is None else row._replace(to_come=None)
        return cache_of(H2OKVCache, self.policy, state, self.keeps_view)

    def unbatched(self) -> List[H2OKVCache]:
        """Every batch row as a single-prompt cache."""
        n = len(self._s.seen) if self._s.core is not None else self._s.waiting
        return [self.extract(i) for i in range(n)]


# mlx-lm's load_prompt_cache (and CacheList) look classes up by name in its cache module
mlx_cache.H2OKVCache = H2OKVCache
mlx_cache.BatchH2OKVCache = BatchH2OKVCache
