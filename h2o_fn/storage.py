"""Row storage: how a state holds its kept keys and values, dense or quantized.

`Storage(bits, group_size)` is the choice, a value of its own beside the eviction
rule (`H2OConfig`): `Storage()` keeps rows in the model's dtype, `Storage(8)` stores
them as mlx-lm's `QuantizedKVCache(bits=8)` does. The core's functions that write or
read rows take it as `kv` (default `Storage()`).

A store is either one array `[B, H, C, D]` (the model's dtype) or, with `bits`,
the triple mlx's affine quantization gives (as mlx-lm's `QuantizedKVCache` holds
it): packed words `[B, H, C, D * bits / 32]` uint32, scales and biases
`[B, H, C, D / group]` in the model's dtype. Every function here treats both alike,
so the core never branches on the storage kind. Writes touch O(D) words per (b, h);
nothing here copies a whole store.

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn.storage import Storage, empty, quantize, dense, take
    >>> Storage(8).bytes_per_element()          # 8 bits + a float16 scale and bias per 64
    0.53125
    >>> Storage(bits=7)
    Traceback (most recent call last):
    ...
    ValueError: Storage.bits=7 is invalid: expected None or one of (2, 3, 4, 5, 6, 8)
    >>> store = empty((1, 2, 4), 64, mx.float16, bits=8, group_size=64)
    >>> [x.shape for x in store]
    [(1, 2, 4, 16), (1, 2, 4, 1), (1, 2, 4, 1)]
    >>> rows = quantize(mx.ones((1, 2, 4, 64), mx.float16), 8, 64)
    >>> dense(rows, 8, 64).shape
    (1, 2, 4, 64)
"""

from typing import NamedTuple, Optional, Tuple, Union

import mlx.core as mx

KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs (1 bit is left out: it collapses)
KV_GROUP_SIZES = (32, 64, 128)

Store = Union[mx.array, Tuple[mx.array, mx.array, mx.array]]  # dense, or (packed, scales, biases)


class _Fields(NamedTuple):
    bits: Optional[int]  # None: rows in the model's dtype; else mx.quantize bits per element
    group_size: int  # elements per quantization group (scale + bias) along head_dim


class Storage(_Fields):
    """How rows are stored, validated at construction (`ValueError` names the field):
    `bits` None or in KV_BITS, `group_size` in KV_GROUP_SIZES (read only with bits)."""

    __slots__ = ()

    def __new__(cls, bits: Optional[int] = None, group_size: int = 64):
        if bits is not None and (isinstance(bits, bool) or bits not in KV_BITS):
            raise ValueError(f"Storage.bits={bits!r} is invalid: expected None or one of {KV_BITS}")
        if isinstance(group_size, bool) or group_size not in KV_GROUP_SIZES:
            raise ValueError(f"Storage.group_size={group_size!r} is invalid: expected one of {KV_GROUP_SIZES}")
        return super().__new__(cls, bits, group_size)

    def _replace(self, **changes) -> "Storage":
        return Storage(**{**self._asdict(), **changes})

    def bytes_per_element(self, model_bits: int = 16) -> float:
        """Stored bits per key/value element over a `model_bits` cache (1.0 when dense).

        Quantized rows hold `bits` per element plus a scale and a bias per group,
        each in the model's dtype: (bits + 2 * model_bits / group) / model_bits.
        """
        if self.bits is None:
            return 1.0
        return (self.bits + 2 * model_bits / self.group_size) / model_bits

    def fields(self) -> dict:
        """As mlx-lm names them (`kv_bits`, `kv_group_size`): what saved caches and JSON record."""
        return {"kv_bits": self.bits, "kv_group_size": self.group_size}


DENSE = Storage()


def check(kv) -> Storage:
    """`kv` if it is a `Storage`, else a TypeError naming what was given."""
    if not isinstance(kv, Storage):
        raise TypeError(f"kv is a {type(kv).__name__}: expected an h2o_fn.Storage (how rows are stored, "
                        "e.g. Storage() or Storage(bits=8))")
    return kv


def check_store(store: "Store", kv: Storage, name: str = "keys") -> None:
    """Raise unless `store` holds rows as `kv` says: dense, or quantized in groups of
    `kv.group_size` (with the incoming rows' width checked too, this pins bits and group)."""
    quantized = is_quantized(store)
    if quantized != (check(kv).bits is not None) or (
            quantized and store[1].shape[-1] * kv.group_size != width(store, kv.bits)):
        kind = f"quantized, {store[1].shape[-1]} groups per row" if quantized else "dense"
        raise ValueError(f"kv={kv} is invalid for these {name}: expected the storage the state was built "
                         f"with (its {name} are {kind})")


def is_quantized(store: Store) -> bool:
    return isinstance(store, tuple)


def parts(store: Store) -> Tuple[mx.array, ...]:
    """The arrays of a store: one, or three when quantized."""
    return store if is_quantized(store) else (store,)


def _map(fn, store: Store) -> Store:
    return tuple(fn(x) for x in store) if is_quantized(store) else fn(store)


def check_dim(dim: int, group_size: int, what: str = "head_dim") -> None:
    """mx.quantize groups the last axis: it must split into whole groups."""
    if dim % group_size:
        raise ValueError(
            f"{what}={dim} is invalid for group_size={group_size}: expected a multiple "
            f"of the group size (pick group_size from {[g for g in KV_GROUP_SIZES if dim % g == 0]})"
        )


def quantize(rows: mx.array, bits: Optional[int], group_size: int) -> Store:
    """Rows `[..., D]` as stored: unchanged when `bits` is None, else mx.quantize's triple."""
    if bits is None:
        return rows
    return tuple(mx.quantize(rows, group_size=group_size, bits=bits))


def dense(store: Store, bits: Optional[int], group_size: int) -> mx.array:
    """The rows' values `[..., D]` (dequantized when quantized). 8-bit rows: the codes read as
    bytes times the scale plus the bias, mx.dequantize's values bit for bit in 3 elementwise
    ops (on the CPU mx.dequantize costs ~90 us even for one row: the key proxy's, every step)."""
    if not is_quantized(store):
        return store
    packed, scales, biases = store
    if bits != 8:
        return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)
    codes = packed.view(mx.uint8)
    *lead, D = codes.shape
    grouped = codes.reshape(*lead, D // group_size, group_size).astype(scales.dtype)
    return (grouped * scales[..., None] + biases[..., None]).reshape(*lead, D)


def matmul_t(x: mx.array, store: Store, bits: Optional[int], group_size: int) -> mx.array:
    """`x` `[..., N, D]` float32 against every row: `x @ rows^T`, `[..., N, C]` float32.

    Quantized rows are multiplied where they lie instead of dequantized into a
    `[..., C, D]` copy first: 8-bit codes read as bytes (`_codes`), the scales and biases
    applied to the products, per group g: `s_g (x_g . c_g) + b_g sum(x_g)`; other widths
    through `mx.quantized_matmul`. The same sums in another order (logits agree to ~1e-6).
    """
    if not is_quantized(store):
        return x @ (store if store.dtype == mx.float32 else store.astype(mx.float32)).swapaxes(-1, -2)
    packed, scales, biases = store
    if bits != 8:
        return mx.quantized_matmul(x, packed, scales.astype(mx.float32), biases.astype(mx.float32), transpose=True,
                                   group_size=group_size, bits=bits)
    s, b = (y.astype(mx.float32).swapaxes(-1, -2) for y in (scales, biases))  # [..., G, C]
    codes = _codes(packed)  # [..., C, D]
    G, N = s.shape[-2], x.shape[-2]
    if G == 1:
        return (x @ codes.swapaxes(-1, -2)) * s + x.sum(-1, keepdims=True) * b
    # each query row once per group, zero outside it: one product gives every group's dot products
    xg = mx.where(_blocks(x.shape[-1], G), x[..., None, :], 0.0).reshape(*x.shape[:-2], N * G, -1)
    dots = (xg @ codes.swapaxes(-1, -2)).reshape(*x.shape[:-2], N, G, -1)  # [..., N, G, C]
    sums = x.reshape(*x.shape[:-1], G, group_size).sum(-1)[..., None]  # [..., N, G, 1]
    return (dots * mx.expand_dims(s, -3) + sums * mx.expand_dims(b, -3)).sum(-2)


def matmul(w: mx.array, store: Store, bits: Optional[int], group_size: int) -> mx.array:
    """`w` `[..., N, C]` float32 times every row: `w @ rows`, `[..., N, D]` float32 (quantized
    rows multiplied where they lie, as `matmul_t`: per group g, `(w s_g) @ c_g + w @ b_g`)."""
    if not is_quantized(store):
        return w @ (store if store.dtype == mx.float32 else store.astype(mx.float32))
    packed, scales, biases = store
    s, b = (y.astype(mx.float32) for y in (scales, biases))  # [..., C, G]
    if bits != 8:
        return mx.quantized_matmul(w, packed, s, b, transpose=False, group_size=group_size, bits=bits)
    codes = _codes(packed)  # [..., C, D]
    G, N = s.shape[-1], w.shape[-2]
    if G == 1:
        return (w * s.swapaxes(-1, -2)) @ codes + w @ b
    wg = (w[..., None, :] * mx.expand_dims(s.swapaxes(-1, -2), -3)).reshape(*w.shape[:-2], N * G, -1)
    out = (wg @ codes).reshape(*w.shape[:-2], N, G, -1)  # [..., N, G, D]: group g's columns are right
    blocks = _blocks(codes.shape[-1], G).astype(mx.float32)  # [G, D]
    return (out * blocks).sum(-2) + (w @ b) @ blocks


def _codes(packed: mx.array) -> mx.array:
    """8-bit rows' codes `[..., C, D]` float32: mx.quantize packs element i of a row into byte
    i % 4 of word i // 4 (little-endian), so the words read as bytes are the codes in order."""
    return packed.view(mx.uint8).astype(mx.float32)


def _blocks(D: int, G: int) -> mx.array:
    """`[G, D]` bool: column d belongs to group g (groups of D / G consecutive columns)."""
    return (mx.arange(D) // (D // G))[None] == mx.arange(G)[:, None]


def empty(shape: Tuple[int, int, int], dim: int, dtype, bits: Optional[int], group_size: int) -> Store:
    """Zero rows for `shape` = (B, H, C) slots of width `dim`."""
    if bits is not None:
        check_dim(dim, group_size)
    return quantize(mx.zeros((*shape, dim), dtype=dtype), bits, group_size)


def width(store: Store, bits: Optional[int]) -> int:
    """Row width D (a quantized store packs 32 / bits elements per word)."""
    return store[0].shape[-1] * 32 // bits if is_quantized(store) else store.shape[-1]


def dtype_of(store: Store):
    """The model dtype the store holds (scales carry it when quantized)."""
    return store[1].dtype if is_quantized(store) else store.dtype


def write(store: Store, index: mx.array, rows: Store) -> Store:
    """Rows `[B, H, 1, *]` written at slot `index` `[B, H, 1, 1]` (O(D) per (b, h))."""
    if is_quantized(store):
        return tuple(mx.put_along_axis(s, index, r.astype(s.dtype), axis=2) for s, r in zip(store, rows))
    if store.shape[-1] == 0:  # rows of width 0 (a key-only cache's values): nothing to write
        return store
    return mx.put_along_axis(store, index, rows.astype(store.dtype), axis=2)


def put(store: Store, rows: Store, start: int) -> Store:
    """Rows `[B, H, n, *]` written at slots [start, start + n)."""
    at = mx.array([start])
    if is_quantized(store):
        return tuple(mx.slice_update(s, r.astype(s.dtype), at, axes=(2,)) for s, r in zip(store, rows))
    return mx.slice_update(store, rows.astype(store.dtype), at, axes=(2,))


def take(store: Store, order: mx.array) -> Store:
    """Rows gathered along the slot axis by `order` `[B, H, M]`."""

    def gather(x):
        if x.shape[-1] == 0:  # rows of width 0
            return mx.zeros((*order.shape, 0), dtype=x.dtype)
        return mx.take_along_axis(x, order[..., None], axis=2)

    return _map(gather, store)


def flat_take(store: Store, slots: mx.array) -> Store:
    """Rows `[N, *]` at flat slots `slots` `[N]` (`(b * H + h) * C + c`) of a store `[B, H, C, *]`."""
    return _map(lambda x: x.reshape(-1, x.shape[-1])[slots], store)


def flat_put(rows: Store, slots: mx.array, shape: Tuple[int, int, int]) -> Store:
    """A store `[B, H, C, *]` (`shape` = (B, H, C)) holding `rows` `[N, *]` at the flat slots
    `slots` `[N]` (as `flat_take` reads them), zeros in every other slot."""

    def put(x):
        full = mx.zeros((shape[0] * shape[1] * shape[2], x.shape[-1]), x.dtype)
        if x.shape[-1] and slots.size:  # rows of width 0 (a key-only cache's values), or none
            full[slots] = x
        return full.reshape(*shape, x.shape[-1])

    return _map(put, rows)


def head(store: Store, n: int) -> Store:
    """The first n slots (the store itself when it holds no more: a slice is one more op to run)."""
    if n >= parts(store)[0].shape[2]:
        return store
    return _map(lambda x: x[:, :, :n], store)


def slot_range(store: Store, start: int, stop: Optional[int] = None) -> Store:
    """Slots [start, stop) (views, no copy)."""
    return _map(lambda x: x[:, :, start:stop], store)


def concat(a: Store, b: Store) -> Store:
    """Two stores joined along the slot axis (b cast to a's dtypes)."""
    if is_quantized(a):
        return tuple(mx.concatenate([x, y.astype(x.dtype)], axis=2) for x, y in zip(a, b))
    return mx.concatenate([a, b.astype(a.dtype)], axis=2)


def select(store: Store, batch: mx.array) -> Store:
    """Batch rows `batch` (indices into B)."""
    return _map(lambda x: x[batch], store)


def stack(stores) -> Store:
    """Stores with B = 1 each, joined along the batch axis."""
    first = stores[0]
    if is_quantized(first):
        return tuple(mx.concatenate([s[i] for s in stores], axis=0) for i in range(3))
    return mx.concatenate(list(stores), axis=0)


def nbytes(store: Store) -> int:
    return sum(x.nbytes for x in parts(store))
