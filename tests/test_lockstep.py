"""Caches of one layer in lockstep: a follower's rows sit where its leader keeps the tokens."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from h2o_fn import H2OConfig, check_invariants
from h2o_fn.adapters.attention import remove_query_hook
from h2o_fn.adapters.cache import H2OKVCache
from h2o_fn.adapters.lockstep import H2OCacheList, H2OFollower
from h2o_fn.adapters.mlx_lm import h2o_caches, make_h2o_cache

import zoo

CHUNKS = [7, 1, 1, 5, 1, 1, 1, 9, 1, 1]


def by_position(seen, n, width):
    """Follower rows that name their own position: row p is p everywhere."""
    return mx.broadcast_to(mx.arange(seen, seen + n, dtype=mx.float32)[None, None, :, None], (1, 2, n, width))


@pytest.mark.parametrize("follower_first", [False, True])
@pytest.mark.parametrize("scoring, prefill", [("key", "oneshot"), ("key", "greedy"), ("query", "oneshot")])
def test_follower_rows_follow_the_leaders_positions(follower_first, scoring, prefill):
    rng = np.random.default_rng(0)
    cfg = H2OConfig(budget=6, n_sink=1, grace=2, scoring=scoring, prefill=prefill)
    pair = H2OCacheList(H2OKVCache(cfg), H2OFollower())
    lead, follow = pair[0], pair[1]
    seen = 0
    for n in CHUNKS:
        k = mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32))
        mine = by_position(seen, n, 4)
        if follower_first:
            fk, _ = follow.update_and_fetch(mine, mine)
        lk, _ = lead.update_and_fetch(k, k)
        if not follower_first:
            fk, _ = follow.update_and_fetch(mine, mine)
        assert fk.shape[2] == lk.shape[2]  # the same columns: the indexer's picks index both
        if scoring == "query":
            w = mx.array(rng.random((1, 2, n, lk.shape[2])).astype(np.float32))
            lead.receive_weights(w)
        seen += n
        pending, before = follow._chunk, follow.keys
        read = follow.state  # a read: the rows relaid on a copy, the follower left as it was
        assert follow._chunk is pending and follow.keys is before
        follow.settled()
        assert mx.array_equal(read[0], follow.keys) and mx.array_equal(read[1], follow.values)
        positions = np.array(lead.core_state.positions)
        rows = np.array(follow.keys)[..., 0]
        valid = positions >= 0
        np.testing.assert_array_equal(rows[valid], positions[valid])
        assert check_invariants(lead.core_state, cfg) == []
    assert follow.offset == lead.offset == seen


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa", "minimax_m3_vl", "longcat_flash"])
def test_models_with_several_caches_per_layer_save_load_and_copy(name, tmp_path):
    model = zoo.build(name)
    try:
        cache = make_h2o_cache(model, H2OConfig(budget=6, n_sink=1, grace=2, scoring="key"))
        lists = [c for c in cache if isinstance(c, H2OCacheList)]
        assert lists and all(c[1].leader is c[0] for c in lists)
        ids = mx.array([list(range(1, 15))])
        model(ids[:, :10], cache=cache)
        model(ids[:, 10:11], cache=cache)
        save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
        loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
        twin = copy.deepcopy(cache)
        assert all(c[1].leader is c[0] for c in loaded if isinstance(c, H2OCacheList))
        rest = [model(ids[:, i : i + 1], cache=c) for c in (cache, loaded, twin) for i in (11, 12)]
        assert mx.array_equal(rest[0], rest[2]) and mx.array_equal(rest[0], rest[4])
        assert all(c.tokens_kept == 6 for c in h2o_caches(cache))
    finally:
        remove_query_hook(model)


def test_lockstep_layers_take_decode_tokens_one_at_a_time():
    model = zoo.build("deepseek_v32")
    try:
        with pytest.warns(UserWarning, match="use evict_every=1"):
            cache = make_h2o_cache(model, H2OConfig(budget=6, n_sink=1, grace=2, scoring="key"), evict_every=4)
        assert all(c.evict_every == 1 for c in h2o_caches(cache))
    finally:
        remove_query_hook(model)
