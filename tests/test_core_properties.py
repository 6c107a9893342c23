"""Properties of the core that need no reference: freeze, decay, chunks, bad input."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

import h2o_fn
from h2o_fn import (
    H2OConfig,
    Prompt,
    Storage,
    absorb,
    accumulate,
    admit,
    assert_invariants,
    evict,
    init,
    key_weights,
    protected_argmin,
    scored_queries,
    step,
)
from h2o_fn.rule import evict_lowest

from helpers import admitted_weights, chunk_weights, core_weights, kept, rows, same, scores
from strategies import configs, make_stream, prompts, shapes, storages, streams


def run_steps(cfg, keys, values=None, dtype=mx.float32):
    B, H, T, D = keys.shape
    values = keys if values is None else values
    state = init(cfg, B, H, D, dtype=dtype)
    for t in range(T):
        state = step(state, mx.array(keys[:, :, t : t + 1]), mx.array(values[:, :, t : t + 1]), cfg)
        assert_invariants(state, cfg)
    return state


def test_published_algorithm_freezes_on_the_first_budget_tokens():
    """grace=0, decay=1: the newest token scores 0 < everyone else, so it is evicted at once."""
    cfg = H2OConfig(budget=16, n_sink=0, grace=0, decay=1.0)
    keys = make_stream((1, 2, 8), 200, seed=1, style="normal", scale=1.0).keys
    state = run_steps(cfg, keys)
    assert kept(state) == [[list(range(16))] * 2]


def test_defaults_advance_the_window():
    """grace and decay: recent tokens are kept and the window follows the stream."""
    cfg = H2OConfig(budget=16, n_sink=2, grace=4, decay=0.5)
    keys = make_stream((1, 2, 8), 200, seed=1, style="normal", scale=1.0).keys
    state = run_steps(cfg, keys)
    for head in kept(state)[0]:
        assert head[:2] == [0, 1] and head[-4:] == [196, 197, 198, 199]
        assert min(head[2:]) > 100, head


def test_decay_one_is_a_plain_running_sum():
    """decay=1.0: each score is exactly the sum of the key-proxy weights it received."""
    cfg = H2OConfig(budget=64, n_sink=0, grace=0, decay=1.0)
    keys = make_stream((1, 1, 4), 40, seed=3, style="normal", scale=1.0).keys
    state = init(cfg, 1, 1, 4, dtype=mx.float32)
    total = mx.zeros((1, 1, cfg.budget + 1))
    for t in range(40):
        k = mx.array(keys[:, :, t : t + 1])
        total = total + key_weights(state, k)[..., 0, :]
        state = step(state, k, k, cfg)
    assert mx.array_equal(state.scores, total)


def test_strong_decay_lets_a_late_token_outscore_an_early_one():
    """Without decay scores only grow with age; with decay a recent heavy hitter wins."""
    keys = make_stream((1, 1, 8), 60, seed=5, style="normal", scale=1.0).keys
    flat = run_steps(H2OConfig(budget=64, n_sink=0, grace=0, decay=1.0), keys)
    decayed = run_steps(H2OConfig(budget=64, n_sink=0, grace=0, decay=0.8), keys)
    s_flat, s_dec = scores(flat)[0][0], scores(decayed)[0][0]
    ages = np.array(sorted(s_flat))
    assert np.corrcoef(ages, [s_flat[p] for p in ages])[0, 1] < -0.8
    assert any(s_dec[late] > s_dec[early] for early in range(10) for late in range(40, 55))
    assert all(s_dec[p] < s_flat[p] for p in range(30))


@given(st.data())
def test_greedy_absorb_equals_steps_without_eviction(data):
    """Below budget a greedy chunk is the N steps: same slots, rows and positions."""
    cfg, kv = data.draw(configs(scoring="key", prefill="greedy")), data.draw(storages())
    shape = data.draw(shapes(max_d=16, kv=kv))
    stream = data.draw(streams(shape, max_len=cfg.budget, decay=cfg.decay))
    k, v = mx.array(stream.keys), mx.array(stream.values)
    T = k.shape[2]
    stepped = init(cfg, shape.B, shape.H, shape.D, dtype=mx.float32, kv=kv)
    for t in range(T):
        stepped = step(stepped, k[:, :, t : t + 1], v[:, :, t : t + 1], cfg, kv=kv)
    chunked = absorb(init(cfg, shape.B, shape.H, shape.D, dtype=mx.float32, kv=kv), k, v, cfg, kv=kv)
    for field in ("keys", "values", "positions", "length", "seen"):
        assert same(getattr(stepped, field), getattr(chunked, field)), field
    # scores: the same sums, reassociated (one weight pass vs T passes): float32 rounding only
    np.testing.assert_allclose(np.array(chunked.scores), np.array(stepped.scores), rtol=1e-5, atol=1e-6)


@given(st.data())
def test_a_prompt_chunks_last_window_weights_are_enough(data):
    """Query scoring, oneshot: a chunk longer than the window absorbs the same from the
    weights of its last `scored_queries` queries as from all N (the others do not score):
    the same kept positions and rows, scores equal up to float32 reassociation."""
    cfg, kv = data.draw(configs(scoring="query", prefill="oneshot")), data.draw(storages())
    prompt = data.draw(prompts())._replace(window=data.draw(st.integers(1, 12)))
    shape = data.draw(shapes(max_d=16, kv=kv))
    stream = data.draw(streams(shape, min_len=prompt.window + 1, max_len=cfg.budget + 40, decay=cfg.decay))
    k, v = mx.array(stream.keys), mx.array(stream.values)
    prefix = data.draw(st.integers(0, k.shape[2] - prompt.window - 1))
    state = init(cfg, shape.B, shape.H, shape.D, dtype=mx.float32, kv=kv)
    if prefix:
        w = core_weights(state, chunk_weights(stream, 0, prefix))
        state = absorb(state, k[:, :, :prefix], v[:, :, :prefix], cfg, w, prompt=prompt, kv=kv)
    N = k.shape[2] - prefix
    M = scored_queries(N, cfg, prompt=prompt)
    assert M == prompt.window < N
    w = core_weights(state, chunk_weights(stream, prefix, N))  # [B, H, N, C + N]
    full = absorb(state, k[:, :, prefix:], v[:, :, prefix:], cfg, w, prompt=prompt, kv=kv)
    last = absorb(state, k[:, :, prefix:], v[:, :, prefix:], cfg, w[:, :, N - M :], prompt=prompt, kv=kv)
    assert kept(last) == kept(full)
    for field in ("keys", "values", "positions", "length", "seen"):
        assert same(getattr(last, field), getattr(full, field)), field
    np.testing.assert_allclose(np.array(last.scores), np.array(full.scores), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=f"expected \\(.*, {M} or {N},"):
        absorb(state, k[:, :, prefix:], v[:, :, prefix:], cfg, w[:, :, N - M + 1 :], prompt=prompt, kv=kv)


@given(st.data())
def test_a_chunk_written_into_free_slots_keeps_what_absorb_keeps(data):
    """A chunk that fits the room (nothing evicted), written where it lies (`admit_chunk`) and
    scored (`settle_chunk`), keeps absorb's positions with the same rows and scores per
    position (scores up to float32 reassociation); only the slot layout differs."""
    scoring = data.draw(st.sampled_from(["key", "query"]))
    cfg, kv = data.draw(configs(scoring=scoring, prefill="oneshot")), data.draw(storages())
    prompt = data.draw(prompts())
    shape = data.draw(shapes(max_d=16, kv=kv))
    stream = data.draw(streams(shape, min_len=2, max_len=max(cfg.budget, 2), decay=cfg.decay))
    k, v = mx.array(stream.keys), mx.array(stream.values)
    assume(k.shape[2] <= cfg.budget)  # the chunk fits: nothing is evicted
    start = data.draw(st.integers(1, k.shape[2] - 1))
    N = k.shape[2] - start
    state = init(cfg, shape.B, shape.H, shape.D, dtype=mx.float32, kv=kv)
    w = None if scoring == "key" else core_weights(state, chunk_weights(stream, 0, start))
    state = absorb(state, k[:, :, :start], v[:, :, :start], cfg, w, prompt=prompt, kv=kv)
    chunk = (k[:, :, start:], v[:, :, start:])
    w = None if scoring == "key" else core_weights(state, chunk_weights(stream, start, N))  # [B, H, N, C + N]
    want = absorb(state, *chunk, cfg, w, prompt=prompt, kv=kv)
    C = state.positions.shape[-1]
    if w is not None:
        w = admitted_weights(w, C, start)
    got = h2o_fn.prefill.settle_chunk(h2o_fn.prefill.admit_chunk(state, *chunk, start, kv), chunk[0], cfg, start,
                                      w, prompt, kv)
    assert kept(got) == kept(want)
    assert got.length.tolist() == want.length.tolist() and got.seen.tolist() == want.seen.tolist()
    for g_row, w_row in zip(scores(got), scores(want)):
        for g, ws in zip(g_row, w_row):
            np.testing.assert_allclose([g[p] for p in sorted(ws)], [ws[p] for p in sorted(ws)], rtol=1e-5, atol=1e-6)
    for which in ("keys", "values"):
        for g_row, w_row in zip(rows(got, which, kv), rows(want, which, kv)):
            for g, ws in zip(g_row, w_row):
                assert all(np.array_equal(g[p], ws[p]) for p in ws), which
    with pytest.raises(ValueError, match="start=.* is invalid"):
        h2o_fn.prefill.admit_chunk(state, *chunk, C - N + 1, kv)


@given(st.data())
def test_bottom_k_equals_k_single_evictions(data):
    """evict_lowest(k) frees exactly what k successive protected_argmin calls free, with
    two sorts or with a partition of at most `at_most` >= k keys."""
    C = data.draw(st.integers(1, 40))
    n_sink, grace = data.draw(st.integers(0, 5)), data.draw(st.integers(0, 5))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    s = rng.choice([0.0, -0.0, 0.25, 0.5, 1.0, np.inf, -np.inf, np.nan], size=(2, 3, C))
    s = s.astype(np.float32)
    p = np.stack([rng.permutation(C) for _ in range(6)]).reshape(2, 3, C).astype(np.int32)
    p = np.where(rng.random((2, 3, C)) < 0.2, -1, p).astype(np.int32)
    newest, k = mx.array(C - 1, dtype=mx.int32), data.draw(st.integers(0, C))
    scores_, positions = mx.array(s), mx.array(p)
    gone = np.zeros((2, 3, C), bool)
    for _ in range(k):
        slot = np.array(protected_argmin(scores_, positions, newest, n_sink, grace))
        for b in range(2):
            for h in range(3):
                if slot[b, h] >= 0:
                    gone[b, h, slot[b, h]] = True
        positions = mx.array(np.where(gone, -1, p).astype(np.int32))
    batch = np.array(evict_lowest(mx.array(s), mx.array(p), mx.array(k), newest, n_sink, grace))
    assert (batch == gone).all()
    at_most = data.draw(st.integers(max(k, 1), C))  # a partition of at_most >= k keys: the same mask
    bounded = evict_lowest(mx.array(s), mx.array(p), mx.array(k), newest, n_sink, grace, at_most=at_most)
    assert (np.array(bounded) == gone).all()


@pytest.mark.parametrize("prefill", ["greedy", "oneshot"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_keys_keep_the_invariants(prefill, bad):
    """NaN/inf keys give non-finite weights; they count as 0 and scores stay finite >= 0."""
    cfg = H2OConfig(budget=8, n_sink=2, grace=2, prefill=prefill)
    keys = make_stream((1, 2, 4), 40, seed=7, style="normal", scale=1.0).keys
    keys[:, :, 5, 1] = bad
    keys[:, 1, 20:23] = bad
    k = mx.array(keys)
    state = run_steps(cfg, keys)
    chunked = init(cfg, 1, 2, 4, dtype=mx.float32)
    for start in range(0, 40, 7):
        chunked = absorb(chunked, k[:, :, start : start + 7], k[:, :, start : start + 7], cfg)
        assert_invariants(chunked, cfg)
    assert kept(state)[0][0][-2:] == [38, 39]


@pytest.mark.parametrize("prefill", ["greedy", "oneshot"])
def test_non_finite_and_negative_query_weights_count_as_zero(prefill):
    cfg = H2OConfig(budget=6, n_sink=1, grace=1, scoring="query", prefill=prefill)
    state = init(cfg, 1, 1, 2, dtype=mx.float32)
    for t in range(12):
        w = np.full((1, 1, 1, cfg.budget + 2), [np.nan, np.inf, -1.0, 0.5][t % 4], np.float32)
        k = mx.ones((1, 1, 1, 2))
        state = absorb(state, k, k, cfg, weights=mx.array(w))
        assert_invariants(state, cfg)
    assert float(mx.max(state.scores).item()) < 2.0


@pytest.mark.parametrize("prefill", ["greedy", "oneshot"])
def test_query_decode_building_blocks_equal_absorb_of_one_token(prefill):
    """admit -> accumulate(weights over slots) -> evict is absorb(weights) for N = 1."""
    cfg = H2OConfig(budget=5, n_sink=1, grace=1, decay=0.9, scoring="query", prefill=prefill)
    rng = np.random.default_rng(0)
    a = b = init(cfg, 1, 2, 3, dtype=mx.float32)
    for t in range(15):
        k = mx.array(rng.standard_normal((1, 2, 1, 3)).astype(np.float32))
        by_position = rng.random((1, 2, 1, t + 1)).astype(np.float32)  # query t's weight on each position
        a = absorb(a, k, k, cfg, weights=core_weights(a, by_position))
        admitted = admit(b, k, k)
        pos = np.array(admitted.positions)
        over_slots = np.where(pos >= 0, np.take_along_axis(by_position[:, :, 0], np.maximum(pos, 0), -1), 0)
        b = evict(accumulate(admitted, mx.array(over_slots), cfg), cfg)
        assert kept(a) == kept(b)
        for sa, sb in zip(scores(a)[0], scores(b)[0]):
            assert sa.keys() == sb.keys()
            np.testing.assert_allclose([sa[p] for p in sa], [sb[p] for p in sa], rtol=1e-6)


def test_a_4000_token_absorb_below_budget_completes():
    cfg = H2OConfig(budget=4096, n_sink=4, grace=16)
    keys = make_stream((1, 2, 16), 4000, seed=11, style="normal", scale=1.0).keys
    k = mx.array(keys).astype(mx.float16)
    for prefill in ("greedy", "oneshot"):
        c = cfg._replace(prefill=prefill)
        state = absorb(init(c, 1, 2, 16), k, k, c)
        mx.eval(state)
        assert state.length.tolist() == [4000] and state.seen.tolist() == [4000]
        assert_invariants(state, c)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(budget=0), "budget"),
        (dict(budget=-3), "budget"),
        (dict(n_sink=-1), "n_sink"),
        (dict(grace=-1), "grace"),
        (dict(budget=8, n_sink=4, grace=4), "n_sink + grace"),
        (dict(decay=0.0), "decay"),
        (dict(decay=1.5), "decay"),
        (dict(decay=float("nan")), "decay"),
        (dict(scoring="value"), "scoring"),
        (dict(prefill="lazy"), "prefill"),
        (dict(budget=8.0), "budget"),
    ],
)
def test_bad_configs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("+", r"\+")):
        H2OConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [(dict(bits=7), "bits"), (dict(bits=True), "bits"),
                                           (dict(group_size=16), "group_size")])
def test_bad_storages_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"Storage.{field}="):
        Storage(**kwargs)


def test_a_storage_the_state_was_not_built_with_is_refused():
    """Rows written with another storage than `init`'s would be stored in the wrong form."""
    cfg, tok = H2OConfig(budget=8, n_sink=1, grace=1), mx.zeros((1, 2, 1, 64))
    with pytest.raises(ValueError, match="expected the storage the state was built with"):
        step(init(cfg, 1, 2, 64), tok, tok, cfg, kv=Storage(8, 32))
    with pytest.raises(ValueError, match="its keys are quantized"):
        absorb(init(cfg, 1, 2, 64, kv=Storage(8, 32)), tok, tok, cfg)
    with pytest.raises(ValueError, match="2 groups per row"):  # groups of 32, told 64
        admit(init(cfg, 1, 2, 64, kv=Storage(8, 32)), tok, tok, Storage(8, 64))
    with pytest.raises(ValueError, match="its keys are quantized"):
        key_weights(init(cfg, 1, 2, 64, kv=Storage(4, 32)), tok)
    with pytest.raises(ValueError, match="D=32"):  # 4 bits read as 8: the rows' width gives it away
        step(init(cfg, 1, 2, 64, kv=Storage(4, 64)), tok, tok, cfg, kv=Storage(8, 32))
    with pytest.raises(TypeError, match="expected an h2o_fn.Storage"):
        admit(init(cfg, 1, 2, 64), tok, tok, cfg)  # the config where the storage goes


@pytest.mark.parametrize("kwargs, field", [(dict(window=-1), "window"), (dict(window=2.0), "window"),
                                           (dict(pool=4), "pool"), (dict(pool=0), "pool")])
def test_bad_prompts_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"Prompt.{field}="):
        Prompt(**kwargs)


def test_replace_validates_too():
    with pytest.raises(ValueError, match="grace"):
        H2OConfig(budget=8)._replace(grace=-2)


def test_mismatched_shapes_raise():
    cfg = H2OConfig(budget=8, n_sink=1, grace=1)
    state = init(cfg, 1, 2, 4)
    with pytest.raises(ValueError, match=r"head_dim|D=4"):
        step(state, mx.zeros((1, 2, 1, 5)), mx.zeros((1, 2, 1, 5)), cfg)
    with pytest.raises(ValueError, match="H=2"):
        absorb(state, mx.zeros((1, 3, 2, 4)), mx.zeros((1, 3, 2, 4)), cfg)
    with pytest.raises(ValueError, match="empty chunk"):
        absorb(state, mx.zeros((1, 2, 0, 4)), mx.zeros((1, 2, 0, 4)), cfg)
    with pytest.raises(ValueError, match="1 token"):
        step(state, mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)), cfg)
    with pytest.raises(ValueError, match="scoring"):
        absorb(state, mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)), cfg, weights=mx.zeros((1, 2, 1, 10)))
    q = cfg._replace(scoring="query")
    with pytest.raises(ValueError, match="scoring"):
        absorb(state, mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)), q)
    with pytest.raises(ValueError, match=r"expected \(1, 2, 1, 10\)"):
        absorb(state, mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)), q, weights=mx.zeros((1, 2, 1, 9)))
    with pytest.raises(ValueError, match="scoring='query'"):
        step(state, mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)), q)


@settings(max_examples=30)
@given(data=st.data())
def test_quantized_products_equal_the_dequantized_rows(data):
    """`storage.matmul_t` / `matmul` multiply quantized rows where they lie (8 bits: the codes
    read as bytes, per group) and give the products of the dequantized rows."""
    from h2o_fn import storage

    kv = h2o_fn.Storage(data.draw(st.sampled_from([8, 8, 6, 4, 3, 2])), data.draw(st.sampled_from([32, 64])))
    G = data.draw(st.integers(1, 3))
    D, N, C = kv.group_size * G, data.draw(st.integers(1, 5)), data.draw(st.integers(1, 40))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    rows = mx.array(rng.normal(size=(2, 3, C, D)).astype(np.float32) * 3 + 0.5)
    store = storage.quantize(rows, kv.bits, kv.group_size)
    dense = storage.dense(store, kv.bits, kv.group_size)
    x = mx.array(rng.normal(size=(2, 3, N, D)).astype(np.float32))
    w = mx.softmax(mx.array(rng.normal(size=(2, 3, N, C)).astype(np.float32)), axis=-1)
    got, want = storage.matmul_t(x, store, kv.bits, kv.group_size), x @ dense.swapaxes(-1, -2)
    assert mx.allclose(got, want, atol=1e-4 * (1 + mx.abs(want).max().item()), rtol=1e-5), kv
    got, want = storage.matmul(w, store, kv.bits, kv.group_size), w @ dense
    assert mx.allclose(got, want, atol=1e-5 * (1 + mx.abs(want).max().item()), rtol=1e-5), kv


@settings(max_examples=40)
@given(data=st.data())
def test_dense_rows_are_mx_dequantize_bit_for_bit(data):
    """`storage.dense` reads 8-bit rows itself (codes times scale plus bias) instead of calling
    mx.dequantize: the same values, bit for bit, in every dtype a model stores."""
    from h2o_fn import storage

    dtype = data.draw(st.sampled_from([mx.float32, mx.float16, mx.bfloat16]))
    group, G = data.draw(st.sampled_from(storage.KV_GROUP_SIZES)), data.draw(st.integers(1, 3))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    scale = data.draw(st.sampled_from([1e-3, 1.0, 30.0]))
    rows = mx.array(rng.normal(size=(2, 3, data.draw(st.integers(1, 9)), group * G)).astype(np.float32) * scale)
    store = storage.quantize(rows.astype(dtype), 8, group)
    got, want = storage.dense(store, 8, group), mx.dequantize(*store, group_size=group, bits=8)
    assert got.dtype == want.dtype == dtype
    assert mx.array_equal(got, want).item(), (dtype, group, G, scale)
