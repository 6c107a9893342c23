"""The proxy's softmax with an exponential of its own: faster and closer than mlx's on a CPU.

mlx 0.32's CPU `exp` costs 10-25 ns per float32 element on the machines we measure
(BENCHMARKS.md: it is most of a decode step's proxy weights at 2048-4096 slots) and is
off by up to 61 ulp. `exp` here is Cephes' `expf` (range reduction by ln 2 in two
parts, a degree-6 polynomial, the exponent written into the float's bits): plain
multiply-adds that `mx.compile` fuses into a few loops (it cuts at the bit cast and
where an intermediate is read twice), within 1 ulp of the float64 exponential and
several times faster. The softmax's inputs (the max subtracted) are <= 0, so it skips
the upper clip and the inf branch (`_exp_nonpositive`: the same values).
Below -87.3 (the smallest normal float32 is e^-87.34) it is exactly 0, so masked
entries (-inf) weigh nothing; above 88.37 it is inf (2^128 has no float32 exponent);
NaN stays NaN.

Shapes: any; `softmax` normalises along one axis.

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn.softmax import exp, softmax
    >>> exp(mx.array([0.0, 1.0, -mx.inf])).tolist()
    [1.0, 2.7182817459106445, 0.0]
    >>> softmax(mx.array([[0.0, 0.0, -mx.inf]])).tolist()
    [[0.5, 0.5, 0.0]]
"""

import mlx.core as mx

_LOWEST = -87.3  # below this the result is 0 (e^-87.34 is the smallest normal float32)
_HIGHEST = 88.37  # above this it is inf: n would reach 128, past float32's exponents
_ROUND = 12582912.0  # 1.5 * 2^23: (y + _ROUND) - _ROUND is y rounded to the nearest integer
# up to this many elements mlx's softmax is faster on a CPU: `softmax`'s 17 primitives (mlx fuses
# at most 11 ops deep) cost more to dispatch than mlx's slower exps (`ranking_softmax`;
# BENCHMARKS.md, "The softmax without a floor")
MLX_UP_TO = 8192


def _rounded(y: mx.array) -> mx.array:
    # not mx.floor: g++ (mlx's CPU compiler, baseline x86-64) calls libm's floorf per
    # element, which keeps the fused loop scalar (BENCHMARKS.md, "The softmax without a floor")
    return (y + _ROUND) - _ROUND


def _from_n(x: mx.array, n: mx.array):
    """x = n ln2 + r, |r| <= ln2 / 2: (e^r by Cephes' polynomial, the float32 bits of 2^n)."""
    r = x - n * 0.693359375 + n * 2.12194440e-4  # ln 2 in two parts: the first is exact in float32
    p = ((((1.9875691500e-4 * r + 1.3981999507e-3) * r + 8.3334519073e-3) * r + 4.1665795894e-2) * r
         + 1.6666665459e-1) * r + 5.0000001201e-1
    return p * r * r + r + 1.0, (n.astype(mx.int32) + 127) << 23  # n + 127 in the exponent bits


def _reduced(x: mx.array):
    return _from_n(x, _rounded(mx.clip(x, _LOWEST, _HIGHEST) * 1.44269504088896341))


def _reduced_nonpositive(x: mx.array):  # x <= 0, -inf or NaN: n never reaches the top
    return _from_n(x, _rounded(mx.maximum(x, _LOWEST) * 1.44269504088896341))


def _scaled(x: mx.array, e_r: mx.array, two_n: mx.array) -> mx.array:
    return _scaled_nonpositive(x, mx.where(x > _HIGHEST, mx.inf, e_r), two_n)


def _scaled_nonpositive(x: mx.array, e_r: mx.array, two_n: mx.array) -> mx.array:
    return mx.where(x >= _LOWEST, e_r * two_n, mx.where(x == x, 0.0, x))  # NaN >= anything is False


# shapeless: one trace for every shape (attention grows by a row per decode step); the
# bit cast between the two cannot be traced shapeless, so it sits outside them
_reduced_c, _scaled_c = mx.compile(_reduced, shapeless=True), mx.compile(_scaled, shapeless=True)
_reduced_np_c = mx.compile(_reduced_nonpositive, shapeless=True)
_scaled_np_c = mx.compile(_scaled_nonpositive, shapeless=True)


def exp(x: mx.array) -> mx.array:
    """e^x for float32 `x` (any shape): Cephes' expf, 0 below -87.3, inf above 88.37."""
    e_r, bits = _reduced_c(x)
    return _scaled_c(x, e_r, bits.view(mx.float32))


def _exp_nonpositive(x: mx.array) -> mx.array:
    """`exp` of `x` <= 0 (or -inf, NaN), one comparison and one clip fewer per element."""
    e_r, bits = _reduced_np_c(x)
    return _scaled_np_c(x, e_r, bits.view(mx.float32))


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """softmax of float32 `x` along `axis`, as mx.softmax(precise=True) computes it (the max
    subtracted first), with `exp`. A row of -inf only gives NaN, as mx.softmax does."""
    e = _exp_nonpositive(x - mx.max(x, axis=axis, keepdims=True))  # <= 0, or NaN (inf - inf)
    return e / mx.sum(e, axis=axis, keepdims=True)


def ranking_softmax(x: mx.array, axis: int = -1) -> mx.array:
    """`softmax`, or mx.softmax itself up to `MLX_UP_TO` elements (one primitive instead of
    17: faster there, and a few ulp off): for weights that only rank tokens (the key proxy's;
    attention's own weights also make its output, and keep `softmax`)."""
    if x.size <= MLX_UP_TO:
        return mx.softmax(x, axis=axis, precise=True)
    return softmax(x, axis)
