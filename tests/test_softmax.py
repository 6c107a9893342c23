"""h2o_fn.softmax against float64 and mlx's own softmax: accuracy, edges, masking, shapes."""

import mlx.core as mx
import numpy as np
import pytest

from h2o_fn.softmax import MLX_UP_TO, _exp_nonpositive, exp, ranking_softmax, softmax


def ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in float32 units in the last place of `want` (float64)."""
    return np.abs(got.astype(np.float64) - want) / np.spacing(want.astype(np.float32)).astype(np.float64)


def test_exp_is_within_one_ulp_of_float64_over_the_normal_range():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-87.3, 88.37, 200_000), rng.normal(0, 1, 50_000)]).astype(np.float32)
    want = np.exp(x.astype(np.float64))
    assert ulps(np.array(exp(mx.array(x))), want).max() <= 1.0


def test_exp_edges():
    x = mx.array([-mx.inf, -100.0, -87.31, 0.0, -0.0, 88.4, mx.inf, float("nan")])
    got = np.array(exp(x))
    assert got[:3].tolist() == [0.0, 0.0, 0.0]  # masked (-inf) and below the normal range weigh nothing
    assert got[3] == got[4] == 1.0
    assert np.isposinf(got[5]) and np.isposinf(got[6]) and np.isnan(got[7])


def test_the_softmax_exponential_is_exp_bit_for_bit_on_its_inputs():
    rng = np.random.default_rng(1)
    x = np.concatenate([-rng.exponential(10.0, 100_000), [0.0, -0.0, -87.3, -87.31, -np.inf, np.nan]])
    got, want = np.array(_exp_nonpositive(mx.array(x, mx.float32))), np.array(exp(mx.array(x, mx.float32)))
    np.testing.assert_array_equal(got, want)  # NaN where NaN


@pytest.mark.parametrize("shape", [(1, 3, 1, 7), (2, 3, 3, 1, 513), (1, 1, 4, 2049)])
def test_softmax_agrees_with_mlx_and_masks_exactly(shape):
    x = mx.random.normal(shape, key=mx.random.key(len(shape))) * 4
    hidden = mx.random.uniform(shape=shape, key=mx.random.key(7)) < 0.3
    masked = mx.where(hidden, -mx.inf, x)
    got, want = softmax(masked), mx.softmax(masked, axis=-1, precise=True)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-5, atol=1e-7)
    assert mx.all(mx.where(hidden, got == 0, True)).item()  # exactly 0, not 1e-38
    np.testing.assert_allclose(np.array(got.sum(-1)), 1.0, rtol=1e-5)


def test_a_row_with_nothing_visible_is_nan_as_in_mlx():
    assert mx.all(mx.isnan(softmax(mx.full((1, 4), -mx.inf)))).item()


@pytest.mark.parametrize("shape", [(1, 3, 257), (1, 3, MLX_UP_TO // 3), (1, 3, MLX_UP_TO // 3 + 1), (1, 3, 4097)])
def test_the_ranking_softmax_is_mlx_up_to_its_size_and_ours_above(shape):
    """The key proxy's softmax: mx.softmax bit for bit up to MLX_UP_TO elements, `softmax` above;
    hidden slots exactly 0 either way."""
    x = mx.random.normal(shape, key=mx.random.key(3)) * 4
    x = mx.where(mx.random.uniform(shape=shape, key=mx.random.key(4)) < 0.3, -mx.inf, x)
    want = mx.softmax(x, axis=-1, precise=True) if x.size <= MLX_UP_TO else softmax(x)
    got = ranking_softmax(x)
    assert mx.array_equal(got, want).item()
    assert mx.all(mx.where(x == -mx.inf, got == 0, True)).item()
