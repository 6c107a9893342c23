"""A state at rest: only the rows of the slots that hold tokens (`pack` / `unpack`).

A state allocates C slots per (b, h) whatever each head keeps. After a selection across
heads (`h2o_fn.budgets`) a layer's C follows its fullest head, so most of its bytes can be
reserved and free slots, whose rows nothing reads. `pack` keeps the key and value rows of
the slots holding a token, `[N, D]` with N the tokens held over every (b, h), and the
slot each came from; scores, positions and counts stay whole (4 bytes per slot each,
against a row's 2 * D elements). `unpack` writes the rows back into the same slots, so the
state it gives continues exactly as the packed one would have: the same slots, scores and
positions, and free or reserved slots' rows (stale data) come back as zeros.

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn import H2OConfig, absorb, init
    >>> from h2o_fn.packing import pack, packed_nbytes, unpack
    >>> cfg = H2OConfig(budget=8, n_sink=1, grace=2)
    >>> kv = mx.random.normal((1, 2, 3, 4))
    >>> s = absorb(init(cfg, 1, 2, 4), kv, kv, cfg)   # 3 tokens held in 9 slots per head
    >>> p = pack(s)
    >>> p.keys.shape, p.slots.tolist()
    ((6, 4), [0, 1, 2, 9, 10, 11])
    >>> packed_nbytes(p) < s.keys.nbytes + s.values.nbytes
    True
    >>> bool(mx.array_equal(unpack(p).keys[:, :, :3], s.keys[:, :, :3]))
    True
"""

from typing import NamedTuple

import mlx.core as mx

from . import storage
from .state import H2OState
from .storage import Store


class Packed(NamedTuple):
    keys: Store  # [N, Dk] the occupied slots' key rows (or the quantized triple, each [N, w])
    values: Store  # [N, Dv]
    slots: mx.array  # [N] int32, each row's slot as a flat index (b * H + h) * C + c, ascending
    scores: mx.array  # [B, H, C] float32, as the state's
    positions: mx.array  # [B, H, C] int32, as the state's (FREE and RESERVED included)
    length: mx.array  # [B] int32
    seen: mx.array  # [B] int32


def pack(state: H2OState) -> Packed:
    """The rows of the slots holding a token (position >= 0), in slot order. Reads the
    number of tokens held (one host sync): not for compiled code."""
    flat = state.positions.reshape(-1)
    held = flat >= 0
    n = int(mx.sum(held).item())
    index = mx.arange(flat.size, dtype=mx.int32)
    slots = mx.sort(mx.where(held, index, flat.size))[:n]  # the held slots first, ascending
    return Packed(storage.flat_take(state.keys, slots), storage.flat_take(state.values, slots), slots, *state[2:])


def unpack(packed: Packed) -> H2OState:
    """The state `pack` was given, rows of its free and reserved slots zeroed."""
    shape = packed.positions.shape
    return H2OState(storage.flat_put(packed.keys, packed.slots, shape),
                    storage.flat_put(packed.values, packed.slots, shape), *packed[3:])


def packed_nbytes(packed: Packed) -> int:
    """Bytes held: the packed rows, their slots, scores, positions and counts."""
    return (storage.nbytes(packed.keys) + storage.nbytes(packed.values)
            + sum(x.nbytes for x in packed[2:]))
