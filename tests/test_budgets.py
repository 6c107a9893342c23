"""Budgets across heads and layers (`h2o_fn.budgets`): the selection against its reference
twin, and what a selection promises (the total, the sinks, heads of their own budgets)."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from h2o_fn import H2OConfig, assert_invariants, budgets, init, kept_positions, step
from h2o_fn import reference as ref


@st.composite
def scored_layers(draw):
    """Per layer (scores, positions) `[B, H, M]`: unique positions per head with free (-1) and
    reserved (-2) holes; scores on a grid (exact ties across heads and layers), NaN and inf."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    B, H, L = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    layers = []
    for _ in range(L):
        M = draw(st.integers(1, 12))
        positions = np.stack([np.stack([rng.permutation(20)[:M] for _ in range(H)]) for _ in range(B)])
        holes = rng.random((B, H, M))
        positions = np.where(holes < 0.15, -1, np.where(holes < 0.25, -2, positions)).astype(np.int32)
        scores = np.round(rng.random((B, H, M)) * 4) / 4 if draw(st.booleans()) else rng.random((B, H, M))
        odd = rng.random((B, H, M))
        scores = np.where(odd < 0.05, np.nan, np.where(odd < 0.08, np.inf, scores)).astype(np.float32)
        layers.append((scores, positions))
    return layers


@settings(max_examples=100)
@given(scored_layers(), st.integers(0, 4), st.one_of(st.none(), st.integers(1, 6)), st.data())
def test_select_equals_its_reference_twin(layers, n_sink, cap, data):
    B = layers[0][0].shape[0]
    total = [data.draw(st.integers(1, 40)) for _ in range(B)]
    scores, positions = [s for s, _ in layers], [p for _, p in layers]
    got = budgets.select([mx.array(s) for s in scores], [mx.array(p) for p in positions], mx.array(total), n_sink,
                         cap)
    want = ref.select(scores, positions, total, n_sink, cap)
    for layer, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(np.array(g), w, err_msg=f"layer {layer}, total {total}, n_sink {n_sink}")
    if cap is not None:  # the promise: no head keeps more than cap; the rest as without a cap
        assert all(int(np.array(g).sum(axis=-1).max()) <= cap for g in got)
        return
    for b in range(B):  # the promise: min(total, tokens held) kept, sinks first, never a hole
        held = sum(int((p[b] >= 0).sum()) for p in positions)
        kept = sum(int(np.array(g)[b].sum()) for g in got)
        assert kept == min(total[b], held)
        sinks = sum(int(((p[b] >= 0) & (p[b] < n_sink)).sum()) for p in positions)
        kept_sinks = sum(int((np.array(g)[b] & (p[b] < n_sink)).sum()) for g, p in zip(got, positions))
        assert kept_sinks == min(sinks, total[b])
        assert not any((np.array(g)[b] & (p[b] < 0)).any() for g, p in zip(got, positions))


def test_select_is_one_budget_for_every_layer_and_head():
    """Six of 16 tokens over two layers of two heads: the four sinks, then the two best scores,
    both in layer 1's head 0, which keeps 3 tokens where the others keep their sink."""
    positions = mx.broadcast_to(mx.arange(4), (1, 2, 4))
    low = mx.full((1, 2, 4), 0.1)
    high = mx.array([[[0.9, 0.8, 0.7, 0.0], [0.1, 0.1, 0.1, 0.1]]])
    keep = budgets.select([low, high], [positions, positions], mx.array([6]), n_sink=1)
    assert [mx.sum(k, axis=-1).tolist() for k in keep] == [[[1, 1]], [[3, 1]]]  # sinks, then the best


def test_a_head_keeps_its_own_budget_after_a_selection():
    """After absorb_selected the head that kept 2 tokens keeps 2 + t and the one that kept 5
    keeps 5 + t (layer budget = held + t): the rule evicts within each head's own share."""
    cfg = H2OConfig(budget=8, n_sink=1, grace=1, decay=0.9)  # held 5 + t 3
    s = init(cfg, 1, 2, 4, dtype=mx.float32)
    kv = mx.random.normal((1, 2, 6, 4), key=mx.random.key(0))
    scores = mx.array([[[0.0] * 9 + [1, .5, .1, .1, .1, .1], [0.0] * 9 + [1, .5, .4, .3, .2, .1]]])
    keep = mx.array([[[False] * 9 + [True, True, False, False, False, False], [False] * 9 + [True] * 5 + [False]]])
    s = budgets.absorb_selected(s, kv, kv, scores, keep, held=5, capacity=9)
    assert budgets.tokens(s).tolist() == [[2, 5]] and budgets.reserved(s).tolist() == [[3, 0]]
    assert_invariants(s, cfg, selected=6)
    for t in range(10):
        k = mx.random.normal((1, 2, 1, 4), key=mx.random.key(t + 1))
        s = step(s, k, k, cfg)
        assert_invariants(s, cfg, selected=6)
        assert budgets.tokens(s).tolist() == [[2 + min(t + 1, 3), 5 + min(t + 1, 3)]]
    assert kept_positions(s)[0, 0, :1].tolist() == [0]  # the sink stays


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_widen_keeps_every_token_and_the_rule(extra):
    """A row widened by `extra` reserved slots at a budget `extra` larger keeps, token for
    token, what it would have kept unwidened (batches of rows of different layer budgets)."""
    cfg = H2OConfig(budget=5, n_sink=1, grace=1)
    wide = cfg._replace(budget=cfg.budget + extra)
    a = init(cfg, 1, 2, 4, dtype=mx.float32)
    for t in range(7):
        k = mx.random.normal((1, 2, 1, 4), key=mx.random.key(t))
        a = step(a, k, k, cfg)
    b = budgets.widen(a, extra)
    assert_invariants(b, wide)
    for t in range(7, 15):
        k = mx.random.normal((1, 2, 1, 4), key=mx.random.key(t))
        a, b = step(a, k, k, cfg), step(b, k, k, wide)
        assert kept_positions(a).tolist()[0][0][:5] == [p for p in kept_positions(b).tolist()[0][0] if p >= 0][:5]
        assert budgets.reserved(b).tolist() == [[extra, extra]]


def test_a_cap_bounds_every_head_and_gives_the_rest_to_the_others():
    """The same six of 16 with cap=2: layer 1's head 0 keeps its sink and its best token, and
    the sixth goes to the next best elsewhere: a 0.1 at the latest position, the earlier
    layer and head first."""
    positions = mx.broadcast_to(mx.arange(4), (1, 2, 4))
    low = mx.full((1, 2, 4), 0.1)
    high = mx.array([[[0.9, 0.8, 0.7, 0.0], [0.1, 0.1, 0.1, 0.1]]])
    keep = budgets.select([low, high], [positions, positions], mx.array([6]), n_sink=1, cap=2)
    assert [mx.sum(k, axis=-1).tolist() for k in keep] == [[[2, 1]], [[2, 1]]]
    with pytest.raises(ValueError, match="cap=0 is invalid"):
        budgets.select([low], [positions], mx.array([6]), n_sink=1, cap=0)
