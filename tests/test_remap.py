"""remap: RoPE re-rotation between positions, both layouts, partial rotary."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, strategies as st

from h2o_fn import remap

LAYOUTS = st.sampled_from([True, False])


def rope_at(x, positions, dims, base, traditional, scale=1.0):
    """mx.fast.rope applied per token at its own position: x `[1, 1, L, D]`."""
    rows = [
        mx.fast.rope(x[:, :, i : i + 1], dims, traditional=traditional, base=base, scale=scale,
                     offset=int(p))
        for i, p in enumerate(positions)
    ]
    return mx.concatenate(rows, axis=2)


@st.composite
def cases(draw):
    D = draw(st.sampled_from([2, 8, 16, 64]))
    dims = draw(st.sampled_from([d for d in (2, D // 2, D) if d % 2 == 0 and d > 0]))
    L = draw(st.integers(1, 6))
    pos = lambda: draw(st.lists(st.integers(0, 2048), min_size=L, max_size=L))
    x = mx.array(np.random.default_rng(draw(st.integers(0, 2**31))).standard_normal((1, 1, L, D)),
                 dtype=mx.float32)
    return x, dims, draw(st.sampled_from([10000.0, 100000.0, 500.0])), draw(LAYOUTS), pos(), pos(), pos()


@given(cases())
def test_round_trip_is_identity(case):
    x, dims, base, trad, a, _, _ = case
    p = mx.array(a)
    y = remap(remap(x, p, p + 7, dims=dims, base=base, traditional=trad), p + 7, p, dims=dims,
              base=base, traditional=trad)
    assert mx.allclose(y, x, atol=1e-5, rtol=1e-5)
    assert mx.array_equal(remap(x, p, p, dims=dims, base=base, traditional=trad), x)


@given(cases())
def test_composition(case):
    x, dims, base, trad, a, b, c = case
    a, b, c = mx.array(a), mx.array(b), mx.array(c)
    kw = dict(dims=dims, base=base, traditional=trad)
    two = remap(remap(x, a, b, **kw), b, c, **kw)
    # float32 angles: |angle| <= 4096 rad carries ~ulp(4096) = 5e-4 rad of rounding
    assert mx.allclose(two, remap(x, a, c, **kw), atol=1e-3, rtol=1e-3)
    near = lambda p: mx.array([v % 64 for v in p.tolist()])  # small angles: tight
    a, b, c = near(a), near(b), near(c)
    assert mx.allclose(remap(remap(x, a, b, **kw), b, c, **kw), remap(x, a, c, **kw), atol=2e-5)


@given(cases(), st.sampled_from([1.0, 0.5, 0.25]))
def test_fingerprinted_key_remapped_equals_key_rotated_at_target(case, scale):
    """A key rotated at p and remapped to q is the key rotated at q, as mx.fast.rope does it."""
    x, dims, base, trad, p, q, _ = case
    at_p = rope_at(x, p, dims, base, trad, scale)
    moved = remap(at_p, mx.array(p), mx.array(q), dims=dims, base=base, traditional=trad, scale=scale)
    # float32 angles at positions up to 2048 carry ~1e-4 absolute error in mx.fast.rope itself
    assert mx.allclose(moved, rope_at(x, q, dims, base, trad, scale), atol=2e-3, rtol=1e-3)
    untouched = slice(dims, None)
    assert mx.array_equal(moved[..., untouched], x[..., untouched])


def test_relative_positions_survive_remap():
    """q(m) . k(n) depends on m - n only, so shifting both by s keeps the logit."""
    rng = np.random.default_rng(0)
    q, k = (mx.array(rng.standard_normal((1, 1, 1, 64)), dtype=mx.float32) for _ in range(2))
    kw = dict(dims=64, base=10000.0, traditional=False)
    logit = lambda m, n: (rope_at(q, [m], 64, 10000.0, False) * rope_at(k, [n], 64, 10000.0, False)).sum()
    shifted_k = remap(rope_at(k, [40], 64, 10000.0, False), mx.array([40]), mx.array([140]), **kw)
    shifted = (rope_at(q, [150], 64, 10000.0, False) * shifted_k).sum()
    assert abs(float(shifted.item()) - float(logit(50, 40).item())) < 1e-3


def test_bad_dims_raise():
    with pytest.raises(ValueError, match="dims=3"):
        remap(mx.zeros((1, 1, 1, 8)), mx.array([0]), mx.array([1]), dims=3, base=1e4, traditional=True)
