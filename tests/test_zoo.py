"""H2O over mlx-lm's model zoo (tests/zoo.py: tiny random-weight configs of ~120
architectures): drop-in equality with mlx-lm's own cache when nothing is evicted,
bounded memory when it is, and query scoring that matches or says at build time which
layers cannot be hooked."""

import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from h2o_fn import H2OConfig, check_invariants
from h2o_fn.adapters.attention import remove_query_hook
from h2o_fn.adapters.mlx_lm import h2o_caches, make_h2o_cache

import zoo

PROMPT, DECODE = 12, 3  # a prompt chunk, then single tokens (sliding windows are 8 wide)
NO_ATTENTION_CACHE = {  # nothing for H2O to manage: no plain KVCache anywhere in make_cache()
    name for name, facts in zoo.FACTS.items()
    if not any("KVCache" == c or "[KVCache" in c or ",KVCache" in c for c in facts["caches"])
}


def tokens(name):
    rng = np.random.default_rng(0)
    return mx.array(rng.integers(1, min(zoo.vocab(name), 200), (1, PROMPT + DECODE)))


def run(model, cache, ids):
    out = [model(ids[:, :PROMPT], cache=cache)]
    out += [model(ids[:, i : i + 1], cache=cache) for i in range(PROMPT, PROMPT + DECODE)]
    return mx.concatenate(out, axis=1)


def finite_where_expected(name, logits):
    x = np.array(logits.astype(mx.float32))
    if name == "phi3small":  # it masks 91 token ids with -inf (see zoo.NOTES)
        x = np.where(np.isneginf(x), 0, x)
    return np.isfinite(x).all()


@pytest.fixture
def model(request):
    m = zoo.build(request.param)
    yield m
    remove_query_hook(m)


CASES = sorted(set(zoo.ZOO) - NO_ATTENTION_CACHE)


@pytest.mark.parametrize("model", CASES, indirect=True, ids=CASES)
def test_key_scoring_is_a_drop_in_and_bounds_memory(model, request):
    name = request.node.callspec.id
    ids = tokens(name)
    full = run(model, make_prompt_cache(model), ids)
    cache = make_h2o_cache(model, H2OConfig(budget=64, n_sink=2, grace=4, scoring="key"))
    # decode tokens attend through the hook's explicit attention (on the CPU) with the proxy in its
    # product, or (sinks, attention of the model's own) mlx-lm's, the cache scoring the key itself
    got = run(model, cache, ids)
    assert mx.allclose(got, full, atol=2e-3, rtol=2e-3), "logits through the hook differ from mlx-lm's cache"
    remove_query_hook(model)  # mlx-lm's own attention: the same logits
    cache = make_h2o_cache(model, H2OConfig(budget=64, n_sink=2, grace=4, scoring="key"))
    remove_query_hook(model)
    assert mx.array_equal(run(model, cache, ids), full), "logits differ from mlx-lm's cache"
    tight = H2OConfig(budget=6, n_sink=1, grace=2, scoring="key")
    cache = make_h2o_cache(model, tight)
    logits = run(model, cache, ids)
    assert finite_where_expected(name, logits)
    managed = h2o_caches(cache)
    assert managed and all(c.tokens_kept <= tight.budget for c in managed)
    for c in managed:
        if not c.empty():  # a cache the model allocates but never uses stays empty
            assert check_invariants(c.core_state, tight) == []


@pytest.mark.parametrize("model", CASES, indirect=True, ids=CASES)
def test_query_scoring_matches_or_names_the_layers_it_cannot_hook(model, request):
    name = request.node.callspec.id
    ids = tokens(name)
    full = run(model, make_prompt_cache(model), ids)
    cfg = H2OConfig(budget=64, n_sink=2, grace=4, scoring="query")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = make_h2o_cache(model, cfg)
    said = [str(w.message) for w in caught if "never hand their attention weights" in str(w.message)]
    fell_back = [i for i, c in enumerate(h2o_caches(cache)) if c.config.scoring == "key"]
    if fell_back:  # said at build time, naming exactly those layers
        assert len(said) == 1 and f"H2O layers {fell_back} of" in said[0], said
    else:
        assert not said
    got = run(model, cache, ids)  # no "hook is missing" in the middle of a generation
    assert mx.allclose(got, full, atol=2e-3, rtol=2e-3), "logits through the hook differ from mlx-lm's cache"
    for c in h2o_caches(cache):
        assert not c.wants_weights


def test_the_zoo_covers_mlx_lm_and_says_what_it_leaves_out():
    import pkgutil

    import mlx_lm.models

    modules = {m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)}
    covered = {module for module, _ in zoo.ZOO.values()}
    assert modules <= covered | set(zoo.SKIPPED), sorted(modules - covered - set(zoo.SKIPPED))
    assert len(CASES) >= 100
    # what H2O does not manage: models without an attention KV cache of mlx-lm's kind
    assert NO_ATTENTION_CACHE == {"deepseek_v41", "mamba", "mamba2", "recurrent_gemma", "rwkv7"}, \
        NO_ATTENTION_CACHE
