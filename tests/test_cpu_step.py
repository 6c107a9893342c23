"""The C++ key step (`h2o_fn.metal_ops.cpu_step`) against its spec, the core's admit then
settle_key, bit for bit (rows, scores, positions, counts), over whole decodes, on random
states and in a model's decode loop; and its stores written in place only when nothing
else holds them."""

import sys

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from h2o_fn import H2OConfig, absorb, admit, init, settle_key
from h2o_fn.metal_ops import cpu_step

pytestmark = pytest.mark.skipif(not cpu_step.available(),
                                reason="the C++ key step is not built here (make setup: cmake, g++, nanobind)")


def both(s, k, v, cfg):
    return cpu_step.key_step(s, k, v, cfg), settle_key(admit(s, k, v), k, cfg)


def assert_same(got, want):
    for name in ("keys", "values", "positions", "length", "seen"):
        assert mx.array_equal(getattr(got, name), getattr(want, name)).item(), name
    assert mx.array_equal(got.scores, want.scores).item()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("B", [1, 3])
def test_a_decode_keeps_what_the_core_keeps(dtype, B):
    cfg = H2OConfig(budget=16, n_sink=2, grace=3, decay=0.98, scoring="key")
    s = init(cfg, B, 3, 8, dtype=dtype)
    mine = s
    for t in range(60):
        k, v = (mx.random.normal((B, 3, 1, 8), key=mx.random.key(2 * t + i)).astype(dtype) for i in (0, 1))
        mine, s = cpu_step.key_step(mine, k, v, cfg), settle_key(admit(s, k, v), k, cfg)
        assert_same(mine, s)  # two decodes side by side: nothing drifts
    assert s.length.tolist() == [16] * B


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**30), C=st.sampled_from([9, 65, 258]), n_sink=st.integers(0, 3),
       grace=st.integers(0, 4), decay=st.sampled_from([1.0, 0.9]), strided=st.booleans(),
       wide=st.booleans())
def test_random_states(seed, C, n_sink, grace, decay, strided, wide):
    cfg = H2OConfig(budget=C - 1, n_sink=n_sink, grace=grace, decay=decay, scoring="key")
    keys = mx.random.normal((2, 3, C + 7, 16), key=mx.random.key(seed))
    s = absorb(init(cfg, 2, 3, 16, dtype=mx.float32 if wide else mx.float16), keys, keys, cfg)
    k = mx.random.normal((2, 1, 3, 16), key=mx.random.key(seed + 1))
    k = k.transpose(0, 2, 1, 3) if strided else k.reshape(2, 3, 1, 16)  # as a model's projection hands it
    assert_same(*both(s, k, k * 2, cfg))


def test_stores_that_are_views_are_copied_first():
    cfg = H2OConfig(budget=8, n_sink=1, grace=1, scoring="key")
    kv = mx.random.normal((1, 3, 12, 4), key=mx.random.key(0))
    s = absorb(init(cfg, 1, 3, 4, dtype=mx.float32), kv, kv, cfg)
    mx.eval(s)
    rows = mx.array(s.keys.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # the same rows, strided
    s = s._replace(keys=rows, values=s.values[:, ::-1][:, ::-1])
    k = mx.random.normal((1, 3, 1, 4), key=mx.random.key(1))
    assert_same(*both(s, k, k, cfg))


def test_below_budget_and_a_key_only_cache():
    cfg = H2OConfig(budget=8, n_sink=1, grace=1, scoring="key")
    s = init(cfg, 1, 2, 4)
    s = s._replace(values=mx.zeros((1, 2, 9, 0), dtype=s.keys.dtype))  # rows of width 0
    for t in range(5):
        k = mx.random.normal((1, 2, 1, 4), key=mx.random.key(t))
        got, s = both(s, k, mx.zeros((1, 2, 1, 0)), cfg)
        assert_same(got, s)
    assert s.length.tolist() == [5]


@pytest.mark.parametrize("lazy_counts", [False, True])
def test_the_stores_are_written_in_place_when_nothing_else_holds_them(lazy_counts):
    """Also when, as in a model, only what attends to the new rows is evaluated and the scores
    and counts wait for the next token."""
    cfg = H2OConfig(budget=64, scoring="key")
    k = mx.ones((1, 3, 1, 64))
    s = cpu_step.key_step(init(cfg, 1, 3, 64), k, k, cfg)
    mx.eval(s)
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in range(3):
        s = cpu_step.key_step(s, k, k, cfg)  # the old state's arrays: held by the graph only
        mx.eval(s.keys.sum() + s.values.sum() if lazy_counts else s)
    assert mx.get_peak_memory() - held < s.keys.nbytes // 4  # no second store


def test_a_state_still_held_is_not_written():
    cfg = H2OConfig(budget=8, n_sink=1, grace=1, scoring="key")
    s = cpu_step.key_step(init(cfg, 1, 2, 4), mx.ones((1, 2, 1, 4)), mx.ones((1, 2, 1, 4)), cfg)
    mx.eval(s)
    keys = mx.array(s.keys)
    t = cpu_step.key_step(s, mx.full((1, 2, 1, 4), 2.0), mx.full((1, 2, 1, 4), 2.0), cfg)
    mx.eval(t)
    assert mx.array_equal(s.keys, keys).item() and not mx.array_equal(t.keys, keys).item()


def test_bad_inputs_name_what_was_expected():
    cfg = H2OConfig(budget=4, n_sink=1, grace=1, scoring="key")
    s = init(cfg, 1, 2, 8)
    with pytest.raises(ValueError, match="expected key"):
        cpu_step.module().key_step(*s, mx.zeros((1, 2, 2, 8)), mx.zeros((1, 2, 1, 8)), 1.0, 1.0, 0, 0, 4, 5)
    with pytest.raises(ValueError, match="scoring='key'"):
        cpu_step.key_step(s, mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 8)), cfg._replace(scoring="query"))
    with pytest.raises(ValueError, match="Hq a multiple"):
        cpu_step.attention(mx.zeros((1, 3, 1, 8)), s.keys, s.values, 1.0)
    rows = tuple(mx.quantize(mx.zeros((1, 2, 4, 64)), group_size=32, bits=8))  # two groups per row
    with pytest.raises(ValueError, match="one group per row"):
        cpu_step.attention(mx.zeros((1, 2, 1, 64)), rows, rows, 1.0)
    with pytest.raises(ValueError, match="expected key"):
        cpu_step.admit(s, mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 8)))
    with pytest.raises(ValueError, match="proxy rows"):
        cpu_step.attention(mx.zeros((1, 2, 1, 8)), s.keys, s.values, 1.0, mx.zeros((1, 2, 1, 4)))
    with pytest.raises(ValueError, match="span at most C"):
        cpu_step.settle_key(s, mx.zeros((1, 2, 1, s.scores.shape[-1] + 1)), cfg)


def test_a_module_built_for_another_mlx_is_refused(tmp_path, monkeypatch):
    (tmp_path / "_h2o_cpu_step.so").write_bytes(b"not a library")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "env"))
    monkeypatch.setattr(cpu_step, "library_dir", lambda: tmp_path)
    cpu_step.module.cache_clear()
    try:
        assert cpu_step.module() is None
    finally:
        cpu_step.module.cache_clear()


PROMPT = mx.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4])


def decode(model, cfg: H2OConfig, hooked: bool, kv_bits=None):
    """A tiny model's mlx-lm decode of 30 tokens through the adapter (rows in `kv_bits`, one
    group per row): (logits `[T, V]`, each layer's core state)."""
    from mlx_lm.generate import generate_step

    from h2o_fn.adapters.attention import remove_query_hook
    from h2o_fn.adapters.mlx_lm import h2o_caches, make_h2o_cache

    cache = make_h2o_cache(model, cfg, kv_bits=kv_bits, kv_group_size=model.args.hidden_size // model.args.num_attention_heads)
    if not hooked:
        remove_query_hook(model)
    logits = mx.stack([mx.array(lp) for _, lp in generate_step(PROMPT, model, prompt_cache=cache, max_tokens=30)])
    for c in h2o_caches(cache):
        c.flush()
    return logits, [c.core_state for c in h2o_caches(cache)]


@pytest.mark.parametrize("scoring, hooked, kv_bits, wide", [
    ("key", True, None, False), ("key", False, None, False), ("key", True, None, True), ("key", True, 8, True),
    ("query", True, None, False), ("query", True, 8, False)])
def test_a_models_decode_through_it_is_the_cores(scoring, hooked, kv_bits, wide, monkeypatch):
    """mlx-lm's decode loop with the adapter: the C++ ops (the key step; query's admit, attention
    and settle; 8-bit rows: attention and settle; key-scored tokens the key step does not take,
    `wide`: as for views above cpu_step.UP_TO, the attention with the proxy's rows and the settle
    by their logits) and the core's mlx ops give the same logits, kept positions and scores, bit
    for bit."""
    from h2o_fn.adapters import attention
    from h2o_fn.adapters.attention import remove_query_hook
    from tiny_models import tiny_model

    model = tiny_model("llama", hidden_size=128)  # head_dim 32: one group of 8-bit codes per row
    cfg = H2OConfig(budget=12, n_sink=1, grace=2, scoring=scoring)
    if wide:  # the paths of views wider than these thresholds, at this model's size
        monkeypatch.setattr(cpu_step, "UP_TO", 0)
        monkeypatch.setattr(attention, "FUSED_UP_TO", 0)
    calls = {}
    if scoring == "key":
        ops = (["admit", "attention", "settle_key"] + (["newest_row"] if kv_bits else [])) if wide else ["key_step"]
    else:
        ops = ["admit", "attention", "settle"]
    for name in ops:
        op = getattr(cpu_step, name)
        monkeypatch.setattr(cpu_step, name, lambda *a, op=op, name=name: (calls.setdefault(name, []).append(1), op(*a))[1])
    try:
        (a, sa) = decode(model, cfg, hooked, kv_bits)
        n = {name: len(c) for name, c in calls.items()}
        monkeypatch.setattr(cpu_step, "available", lambda: False)  # the core's path from here
        (b, sb) = decode(model, cfg, hooked, kv_bits)
    finally:
        remove_query_hook(model)
    assert min(n.values()) >= 29 * len(sa) and len(n) == len(ops)  # every decode token, every layer
    assert {name: len(c) for name, c in calls.items()} == n  # and none in the second run
    assert mx.array_equal(a, b).item()
    for x, y in zip(sa, sb):
        assert mx.array_equal(x.positions, y.positions).item() and mx.array_equal(x.scores, y.scores).item()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**30), C=st.sampled_from([9, 65, 258]), n_sink=st.integers(0, 3),
       grace=st.integers(0, 4), decay=st.sampled_from([1.0, 0.9]), odd=st.booleans())
def test_a_weights_settle_is_the_cores(seed, C, n_sink, grace, decay, odd):
    """`cpu_step.settle` (query scoring's decode settle) against `core.settle`, bit for bit, odd
    weights (NaN, inf, negative) included."""
    from h2o_fn import settle

    cfg = H2OConfig(budget=C - 1, n_sink=n_sink, grace=grace, decay=decay, scoring="query")
    kv = mx.random.normal((2, 3, C + 5, 8), key=mx.random.key(seed))
    k = mx.random.normal((2, 3, 1, 8), key=mx.random.key(seed + 1))
    admitted = admit(absorb(init(cfg, 2, 3, 8), kv, kv, cfg, weights=mx.random.uniform(
        shape=(2, 3, C + 5, 2 * C + 5), key=mx.random.key(seed + 2))), k, k)
    w = mx.random.uniform(shape=(2, 3, C), key=mx.random.key(seed + 3))
    if odd:
        w = mx.where(w < 0.1, mx.nan, mx.where(w > 0.9, -w, mx.where((w > 0.5) & (w < 0.52), mx.inf, w)))
    got, want = cpu_step.settle(admitted, w, cfg), settle(admitted, w, cfg)
    for name in ("scores", "positions", "length", "seen"):
        assert mx.array_equal(getattr(got, name), getattr(want, name)).item(), name


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**30), C=st.sampled_from([9, 65, 258, 1400]), n_sink=st.integers(0, 3),
       grace=st.integers(0, 4), decay=st.sampled_from([1.0, 0.9]), narrow=st.booleans(), odd=st.booleans())
def test_a_key_settle_by_logits_is_the_cores(seed, C, n_sink, grace, decay, narrow, odd):
    """`cpu_step.settle_key` (a key-scored token whose proxy logits attention computed) against
    `core.settle_key` with those logits over the view, bit for bit: logits over every slot or
    the first few (0 beyond), odd ones (NaN, huge) included, states within mx.softmax's size
    (`exact`) and above it (C=1400: h2o_fn.softmax's exp)."""
    from h2o_fn.view import decode_weights

    cfg = H2OConfig(budget=C - 1, n_sink=n_sink, grace=grace, decay=decay, scoring="key")
    kv = mx.random.normal((2, 3, C + 5, 8), key=mx.random.key(seed))
    k = mx.random.normal((2, 3, 1, 8), key=mx.random.key(seed + 1))
    admitted = admit(absorb(init(cfg, 2, 3, 8), kv, kv, cfg), k, k)
    logits = mx.random.normal((2, 3, 1, C // 2 if narrow else C), key=mx.random.key(seed + 3)) * 4
    if odd:
        logits = mx.where(logits > 7, mx.nan, mx.where(logits < -7, 1e30, logits))
    assert cpu_step.exact(admitted) == (C < 1400)
    got = cpu_step.settle_key(admitted, logits, cfg)
    want = settle_key(admitted, k, cfg, logits=decode_weights(logits, admitted))
    for name in ("scores", "positions", "length", "seen"):
        assert mx.array_equal(getattr(got, name), getattr(want, name)).item(), name


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**30), dtype=st.sampled_from([mx.float16, mx.bfloat16, mx.float32]),
       shape=st.sampled_from([(1, 9, 3, 257, 64), (2, 4, 2, 33, 16), (1, 2, 2, 1, 8), (2, 6, 1, 130, 32),
                              (1, 6, 3, 2049, 16)]),
       sliced=st.booleans(), big=st.booleans(), q8=st.booleans(), proxy=st.booleans())
def test_one_querys_attention_is_the_hooks(seed, dtype, shape, sliced, big, q8, proxy):
    """`cpu_step.attention` against `attention_with_weights` then `per_kv_head`, bit for bit
    (output and weights), keys and values as a store's first L rows or on their own, dense or
    8-bit (one group per row), logits large enough that most weights underflow (`big`); with
    the key proxy's rows, against `attention_with_proxy` (output and the rows' logits)."""
    from h2o_fn.adapters.attention import attention_with_proxy, attention_with_weights, per_kv_head

    B, Hq, H, L, D = shape
    q = (mx.random.normal((B, Hq, 1, D), key=mx.random.key(seed)) * (30 if big else 1)).astype(dtype)
    kv = mx.random.normal((2, B, H, L + 3 * sliced, D), key=mx.random.key(seed + 1)).astype(dtype)
    if q8 and D >= 32:
        k, v = (tuple(x[:, :, :L] for x in mx.quantize(kv[i], group_size=D, bits=8)) for i in (0, 1))
    else:
        q8, k, v = False, kv[0, :, :, :L], kv[1, :, :, :L]
    assert cpu_step.attends(q, k, v, 8 if q8 else None)
    if proxy:
        rows = mx.random.normal((B, H, 1, D), key=mx.random.key(seed + 2)) * D ** -0.5
        out, _, logits = cpu_step.attention(q, k, v, D ** -0.5, rows)
        want, wl = attention_with_proxy(q, k, v, D ** -0.5, None, rows, 8 if q8 else None, D)
        assert out.dtype == want.dtype and mx.array_equal(out, want).item()
        assert mx.array_equal(logits, wl).item()
        return
    out, w = cpu_step.attention(q, k, v, D ** -0.5)
    want, ww = attention_with_weights(q, k, v, D ** -0.5, bits=8 if q8 else None, group_size=D)
    assert out.dtype == want.dtype and mx.array_equal(out, want).item()
    assert mx.array_equal(w, per_kv_head(ww, H)).item()


@pytest.mark.parametrize("dtype, bits", [(mx.float16, None), (mx.bfloat16, None), (mx.float32, None),
                                         (mx.float16, 8), (mx.float32, 8), (mx.float32, 4)])
def test_an_admit_is_the_cores(dtype, bits):
    """`cpu_step.admit` against `core.admit` over a query-scored decode (each token settled by
    random weights), every field bit for bit (quantized rows: each of the stores' arrays), the
    rows written in place when nothing holds them."""
    from h2o_fn import settle
    from h2o_fn.storage import DENSE, Storage, parts

    cfg = H2OConfig(budget=16, n_sink=2, grace=3, scoring="query")
    kv = DENSE if bits is None else Storage(bits=bits, group_size=32)
    D = 8 if bits is None else 64
    s = mine = init(cfg, 2, 3, D, dtype=dtype, kv=kv)
    for t in range(40):
        k, v = (mx.random.normal((2, 3, 1, D), key=mx.random.key(2 * t + i)) for i in (0, 1))  # float32 rows
        a, b = cpu_step.admit(mine, k, v, kv), admit(s, k, v, kv)
        for name in ("keys", "values"):
            assert all(mx.array_equal(x, y).item() for x, y in zip(parts(getattr(a, name)), parts(getattr(b, name))))
        for name in ("scores", "positions", "length", "seen"):
            assert mx.array_equal(getattr(a, name), getattr(b, name)).item(), name
        w = mx.random.uniform(shape=(2, 3, 17), key=mx.random.key(100 + t))
        mine, s = settle(a, w, cfg), settle(b, w, cfg)
    big = H2OConfig(budget=256, scoring="query")
    k = mx.ones((1, 3, 1, 64), dtype=dtype)
    s = settle(cpu_step.admit(init(big, 1, 3, 64, dtype=dtype), k, k), mx.zeros((1, 3, 257)), big)
    mx.eval(s)
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in range(3):
        s = cpu_step.settle(cpu_step.admit(s, k, k), mx.zeros((1, 3, 257)), big)  # the old state: held by the graph only
        mx.eval(s)
    assert mx.get_peak_memory() - held < s.keys.nbytes // 2  # no second store


@pytest.mark.parametrize("B, C, full", [(1, 5, False), (2, 9, True), (3, 40, False)])
def test_the_newest_row_read_back_is_the_proxys_query(B, C, full):
    """`cpu_step.newest_row` of an admitted 8-bit state against `view.proxy_query` (the key
    quantized again, dequantized, scaled), bit for bit, wherever admit put it (the first free
    slot; slot 0 of a full state)."""
    from h2o_fn.storage import Storage
    from h2o_fn.view import proxy_query

    kv = Storage(bits=8, group_size=64)
    cfg = H2OConfig(budget=C, n_sink=1, grace=1, scoring="key")
    s = init(cfg, B, 3, 64, dtype=mx.float32, kv=kv)
    for t in range(C + 3 if full else C // 2):
        k = 3 * mx.random.normal((B, 3, 1, 64), key=mx.random.key(t))
        a = cpu_step.admit(s, k, k, kv)
        assert cpu_step.reads_back(a, kv)
        assert mx.array_equal(cpu_step.newest_row(a), proxy_query(a, k, kv)).item()
        s = settle_key(a, k, cfg, kv=kv) if not full else a
    assert not cpu_step.reads_back(a, Storage(bits=4, group_size=64))
    assert not cpu_step.reads_back(init(cfg, B, 3, 64, dtype=mx.float16, kv=kv), kv)  # float16 scales: mlx ops
