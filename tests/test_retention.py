"""Query-agnostic retention: the pure rules (`h2o_fn.retention`, `view.compact`) against
their reference twins, and `cache_prompt` (the adapter's two passes) on tiny models."""

import copy
from fractions import Fraction

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mlx_lm.models.cache import KVCache, RotatingKVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

from h2o_fn import H2OConfig, Prompt, Storage, absorb_scored, assert_invariants, init, kept_positions, step
from h2o_fn import reference as ref
from h2o_fn import retention, view
from h2o_fn.adapters.attention import remove_query_hook
from h2o_fn.adapters.mlx_lm import H2OKVCache, cache_prompt, h2o_caches, make_h2o_cache
from h2o_fn.adapters.retention import LAYER_FROM, ScoringPass, spread_for

from helpers import assert_matches
from tiny_models import tiny_model


@settings(max_examples=25)
@given(st.integers(1, 2), st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]), st.integers(1, 5),
       st.integers(1, 7), st.integers(0, 2**31 - 1))
def test_aggregate_equals_its_reference_twin(B, heads, N, L, seed):
    Hq, H = heads
    w = np.random.default_rng(seed).random((B, Hq, N, L)).astype(np.float32)
    got = retention.aggregate(mx.array(w), H)
    assert got.shape == (B, H, L) and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), ref.aggregate(w, H), rtol=0, atol=0)


@settings(max_examples=25)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(0, 9), st.sampled_from([1, 3, 5, 7]), st.data())
def test_pool_equals_its_reference_twin(B, H, L, window, data):
    start = data.draw(st.integers(0, L))
    s = np.random.default_rng(L * 7 + window).random((B, H, L)).astype(np.float32)
    got = np.array(retention.pool(mx.array(s), window, start))
    np.testing.assert_array_equal(got, ref.pool(s, window, start))
    assert (got >= s).all() and (got[..., :start] == s[..., :start]).all()


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 2), N=st.integers(1, 6), V=st.integers(2, 7), seed=st.integers(0, 2**16))
def test_surprisal_equals_its_reference_twin(B, N, V, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, N, V)) * 4
    targets = rng.integers(0, V, size=(B, N))
    got = retention.surprisal(mx.array(logits, dtype=mx.float32), mx.array(targets))
    np.testing.assert_allclose(np.array(got), ref.surprisal(np.float32(logits), targets), rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), L=st.integers(1, 9), weight=st.sampled_from([0.0, 0.5, 3.0]),
       data=st.data())
def test_weigh_equals_its_reference_twin(B, H, L, weight, data):
    start = data.draw(st.integers(0, L))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    scores = rng.uniform(size=(B, H, L)).astype(np.float32)
    s = rng.exponential(size=(B, L - start)).astype(np.float32)
    s[rng.uniform(size=s.shape) < 0.2] = np.nan  # tokens nothing predicted
    if data.draw(st.booleans()):
        s[0] = 0.0  # a row predicted perfectly
    got = np.array(retention.weigh(mx.array(scores), mx.array(s), weight, start))
    np.testing.assert_allclose(got, ref.weigh(scores, s, weight, start), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(got[..., :start], scores[..., :start])


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 2), layers=st.lists(st.integers(1, 3), min_size=1, max_size=3), N=st.integers(1, 11),
       width=st.integers(1, 4), data=st.data())
def test_shared_equals_its_reference_twin_and_keeps_whole_windows_within_room(B, layers, N, width, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    scores = [rng.integers(-1, 5, size=(B, H, N)).astype(np.float32) / 4 for H in layers]  # quarters: exact means
    if data.draw(st.booleans()):
        scores[0][0, 0, 0] = np.nan  # counts as 0
    room = np.array([data.draw(st.integers(-1, N + 1)) for _ in range(B)])
    got = np.array(retention.shared([mx.array(s) for s in scores], width, mx.array(room)))
    np.testing.assert_array_equal(got, ref.shared(scores, width, room))
    assert got.shape == (B, N) and (got.sum(axis=1) <= np.maximum(room, 0)).all()
    for b in range(B):  # a window is taken whole or not at all
        for a in range(0, N, width):
            assert got[b, a : a + width].all() or not got[b, a : a + width].any()


def test_shared_rejects_a_width_below_one_and_no_layers():
    with pytest.raises(ValueError, match="width=0 is invalid: expected >= 1"):
        retention.shared([mx.zeros((1, 1, 3))], 0, 3)
    with pytest.raises(ValueError, match="scores is empty"):
        retention.shared([], 2, 3)


def test_weigh_rejects_a_negative_or_nan_weight_and_surprisals_of_another_chunk():
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"weight={bad}"):
            retention.weigh(mx.zeros((1, 1, 3)), mx.zeros((1, 3)), bad)
    with pytest.raises(ValueError, match=r"expected \(1, 2\)"):
        retention.weigh(mx.zeros((1, 1, 3)), mx.zeros((1, 3)), 1.0, start=1)


def test_pool_rejects_an_even_window_and_a_start_past_the_scores():
    with pytest.raises(ValueError, match="window=4 is invalid: expected an odd number"):
        retention.pool(mx.zeros((1, 1, 5)), 4)
    with pytest.raises(ValueError, match="start=6 is invalid for 5 scores"):
        retention.pool(mx.zeros((1, 1, 5)), 3, start=6)


def test_aggregate_rejects_a_head_count_that_does_not_divide():
    with pytest.raises(ValueError, match="3 query heads is invalid for kv_heads=2"):
        retention.aggregate(mx.zeros((1, 3, 2, 4)), 2)


def _scored_states(data, cfg, prompt=Prompt()):
    """A core state and its twin after one or two scored chunks, plus the rng."""
    B, H, D = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)), 4
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    s, r = init(cfg, B, H, D, dtype=mx.float32), ref.init(cfg, B, H, D)
    for _ in range(data.draw(st.integers(1, 2))):
        s, r = _absorb_both(s, r, rng, data.draw(st.integers(1, 2 * cfg.budget)), cfg, prompt)
    return s, r, rng


def _absorb_both(s, r, rng, n, cfg, prompt):
    """One chunk of n random tokens scored by random weights, through the core (compact,
    chunk_scores, absorb_scored) and through the reference twins."""
    B, H, C = s.positions.shape
    k = rng.standard_normal((B, H, n, 4)).astype(np.float32)
    by_position = rng.random((B, H, int(max(s.seen.tolist())) + n)).astype(np.float32)
    s = view.compact(s)
    span = int(mx.max(s.length).item())
    pos = np.array(s.positions[..., :span])
    on_slots = np.where(pos >= 0, np.take_along_axis(by_position, np.maximum(pos, 0), -1), 0)
    seen = np.array(s.seen)[:, None, None]
    on_chunk = np.take_along_axis(by_position, seen + np.arange(n), -1)
    scores = mx.array(np.concatenate([on_slots, on_chunk], -1).astype(np.float32))
    got = retention.chunk_scores(s, scores, span)
    want = ref.chunk_scores(r, by_position)
    for b in range(B):
        for h in range(H):
            for j, p in enumerate(np.array(s.positions[b, h]).tolist()):
                if p >= 0:
                    assert got[b, h, j].item() == pytest.approx(want[b][h][p], rel=1e-6)
            for i in range(n):
                assert got[b, h, C + i].item() == pytest.approx(want[b][h][int(seen[b, 0, 0]) + i], rel=1e-6)
    merged = np.zeros_like(by_position)
    for b in range(B):
        for h in range(H):
            for p, v in want[b][h].items():
                merged[b, h, p] = v
    return (absorb_scored(s, mx.array(k), mx.array(k), got, cfg, prompt),
            ref.absorb_scored(r, k, k, merged, cfg, prompt))


@settings(max_examples=30)
@given(st.data())
def test_chunk_scores_then_absorb_scored_equal_the_reference(data):
    cfg = H2OConfig(budget=data.draw(st.integers(4, 8)), n_sink=data.draw(st.integers(0, 1)),
                    grace=data.draw(st.integers(0, 2)))
    s, r, _ = _scored_states(data, cfg, Prompt(pool=data.draw(st.sampled_from([1, 3]))))
    assert_invariants(s, cfg)
    assert_matches(s, r, where=str(cfg), kv=Storage())


@settings(max_examples=20)
@given(st.data())
def test_compact_keeps_everything_and_sorts_the_kept_first(data):
    """Token-by-token eviction leaves survivors in slot order of arrival: compact lays
    them out first, sorted by position, and changes nothing else."""
    cfg = H2OConfig(budget=data.draw(st.integers(3, 8)), n_sink=1, grace=1)
    B, H = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    s = init(cfg, B, H, 4, dtype=mx.float32)
    for _ in range(data.draw(st.integers(0, 3 * cfg.budget))):
        kv = mx.array(rng.standard_normal((B, H, 1, 4)).astype(np.float32))
        s = step(s, kv, kv, cfg)
    c = view.compact(s)
    assert_invariants(c, cfg)
    for b in range(B):
        for h in range(H):
            slots = [(p, float(sc)) for p, sc in zip(np.array(s.positions[b, h]).tolist(),
                                                     np.array(s.scores[b, h]).tolist()) if p >= 0]
            after = list(zip(np.array(c.positions[b, h]).tolist(), np.array(c.scores[b, h]).tolist()))
            assert after[: len(slots)] == sorted(slots) and all(p < 0 for p, _ in after[len(slots):])
            order = np.argsort(np.where(np.array(s.positions[b, h]) >= 0, np.array(s.positions[b, h]), 1 << 30),
                               kind="stable")
            assert np.array_equal(np.array(c.keys[b, h]), np.array(s.keys[b, h])[order])


def test_chunk_scores_rejects_a_span_beyond_the_slots():
    s = init(H2OConfig(budget=2, n_sink=0, grace=0), 1, 1, 4)
    with pytest.raises(ValueError, match="span=9 is invalid"):
        retention.chunk_scores(s, mx.zeros((1, 1, 12)), 9)


# ---------------------------------------------------------------- cache_prompt on tiny models

PROMPT = np.random.default_rng(1).integers(0, 101, 40).tolist()


@pytest.fixture
def llama():
    model = tiny_model("llama")
    yield model
    remove_query_hook(model)


def _next_logits(model, cache, ids):
    return model(mx.array(ids)[None], cache=cache)[:, -1]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_prompt_within_budget_gives_the_full_cache_logits(arch):
    """Nothing evicted: the repeat pass leaves no trace (its rows and sliding-window
    updates are thrown away), so the next token is the full cache's."""
    model = tiny_model(arch)
    try:
        full = make_prompt_cache(model)
        want = _next_logits(model, full, PROMPT + [7])
        cache = make_h2o_cache(model, H2OConfig(budget=64, n_sink=1, grace=2))
        cache_prompt(model, PROMPT, cache, repeat_prefix=[3, 4], chunk_size=16)
        assert all(c.tokens_kept == c.tokens_seen == len(PROMPT) for c in h2o_caches(cache))
        assert all(c.offset == len(PROMPT) for c in cache)
        assert mx.allclose(_next_logits(model, cache, [7]), want, atol=1e-4, rtol=1e-4)
        if arch == "gemma3":
            assert [type(c) for c in cache] == [RotatingKVCache, RotatingKVCache, H2OKVCache]
    finally:
        remove_query_hook(model)


@pytest.mark.parametrize("chunk", [7, 64])
def test_a_long_prompt_is_held_to_budget_in_every_layer(llama, chunk):
    cfg = H2OConfig(budget=12, n_sink=1, grace=2)
    cache = make_h2o_cache(llama, cfg, prompt=Prompt(pool=3))
    assert cache_prompt(llama, PROMPT, cache, chunk_size=chunk, budgets="uniform") is cache
    for c in cache:
        assert c.tokens_seen == len(PROMPT) and c.tokens_kept == cfg.budget
        assert_invariants(c.core_state, cfg)
        kept = np.array(kept_positions(c.core_state))
        assert kept.max() == len(PROMPT) - 1 and 0 in kept[0, 0]  # the sink and the grace window
    logits = _next_logits(llama, cache, [5, 6])  # and the cache decodes on
    assert logits.shape == (1, 101) and all(c.tokens_kept == cfg.budget for c in cache)


@pytest.mark.parametrize("budgets, windows", [("global", None), ("layer", None), ("global", 1)])
@pytest.mark.parametrize("chunk", [16, 64])
def test_shared_windows_are_kept_whole_in_every_head_within_their_share(llama, chunk, budgets, windows):
    """share: the best windows of each chunk are in every layer and head, whole (aligned on the
    chunk's start), and with the windows of earlier chunks they take at most share x budget,
    and at most `windows` x width tokens."""
    cfg, share, width = H2OConfig(budget=12, n_sink=1, grace=2), 0.5, 3
    most = share * cfg.budget if windows is None else min(share * cfg.budget, windows * width)
    cache = make_h2o_cache(llama, cfg)
    cache_prompt(llama, PROMPT, cache, chunk_size=chunk, budgets=budgets, share=share, width=width,
                 windows=windows)
    shared = None
    for c in cache:
        core = c.core_state
        lifted = (np.array(core.positions) >= 0) & (np.array(core.scores) >= retention.SHARED / 2)
        heads = [set(np.array(core.positions)[0, h][lifted[0, h]].tolist()) for h in range(c.kv_heads)]
        assert all(h == heads[0] for h in heads)  # in every head
        shared = heads[0] if shared is None else shared
        assert heads[0] == shared  # and every layer
        kept = [set(head) for head in kept_positions(core).tolist()[0]]
        assert all(shared <= k for k in kept)
    assert 0 < len(shared) <= int(most)
    first = min(chunk, len(PROMPT))  # the first chunk shares at most its part of the room
    assert len([p for p in shared if p < first]) <= int(first / len(PROMPT) * most)
    for p in shared:  # whole windows, cut from each chunk's first token
        start = p // chunk * chunk + (p % chunk) // width * width
        assert set(range(start, min(start + width, (p // chunk + 1) * chunk, len(PROMPT)))) <= shared
    none = make_h2o_cache(llama, cfg)
    cache_prompt(llama, PROMPT, none, chunk_size=chunk, budgets=budgets, share=0.0)
    assert all((np.array(c.core_state.scores) < retention.SHARED / 2).all() for c in none)


def test_cache_prompt_rejects_a_share_outside_0_1_and_a_width_below_one(llama):
    cache = make_h2o_cache(llama, H2OConfig(budget=12, n_sink=1, grace=2))
    with pytest.raises(ValueError, match=r"share=1.5 is invalid: expected 0 <= share <= 1"):
        cache_prompt(llama, PROMPT, cache, share=1.5)
    with pytest.raises(ValueError, match="width=0 is invalid: expected >= 1"):
        cache_prompt(llama, PROMPT, cache, share=0.5, width=0)
    with pytest.raises(ValueError, match=r"windows=0 is invalid: expected >= 1 or None \(no bound\)"):
        cache_prompt(llama, PROMPT, cache, share=0.5, windows=0)
    with pytest.raises(ValueError, match="share=0.5 is invalid with budgets='uniform': expected 0 or None"):
        cache_prompt(llama, PROMPT, cache, share=0.5, budgets="uniform")


@pytest.mark.parametrize("chunk", [7, 64])
def test_a_long_prompt_keeps_the_total_budget_where_the_scores_are(llama, chunk):
    """budgets="global": the budget summed over layers and heads is kept, spread by one
    selection; each head keeps its own share (sinks always), each layer's budget is its
    most kept tokens per head + tail, and the cache decodes on: the tail's tokens are
    taken without evicting the prompt's."""
    cfg, tail = H2OConfig(budget=12, n_sink=1, grace=2), 4
    cache = make_h2o_cache(llama, cfg)
    cache_prompt(llama, PROMPT, cache, chunk_size=chunk, tail=tail, budgets="global")
    per_head = [c.tokens_per_head[0] for c in cache]
    assert sum(map(sum, per_head)) == cfg.budget * cache[0].kv_heads * len(cache)
    for c, heads in zip(cache, per_head):
        assert c.config.budget == max(heads) + tail and c.target_budget == cfg.budget
        assert_invariants(c.core_state, c.config, selected=len(PROMPT))
        assert all(0 in head for head in kept_positions(c.core_state).tolist()[0])  # the sink
    before = [kept_positions(c.core_state).tolist()[0] for c in cache]
    _next_logits(llama, cache, [5, 6, 7])
    for c, heads, kept in zip(cache, per_head, before):
        assert c.tokens_per_head[0] == [n + 3 for n in heads]  # nothing of the prompt evicted
        now = kept_positions(c.core_state).tolist()[0]
        assert all(set(k) - {-1} <= set(n) for k, n in zip(kept, now))


@pytest.mark.parametrize("chunk", [7, 64])
def test_budgets_per_layer_keep_each_layers_total_spread_over_its_heads(llama, chunk):
    """budgets="layer": every layer keeps its budget times its heads, spread over its heads
    by the scores (heads differ, the layer's sum does not), sinks in every head."""
    cfg, tail = H2OConfig(budget=12, n_sink=1, grace=2), 4
    cache = make_h2o_cache(llama, cfg)
    cache_prompt(llama, PROMPT, cache, chunk_size=chunk, tail=tail, budgets="layer")
    per_head = [c.tokens_per_head[0] for c in cache]
    assert all(sum(heads) == cfg.budget * c.kv_heads for c, heads in zip(cache, per_head))
    assert any(len(set(heads)) > 1 for heads in per_head)  # spread by the scores, not uniform
    for c, heads in zip(cache, per_head):
        assert c.config.budget == max(heads) + tail and c.target_budget == cfg.budget
        assert_invariants(c.core_state, c.config, selected=len(PROMPT))
        assert all(0 in head for head in kept_positions(c.core_state).tolist()[0])
    assert _next_logits(llama, cache, [5, 6]).shape == (1, 101)


def test_auto_spreads_per_layer_from_layer_from_of_the_prompt_kept(llama):
    """budgets="auto" (the default): "layer" while each head's budget is at least LAYER_FROM
    of the tokens read, counting those the cache already holds; "global" below."""
    cfg = H2OConfig(budget=20, n_sink=1, grace=2)
    cache = make_h2o_cache(llama, cfg)
    edge = int(cfg.budget / LAYER_FROM)
    assert spread_for(cache, edge) == "layer" and spread_for(cache, edge + 1) == "global"
    share = Fraction(LAYER_FROM).limit_denominator(100)  # a budget and a length exactly on the edge
    on_edge = make_h2o_cache(llama, H2OConfig(budget=share.numerator, n_sink=1, grace=2))
    assert spread_for(on_edge, share.denominator) == "layer" and spread_for(on_edge, share.denominator + 1) == "global"
    auto, layer = make_h2o_cache(llama, cfg), make_h2o_cache(llama, cfg)
    cache_prompt(llama, PROMPT, auto, chunk_size=16)
    cache_prompt(llama, PROMPT, layer, chunk_size=16, budgets="layer")
    assert [c.tokens_per_head for c in auto] == [c.tokens_per_head for c in layer]
    more = edge - len(PROMPT)  # the tokens held count too
    assert spread_for(auto, more) == "layer" and spread_for(auto, more + 1) == "global"


def test_a_prompt_read_in_slices_within_it_keeps_what_one_call_keeps(llama):
    """within=(start, total): serve reads a long prompt one slice per call; each slice is spread
    as the whole prompt is ("auto" on all of it: "global" here, where the first slice alone would
    be "layer") and its windows take their part of the prompt's room, so the kept sets are one
    call's, bit for bit."""
    cfg, size = H2OConfig(budget=12, n_sink=1, grace=2), 16
    one, sliced = make_h2o_cache(llama, cfg), make_h2o_cache(llama, cfg)
    assert spread_for(one, size) == "layer" != spread_for(one, len(PROMPT))
    cache_prompt(llama, PROMPT, one, chunk_size=size, share=0.5, width=3)
    for start in range(0, len(PROMPT), size):
        cache_prompt(llama, PROMPT[start : start + size], sliced, chunk_size=size, share=0.5, width=3,
                     within=(start, len(PROMPT)))
    for a, b in zip(one, sliced):
        assert a.tokens_per_head == b.tokens_per_head
        assert np.array_equal(np.array(a.core_state.positions), np.array(b.core_state.positions))
        assert np.array_equal(np.array(a.core_state.scores), np.array(b.core_state.scores))
    for bad in [(-1, 40), (30, 40)]:
        with pytest.raises(ValueError, match=rf"within=\({bad[0]}, 40\) is invalid: expected \(start, total\)"):
            cache_prompt(llama, PROMPT[:16], make_h2o_cache(llama, cfg), within=bad)


def test_a_cap_bounds_every_head_and_so_every_layers_slots(llama):
    """cap=: no head keeps more than cap tokens, the total is still kept (the others take
    the rest), and each layer's budget (its slots per head) is at most cap + tail."""
    cfg, tail, cap = H2OConfig(budget=12, n_sink=1, grace=2), 4, 13
    free, capped = make_h2o_cache(llama, cfg), make_h2o_cache(llama, cfg)
    cache_prompt(llama, PROMPT, free, chunk_size=64, tail=tail, budgets="global")
    cache_prompt(llama, PROMPT, capped, chunk_size=64, tail=tail, cap=cap, budgets="global")
    assert max(max(c.tokens_per_head[0]) for c in free) > cap  # the bound matters here
    assert sum(sum(c.tokens_per_head[0]) for c in capped) == cfg.budget * capped[0].kv_heads * len(capped)
    assert all(max(c.tokens_per_head[0]) <= cap and c.config.budget <= cap + tail for c in capped)
    assert sum(c.nbytes for c in capped) < sum(c.nbytes for c in free)


@pytest.mark.parametrize("budgets", ["global", "uniform"])
def test_attending_in_slices_of_queries_changes_nothing(llama, monkeypatch, budgets):
    """Both passes attend a slice of queries at a time (`weights_per_slice`) (the peak holds one slice's
    weights, not a chunk's): the kept sets, the scores and the next logits are those of
    whole chunks, also where later chunks' kept heads hold reserved slots (masks per head)."""
    cfg = H2OConfig(budget=12, n_sink=1, grace=2)
    runs = []
    for most in (None, 5 * 4 * 40):  # slices of ~5 queries (4 query heads, up to 40 keys)
        monkeypatch.setattr(ScoringPass, "weights_per_slice", most)
        cache = make_h2o_cache(llama, cfg)
        cache_prompt(llama, PROMPT, cache, repeat_prefix=[3, 4], chunk_size=16, budgets=budgets)
        runs.append((cache, [kept_positions(c.core_state) for c in cache], _next_logits(llama, cache, [5, 6])))
    (whole, kept, logits), (sliced, kept_s, logits_s) = runs
    assert all(mx.array_equal(a, b) for a, b in zip(kept, kept_s))
    for a, b in zip(whole, sliced):
        assert mx.allclose(a.core_state.scores, b.core_state.scores, atol=1e-6)
    assert mx.allclose(logits, logits_s, atol=1e-4, rtol=1e-4)


def test_reserved_slots_are_never_attended(llama):
    """After a selection some heads hold reserved slots inside the rows attention reads:
    garbage written into them changes no logit (each layer's mask per KV head hides them),
    in a decode step and in a chunk."""
    cache = make_h2o_cache(llama, H2OConfig(budget=8, n_sink=1, grace=2))
    cache_prompt(llama, PROMPT, cache, chunk_size=16, tail=4)
    assert any(int(mx.sum(c.core_state.positions == -2).item()) for c in cache)
    dirty = copy.deepcopy(cache)
    for c in dirty:
        s = c.core_state
        junk = (s.positions == -2)[..., None]
        c.keys = mx.where(junk, 1e3, s.keys)
        c.values = mx.where(junk, -1e3, s.values)
    for ids in ([5], [6, 7, 8]):
        assert mx.array_equal(_next_logits(llama, dirty, ids), _next_logits(llama, cache, ids))


def test_a_selected_cache_needs_the_hook(llama):
    cache = make_h2o_cache(llama, H2OConfig(budget=8, n_sink=1, grace=2, scoring="key"))
    cache_prompt(llama, PROMPT, cache, chunk_size=16)
    remove_query_hook(llama)
    _next_logits(llama, cache, [5])  # attended without the masks: the next update says so
    with pytest.raises(RuntimeError, match="install_query_hook"):
        _next_logits(llama, cache, [6])


def test_caches_of_different_selections_batch_as_they_decode_alone(llama):
    """Two prompts compressed by their own selections (different budgets per layer) merge
    into one batch cache (the narrower rows widened by reserved slots) and decode exactly
    as each does alone."""
    cfg = H2OConfig(budget=8, n_sink=1, grace=2)
    a, b = make_h2o_cache(llama, cfg), make_h2o_cache(llama, cfg)
    cache_prompt(llama, PROMPT, a, chunk_size=16, tail=3)
    cache_prompt(llama, PROMPT[::-1][:31], b, chunk_size=16, tail=3)
    assert [c.config.budget for c in a] != [c.config.budget for c in b]
    batch = [H2OKVCache.merge([x, y]) for x, y in zip(copy.deepcopy(a), copy.deepcopy(b))]
    for t in range(6):  # past the tail: the rule evicts within each row's own shares
        got = llama(mx.array([[t + 1], [t + 2]]), cache=batch)[:, -1]
        want = mx.concatenate([_next_logits(llama, a, [t + 1]), _next_logits(llama, b, [t + 2])])
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5), t
    for i, alone in enumerate((a, b)):
        row = [c.extract(i) for c in batch]
        for r, c in zip(row, alone):
            mine = [p for p in kept_positions(c.core_state).tolist()[0]]
            theirs = [p for p in kept_positions(r.core_state).tolist()[0]]
            assert [[p for p in h if p >= 0] for h in mine] == [[p for p in h if p >= 0] for h in theirs]


def test_one_scoring_of_a_one_chunk_prompt_serves_every_budget(llama):
    """score_chunk once, then select_across onto fresh caches of two budgets: the same caches
    as cache_prompt at each budget (what eval ruler does for its ratios)."""
    from h2o_fn.adapters.retention import score_chunk, select_across

    passes = score_chunk(llama, PROMPT, h2o_caches(make_h2o_cache(llama, H2OConfig(budget=8, n_sink=1, grace=2))))
    for budget in (8, 16):
        cfg = H2OConfig(budget=budget, n_sink=1, grace=2)
        want = cache_prompt(llama, PROMPT, make_h2o_cache(llama, cfg), chunk_size=len(PROMPT))
        got = make_h2o_cache(llama, cfg)
        select_across([p.onto(c) for p, c in zip(passes, got)], tail=32)
        for g, w in zip(got, want):
            assert mx.array_equal(kept_positions(g.core_state), kept_positions(w.core_state))
            assert g.config == w.config
        assert mx.array_equal(_next_logits(llama, got, [3]), _next_logits(llama, want, [3]))
    with pytest.raises(ValueError, match="expected both empty"):
        passes[0].onto(want[0])


@pytest.mark.parametrize("budgets", ["global", "uniform"])
def test_each_chunks_scores_are_pooled_before_the_selection(llama, monkeypatch, budgets):
    """cache_prompt(pool=5) keeps what an unpooled pass keeps once its chunk scores (not the
    kept rows' before them) are pooled by the reference; pool=1 is KVzip's scores as they are."""
    cfg = H2OConfig(budget=12, n_sink=1, grace=2)
    kw = dict(chunk_size=16, budgets=budgets, surprisal=0)
    pooled = cache_prompt(llama, PROMPT, make_h2o_cache(llama, cfg), pool=5, **kw)
    raw = cache_prompt(llama, PROMPT, make_h2o_cache(llama, cfg), pool=1, **kw)
    original = ScoringPass._scores
    monkeypatch.setattr(ScoringPass, "_scores", lambda p: mx.array(ref.pool(
        np.array(original(p)), 5, p.span).astype(np.float32)))
    by_hand = cache_prompt(llama, PROMPT, make_h2o_cache(llama, cfg), pool=1, **kw)
    kept = [[kept_positions(c.core_state) for c in cache] for cache in (pooled, raw, by_hand)]
    assert all(mx.array_equal(a, b) for a, b in zip(kept[0], kept[2]))
    assert not all(mx.array_equal(a, b) for a, b in zip(kept[0], kept[1]))


@pytest.mark.parametrize("budgets", ["global", "uniform"])
def test_each_chunks_scores_are_weighed_by_surprisal(llama, monkeypatch, budgets):
    """cache_prompt(surprisal=3) keeps what the reference's `weigh` of each chunk's scores by
    its tokens' surprisals keeps, and not what KVzip's scores alone keep (surprisal=0)."""
    cfg = H2OConfig(budget=12, n_sink=1, grace=2)
    weighed = cache_prompt(llama, PROMPT, make_h2o_cache(llama, cfg), chunk_size=16, budgets=budgets, surprisal=3)
    plain = cache_prompt(llama, PROMPT, make_h2o_cache(llama, cfg), chunk_size=16, budgets=budgets, surprisal=0)
    seen = []
    monkeypatch.setattr(ScoringPass, "_scores", lambda p: (seen.append(p.surprisals.shape), mx.array(ref.weigh(
        np.array(p.scores), np.array(p.surprisals), p.surprisal, p.span).astype(np.float32)))[1])
    by_hand = cache_prompt(llama, PROMPT, make_h2o_cache(llama, cfg), chunk_size=16, budgets=budgets, surprisal=3)
    kept = [[kept_positions(c.core_state) for c in cache] for cache in (weighed, plain, by_hand)]
    assert seen and all(shape[1] in (16, len(PROMPT) % 16) for shape in seen)
    assert all(mx.array_equal(a, b) for a, b in zip(kept[0], kept[2]))
    assert not all(mx.array_equal(a, b) for a, b in zip(kept[0], kept[1]))


@pytest.mark.parametrize("known", [True, False])
def test_the_first_pass_gives_the_models_surprisals(llama, monkeypatch, known):
    """`read` gives each token's surprisal under the model's own logits (NaN for the first), made
    a few rows at a time from the hidden states where the model's head is known, else from
    the whole logits."""
    from mlx_lm.models.cache import make_prompt_cache

    from h2o_fn.adapters import retention as adapter

    ids = mx.array(PROMPT[:20])[None]
    logits = llama(ids, cache=make_prompt_cache(llama))
    want = ref.surprisal(np.array(logits[:, :-1]), np.array(ids[:, 1:]))
    monkeypatch.setattr(adapter, "SLICE", 3 * logits.shape[-1])  # 3 rows a slice
    model = llama if known else (lambda x, cache: llama(x, cache=cache))
    assert (adapter._body_and_head(model) is not None) == known
    got = np.array(adapter.read(model, ids, make_prompt_cache(llama), True))
    assert got.shape == (1, 20) and np.isnan(got[0, 0])
    np.testing.assert_allclose(got[:, 1:], want, rtol=1e-4, atol=1e-4)
    assert adapter.read(model, ids, make_prompt_cache(llama), False) is None


def test_continuing_a_cache_and_copies_per_question(llama):
    cfg = H2OConfig(budget=12, n_sink=1, grace=2)
    cache = make_h2o_cache(llama, cfg)
    cache_prompt(llama, PROMPT[:20], cache, chunk_size=8)
    cache_prompt(llama, PROMPT[20:], cache, chunk_size=8)  # continues: positions go on
    assert all(c.tokens_seen == len(PROMPT) for c in cache)
    first, second = copy.deepcopy(cache), copy.deepcopy(cache)
    a = _next_logits(llama, first, [1, 2, 3])
    _next_logits(llama, second, [9, 9])
    assert mx.allclose(_next_logits(llama, copy.deepcopy(cache), [1, 2, 3]), a)
    assert all(c.tokens_seen == len(PROMPT) for c in cache)  # the copies left it alone


def test_bad_input_raises_with_what_was_expected(llama):
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        cache_prompt(llama, [], make_h2o_cache(llama, H2OConfig(budget=8, n_sink=1, grace=2)))
    with pytest.raises(ValueError, match="chunk_size=0 is invalid"):
        cache_prompt(llama, PROMPT, make_h2o_cache(llama, H2OConfig(budget=8, n_sink=1, grace=2)), chunk_size=0)
    with pytest.raises(ValueError, match="no H2OKVCache layer"):
        cache_prompt(llama, PROMPT, [KVCache() for _ in llama.layers])
    with pytest.raises(ValueError, match="pool=2 is invalid: expected an odd number"):
        cache_prompt(llama, PROMPT, make_h2o_cache(llama, H2OConfig(budget=8, n_sink=1, grace=2)), pool=2)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"surprisal={bad} is invalid: expected a finite number"):
            cache_prompt(llama, PROMPT, make_h2o_cache(llama, H2OConfig(budget=8, n_sink=1, grace=2)), surprisal=bad)


def test_a_compressed_prompt_cache_file_round_trips(tmp_path):
    llama = tiny_model("llama", hidden_size=128)  # head_dim 32: one quantization group
    cache = make_h2o_cache(llama, H2OConfig(budget=12, n_sink=1, grace=2), kv_bits=8, kv_group_size=32)
    cache_prompt(llama, PROMPT, cache, chunk_size=16)
    save_prompt_cache(str(tmp_path / "p.safetensors"), cache, {"model": "tiny"})
    loaded, meta = load_prompt_cache(str(tmp_path / "p.safetensors"), return_metadata=True)
    assert meta["model"] == "tiny" and [type(c) for c in loaded] == [H2OKVCache] * 2
    assert mx.array_equal(_next_logits(llama, loaded, [4, 5]), _next_logits(llama, cache, [4, 5]))


def test_to_kvcache_relays_kept_rows_at_consecutive_positions(llama):
    from h2o_fn.adapters.export import to_kvcache

    full = make_prompt_cache(llama)
    want = _next_logits(llama, full, PROMPT + [7])
    cache = make_h2o_cache(llama, H2OConfig(budget=64, n_sink=1, grace=2))
    cache_prompt(llama, PROMPT, cache, chunk_size=16)
    plain = to_kvcache(llama, cache)  # nothing evicted: positions already 0..K-1
    assert [type(c) for c in plain] == [KVCache] * 2 and plain[0].offset == len(PROMPT)
    assert mx.allclose(_next_logits(llama, plain, [7]), want, atol=1e-4, rtol=1e-4)

    cache = make_h2o_cache(llama, H2OConfig(budget=12, n_sink=1, grace=2))
    cache_prompt(llama, PROMPT, cache, chunk_size=16, budgets="uniform")
    plain = to_kvcache(llama, cache)
    assert all(c.offset == 12 and c.keys.shape[2] == 12 for c in plain)
    kept = np.array(kept_positions(cache[0].core_state))[0, 1]
    p = int(kept[kept >= 0][-1])  # the newest kept key, now at row 11: re-rotated by 11 - p
    from h2o_fn import remap

    back = remap(plain[0].keys[:, 1:2, 11:12], mx.array(11), mx.array(p), dims=16, base=10000.0, traditional=False)
    stored = cache[0].core_state.keys[:, 1:2]
    slot = int(np.argmax(np.array(cache[0].core_state.positions[0, 1]) == p))
    assert mx.allclose(back, stored[:, :, slot : slot + 1].astype(mx.float32), atol=1e-4)
    assert _next_logits(llama, plain, [7]).shape == (1, 101)
    with pytest.raises(ValueError, match="layer 0 holds KVCache"):
        to_kvcache(llama, plain)
