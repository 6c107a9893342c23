"""H2O caches at rest: a held cache list's layers packed to the rows that hold tokens.

A server that holds many finished conversations (`h2o-fn serve`'s prompt cache) pays for
every slot of every layer it holds. After `cache_prompt`'s selection across heads a
layer's slots follow its fullest head, and a short chat holds a few tokens in budget + 1
slots. `pack_layers` replaces each H2O layer whose packed form (`h2o_fn.packing`) takes at
most `AT_MOST` of its bytes by a `PackedH2OKVCache`. A `PackedH2OKVCache` answers what mlx-lm's
prompt cache asks of a held layer (`nbytes`, `is_trimmable()`, `offset`, `size()`,
`tokens_kept`, `tokens_seen`) without unpacking. `unpack_layers` gives caches that continue
exactly as the packed ones would have.

Unpacking allocates a layer's slots again. A held state that is shared pays that copy
anyway: its first write copies every slot, since mlx cannot write in place into an array
that is still held. Above `AT_MOST` a layer stays as it is and is shared without a copy
until then.

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn import H2OConfig
    >>> from h2o_fn.adapters.mlx_lm import H2OKVCache
    >>> cache = H2OKVCache(H2OConfig(budget=64, scoring="key"))
    >>> _ = cache.update_and_fetch(mx.ones((1, 2, 5, 8)), mx.ones((1, 2, 5, 8)))
    >>> [held] = pack_layers([cache])        # 5 tokens in 65 slots per head
    >>> type(held).__name__, held.nbytes < cache.nbytes, held.offset
    ('PackedH2OKVCache', True, 5)
    >>> [back] = unpack_layers([held])
    >>> bool(mx.array_equal(back.keys[:, :, :5], cache.keys[:, :, :5])), back.tokens_kept
    (True, 5)
"""

from typing import Any, List, Optional

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from h2o_fn import packing

from . import cache_state, staging
from .cache import H2OKVCache, cache_of
from .mlx_lm import h2o_caches

AT_MOST = 0.75  # pack a layer when its packed bytes are at most this share of its slots' bytes


class PackedH2OKVCache:
    """One H2O layer at rest (`h2o_fn.packing.Packed`); `unpack()` gives the cache back.

    Args:
      cache: a settled H2O cache (no attention weights awaited) holding tokens.
      packed: `packing.pack` of its core state, when the caller has it already.
    """

    def __init__(self, cache: H2OKVCache, packed: Optional[packing.Packed] = None):
        s = cache.layer_state
        if s.core is None or s.pending is not None:
            raise ValueError(f"cannot pack a {type(cache).__name__} that "
                             f"{'holds no tokens' if s.core is None else 'awaits attention weights'}")
        self.kind, self.policy, self.keeps_view = type(cache), cache.policy, cache.keeps_view
        self.packed = packing.pack(s.core) if packed is None else packed
        mx.eval(self.packed)  # now: a lazy gather would hold every slot, and on the thread that built it
        self._s = s._replace(core=None, head_mask=None)  # the last view's mask: rebuilt at the next update
        self.tokens_kept, self.tokens_seen = cache.tokens_kept, cache.tokens_seen
        self._trimmable = cache.is_trimmable()

    nbytes = property(lambda self: packing.packed_nbytes(self.packed))
    offset = property(lambda self: self.tokens_seen)

    def size(self) -> int:
        return self.tokens_kept

    def empty(self) -> bool:
        return False

    def is_trimmable(self) -> bool:
        return self._trimmable

    @property
    def state(self):
        """The packed arrays (`h2o_fn.packing.Packed`), the staged decode tokens' arrays, then
        the policy's JSON, as `H2OKVCache.state` orders them: what `save_prompt_cache` writes."""
        return (*self.packed, *staging.to_arrays(self._s.staged), cache_state.meta(self._s, self.policy))

    @classmethod
    def from_state(cls, state) -> "PackedH2OKVCache":
        """The layer a saved `state` holds (mlx-lm's `load_prompt_cache` calls it by class name)."""
        keys, values, *rest, meta = state
        store = lambda x: tuple(x) if isinstance(x, (list, tuple)) else x  # noqa: E731 (a quantized store)
        core = packing.unpack(packing.Packed(store(keys), store(values), *rest[:5]))
        return cls(H2OKVCache.from_state((*core, *rest[5:], meta)))

    def unpack(self) -> H2OKVCache:
        """A new cache holding the packed state, evaluated (new arrays; this layer is unchanged)."""
        core = packing.unpack(self.packed)
        mx.eval(core)
        return cache_of(self.kind, self.policy, self._s._replace(core=core), self.keeps_view)


def at_rest(cache: Any) -> Any:
    """`cache` as `pack_layers` holds it: packed when it is an H2O layer holding tokens,
    settled, leading no lockstep followers, whose packed bytes are at most `AT_MOST` of its
    own; else `cache` itself."""
    if not isinstance(cache, H2OKVCache):
        return cache
    s = cache.layer_state
    if s.core is None or s.pending is not None or s.followed:
        return cache
    packed = packing.pack(s.core)  # lazy: its bytes are known from its shapes, before any gather runs
    return PackedH2OKVCache(cache, packed) if packing.packed_nbytes(packed) <= AT_MOST * cache.nbytes else cache


def pack_layers(caches: List[Any]) -> List[Any]:
    """`caches` with every layer `at_rest` packs as a `PackedH2OKVCache` (the others as they are)."""
    return [at_rest(c) for c in caches]


def unpack_layers(caches: List[Any], in_place: bool = False) -> List[Any]:
    """`caches` with every `PackedH2OKVCache` unpacked (new caches; the others as they are).
    `in_place`: replace them in `caches` itself, one layer at a time, so that a list nobody
    else holds frees each packed layer as soon as it is unpacked (its slots plus one
    packed layer at most, instead of plus all of them)."""
    out = caches if in_place else list(caches)
    for i, c in enumerate(out):
        if isinstance(c, PackedH2OKVCache):
            out[i] = c.unpack()
    return out


def h2o_layers(caches: List[Any]) -> List[Any]:
    """The H2O layers of a cache list, packed or not (also inside `CacheList`s), in layer order."""
    return [x for c in caches for x in ([c] if isinstance(c, PackedH2OKVCache) else h2o_caches([c]))]


# mlx-lm's load_prompt_cache looks classes up by name in its cache module
mlx_cache.PackedH2OKVCache = PackedH2OKVCache
