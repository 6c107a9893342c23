"""Array helpers the core's modules share: config numbers as computed scalars, per-row
broadcasting, dtypes, and rows as a store holds them or as scoring reads them.

Shapes: B batch rows, H KV heads, N tokens, D head_dim.

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn.arrays import knob, per_row
    >>> knob(3).shape, per_row(mx.array([1, 2])).shape
    ((), (2, 1, 1))
"""

import mlx.core as mx

from . import storage
from .state import RESERVED
from .storage import Storage

INT32_MAX = 2**31 - 1


def knob(x, dtype=mx.int32) -> mx.array:
    """A config number as a computed 0-d array, not a literal. mx.compile names a fused
    kernel after its literals' digits run together (mlx 0.32: n_sink=1, grace=10 reads as
    n_sink=11, grace=0), and caches kernels by name across processes (/tmp/mlx), so two
    configs would share one kernel; a computed scalar is read at run time instead."""
    return x if isinstance(x, mx.array) else mx.array([x], dtype=dtype).reshape(())


def per_row(x: mx.array, ndim: int = 3) -> mx.array:
    """A `[B]` array shaped to broadcast against `[B, ...]` of `ndim` axes ([] stays [])."""
    return x.reshape(x.shape[0], *([1] * (ndim - 1))) if x.ndim == 1 else x


def newest_slots(positions: mx.array, seen: mx.array, alive=None) -> mx.array:
    """`[B, H, C]` bool: the slot of each row's newest token (position seen - 1), in the rows
    that took one (`alive` `[B]`; a row that sat the token out has no newest)."""
    newest = positions == per_row(seen - 1)
    return newest if alive is None else newest & per_row(alive)


def slot_order(positions: mx.array) -> mx.array:
    """Sort keys `[..., C]` int32 that lay slots out canonically: tokens by position, then
    reserved slots, then free ones (`view.compact`, and every chunk that rewrites a state)."""
    return mx.where(positions >= 0, positions, mx.where(positions == RESERVED, INT32_MAX - 1, INT32_MAX))


def as_dtype(x: mx.array, dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)


def f32(x: mx.array) -> mx.array:
    return as_dtype(x, mx.float32)


def dense(store, kv: Storage) -> mx.array:
    return storage.dense(store, storage.check(kv).bits, kv.group_size)


def times_rows(x: mx.array, store, kv: Storage) -> mx.array:
    """`x` `[..., N, D]` float32 times a store's rows transposed: `[..., N, C]` float32."""
    return storage.matmul_t(x, store, kv.bits, kv.group_size)


def stored_rows(rows: mx.array, like, kv: Storage):
    """New rows `[B, H, N, D]` as a store would hold them: cast to its dtype, quantized
    when `kv.bits` (a store or its arrays only give the dtype)."""
    storage.check(kv)
    return storage.quantize(as_dtype(rows, storage.dtype_of(like)), kv.bits, kv.group_size)


def scored_rows(keys: mx.array, like, kv: Storage) -> mx.array:
    """The keys as scoring sees them: as given, or their stored (dequantized) values."""
    if kv.bits is None:
        return keys
    return dense(stored_rows(keys, like, kv), kv)
