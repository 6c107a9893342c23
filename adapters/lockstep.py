"""Caches that keep another cache's positions: one layer, several caches, one kept set.

mlx-lm's `CacheList` holds several caches for one layer. Where two of them are
plain KV caches they describe the same tokens: DeepSeek sparse attention (deepseek_v32,
glm_moe_dsa, minimax_m3_vl) scores positions with an indexer cache and gathers the
chosen ones from the attention cache by index, so both must hold the same positions in
the same rows. An `H2OCacheList` makes its first KV cache an `H2OKVCache` (the leader,
which scores and evicts) and the others `H2OFollower`s, whose rows follow the leader's
slot layout: the same token in the same slot, evicted when the leader evicts it.

A follower is updated once per forward pass, before or after its leader (models
differ). Either way its view is built on the layout the leader's view is built on
(the leader's settled positions before this pass), so columns match; a chunk's rows
are moved to the leader's new layout at the next update (`h2o_fn.view.relayout`),
when the leader has settled (query scoring settles inside attention).

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn import H2OConfig
    >>> from h2o_fn.adapters.cache import H2OKVCache
    >>> from h2o_fn.adapters.lockstep import H2OCacheList, H2OFollower
    >>> pair = H2OCacheList(H2OKVCache(H2OConfig(budget=4, n_sink=1, grace=1, scoring="key")),
    ...                     H2OFollower())
    >>> for n in (5, 1, 1):
    ...     k, _ = pair[0].update_and_fetch(mx.random.normal((1, 1, n, 8)), mx.zeros((1, 1, n, 8)))
    ...     i, _ = pair[1].update_and_fetch(mx.ones((1, 1, n, 4)), mx.ones((1, 1, n, 4)))
    >>> k.shape[2] == i.shape[2], pair[1].offset
    (True, 7)
"""

import json
from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import CacheList, _BaseCache

from h2o_fn import H2OState, admit, storage, view

from . import cache_state
from .cache import BatchH2OKVCache, H2OKVCache


class H2OFollower(_BaseCache):
    """The rows of one more cache of a layer, kept where its leader keeps its tokens."""

    def __init__(self, leader: Optional[H2OKVCache] = None, keys=None, values=None, seen: Sequence[int] = ()):
        self.leader = leader
        self.keys, self.values = keys, values  # stores in the leader's slot layout, [B, H, C, D]
        self._seen: List[int] = list(seen)
        self._chunk = None  # (keys, values, positions) of the last chunk, to re-lay out
        self._view = None

    @property
    def offset(self):
        if isinstance(self.leader, BatchH2OKVCache):
            return mx.array(self._seen or [0], dtype=mx.int32)
        return self._seen[0] if self._seen else 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store `[B, H, N, D]`; return the rows aligned with the leader's last view."""
        lead = self.leader
        if lead is None:
            raise RuntimeError("an H2OFollower needs a leader: build it inside an H2OCacheList")
        B, H, N, _ = keys.shape
        seen = self._seen or [0] * B
        lead_state = lead.settle()  # the layout the leader keeps (a waiting key-scored token settled)
        led, lead_seen = lead_state.last, list(lead_state.seen)
        if led is not None and led.seen == seen and lead_seen == [s + n for s, n in zip(seen, led.counts)]:
            step = led  # the leader took these tokens already
        elif (lead_seen or [0] * B) == seen:
            # the leader takes them next, from its settled layout
            step = cache_state.next_step(lead_state, lead.config, B, H, N)
        else:
            raise RuntimeError(
                f"an H2O follower at {seen} tokens is out of step with its leader at "
                f"{lead_seen} (each forward pass must update both, once)"
            )
        if self.keys is None:
            C = step.positions.shape[-1]
            self.keys = mx.zeros((B, H, C, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((B, H, C, values.shape[3]), values.dtype)
        self._settle(step.positions)
        state = H2OState(self.keys, self.values, mx.zeros(step.positions.shape, mx.float32),
                         step.positions, mx.array(seen, dtype=mx.int32), mx.array(seen, dtype=mx.int32))
        if N == 1:  # the row goes where the leader put its token; evictions move no rows
            first = admit(state, keys, values)  # a follower's rows are dense
            self.keys, self.values = first.keys, first.values
            out = view.view(first, step.span)
        else:
            out = view.chunk_view(state, keys, values, step.span)
            arange = mx.arange(N, dtype=mx.int32)
            chunk = mx.where(arange < mx.array(step.counts)[:, None], mx.array(seen)[:, None] + arange, -1)
            positions = mx.concatenate([step.positions, mx.broadcast_to(chunk[:, None], (B, H, N))], axis=-1)
            self._chunk = (storage.concat(self.keys, keys), storage.concat(self.values, values), positions)
        self._seen = [s + n for s, n in zip(seen, step.counts)]
        self._view = out if getattr(self.leader, "keeps_view", True) else None  # as its leader (H2OKVCache)
        return out

    def _settle(self, positions: mx.array) -> None:
        """Move the last chunk's rows to the leader's layout `positions`, once it is known."""
        if self._chunk is not None:
            self.keys, self.values = self._relaid(positions)
            self._chunk = None

    def _relaid(self, positions: mx.array):
        """`(keys, values)` with the last chunk's rows in the layout `positions` (computed, not stored)."""
        if self._chunk is None:
            return self.keys, self.values
        keys, values, before = self._chunk
        return view.relayout(keys, before, positions), view.relayout(values, before, positions)

    def settled(self) -> "H2OFollower":
        """This follower with its last chunk's rows moved to the leader's settled layout."""
        if self._chunk is not None:
            self._settle(self.leader.core_state.positions)
        return self

    def seen_rows(self) -> List[int]:
        """Tokens seen per batch row (empty before the first update)."""
        return list(self._seen)

    def keys_and_values(self):
        if self._view is None:
            raise RuntimeError("H2OFollower holds no view to share: no tokens yet, or its leader was built "
                               "with keeps_view=False")
        return self._view

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        return self.leader.make_mask(N, return_array=return_array, window_size=window_size)

    def size(self) -> int:
        return self.leader.size() if self.leader is not None else 0

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else storage.nbytes(self.keys) + storage.nbytes(self.values)

    def is_trimmable(self) -> bool:
        return self.leader is not None and self.leader.is_trimmable()

    def trim(self, n: int) -> int:
        """Forget the n newest tokens (the leader frees their slots; the rows stay, stale)."""
        self.settled()
        n = min(n, min(self._seen, default=0))
        self._seen = [s - n for s in self._seen]
        return n

    @property
    def state(self):
        """The rows in the leader's settled layout (relaid on a copy: reading changes nothing),
        the tokens seen per row and whether it is empty."""
        keys, values = self._relaid(self.leader.core_state.positions) if self._chunk is not None else (
            self.keys, self.values)
        return keys, values, mx.array(self._seen or [0], dtype=mx.int32), json.dumps({"empty": keys is None})

    @state.setter
    def state(self, v):
        keys, values, seen, meta = v
        self.__init__()
        if not json.loads(meta)["empty"]:
            self.keys, self.values, self._seen = keys, values, seen.tolist()

    # ------------------------------------------------------------ batching

    @classmethod
    def merge(cls, caches: Sequence["H2OFollower"]) -> "H2OFollower":
        held = [c.settled() for c in caches if c.keys is not None]
        seen = [s for c in caches for s in (c.seen_rows() or [0])]
        if not held:
            return cls(seen=seen)
        like = held[0]
        return cls(keys=mx.concatenate([_rows_or_zeros(c.keys, like.keys) for c in caches], axis=0),
                   values=mx.concatenate([_rows_or_zeros(c.values, like.values) for c in caches], axis=0),
                   seen=seen)

    def prepare(self, **kwargs):
        del kwargs  # the leader takes the padding; the follower reads its counts

    def finalize(self):
        pass

    def filter(self, batch_indices):
        self.settled()
        idx = [int(i) for i in batch_indices]
        if self.keys is not None:
            self.keys, self.values = self.keys[mx.array(idx)], self.values[mx.array(idx)]
        self._seen = [self._seen[i] for i in idx] if self._seen else []

    def extend(self, other: "H2OFollower"):
        merged = H2OFollower.merge([*self.unbatched(), *other.unbatched()])
        self.keys, self.values, self._seen = merged.keys, merged.values, merged.seen_rows()

    def extract(self, idx: int) -> "H2OFollower":
        self.settled()
        if self.keys is None:
            return H2OFollower()
        return H2OFollower(keys=self.keys[idx : idx + 1], values=self.values[idx : idx + 1], seen=[self._seen[idx]])

    def unbatched(self) -> List["H2OFollower"]:
        """Every batch row as a follower of its own."""
        return [self.extract(i) for i in range(len(self._seen))]


def _rows_or_zeros(x: Optional[mx.array], like: mx.array) -> mx.array:
    return x if x is not None else mx.zeros((1, *like.shape[1:]), like.dtype)


class H2OCacheList(CacheList):
    """A `CacheList` whose KV caches keep one set of positions: the first `H2OKVCache`
    leads, every `H2OFollower` follows it (re-linked after load, merge and extract)."""

    def __init__(self, *caches):
        super().__init__(*caches)
        self.link()

    def link(self) -> None:
        """Point every follower at the leader (after load, merge and extract)."""
        caches = list(self.caches)
        leader = next((c for c in caches if isinstance(c, H2OKVCache)), None)
        for c in caches:
            if isinstance(c, H2OFollower):
                c.leader = leader
        if leader is not None:
            leader.follow(any(isinstance(c, H2OFollower) for c in caches))

    @property
    def state(self):
        return CacheList.state.fget(self)

    @state.setter
    def state(self, v):
        CacheList.state.fset(self, v)
        self.link()

    @classmethod
    def merge(cls, caches):
        out = super().merge(caches)
        out.link()
        return out

    def extract(self, idx):
        return H2OCacheList(*(c.extract(idx) for c in self.caches))

    def extend(self, other):
        super().extend(other)
        self.link()

    def filter(self, batch_indices):
        super().filter(batch_indices)
        self.link()


# mlx-lm's load_prompt_cache (and CacheList's state setter) look classes up by name here
mlx_cache.H2OFollower = H2OFollower
mlx_cache.H2OCacheList = H2OCacheList
