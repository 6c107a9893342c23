"""H2O in mlx-lm's batch generator (the path `batch_generate` and `mlx_lm.server` take)."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate

from h2o_fn import H2OConfig, check_invariants, kept_positions
from h2o_fn.adapters.attention import remove_query_hook
from h2o_fn.adapters.mlx_lm import BatchH2OKVCache, H2OKVCache, make_h2o_cache, use_h2o

from tiny_models import tiny_model


class Tokenizer:
    """What batch_generate needs of a tokenizer (the tiny models have no real one)."""

    eos_token_ids = [1000]  # never sampled: every row runs to its max_tokens

    def decode(self, ids):
        return " ".join(map(str, ids))


PROMPTS = [np.random.default_rng(s).integers(1, 99, n).tolist() for s, n in ((0, 5), (1, 23), (2, 14))]
MAX_TOKENS = [12, 7, 10]  # rows finish at different steps: the batch is filtered as they go


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", hidden_size=128)  # head_dim 32: quantizable rows
    yield m
    remove_query_hook(m)


def replay(model, config, prompt, generated, evict_every=1, **options):
    """One row alone: the prompt minus its last token as one chunk, then single tokens
    (how the batch generator feeds it: it runs one step ahead, so the last one too)."""
    cache = make_h2o_cache(model, config, evict_every=evict_every, **options)
    model(mx.array([prompt[:-1]]), cache=cache)
    for t in (prompt + generated)[len(prompt) - 1 :]:
        model(mx.array([[t]]), cache=cache)
    return cache


@pytest.mark.parametrize("scoring", ["key", "query"])
def test_batch_generate_equals_mlx_lm_when_nothing_is_evicted(model, scoring):
    want = batch_generate(model, Tokenizer(), PROMPTS, max_tokens=MAX_TOKENS, return_token_ids=True,
                          return_logprobs=True)
    cfg = H2OConfig(budget=64, n_sink=2, grace=4, scoring=scoring)
    got = batch_generate(model, Tokenizer(), PROMPTS, max_tokens=MAX_TOKENS, return_token_ids=True,
                         return_logprobs=True, prompt_caches=[make_h2o_cache(model, cfg) for _ in PROMPTS])
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scoring, prefill, kv_bits, evict_every", [
    ("key", "oneshot", None, 1), ("query", "oneshot", None, 1), ("key", "greedy", None, 1),
    ("query", "oneshot", 8, 1), ("key", "oneshot", None, 3), ("query", "oneshot", None, 3),
])
def test_each_row_evicts_on_its_own_positions(model, scoring, prefill, kv_bits, evict_every):
    """At a small budget every row of the batch keeps exactly what it keeps alone (rows
    that finish early leave the others' staged decode tokens staged)."""
    cfg = H2OConfig(budget=9, n_sink=1, grace=2, scoring=scoring, prefill=prefill)
    storage = dict(kv_bits=kv_bits, kv_group_size=32)
    caches = [make_h2o_cache(model, cfg, evict_every=evict_every, **storage) for _ in PROMPTS]
    out = batch_generate(model, Tokenizer(), PROMPTS, max_tokens=MAX_TOKENS, return_token_ids=True,
                         return_prompt_caches=True, prompt_caches=caches)
    for prompt, ids, caches in zip(PROMPTS, out.token_ids, out.caches):
        alone = replay(model, cfg, prompt, ids, evict_every, **storage)
        for a, b in zip(caches, alone):
            assert type(a) is H2OKVCache
            assert a.tokens_seen == b.tokens_seen == len(prompt) + len(ids)
            a.flush(), b.flush()  # staged tokens scored in both (evict_every > 1)
            assert a.tokens_kept == cfg.budget and check_invariants(a.core_state, cfg) == []
            assert mx.array_equal(kept_positions(a.core_state), kept_positions(b.core_state))
            # a batch's products and one row's are summed in different orders by a blocked BLAS
            # (OpenBLAS, adapters/blas.py): 3e-4 apart after 8-bit rows, bit-equal with the reference BLAS
            np.testing.assert_allclose(np.array(a.core_state.scores), np.array(b.core_state.scores),
                                       rtol=1e-3, atol=1e-6)


def test_rows_inserted_later_and_caches_with_history(model):
    """Prompts that arrive while others decode (extend), and per-prompt caches that
    already hold a prefix (merge of different lengths), each evict as they would alone."""
    cfg = H2OConfig(budget=9, n_sink=1, grace=2, scoring="key")
    prefix = [7, 8, 9, 10, 11, 12]
    held = make_h2o_cache(model, cfg)
    model(mx.array([prefix]), cache=held)
    undo = use_h2o(model, cfg)  # the generator builds the caches of prompts that bring none
    gen = BatchGenerator(model, stop_tokens=[[1000]])
    first = gen.insert([PROMPTS[0], PROMPTS[1]], [12, 9], caches=[copy.deepcopy(held), None])
    results = {uid: [] for uid in first}
    caches = {}
    steps = 0
    later = None
    while responses := gen.next_generated():
        steps += 1
        if steps == 3:
            later = gen.insert([PROMPTS[2]], [6])[0]
            results[later] = []
        for r in responses:
            if r.finish_reason != "stop":
                results[r.uid].append(r.token)
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache
    gen.close()
    undo()
    assert later is not None and set(caches) == {*first, later}
    expected = {first[0]: (prefix + PROMPTS[0], PROMPTS[0]), first[1]: (PROMPTS[1], PROMPTS[1]),
                later: (PROMPTS[2], PROMPTS[2])}
    for uid, (seen_prompt, fed) in expected.items():
        if uid == first[0]:  # the held prefix as one chunk, then this prompt as the batch feeds it
            alone = copy.deepcopy(held)
            model(mx.array([fed[:-1]]), cache=alone)
            for t in (fed + results[uid])[len(fed) - 1 :]:
                model(mx.array([[t]]), cache=alone)
        else:
            alone = replay(model, cfg, fed, results[uid])
        for a, b in zip(caches[uid], alone):
            assert a.tokens_seen == b.tokens_seen == len(seen_prompt) + len(results[uid])
            assert mx.array_equal(kept_positions(a.core_state), kept_positions(b.core_state))


def test_batch_cache_protocol_pieces(model):
    cfg = H2OConfig(budget=6, n_sink=1, grace=1, scoring="key")
    rows = []
    for n in (3, 8, 5):
        c = H2OKVCache(cfg)
        c.update_and_fetch(mx.ones((1, 2, n, 32)), mx.ones((1, 2, n, 32)))
        rows.append(c)
    batch = H2OKVCache.merge(rows)
    assert isinstance(batch, BatchH2OKVCache)
    assert batch.offset.tolist() == [3, 8, 5] and batch.size() == 6
    mask = batch.make_mask(2)  # rows of different lengths: an array, padding hidden
    assert mask.shape == (3, 1, 2, 7 + 1)
    assert mask[0, 0, 0].tolist() == [True] * 4 + [False] * 4
    batch.filter([2, 0])
    assert batch.offset.tolist() == [5, 3]
    other = H2OKVCache.merge([rows[1]])
    batch.extend(other)
    assert batch.offset.tolist() == [5, 3, 8]
    single = batch.extract(2)
    assert type(single) is H2OKVCache and single.offset == 8 and single.tokens_kept == 6
    with pytest.raises(ValueError, match="left_padding"):
        BatchH2OKVCache(cfg).prepare(left_padding=[1, 0])
    from mlx_lm.models.cache import KVCache

    with pytest.raises(ValueError, match="use_h2o"):
        H2OKVCache.merge([H2OKVCache(cfg), KVCache()])
    with pytest.raises(ValueError, match="different configs"):
        H2OKVCache.merge([H2OKVCache(cfg), H2OKVCache(cfg._replace(decay=0.5))])
    # budgets alone may differ (caches shaped by selections): the batch takes the widest
    assert H2OKVCache.merge([H2OKVCache(cfg), H2OKVCache(cfg._replace(budget=cfg.budget + 3))]).config.budget == \
        cfg.budget + 3
