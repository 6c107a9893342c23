"""The mlx-lm adapter on tiny random-weight models of several architectures."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    KVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

from h2o_fn import H2OConfig, absorb, assert_invariants, init, kept_positions, step
from h2o_fn.adapters.attention import attention_with_weights, install_query_hook, is_hooked, remove_query_hook
from h2o_fn.adapters.mlx_lm import H2OKVCache, make_h2o_cache

from tiny_models import ARCHS, tiny_model

CHUNKS = [9, 1, 1, 6, 1, 1, 12, 1, 1, 1]  # prefill chunks and decode steps mixed
TOKENS = mx.array(np.random.default_rng(0).integers(0, 101, (1, sum(CHUNKS))))
MODES = [(s, p) for s in ("key", "query") for p in ("greedy", "oneshot")]


def run(model, cache, chunks=CHUNKS, tokens=TOKENS):
    out, i = [], 0
    for n in chunks:
        out.append(model(tokens[:, i : i + n], cache=cache))
        i += n
    return mx.concatenate(out, axis=1)


@pytest.fixture(autouse=True)
def unhook():
    yield
    for arch in ARCHS:  # hooks patch module globals: leave every module as found
        remove_query_hook(tiny_model(arch))


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("scoring, prefill", MODES)
def test_logits_equal_the_full_cache_when_nothing_is_evicted(arch, scoring, prefill):
    model = tiny_model(arch)
    full = run(
        model, model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    )
    cache = make_h2o_cache(model, H2OConfig(budget=64, n_sink=2, grace=4, scoring=scoring, prefill=prefill))
    h2o = run(model, cache)
    if scoring == "key":
        assert mx.array_equal(h2o, full)
    else:  # explicit float32 attention instead of the fused kernel
        assert mx.allclose(h2o, full, atol=1e-4, rtol=1e-4)
    managed = [c for c in cache if isinstance(c, H2OKVCache)]
    assert managed and all(c.tokens_kept == c.tokens_seen == sum(CHUNKS) for c in managed)
    if arch == "gemma3":
        assert [type(c) for c in cache] == [RotatingKVCache, RotatingKVCache, H2OKVCache]


@pytest.mark.parametrize("scoring, prefill", MODES)
def test_under_eviction_the_invariants_hold_in_every_layer(scoring, prefill):
    model = tiny_model("llama")
    cfg = H2OConfig(budget=12, n_sink=2, grace=3, scoring=scoring, prefill=prefill)
    cache = make_h2o_cache(model, cfg)
    i = 0
    for n in CHUNKS:
        logits = model(TOKENS[:, i : i + n], cache=cache)
        i += n
        assert mx.all(mx.isfinite(logits)).item()
        for c in cache:
            assert c.tokens_kept == min(i, cfg.budget) and c.tokens_seen == c.offset == i
            assert_invariants(c.core_state, cfg)
    assert cache[0].compression_ratio == pytest.approx(i / cfg.budget)
    assert not cache[0].is_trimmable() and cache[0].trim(3) == 0


@pytest.mark.parametrize("prefill", ["greedy", "oneshot"])
def test_layer0_kept_positions_equal_the_core_on_the_same_keys(prefill):
    """The adapter holds no algorithm: replaying layer 0's keys through the core agrees."""
    model = tiny_model("llama")
    cfg = H2OConfig(budget=10, n_sink=1, grace=2, prefill=prefill)
    cache = make_h2o_cache(model, cfg)
    seen = []
    original = cache[0].update_and_fetch
    cache[0].update_and_fetch = lambda k, v: (seen.append((k, v)), original(k, v))[1]
    run(model, cache)
    state = init(cfg, 1, 2, 16, dtype=seen[0][0].dtype)
    for k, v in seen:
        state = step(state, k, v, cfg) if k.shape[2] == 1 else absorb(state, k, v, cfg)
    assert mx.array_equal(kept_positions(state), kept_positions(cache[0].core_state))
    assert mx.array_equal(state.scores, cache[0].core_state.scores)


@pytest.mark.parametrize("scoring", ["key", "query"])
def test_decode_returns_the_kept_rows_plus_the_new_one(scoring):
    """Each decode call returns exactly S_{t-1} + {t}: kept before, plus the new token."""
    cfg = H2OConfig(budget=4, n_sink=1, grace=1, scoring=scoring)
    cache = H2OKVCache(cfg)
    rng = np.random.default_rng(1)
    by_position, rows = [], []
    for t in range(9):
        k = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
        by_position.append(k[0, :, 0])  # [H, D]
        before = [] if t == 0 else np.array(kept_positions(cache.core_state))[0]  # [H, C]
        keys, values = cache.update_and_fetch(mx.array(k), mx.array(k))
        rows.append(keys.shape[2])
        assert mx.array_equal(keys, values)
        if scoring == "query":
            cache.receive_weights(mx.array(rng.random((1, 2, 1, keys.shape[2])).astype(np.float32)))
        for h in range(2):
            expected = [by_position[p][h] for p in (list(before[h]) if t else []) if p >= 0]
            expected = np.stack(expected + [k[0, h, 0]])
            got = np.array(keys[0, h])
            order = lambda x: x[np.lexsort(x.T[::-1])]
            np.testing.assert_array_equal(order(got), order(expected))
    assert rows == [1, 2, 3, 4, 5, 5, 5, 5, 5]


def test_make_mask():
    cache = H2OKVCache(H2OConfig(budget=6, n_sink=1, grace=1))
    assert cache.make_mask(1) is None and cache.make_mask(5) == "causal"
    cache.update_and_fetch(mx.zeros((1, 1, 9, 4)), mx.zeros((1, 1, 9, 4)))
    assert mx.array_equal(cache.make_mask(3, return_array=True), create_causal_mask(3, offset=6))
    with pytest.raises(ValueError, match="window_size=4"):
        cache.make_mask(3, window_size=4)


@pytest.mark.parametrize("scoring", ["key", "query"])
def test_save_and_load_prompt_cache_round_trips(tmp_path, scoring):
    model = tiny_model("llama")
    cfg = H2OConfig(budget=10, n_sink=1, grace=2, scoring=scoring)
    cache = make_h2o_cache(model, cfg)
    run(model, cache, CHUNKS[:6])
    save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert [type(c) for c in loaded] == [H2OKVCache] * 2
    for a, b in zip(cache, loaded):
        assert (a.config, a.offset, a.tokens_kept) == (b.config, b.offset, b.tokens_kept)
        for x, y in zip(a.core_state, b.core_state):
            assert mx.array_equal(x, y)
    rest, start = CHUNKS[6:], sum(CHUNKS[:6])
    more = TOKENS[:, start:]
    assert mx.array_equal(run(model, cache, rest, more), run(model, loaded, rest, more))


def test_trim_before_any_eviction():
    model = tiny_model("llama")
    cache = make_h2o_cache(model, H2OConfig(budget=64, n_sink=2, grace=4))
    run(model, cache, [10])
    assert can_trim_prompt_cache(cache) and trim_prompt_cache(cache, 3) == 3
    assert all(c.offset == c.tokens_kept == 7 for c in cache)
    assert_invariants(cache[0].core_state, cache[0].config)
    full = [KVCache() for _ in model.layers]
    run(model, full, [7])
    a = model(TOKENS[:, 7:8], cache=cache)
    b = model(TOKENS[:, 7:8], cache=full)
    assert mx.allclose(a, b, atol=1e-5)  # scores differ (they keep the trimmed mass), rows do not


def test_generate_step_with_budget_above_length_matches_the_full_cache():
    model = tiny_model("qwen3")
    prompt = TOKENS[0, :20]
    full = [t for t, _ in zip(generate_step(prompt, model, max_tokens=15), range(15))]
    cache = make_h2o_cache(model, H2OConfig(budget=64, n_sink=2, grace=4))
    h2o = [t for t, _ in zip(generate_step(prompt, model, max_tokens=15, prompt_cache=cache), range(15))]
    assert [t for t, _ in full] == [t for t, _ in h2o]
    tight = make_h2o_cache(model, H2OConfig(budget=12, n_sink=2, grace=4, scoring="query"))
    out = [t for t, _ in generate_step(prompt, model, max_tokens=15, prompt_cache=tight)]
    assert len(out) == 15 and tight[0].tokens_kept == 12 and tight[0].tokens_seen == 20 + 15  # one step ahead


# ---------------------------------------------------------------- the hook


def sdpa_cases():
    rng = np.random.default_rng(2)
    q = mx.array(rng.standard_normal((2, 6, 5, 16)).astype(np.float32))
    k = mx.array(rng.standard_normal((2, 2, 9, 16)).astype(np.float32))
    v = mx.array(rng.standard_normal((2, 2, 9, 16)).astype(np.float32))
    boolean = mx.array(rng.random((2, 6, 5, 9)) < 0.7) | (mx.arange(9) == 0)
    additive = mx.array(rng.standard_normal((1, 1, 5, 9)).astype(np.float32))
    return (
        q,
        k,
        v,
        {
            "none": None,
            "causal": "causal",
            "bool": boolean,
            "additive": additive,
            "bool-2d": create_causal_mask(5, offset=4),
        },
    )


@pytest.mark.parametrize("mask_name", ["none", "causal", "bool", "additive", "bool-2d"])
def test_explicit_attention_equals_fused_sdpa(mask_name):
    q, k, v, masks = sdpa_cases()
    mask = masks[mask_name]
    out, w = attention_with_weights(q, k, v, 0.25, mask)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert mx.allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert mx.allclose(w.sum(-1), mx.ones(w.shape[:-1]), atol=1e-5)


def test_explicit_attention_with_sinks_equals_fused_sdpa():
    q, k, v, _ = sdpa_cases()
    sinks = mx.array(np.linspace(-1, 1, 6).astype(np.float32))
    out, w = attention_with_weights(q, k, v, 0.25, "causal", sinks)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal", sinks=sinks)
    assert mx.allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert mx.all(w.sum(-1) < 1).item()


def test_hook_is_reversible_and_falls_through_for_other_caches():
    model = tiny_model("llama")
    make_h2o_cache(model, H2OConfig(budget=64, scoring="query"))
    assert is_hooked(model)
    full = [KVCache() for _ in model.layers]
    hooked = run(model, full)
    remove_query_hook(model)
    assert not is_hooked(model)
    assert mx.array_equal(hooked, run(model, [KVCache() for _ in model.layers]))


def test_max_reduction_hook_and_bad_reduce():
    model = tiny_model("llama")
    install_query_hook(model, "max")
    cache = make_h2o_cache(model, H2OConfig(budget=8, n_sink=1, grace=2, scoring="query"))
    run(model, cache)
    assert_invariants(cache[0].core_state, cache[0].config)
    remove_query_hook(model)
    with pytest.raises(ValueError, match="reduce='sum'"):
        install_query_hook(model, "sum")


# ---------------------------------------------------------------- bad input


def test_query_cache_without_the_hook_raises_at_the_next_token():
    model = tiny_model("llama")
    cache = make_h2o_cache(model, H2OConfig(budget=16, n_sink=1, grace=1, scoring="query"))
    remove_query_hook(model)
    model(TOKENS[:, :4], cache=cache)
    with pytest.raises(RuntimeError, match="hook is missing"):
        model(TOKENS[:, 4:5], cache=cache)


def test_inputs_that_change_between_calls_raise():
    cache = H2OKVCache(H2OConfig(budget=8, n_sink=1, grace=1))
    cache.update_and_fetch(mx.zeros((1, 2, 3, 4), mx.float16), mx.zeros((1, 2, 3, 4), mx.float16))
    for shape, dtype, match in [
        ((1, 2, 1, 8), mx.float16, "D=4"),
        ((1, 3, 1, 4), mx.float16, "H=2"),
        ((2, 2, 1, 4), mx.float16, "B=1"),
        ((1, 2, 1, 4), mx.float32, "dtype"),
    ]:
        with pytest.raises(ValueError, match=match):
            cache.update_and_fetch(mx.zeros(shape, dtype), mx.zeros(shape, dtype))
    with pytest.raises(ValueError, match="empty chunk"):
        cache.update_and_fetch(mx.zeros((1, 2, 0, 4), mx.float16), mx.zeros((1, 2, 0, 4), mx.float16))
    with pytest.raises(ValueError, match="disagree"):
        cache.update_and_fetch(mx.zeros((1, 2, 1, 4), mx.float16), mx.zeros((1, 2, 1, 6), mx.float16))
    assert cache.offset == 3 and cache.tokens_kept == 3  # nothing was half-written


def test_batch_generator_is_refused_with_a_clear_error():
    from mlx_lm.generate import _merge_caches

    model = tiny_model("llama")
    caches = [make_h2o_cache(model, H2OConfig(budget=32)) for _ in range(2)]
    with pytest.raises(ValueError, match="batch generator"):
        _merge_caches(caches)


def test_make_h2o_cache_needs_a_full_attention_layer():
    class OnlyWindows:
        layers = [0, 1]

        def make_cache(self):
            return [RotatingKVCache(max_size=8) for _ in self.layers]

    with pytest.raises(ValueError, match="full-attention"):
        make_h2o_cache(OnlyWindows(), H2OConfig(budget=32))
