"""The mlx-lm adapter on tiny random-weight models of several architectures."""

import copy
import pickle

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.base import create_causal_mask, quantized_scaled_dot_product_attention
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

import h2o_fn
from h2o_fn import H2OConfig, Prompt, Storage, absorb, assert_invariants, check_invariants, init, kept_positions, step
from h2o_fn.adapters import attention
from h2o_fn.metal_ops import cpu_step
from h2o_fn.adapters.attention import (
    attention_with_weights,
    install_query_hook,
    is_hooked,
    query_scoring,
    remove_query_hook,
)
from h2o_fn.adapters.mlx_lm import DEFAULT_CONFIG, DEFAULT_PROMPT, H2OKVCache, h2o_caches, make_h2o_cache

from helpers import same
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


@pytest.fixture
def llama():
    model = tiny_model("llama")
    yield model
    remove_query_hook(model)  # hooks patch module globals: leave the module as found


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("scoring, prefill", MODES)
def test_logits_equal_the_full_cache_when_nothing_is_evicted(arch, scoring, prefill):
    model = tiny_model(arch)
    full = run(model, model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers])
    with query_scoring(model):
        cache = make_h2o_cache(model, H2OConfig(budget=64, n_sink=2, grace=4, scoring=scoring, prefill=prefill))
        h2o = run(model, cache)
    # explicit float32 attention instead of the fused kernel (key scoring: on decode tokens over more
    # than FUSED_UP_TO keys, the CPU)
    assert mx.allclose(h2o, full, atol=1e-4, rtol=1e-4)
    if scoring == "key":  # without the hook, mlx-lm's own attention: the same logits
        bare = make_h2o_cache(model, H2OConfig(budget=64, n_sink=2, grace=4, scoring=scoring, prefill=prefill))
        remove_query_hook(model)
        assert mx.array_equal(run(model, bare), full)
    managed = h2o_caches(cache)
    assert managed and all(c.tokens_kept == c.tokens_seen == sum(CHUNKS) for c in managed)
    if arch == "gemma3":
        assert [type(c) for c in cache] == [RotatingKVCache, RotatingKVCache, H2OKVCache]


@pytest.fixture
def llama32():
    model = tiny_model("llama", hidden_size=128)  # head_dim 32: one quantization group
    yield model
    remove_query_hook(model)


@pytest.mark.parametrize("kv_bits", [None, 8])
@pytest.mark.parametrize("evict_every", [1, 4])
@pytest.mark.parametrize("fused_up_to", [0, attention.FUSED_UP_TO])
def test_key_scoring_in_the_hook_keeps_what_the_core_keeps(llama32, kv_bits, evict_every, fused_up_to,
                                                           monkeypatch):
    """Under the hook (on the CPU) a key-scored decode token's proxy is computed beside
    attention (in its own product, or up to FUSED_UP_TO keys after mlx-lm's attention) and
    handed to the cache (a staged token's kept for its chunk); without it the cache scores
    the key itself at the next update (or flush). All keep the same tokens with the same
    scores (to float rounding)."""
    monkeypatch.setattr(attention, "FUSED_UP_TO", fused_up_to)
    monkeypatch.setattr(cpu_step, "UP_TO", 0)  # a token waits for the hook (key_step: tests/test_cpu_step.py)
    cfg = H2OConfig(budget=12, n_sink=2, grace=3, scoring="key")
    hooked = make_h2o_cache(llama32, cfg, kv_bits=kv_bits, kv_group_size=32, evict_every=evict_every)
    run(llama32, hooked)
    assert all(c.proxy_queries() is None for c in h2o_caches(hooked))  # the hook settled each one
    if evict_every > 1:
        staged = h2o_caches(hooked)[0]._s.staged
        assert len(staged.keys) == 3 and len(staged.logits) == 3  # the last three, each with its logits
    bare = make_h2o_cache(llama32, cfg, kv_bits=kv_bits, kv_group_size=32, evict_every=evict_every)
    remove_query_hook(llama32)
    run(llama32, bare)
    assert all(c.proxy_queries() is not None for c in h2o_caches(bare))  # the last token still waits
    for c in (*h2o_caches(hooked), *h2o_caches(bare)):
        c.flush()  # staged tokens judged: from the hook's logits, and by the core's own proxy
    for a, b in zip(h2o_caches(hooked), h2o_caches(bare)):
        assert a.tokens_seen == b.tokens_seen == sum(CHUNKS) and a.tokens_kept == cfg.budget
        assert kept_positions(a.core_state).tolist() == kept_positions(b.core_state).tolist()
        assert mx.allclose(a.core_state.scores, b.core_state.scores, atol=1e-5)
        assert_invariants(a.core_state, cfg)


def test_a_waiting_key_scored_token_settles_like_a_step(monkeypatch):
    """`settle_proxy` (no hook) and `receive_proxy` (the proxy row's logits over the view) give
    the state `core.step` gives."""
    from h2o_fn import policy as make_policy
    from h2o_fn.adapters import cache_state

    monkeypatch.setattr(cpu_step, "UP_TO", 0)  # a token that waits (not the key step)
    p = make_policy(H2OConfig(budget=6, n_sink=1, grace=2, scoring="key"))
    s = cache_state.CacheState()
    keys = mx.random.normal((2, 3, 12, 8), key=mx.random.key(1))
    s, _ = cache_state.update(s, p, keys[:, :, :9], keys[:, :, :9])
    for i in range(9, 12):
        before = s.core
        s, (k, _) = cache_state.update(s, p, keys[:, :, i : i + 1], keys[:, :, i : i + 1])
        want = step(before, keys[:, :, i : i + 1], keys[:, :, i : i + 1], p.config)
        rows = cache_state.proxy_queries(s, p)
        assert rows.shape == (2, 3, 1, 8)
        logits = rows @ k.swapaxes(-1, -2)
        for got in (cache_state.settle_proxy(s, p), cache_state.receive_proxy(s, p, logits)):
            assert got.pending is None
            assert mx.array_equal(got.core.positions, want.positions)
            assert mx.allclose(got.core.scores, want.scores, atol=1e-6)
        s = cache_state.settle_proxy(s, p)
    with pytest.raises(RuntimeError, match="no key-scored token waiting"):
        cache_state.receive_proxy(s, p, logits)
    with pytest.raises(ValueError, match="logits shape"):
        s, _ = cache_state.update(s, p, keys[:, :, :1], keys[:, :, :1])
        cache_state.receive_proxy(s, p, logits[..., :-1])


def test_staged_proxy_logits_are_checked():
    """Staged key tokens' logits fit `[B, H, N, C]` and oneshot key scoring only: greedy judges
    each token after the evictions before it, so the logits over the staging slots do not apply."""
    from h2o_fn import absorb, admit, init
    from h2o_fn import policy as make_policy
    from h2o_fn.prefill import absorb_staged

    cfg = H2OConfig(budget=4, n_sink=1, grace=1, scoring="key")
    kv = mx.random.normal((1, 2, 8, 8), key=mx.random.key(2))
    s = absorb(init(cfg, 1, 2, 8, room=2), kv[:, :, :6], kv[:, :, :6], cfg)
    for i in (6, 7):
        s = admit(s, kv[:, :, i : i + 1], kv[:, :, i : i + 1])
    new, logits = kv[:, :, 6:], mx.zeros((1, 2, 2, 6))
    assert absorb_staged(s, new, new, cfg, logits=logits).length.tolist() == [4]
    with pytest.raises(ValueError, match=r"logits shape \(1, 2, 2, 5\) is invalid: expected \(1, 2, 2, 6\)"):
        absorb_staged(s, new, new, cfg, logits=logits[..., :5])
    with pytest.raises(ValueError, match="expected scoring='key' and prefill='oneshot'"):
        absorb_staged(s, new, new, cfg._replace(prefill="greedy"), logits=logits)
    with pytest.raises(ValueError, match="prefill='greedy'"):
        make_policy(cfg._replace(prefill="greedy")).absorb_staged(s, new, new, logits=logits)


@pytest.mark.parametrize("scoring", ["key", "query"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_rows_give_mlx_lm_quantized_cache_logits(llama32, scoring, bits):
    """kv_bits with budget >= tokens: the logits of mlx-lm's QuantizedKVCache(bits)."""
    llama = llama32
    quantized = run(llama, [QuantizedKVCache(group_size=32, bits=bits) for _ in llama.layers])
    cfg = H2OConfig(budget=64, n_sink=2, grace=4, scoring=scoring)
    cache = make_h2o_cache(llama, cfg, kv_bits=bits, kv_group_size=32)
    h2o = run(llama, cache)
    # the hook's explicit attention over the same quantized rows (key scoring: decode tokens, on the CPU)
    assert mx.allclose(h2o, quantized, atol=2e-3, rtol=2e-3)
    if scoring == "key":  # without the hook: the same rows, the same mlx-lm attention path
        bare = make_h2o_cache(llama, cfg, kv_bits=bits, kv_group_size=32)
        remove_query_hook(llama)
        assert mx.array_equal(run(llama, bare), quantized)
    assert cache[0].bits == bits and cache[0].group_size == 32
    unquantized = make_h2o_cache(llama, cfg)
    run(llama, unquantized)
    assert not hasattr(unquantized[0], "bits")  # mlx-lm routes by hasattr(cache, "bits")
    ratio = cache[0].nbytes / unquantized[0].nbytes
    assert ratio < (0.6 if bits == 8 else 0.4), ratio


@pytest.mark.parametrize("scoring, prefill", MODES)
@pytest.mark.parametrize("kv_bits", [None, 8])
def test_under_eviction_the_invariants_hold_in_every_layer(llama32, scoring, prefill, kv_bits):
    llama = llama32
    cfg = H2OConfig(budget=12, n_sink=2, grace=3, scoring=scoring, prefill=prefill)
    cache = make_h2o_cache(llama, cfg, kv_bits=kv_bits, kv_group_size=32)
    i = 0
    for n in CHUNKS:
        logits = llama(TOKENS[:, i : i + n], cache=cache)
        i += n
        assert mx.all(mx.isfinite(logits)).item()
        for c in cache:
            assert c.tokens_kept == min(i, cfg.budget) and c.tokens_seen == c.offset == i
            assert_invariants(c.core_state, cfg)
    assert cache[0].compression_ratio == pytest.approx(i / cfg.budget)
    assert not cache[0].is_trimmable() and cache[0].trim(3) == 0


@pytest.mark.parametrize("prefill", ["greedy", "oneshot"])
def test_layer0_kept_positions_equal_the_core_on_the_same_keys(llama, prefill):
    """The adapter holds no algorithm: replaying layer 0's keys through the core agrees."""
    cfg = H2OConfig(budget=10, n_sink=1, grace=2, prefill=prefill)
    cache = make_h2o_cache(llama, cfg)
    seen = []
    original = cache[0].update_and_fetch
    cache[0].update_and_fetch = lambda k, v: (seen.append((k, v)), original(k, v))[1]
    run(llama, cache)
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
            order = lambda x: x[np.lexsort(x.T[::-1])]  # noqa: E731
            np.testing.assert_array_equal(order(got), order(expected))
    assert rows == [1, 2, 3, 4, 5, 5, 5, 5, 5]


@pytest.mark.parametrize("scoring", ["key", "query"])
def test_the_decode_shortcut_is_the_general_update(llama, scoring, monkeypatch):
    """A plain decode token (`cache_state._plain`) skips `update`'s general bookkeeping: the
    logits, kept positions and every count equal the general path's, bit for bit."""
    from h2o_fn.adapters import cache_state

    cfg = H2OConfig(budget=8, n_sink=1, grace=2, scoring=scoring)

    def decode():
        caches = make_h2o_cache(llama, cfg)
        logits = run(llama, caches, chunks=[9] + [1] * 12, tokens=TOKENS[:, :21])
        return logits, caches

    taken = []
    shortcut = cache_state._plain_decode
    monkeypatch.setattr(cache_state, "_plain_decode", lambda *a: taken.append(1) or shortcut(*a))
    fast, fast_caches = decode()
    assert len(taken) == 12 * len(fast_caches)  # every decode token of every layer took it
    monkeypatch.setattr(cache_state, "_plain", lambda s: False)
    slow, slow_caches = decode()
    assert mx.array_equal(fast, slow)
    for a, b in zip(fast_caches, slow_caches):
        assert kept_positions(a.core_state).tolist() == kept_positions(b.core_state).tolist()
        fields = lambda c: (c._s.seen, c._s.lengths, c._s.span, c._s.last, c._s.head_mask)  # noqa: E731
        assert fields(a) == fields(b)


@pytest.mark.parametrize("scoring", ["key", "query"])
def test_a_chunk_that_fits_the_room_is_absorbed_where_it_lies(scoring, monkeypatch):
    """A chunk with room for all its tokens attends the same view and keeps the same tokens
    and scores as `absorb` on the state before it, and is written into the slots that
    follow the kept ones (`prefill.admit_chunk`), never through `absorb`."""
    cfg = H2OConfig(budget=16, n_sink=1, grace=1, scoring=scoring)
    real_absorb = h2o_fn.prefill.absorb
    monkeypatch.setattr(h2o_fn.prefill, "absorb", lambda *a, **k: pytest.fail("absorb copied a chunk that fits"))
    rng = np.random.default_rng(3)
    cache = H2OKVCache(cfg)
    weights = None
    for n in (5, 6):  # the first chunk into an empty cache, then one that fits beside it
        k = mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32))
        before = None if cache.empty() else cache.core_state
        keys, values = cache.update_and_fetch(k, k)
        if scoring == "query":
            weights = mx.softmax(mx.array(rng.standard_normal((1, 2, n, keys.shape[2])).astype(np.float32)), axis=-1)
            cache.receive_weights(weights)
    L = before.positions.shape[-1] - int((before.positions == -1).sum(-1).max().item())
    assert L == 5 and keys.shape[2] == L + 6
    old_view = h2o_fn.view.chunk_view(before, k, k, L + 1)
    assert mx.array_equal(keys, old_view[0]) and mx.array_equal(values, old_view[1])
    w = None if weights is None else h2o_fn.view.view_weights(before, weights, L + 1)
    want = real_absorb(before, k, k, cfg, w)
    got = cache.core_state
    assert kept_positions(got).tolist() == kept_positions(want).tolist()
    assert got.positions[0, :, :11].tolist() == [list(range(11))] * 2  # the chunk right after the kept rows
    np.testing.assert_allclose(np.sort(np.array(got.scores), axis=-1), np.sort(np.array(want.scores), axis=-1),
                               rtol=1e-6)


def test_make_mask():
    cache = H2OKVCache(H2OConfig(budget=6, n_sink=1, grace=1, scoring="key"))
    assert cache.make_mask(1) is None and cache.make_mask(5) == "causal"
    cache.update_and_fetch(mx.zeros((1, 1, 9, 4)), mx.zeros((1, 1, 9, 4)))
    assert mx.array_equal(cache.make_mask(3, return_array=True), create_causal_mask(3, offset=6))
    with pytest.raises(ValueError, match="window_size=4"):
        cache.make_mask(3, window_size=4)


def test_defaults_agree():
    """One source of defaults: a bare cache and make_h2o_cache(model) use DEFAULT_CONFIG."""
    model = tiny_model("llama")
    try:
        assert H2OKVCache().config == DEFAULT_CONFIG == make_h2o_cache(model)[0].config
        assert DEFAULT_CONFIG == H2OConfig(scoring="query")  # the rest: the policy defaults
        assert DEFAULT_PROMPT == Prompt(window=48, pool=15)
        assert H2OKVCache().policy.prompt == DEFAULT_PROMPT == make_h2o_cache(model)[0].policy.prompt
    finally:
        remove_query_hook(model)


def test_a_budget_or_a_config_keeps_the_recommended_rest(llama):
    """`budget=N` is the recommended policy at N, in every entry point; a config of your own
    is used as given and keeps the recommended prompt scoring (it never silently drops it)."""
    from h2o_fn.adapters.mlx_lm import cache_policy, recommended, use_h2o

    for n in (8, 32, 256, 512):
        want = cache_policy(DEFAULT_CONFIG.at_budget(n))
        assert recommended(n) == DEFAULT_CONFIG.at_budget(n) and want.prompt == DEFAULT_PROMPT
        assert H2OKVCache(budget=n).policy == want == cache_policy(budget=n)
        assert all(c.policy == want for c in h2o_caches(make_h2o_cache(llama, budget=n)))
        undo = use_h2o(llama, budget=n)
        assert all(c.policy == want for c in h2o_caches(llama.make_cache()))
        undo()
    assert make_h2o_cache(llama, DEFAULT_CONFIG)[0].policy == make_h2o_cache(llama)[0].policy
    assert make_h2o_cache(llama, budget=DEFAULT_CONFIG.budget)[0].policy == make_h2o_cache(llama)[0].policy
    mine = H2OConfig(budget=64, n_sink=2, grace=4)  # scoring="key": H2OConfig's own default, used as given
    assert H2OKVCache(mine).policy.prompt == DEFAULT_PROMPT == make_h2o_cache(llama, mine)[0].policy.prompt
    assert make_h2o_cache(llama, mine)[0].config == mine
    assert make_h2o_cache(llama, mine, prompt=Prompt())[0].policy.prompt == Prompt()  # plain oneshot, asked for


def test_wrong_call_forms_name_the_right_one(llama):
    with pytest.raises(TypeError, match=r"config=256 is a int: .*pass budget=256"):
        make_h2o_cache(llama, 256)
    with pytest.raises(TypeError, match=r"budgets=256 is invalid: .*budget=256"):
        make_h2o_cache(llama, budgets=256)
    with pytest.raises(ValueError, match=r"expected one of them .*config.at_budget\(N\)"):
        make_h2o_cache(llama, H2OConfig(), budget=256)
    with pytest.raises(TypeError, match=r"budget=256.0 is invalid: expected an int"):
        H2OKVCache(budget=256.0)
    with pytest.raises(ValueError, match=r"H2OConfig.budget=0 is invalid"):
        H2OKVCache(budget=0)


def test_reading_a_cache_changes_nothing(llama, monkeypatch):
    """Properties and predicates are reads: `state`, `layer_state`, `core_state` and
    `is_trimmable()` leave the cache's state as it was (a waiting key-scored token is settled
    on a copy, twice the same), and `is_trimmable()` is a bool in every state."""
    from h2o_fn.adapters import cache_state

    monkeypatch.setattr(cpu_step, "UP_TO", 0)  # not the key step: a decode token waits
    cfg = H2OConfig(budget=8, n_sink=1, grace=2, scoring="key")
    cache = make_h2o_cache(llama, cfg)
    remove_query_hook(llama)  # no hook: each decode token waits for its own proxy
    run(llama, cache, [12, 1])
    c = cache[0]
    held = c._s
    assert held.pending is not None and held.pending.key is not None
    reads = [c.state, c.state, c.layer_state, c.layer_state, c.core_state, c.is_trimmable(), c.is_trimmable()]
    assert c._s is held  # nothing was assigned
    assert all(mx.array_equal(a, b) for a, b in zip(reads[0][:6], reads[1][:6]))
    assert reads[2].lengths == reads[3].lengths and reads[2].pending is None
    assert all(mx.array_equal(a, b) for a, b in zip(reads[2].core, reads[3].core))
    assert mx.array_equal(reads[4].positions, cache_state.settle_proxy(held, c.policy).core.positions)
    assert reads[5] is False and reads[6] is False  # evicted
    run(llama, cache, [1], TOKENS[:, 13:])  # the next update settles it itself
    assert c.tokens_seen == 14 and c.tokens_kept == cfg.budget and c._s.pending.key is not None

    fresh = H2OKVCache(H2OConfig(budget=8, n_sink=1, grace=2, scoring="query"))
    assert fresh.is_trimmable() is True  # empty
    fresh.update_and_fetch(mx.zeros((1, 2, 3, 16)), mx.zeros((1, 2, 3, 16)))
    assert fresh.wants_weights and fresh.is_trimmable() is False  # weights pending: a bool, no raise
    with pytest.raises(RuntimeError, match="cannot save"):
        fresh.state
    with pytest.raises(RuntimeError, match="cannot trim"):
        fresh.trim(1)


@pytest.mark.parametrize("scoring, kv_bits", [("key", None), ("query", None), ("query", 4)])
def test_save_and_load_prompt_cache_round_trips(llama32, tmp_path, scoring, kv_bits):
    llama = llama32
    cfg = H2OConfig(budget=10, n_sink=1, grace=2, scoring=scoring)
    cache = make_h2o_cache(llama, cfg, kv_bits=kv_bits, kv_group_size=32)
    run(llama, cache, CHUNKS[:6])
    save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert [type(c) for c in loaded] == [H2OKVCache] * 2
    for a, b in zip(cache, loaded):
        assert (a.policy, a.offset, a.tokens_kept, a.nbytes) == (b.policy, b.offset, b.tokens_kept, b.nbytes)
        for x, y in zip(a.core_state, b.core_state):
            assert same(x, y)
    rest, start = CHUNKS[6:], sum(CHUNKS[:6])
    more = TOKENS[:, start:]
    assert mx.array_equal(run(llama, cache, rest, more), run(llama, loaded, rest, more))


@pytest.mark.parametrize("scoring", ["key", "query"])
def test_deepcopy_and_pickle_give_independent_equal_caches(llama, scoring):
    cache = make_h2o_cache(llama, H2OConfig(budget=10, n_sink=1, grace=2, scoring=scoring))
    run(llama, cache, CHUNKS[:6])
    twin = copy.deepcopy(cache)
    pickled = [pickle.loads(pickle.dumps(c)) for c in cache]
    rest, more = CHUNKS[6:], TOKENS[:, sum(CHUNKS[:6]) :]
    a = run(llama, cache, rest, more)
    assert twin[0].tokens_seen == sum(CHUNKS[:6])  # the copy did not move with the original
    assert mx.array_equal(a, run(llama, twin, rest, more))
    assert mx.array_equal(a, run(llama, pickled, rest, more))


def test_pending_weights_are_never_lost_silently(llama, tmp_path):
    """Without the hook, query scoring cannot finish a step: save, trim and the next
    token say so instead of dropping the tokens."""
    cache = make_h2o_cache(llama, H2OConfig(budget=16, n_sink=1, grace=1, scoring="query"))
    remove_query_hook(llama)
    llama(TOKENS[:, :4], cache=cache)
    with pytest.raises(RuntimeError, match="never arrived"):
        save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    assert not can_trim_prompt_cache(cache) and trim_prompt_cache(cache, 2) == 0  # nothing trimmed
    with pytest.raises(RuntimeError, match="never arrived"):
        cache[0].trim(2)
    with pytest.raises(RuntimeError, match="hook is missing"):
        llama(TOKENS[:, 4:5], cache=cache)


def test_trim_before_any_eviction(llama):
    cache = make_h2o_cache(llama, H2OConfig(budget=64, n_sink=2, grace=4))
    run(llama, cache, [10])
    assert can_trim_prompt_cache(cache) and trim_prompt_cache(cache, 3) == 3
    assert all(c.offset == c.tokens_kept == 7 for c in cache)
    assert_invariants(cache[0].core_state, cache[0].config)
    full = [KVCache() for _ in llama.layers]
    run(llama, full, [7])
    a = llama(TOKENS[:, 7:8], cache=cache)
    b = llama(TOKENS[:, 7:8], cache=full)
    assert mx.allclose(a, b, atol=1e-4)  # scores differ (they keep the trimmed mass), rows do not


def test_generate_step_with_budget_above_length_matches_the_full_cache():
    model = tiny_model("qwen3")
    try:
        prompt = TOKENS[0, :20]
        full = [t for t, _ in zip(generate_step(prompt, model, max_tokens=15), range(15))]
        cache = make_h2o_cache(model, H2OConfig(budget=64, n_sink=2, grace=4))
        h2o = [t for t, _ in zip(generate_step(prompt, model, max_tokens=15, prompt_cache=cache), range(15))]
        assert [t for t, _ in full] == [t for t, _ in h2o]
        tight = make_h2o_cache(model, H2OConfig(budget=12, n_sink=2, grace=4, scoring="query"))
        out = [t for t, _ in generate_step(prompt, model, max_tokens=15, prompt_cache=tight)]
        assert len(out) == 15 and tight[0].tokens_kept == 12 and tight[0].tokens_seen == 20 + 15
    finally:
        remove_query_hook(model)


def test_per_layer_budgets(llama):
    """Each layer keeps its own budget; the mask mlx-lm builds from layer 0 is replaced
    for the other layer (the hook), and every layer's invariants hold."""
    cache = make_h2o_cache(llama, H2OConfig(budget=12, n_sink=2, grace=3, scoring="key"), budgets=[16, 8])
    assert [c.config.budget for c in cache] == [16, 8] and is_hooked(llama)
    i = 0
    for n in CHUNKS:
        assert mx.all(mx.isfinite(llama(TOKENS[:, i : i + n], cache=cache))).item()
        i += n
        for c in cache:
            assert c.tokens_kept == min(i, c.config.budget)
            assert_invariants(c.core_state, c.config)
    with pytest.raises(ValueError, match="one per H2O layer"):
        make_h2o_cache(llama, H2OConfig(budget=12, n_sink=2, grace=3), budgets=[16])
    with pytest.raises(ValueError, match=r"H2O layer 1: budget 5 .* n_sink \+ grace = 2 \+ 3"):
        make_h2o_cache(llama, H2OConfig(budget=12, n_sink=2, grace=3), budgets=[16, 5])


def test_budgets_by_policy_name(llama):
    """budgets="uniform" or "pyramid" name an allocation policy; anything else that is not a
    sequence of ints is refused naming the accepted forms (a string used to be read as
    one budget per character)."""
    cfg = H2OConfig(budget=12, n_sink=2, grace=3, scoring="key")
    assert [c.config.budget for c in make_h2o_cache(llama, cfg, budgets="uniform")] == [12, 12]
    pyramid = [c.config.budget for c in make_h2o_cache(llama, cfg, budgets="pyramid")]
    assert pyramid[0] > pyramid[1] and sum(pyramid) <= 24
    with pytest.raises(ValueError, match="'calibrated' needs the tokenizer"):
        make_h2o_cache(llama, cfg, budgets="calibrated")
    with pytest.raises(ValueError, match="budgets='even' is invalid: expected one of"):
        make_h2o_cache(llama, cfg, budgets="even")
    for bad in (12, [12.0, 12], {"a": 1}):
        with pytest.raises(TypeError, match="expected None, a sequence of ints"):
            make_h2o_cache(llama, cfg, budgets=bad)


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


def test_explicit_attention_on_dequantized_rows_equals_mlx_lm_quantized_sdpa():
    q, k, v, _ = sdpa_cases()
    q, k, v = (mx.concatenate([x, x[..., ::-1]], axis=-1) for x in (q, k, v))  # head_dim 32
    qk, qv = mx.quantize(k, group_size=32, bits=8), mx.quantize(v, group_size=32, bits=8)
    dk, dv = (mx.dequantize(*x, group_size=32, bits=8) for x in (qk, qv))
    out, _ = attention_with_weights(q, dk, dv, 0.25, "causal")
    ref = quantized_scaled_dot_product_attention(q, qk, qv, 0.25, "causal", group_size=32, bits=8)
    assert mx.allclose(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [8, 4])
def test_explicit_attention_on_quantized_rows_equals_mlx_lm_quantized_sdpa(bits):
    """Stores as given (multiplied where they lie, `storage.matmul_t` / `matmul`), with and
    without a key-proxy row in the keys' product."""
    from h2o_fn.adapters.attention import attention_with_proxy

    q, k, v, _ = sdpa_cases()
    q, k, v = (mx.concatenate([x, x[..., ::-1]], axis=-1) for x in (q, k, v))  # head_dim 32
    qk, qv = (tuple(mx.quantize(x, group_size=32, bits=bits)) for x in (k, v))
    # a copy of q: mlx-lm's function scales its queries in place
    ref = quantized_scaled_dot_product_attention(q * 1, qk, qv, 0.25, "causal", group_size=32, bits=bits)
    out, w = attention_with_weights(q, qk, qv, 0.25, "causal", bits=bits, group_size=32)
    assert mx.allclose(out, ref, atol=1e-4, rtol=1e-4)
    rows = k[:, :, -1:] * 0.5
    out, logits = attention_with_proxy(q, qk, qv, 0.25, "causal", rows, bits=bits, group_size=32)
    assert mx.allclose(out, ref, atol=1e-4, rtol=1e-4)
    dk = mx.dequantize(*qk, group_size=32, bits=bits)
    assert mx.allclose(logits, rows @ dk.swapaxes(-1, -2), atol=1e-4, rtol=1e-4)


def test_explicit_attention_with_sinks_equals_fused_sdpa():
    q, k, v, _ = sdpa_cases()
    sinks = mx.array(np.linspace(-1, 1, 6).astype(np.float32))
    out, w = attention_with_weights(q, k, v, 0.25, "causal", sinks)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal", sinks=sinks)
    assert mx.allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert mx.all(w.sum(-1) < 1).item()


def test_hook_is_scoped_reversible_and_falls_through_for_other_caches(llama):
    with query_scoring(llama):
        assert is_hooked(llama)
        hooked = run(llama, [KVCache() for _ in llama.layers])
    assert not is_hooked(llama)
    assert mx.array_equal(hooked, run(llama, [KVCache() for _ in llama.layers]))
    with pytest.raises(ZeroDivisionError):
        with query_scoring(llama):
            1 / 0
    assert not is_hooked(llama)  # removed on error too


def test_max_reduction_hook_and_bad_reduce(llama):
    install_query_hook(llama, "max")
    cache = make_h2o_cache(llama, H2OConfig(budget=8, n_sink=1, grace=2, scoring="query"))
    run(llama, cache)
    assert_invariants(cache[0].core_state, cache[0].config)
    remove_query_hook(llama)
    with pytest.raises(ValueError, match="reduce='sum'"):
        install_query_hook(llama, "sum")


# ---------------------------------------------------------------- bad input


def test_inputs_that_change_between_calls_raise():
    cache = H2OKVCache(H2OConfig(budget=8, n_sink=1, grace=1, scoring="key"))
    cache.update_and_fetch(mx.zeros((1, 2, 3, 4), mx.float16), mx.zeros((1, 2, 3, 4), mx.float16))
    for shape, dtype, match in [
        ((1, 2, 1, 8), mx.float16, "Dk=4"),
        ((1, 3, 1, 4), mx.float16, "H=2"),
        ((2, 2, 1, 4), mx.float16, "B=1"),
        ((1, 2, 1, 4), mx.float32, "dtype"),
    ]:
        with pytest.raises(ValueError, match=match):
            cache.update_and_fetch(mx.zeros(shape, dtype), mx.zeros(shape, dtype))
    with pytest.raises(ValueError, match="empty chunk"):
        cache.update_and_fetch(mx.zeros((1, 2, 0, 4), mx.float16), mx.zeros((1, 2, 0, 4), mx.float16))
    with pytest.raises(ValueError, match="disagree"):
        cache.update_and_fetch(mx.zeros((1, 2, 1, 4), mx.float16), mx.zeros((1, 2, 2, 4), mx.float16))
    assert cache.offset == 3 and cache.tokens_kept == 3  # nothing was half-written


def test_keys_and_values_of_different_widths():
    """Multi-head latent attention caches keys and values of different head_dim."""
    cache = H2OKVCache(H2OConfig(budget=4, n_sink=1, grace=1, scoring="key"))
    for n in (3, 1, 1, 1):
        k, v = cache.update_and_fetch(mx.ones((1, 1, n, 24)), mx.ones((1, 1, n, 16)))
    assert k.shape == (1, 1, 5, 24) and v.shape == (1, 1, 5, 16) and cache.tokens_kept == 4


def test_make_h2o_cache_needs_a_full_attention_layer():
    class OnlyWindows:
        layers = [0, 1]

        def make_cache(self):
            return [RotatingKVCache(max_size=8) for _ in self.layers]

    with pytest.raises(ValueError, match="full-attention"):
        make_h2o_cache(OnlyWindows(), H2OConfig(budget=32))


@pytest.mark.parametrize("scoring", ["key", "query"])
def test_evict_every_scores_decode_tokens_as_chunks(llama, scoring):
    """evict_every=k: k - 1 decode tokens are only written, the k-th scores all k as one
    oneshot chunk: the same kept positions and scores as feeding chunks of k."""
    from helpers import kept, scores

    TOKENS = mx.array(np.random.default_rng(3).integers(0, 101, (1, 40)))  # noqa: N806
    cfg, k = H2OConfig(budget=12, n_sink=2, grace=3, scoring=scoring), 4
    staged = make_h2o_cache(llama, cfg, evict_every=k)
    chunked = make_h2o_cache(llama, cfg)
    llama(TOKENS[:, :9], cache=staged)
    llama(TOKENS[:, :9], cache=chunked)
    for i in range(9, 33):
        assert mx.all(mx.isfinite(llama(TOKENS[:, i : i + 1], cache=staged))).item()
        assert staged[0].tokens_kept <= cfg.budget + k - 1
    for i in range(9, 33, 4):
        llama(TOKENS[:, i : i + 4], cache=chunked)
    for a, b in zip(staged, chunked):
        assert kept(a.core_state) == kept(b.core_state)
        for x, y in zip(scores(a.core_state)[0], scores(b.core_state)[0]):
            assert x.keys() == y.keys() and all(abs(x[p] - y[p]) < 1e-6 for p in x)
    for i in (33, 34):  # two staged: saved and loaded as they are (reading state changes nothing)
        llama(TOKENS[:, i : i + 1], cache=staged)
    assert staged[0].tokens_kept == 14
    loaded = [c.from_state(c.state) for c in staged]
    assert loaded[0].tokens_kept == staged[0].tokens_kept == 14
    more = [llama(TOKENS[:, i : i + 1], cache=c) for c in (staged, loaded) for i in (35, 36)]
    assert mx.array_equal(more[0], more[2]) and mx.array_equal(more[1], more[3])
    assert staged[0].tokens_kept == loaded[0].tokens_kept == 12  # the 4th staged token scored them
    assert check_invariants(staged[0].core_state, cfg) == []


def test_evict_every_with_nothing_evicted_equals_the_full_cache(llama):
    cfg = H2OConfig(budget=64, n_sink=2, grace=4, scoring="key")
    full = run(llama, [KVCache() for _ in llama.layers])
    # staged key tokens attend explicitly, with the proxy's row (on the CPU, under the hook)
    assert mx.allclose(run(llama, make_h2o_cache(llama, cfg, evict_every=8)), full, atol=1e-4, rtol=1e-4)
    bare = make_h2o_cache(llama, cfg, evict_every=8)
    remove_query_hook(llama)  # without it, mlx-lm's own attention: the same logits
    assert mx.array_equal(run(llama, bare), full)


def test_the_adapters_knobs_are_checked_and_travel_with_a_saved_cache():
    """evict_every, the prompt scoring and the row storage sit beside the config (not in
    it): a bad value names itself, and a cache's state brings all three back, with the
    config, in one flat JSON (the object older files hold, when they were its fields)."""
    import json

    from h2o_fn import capacity

    cfg = H2OConfig(budget=8, n_sink=1, grace=1, scoring="key")
    with pytest.raises(ValueError, match="evict_every=0 is invalid: expected an int >= 1"):
        H2OKVCache(cfg, evict_every=0)
    with pytest.raises(TypeError, match="expected an h2o_fn.Prompt"):
        H2OKVCache(cfg, prompt={"window": 4})
    with pytest.raises(ValueError, match=r"Storage.bits=7 is invalid: expected None or one of \(2, 3, 4, 5, 6, 8\)"):
        H2OKVCache(cfg, kv_bits=7)
    cache = H2OKVCache(cfg, evict_every=3, prompt=Prompt(window=4, pool=3), kv_bits=8, kv_group_size=32)
    kv = mx.random.normal((1, 2, 20, 32))
    cache.update_and_fetch(kv, kv)
    for t in range(2):  # two decode tokens staged, not yet judged
        cache.update_and_fetch(kv[:, :, t : t + 1], kv[:, :, t : t + 1])
    assert cache.tokens_kept == 10 and json.loads(cache.meta_state) == {
        **cfg._asdict(), "window": 4, "pool": 3, "kv_bits": 8, "kv_group_size": 32, "evict_every": 3}
    loaded = H2OKVCache.from_state(cache.state)
    assert (loaded.config, loaded.policy.prompt, loaded.policy.kv, loaded.evict_every) == (
        cfg, Prompt(4, 3), Storage(8, 32), 3)
    assert (loaded.bits, loaded.group_size) == (8, 32)
    assert loaded.tokens_kept == 10 and capacity(loaded.core_state) == 8 + 3  # room for the staged three
    with pytest.raises(ValueError, match=r"different configs \(config, prompt, storage, evict_every\)"):
        H2OKVCache.merge([cache, H2OKVCache(cfg, evict_every=3, prompt=Prompt(window=4, pool=3))])


@pytest.mark.parametrize("scoring", ["key", "query"])
def test_a_prompt_chunk_leaves_no_copy_of_the_rows_behind(llama, scoring):
    """After a chunk the view attention read (every kept row plus the chunk) is a copy; a
    cache that no other layer reads lets it go with the attention (make_h2o_cache for a
    model whose layers each have their own cache). A continued conversation's peak then
    holds its state, not its state twice."""
    import gc

    from h2o_fn.adapters.mlx_lm import shares_kv

    assert not shares_kv(llama)
    ids = mx.array(np.random.default_rng(0).integers(1, 100, (1, 224)))

    def held_after_chunk(keeps_view):
        cache = make_h2o_cache(llama, H2OConfig(budget=64, n_sink=2, grace=4, scoring=scoring))
        mx.eval(llama(ids[:, :192], cache=cache))
        for c in cache:
            c.keeps_view = keeps_view
        gc.collect()
        base = mx.get_active_memory()
        mx.eval(llama(ids[:, 192:], cache=cache))  # the next turn's 32 tokens
        gc.collect()
        return mx.get_active_memory() - base, cache

    held, cache = held_after_chunk(False)
    kept, keeping = held_after_chunk(True)
    views = sum(k.nbytes + v.nbytes for k, v in (c.keys_and_values() for c in keeping))
    assert views >= len(keeping) * 2 * 2 * 16 * (64 + 32) * 4  # K and V, 2 KV heads, D 16, 64 kept + 32 rows
    # active memory moves by a few KiB between runs (the state's own size after eviction, mlx's
    # buffers): half the views' bytes on either side is the margin, about 24 KiB here
    assert held < views / 2, (held, views)
    assert kept - held > views / 2, (kept, held, views)  # the views a sharing model's caches hold
    with pytest.raises(RuntimeError, match="keeps_view=False"):
        cache[0].keys_and_values()


def test_caches_of_models_whose_layers_share_kv_keep_their_views():
    import zoo

    from h2o_fn.adapters.mlx_lm import shares_kv

    for name in ("afm7", "gemma3n"):
        model = zoo.build(name)
        try:
            assert shares_kv(model), name
            cache = make_h2o_cache(model, H2OConfig(budget=8, n_sink=1, grace=2, scoring="key"))
            assert all(c.keeps_view for c in h2o_caches(cache)), name
            model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)  # their shared layers read keys_and_values()
        finally:
            remove_query_hook(model)
