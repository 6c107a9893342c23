"""H2OKVCache: the H2O core behind mlx-lm's cache protocol.

One cache per attention layer. mlx-lm rotates queries and keys with
`cache.offset` (absolute tokens seen), so kept keys keep the rotation of their
own position and every query-key distance stays exact. Shapes: B batch rows,
H KV heads, C = budget + 1 slots, D head_dim, N new tokens, L = rows returned.

`update_and_fetch(keys, values)` returns S_{t-1} + the N new tokens for this
step's attention (L = kept + N rows: the kept rows in slot order, then the
chunk); the stored state is evicted down to budget: inside `update_and_fetch`
for key scoring, and when the attention hook hands over the weights for query
scoring. Counts are mirrored as Python ints, so decoding never forces an eval.

Example:
    >>> from mlx_lm import generate
    >>> from h2o_fn import H2OConfig
    >>> from h2o_fn.adapters.gguf import load_gguf
    >>> from h2o_fn.adapters.mlx_lm import make_h2o_cache
    >>> model, tokenizer = load_gguf()
    >>> cache = make_h2o_cache(model, H2OConfig(budget=128))
    >>> text = generate(model, tokenizer, "Hello", max_tokens=20, prompt_cache=cache)
"""

from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, _BaseCache

from h2o_fn import H2OConfig, H2OState, core
from h2o_fn.metal_ops import protected_argmin


class H2OKVCache(_BaseCache):
    """A fixed-budget KV cache that evicts the lowest-scoring unprotected token.

    Args:
      config: the eviction policy. `scoring="query"` needs the attention hook
        (`make_h2o_cache` installs it).
      argmin: the eviction op: `h2o_fn.metal_ops.protected_argmin` by default (the
        fused kernel on an Apple or NVIDIA GPU, the core's pure MLX path elsewhere).
    """

    def __init__(self, config: Optional[H2OConfig] = None, argmin=protected_argmin):
        self._setup(config or H2OConfig(), None, 0, 0, argmin)

    def _setup(self, config, state, offset, kept, argmin=protected_argmin):
        self.config = config
        self._core = state  # H2OState, None until the first token
        self.offset = offset  # tokens seen (absolute position of the next token)
        self._kept = kept  # tokens stored (== core length), mirrored as an int
        self._argmin = argmin
        self._step = core.compiled_step(config, argmin)
        self._pending = None  # query scoring: what the weights of this forward pass complete

    # ------------------------------------------------------------ mlx-lm protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store `keys`/`values` `[B, H, N, D]`; return `[B, H, kept + N, D]` for attention."""
        if self._pending is not None:
            raise RuntimeError(
                "H2OKVCache(scoring='query') got new tokens before the attention weights of the "
                "previous ones: the attention hook is missing. Build the cache with "
                "make_h2o_cache(model, config), which installs it."
            )
        self._check(keys, values)
        N, kept = keys.shape[2], self._kept
        if self._core is None:
            B, H, _, D = keys.shape
            self._core = core.init(self.config, B, H, D, dtype=keys.dtype)
        state = self._core
        if self.config.scoring == "key":
            if N == 1:
                self._core = self._step(state, keys, values)
                view = (self._core.keys[:, :, : kept + 1], self._core.values[:, :, : kept + 1])
            else:
                view = self._view(state, keys, values)
                self._core = core.absorb(state, keys, values, self.config, argmin=self._argmin)
        elif N == 1:  # query decode: admit now, score and evict when the weights come
            admitted = core.admit(state, keys, values)
            self._pending = (admitted, None, None, kept)
            view = (admitted.keys[:, :, : kept + 1], admitted.values[:, :, : kept + 1])
        else:
            view = self._view(state, keys, values)
            self._pending = (state, keys, values, kept)
        self.offset += N
        self._kept = min(kept + N, self.config.budget)
        return view

    def receive_weights(self, weights: mx.array) -> None:
        """Attention weights `[B, H, N, kept + N]` (GQA-reduced) over the rows last returned."""
        if self._pending is None:
            raise RuntimeError("H2OKVCache got attention weights but has no tokens waiting for them")
        state, keys, values, kept = self._pending
        B, H = state.keys.shape[:2]
        N = 1 if keys is None else keys.shape[2]
        if tuple(weights.shape) != (B, H, N, kept + N):
            raise ValueError(
                f"weights shape {tuple(weights.shape)} is invalid: expected "
                f"[B={B}, H={H}, N={N}, kept + N={kept + N}]"
            )
        self._pending = None
        L, C = kept + N, self.config.capacity
        if keys is None:  # decode: the token sits in its slot; weights cover slots [0, kept + 1)
            over_slots = mx.pad(weights[:, :, 0], [(0, 0), (0, 0), (0, C - L)])
            state = core.accumulate(state, over_slots, self.config)
            self._core = core.evict(state, self.config, self._argmin)
        else:
            w = self._absorb_layout(state, weights, kept)
            self._core = core.absorb(state, keys, values, self.config, weights=w, argmin=self._argmin)

    @property
    def wants_weights(self) -> bool:
        """True while the attention weights of the last tokens are awaited."""
        return self._pending is not None

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """None for one token; causal over kept + N rows (offset kept) for a chunk."""
        if window_size is not None:
            raise ValueError(
                f"H2OKVCache got window_size={window_size}: sliding-window layers must keep "
                "their own bounded cache (make_h2o_cache leaves them alone)"
            )
        if N == 1:
            return None
        if return_array:
            return create_causal_mask(N, offset=self._kept)
        return "causal"

    def size(self) -> int:
        return self._kept

    def empty(self) -> bool:
        return self._core is None

    @property
    def nbytes(self) -> int:
        """Bytes held by the state: keys, values, scores and positions of all C slots."""
        if self._core is None:
            return 0
        return sum(x.nbytes for x in self._core)

    def is_trimmable(self) -> bool:
        """Trimming is exact only while nothing has been evicted."""
        return self._pending is None and self._kept == self.offset

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        n = min(n, self.offset)
        if n and self._core is not None:
            self._core = core.rewind(self._core, n)
        self.offset -= n
        self._kept -= n
        return n

    @property
    def state(self):
        """(keys, values, scores, positions, length, seen) + the config fields, for save/load.

        decay travels as its repr: mlx-lm stores numbers as float32 arrays.
        """
        arrays = (None,) * 6 if self._core is None else tuple(self._core)
        return arrays + tuple(repr(x) if isinstance(x, float) else x for x in self.config)

    @state.setter
    def state(self, v):
        arrays, (budget, n_sink, grace, decay, scoring, prefill) = v[:6], v[6:]
        config = H2OConfig(int(budget), int(n_sink), int(grace), float(decay), scoring, prefill)
        if arrays[0] is None:
            self._setup(config, None, 0, 0)
            return
        core_state = H2OState(*arrays)
        seen, length = int(core_state.seen.item()), int(core_state.length.item())
        self._setup(config, core_state, seen, length)

    @classmethod
    def merge(cls, caches):
        raise ValueError(
            "H2OKVCache does not support mlx-lm's batch generator (BatchKVCache with padded "
            "rows): use one prompt per generate call, or a batch of equal-length rows"
        )

    # ------------------------------------------------------------ what H2O adds

    @property
    def tokens_kept(self) -> int:
        return self._kept

    @property
    def tokens_seen(self) -> int:
        return self.offset

    @property
    def compression_ratio(self) -> float:
        """Tokens seen per token kept (1.0 until the first eviction)."""
        return self.offset / self._kept if self._kept else 1.0

    @property
    def core_state(self) -> Optional[H2OState]:
        """The pure state, for inspection (`h2o_fn.kept_positions(cache.core_state)`)."""
        return self._core

    # ------------------------------------------------------------ helpers

    def _check(self, keys: mx.array, values: mx.array) -> None:
        if keys.ndim != 4 or values.ndim != 4:
            raise ValueError(
                f"keys/values of shapes {tuple(keys.shape)}/{tuple(values.shape)} are invalid: "
                "expected [B, H, N, D]"
            )
        if keys.shape[:3] != values.shape[:3] or keys.shape[3] != values.shape[3]:
            raise ValueError(
                f"keys {tuple(keys.shape)} and values {tuple(values.shape)} disagree: expected "
                "the same [B, H, N, D] (h2o-fn stores keys and values in one slot layout)"
            )
        if keys.shape[2] == 0:
            raise ValueError("empty chunk: expected N >= 1 new tokens")
        if keys.dtype != values.dtype:
            raise ValueError(f"keys dtype {keys.dtype} != values dtype {values.dtype}")
        if self._core is not None:
            B, H, _, D = self._core.keys.shape
            if (keys.shape[0], keys.shape[1], keys.shape[3]) != (B, H, D):
                raise ValueError(
                    f"keys shape {tuple(keys.shape)} is invalid: this cache holds "
                    f"[B={B}, H={H}, *, D={D}] (batch, head count and head_dim are fixed)"
                )
            if keys.dtype != self._core.keys.dtype:
                raise ValueError(f"keys dtype {keys.dtype} is invalid: this cache holds "
                                 f"{self._core.keys.dtype}")

    def _free_slot(self, state: H2OState) -> mx.array:
        """`[B, H, 1, 1]` index of the free slot (the one the next token takes)."""
        return mx.argmax(state.positions < 0, axis=-1)[..., None, None]

    def _view(self, state: H2OState, keys: mx.array, values: mx.array):
        """S + chunk as `[B, H, kept + N, D]`: the kept rows, then the chunk.

        Below budget the kept rows are the prefix [0, kept). At budget one slot is
        free: the chunk's first token fills it, so no garbage row is attended.
        """
        kept = self._kept
        if kept < self.config.budget:
            return tuple(mx.concatenate([x[:, :, :kept], new.astype(x.dtype)], axis=2)
                         for x, new in ((state.keys, keys), (state.values, values)))
        slot = self._free_slot(state)
        return tuple(
            mx.concatenate([mx.put_along_axis(x, slot, new[:, :, :1].astype(x.dtype), axis=2),
                            new[:, :, 1:].astype(x.dtype)], axis=2)
            for x, new in ((state.keys, keys), (state.values, values))
        )

    def _absorb_layout(self, state: H2OState, weights: mx.array, kept: int) -> mx.array:
        """Weights over the `_view` rows -> the core's `[B, H, N, C + N]` layout."""
        B, H, N, _ = weights.shape
        C = self.config.capacity
        if kept < self.config.budget:
            pad = mx.zeros((B, H, N, C - kept), dtype=weights.dtype)
            return mx.concatenate([weights[..., :kept], pad, weights[..., kept:]], axis=-1)
        slot = mx.broadcast_to(self._free_slot(state), (B, H, N, 1))
        first = mx.take_along_axis(weights[..., :C], slot, axis=-1)  # chunk token 0 sat in the free slot
        return mx.concatenate([weights[..., :C], first, weights[..., C:]], axis=-1)


# mlx-lm's load_prompt_cache looks classes up by name in its cache module
mlx_cache.H2OKVCache = H2OKVCache

# What make_h2o_cache uses without a config, chosen from BENCHMARKS.md (quality first,
# then speed): true-query scoring and oneshot prefill gave the lowest streaming
# perplexity at every budget; oneshot is also the faster prefill.
DEFAULT_CONFIG = H2OConfig(scoring="query", prefill="oneshot")


def make_h2o_cache(
    model: nn.Module, config: Optional[H2OConfig] = None, argmin=protected_argmin
) -> List[Any]:
    """The per-layer cache list for `prompt_cache=` in mlx-lm's generate functions.

    Full-attention layers (mlx-lm's plain `KVCache`) get an `H2OKVCache`;
    sliding-window and recurrent layers keep the model's own cache. With
    `scoring="query"` (the default: `DEFAULT_CONFIG`) the attention hook is installed
    on the model (`h2o_fn.adapters.attention.remove_query_hook(model)` takes it off).
    """
    config = config or DEFAULT_CONFIG
    caches = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    out = [H2OKVCache(config, argmin) if type(c) is KVCache else c for c in caches]
    if not any(isinstance(c, H2OKVCache) for c in out):
        raise ValueError(
            f"{type(model).__name__}.make_cache() returned {sorted({type(c).__name__ for c in caches})}: "
            "expected at least one full-attention KVCache layer for H2O to manage"
        )
    if config.scoring == "query":
        from .attention import install_query_hook

        install_query_hook(model)
    return out
