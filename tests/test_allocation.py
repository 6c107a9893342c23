"""Per-layer budget policies: equal bytes, floors, and the shapes they promise."""

import pytest
from hypothesis import given, strategies as st

from h2o_fn.allocation import from_need, pyramid, uniform


@given(n=st.integers(1, 64), mean=st.integers(8, 2048), floor=st.integers(1, 8),
       need=st.lists(st.floats(0.01, 100.0), min_size=64, max_size=64), mix=st.floats(0.0, 1.0))
def test_every_policy_spends_the_uniform_bytes_and_respects_the_floor(n, mean, floor, need, mix):
    for budgets in (uniform(n, mean), pyramid(n, mean, floor), from_need(need[:n], mean, floor, mix)):
        assert len(budgets) == n and all(isinstance(b, int) and b >= floor for b in budgets)
        assert sum(budgets) == n * mean  # mean >= 8 >= floor: the floors never force more


def test_pyramid_falls_linearly_and_need_orders_the_layers():
    b = pyramid(30, 128, floor=21)
    assert b[0] == 192 and b[-1] == 64 and all(x >= y for x, y in zip(b, b[1:]))
    assert from_need([1.0, 2.0, 4.0], 100, mix=1.0) == [43, 86, 171]
    assert from_need([1.0, 2.0, 4.0], 100, mix=0.0) == [100, 100, 100]


def test_bad_need_and_mix_are_named():
    with pytest.raises(ValueError, match="need="):
        from_need([1.0, 0.0], 100)
    with pytest.raises(ValueError, match="mix=1.5"):
        from_need([1.0, 2.0], 100, mix=1.5)


def test_policies_on_a_model_give_one_budget_per_h2o_layer():
    from h2o_fn import H2OConfig
    from h2o_fn.adapters.allocation import budgets_for
    from h2o_fn.adapters.attention import remove_query_hook
    from h2o_fn.adapters.mlx_lm import make_h2o_cache

    from tiny_models import tiny_model

    class Tokenizer:
        def encode(self, text):
            return [ord(c) % 101 for c in text]

    model = tiny_model("llama", num_hidden_layers=4)
    cfg = H2OConfig(budget=32, n_sink=2, grace=4, scoring="key")
    try:
        assert budgets_for(model, "uniform", cfg) is None
        for policy in ("pyramid", "calibrated"):
            budgets = budgets_for(model, policy, cfg, Tokenizer())
            assert len(budgets) == 4 and sum(budgets) == 4 * 32 and min(budgets) >= 7
            cache = make_h2o_cache(model, cfg, budgets=budgets)
            assert [c.config.budget for c in cache] == budgets
        with pytest.raises(ValueError, match="allocation 'flat'"):
            budgets_for(model, "flat", cfg)
    finally:
        remove_query_hook(model)
