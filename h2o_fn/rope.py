"""remap: move RoPE-rotated keys from one set of positions to another.

A key rotated at position p is R(p) k. Rotations compose, so
R(q) R(p)^-1 = R(q - p): remapping is one rotation by the position difference,
in float32, for the rotated `dims` leading features (the rest pass through).
Relative positions between queries and remapped keys are exactly q - p' for
the new position p', which is why the adapter never needs this: mlx-lm rotates
queries with the absolute offset, so kept keys keep their original rotation.

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn import remap
    >>> k = mx.random.normal((1, 1, 1, 8))
    >>> at3 = mx.fast.rope(k, 8, traditional=False, base=10000.0, scale=1.0, offset=3)
    >>> at7 = remap(at3, mx.array(3), mx.array(7), dims=8, base=10000.0, traditional=False)
    >>> ref = mx.fast.rope(k, 8, traditional=False, base=10000.0, scale=1.0, offset=7)
    >>> bool(mx.allclose(at7, ref, atol=1e-5))
    True
"""

import mlx.core as mx


def remap(
    keys: mx.array,
    from_positions: mx.array,
    to_positions: mx.array,
    *,
    dims: int,
    base: float,
    traditional: bool,
    scale: float = 1.0,
) -> mx.array:
    """Re-rotate `keys` `[..., L, D]` from `from_positions` to `to_positions` (`[..., L]`).

    Args:
      dims: rotated features (partial rotary when dims < D); must be even and <= D.
      base: RoPE base (theta). scale: position scale, as in `mx.fast.rope`.
      traditional: True for the interleaved layout (pairs 2i, 2i+1), False for
        the half-split layout (pairs i, i + dims/2).

    Returns keys of the same shape and dtype; the angle is computed in float32.
    """
    D = keys.shape[-1]
    if dims % 2 or not 0 < dims <= D:
        raise ValueError(f"dims={dims} is invalid: expected an even number in [2, head_dim={D}]")
    delta = (to_positions.astype(mx.float32) - from_positions.astype(mx.float32)) * scale
    inv_freq = base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)  # [dims/2]
    angle = delta[..., None] * inv_freq  # [..., L, dims/2]
    cos, sin = mx.cos(angle), mx.sin(angle)
    x = keys.astype(mx.float32)
    rot, rest = x[..., :dims], x[..., dims:]
    if traditional:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rot.shape)
    else:
        a, b = rot[..., : dims // 2], rot[..., dims // 2 :]
        rotated = mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return mx.concatenate([rotated, rest], axis=-1).astype(keys.dtype)
