"""The core against the NumPy reference (the spec), token by token and chunk by chunk."""

import mlx.core as mx
import numpy as np
from hypothesis import given, strategies as st

import h2o_fn
from h2o_fn import H2OConfig, absorb, assert_invariants, init, step
from h2o_fn import reference as ref

from helpers import assert_matches, chunk_weights, core_weights
from strategies import chunk_sizes, configs, shapes, streams


def run_chunks(cfg, shape, stream, sizes, check_every=True):
    """Absorb `stream` in chunks of `sizes` into core and reference; compare after each."""
    state = init(cfg, shape.B, shape.H, shape.D, dtype=mx.float32)
    rstate = ref.init(cfg, shape.B, shape.H, shape.D)
    start = 0
    for n in sizes:
        k = stream.keys[:, :, start : start + n]
        v = stream.values[:, :, start : start + n]
        pw = chunk_weights(stream, start, n) if cfg.scoring == "query" else None
        cw = None if pw is None else core_weights(state, pw, cfg.capacity)
        state = absorb(state, mx.array(k), mx.array(v), cfg, weights=cw)
        rstate = ref.absorb(rstate, k, v, cfg, weights=pw)
        start += n
        if check_every:
            assert_invariants(state, cfg)
            assert_matches(state, rstate, where=f"after {start} tokens, {cfg}")
    return state, rstate


@given(st.data())
def test_step_matches_reference_every_token(data):
    cfg = data.draw(configs(scoring="key", prefill="greedy"))
    shape = data.draw(shapes())
    stream = data.draw(streams(shape, decay=cfg.decay))
    state = init(cfg, shape.B, shape.H, shape.D, dtype=mx.float32)
    rstate = ref.init(cfg, shape.B, shape.H, shape.D)
    for t in range(stream.keys.shape[2]):
        k, v = stream.keys[:, :, t : t + 1], stream.values[:, :, t : t + 1]
        state = step(state, mx.array(k), mx.array(v), cfg)
        rstate = ref.step(rstate, k, v, cfg)
        assert_invariants(state, cfg)
        assert_matches(state, rstate, where=f"token {t}, {cfg}")


@given(st.data())
def test_absorb_matches_reference_every_chunk(data):
    """Both prefills, both scorings, chunks straddling the budget."""
    cfg = data.draw(configs())
    shape = data.draw(shapes(max_d=16))
    stream = data.draw(streams(shape, decay=cfg.decay))
    sizes = data.draw(chunk_sizes(stream.keys.shape[2]))
    run_chunks(cfg, shape, stream, sizes)


@given(st.data())
def test_query_single_tokens_match_reference(data):
    """scoring="query", one token per absorb: the decode path of true-query scoring."""
    cfg = data.draw(configs(scoring="query", prefill="greedy"))
    shape = data.draw(shapes(max_d=8))
    stream = data.draw(streams(shape, max_len=80, decay=cfg.decay))
    run_chunks(cfg, shape, stream, [1] * stream.keys.shape[2])


def test_every_core_function_has_a_reference_twin():
    """The reference mirrors the core by name (jax's lax_reference habit)."""
    for name in ["init", "step", "absorb", "evict", "kept_positions", "key_weights"]:
        assert callable(getattr(h2o_fn, name)) and callable(getattr(ref, name)), name


def test_evict_matches_reference_on_an_over_budget_state():
    """evict takes exactly the (score, position) minimum among the unprotected."""
    cfg = H2OConfig(budget=4, n_sink=1, grace=1, decay=1.0)
    state = init(cfg, 1, 1, 2, dtype=mx.float32)
    state = state._replace(
        scores=mx.array([[[5.0, 0.5, 0.25, 0.25, 0.0]]]),
        positions=mx.array([[[0, 1, 2, 3, 4]]], dtype=mx.int32),
        length=mx.array(5, dtype=mx.int32),
        seen=mx.array(5, dtype=mx.int32),
    )
    rstate = ref.init(cfg, 1, 1, 2)
    rstate.heads[0][0] = [ref.Token(p, np.zeros(2), np.zeros(2), s)
                          for p, s in zip(range(5), [5.0, 0.5, 0.25, 0.25, 0.0])]
    rstate.seen = 5
    out, rout = h2o_fn.evict(state, cfg), ref.evict(rstate, cfg)
    assert ref.kept_positions(rout) == [[[0, 1, 3, 4]]]  # tie 2 vs 3 -> lower position; 4 in grace
    assert_matches(out, rout)
