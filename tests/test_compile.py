"""mx.compile: compiled == eager, and one trace for 1,000 fixed-shape steps."""

import mlx.core as mx
import numpy as np

from h2o_fn import H2OConfig, absorb, compiled_step, init, step

CFG = H2OConfig(budget=32, n_sink=2, grace=4)


def tokens(T, B=2, H=3, D=16, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal((B, H, T, D)).astype(np.float16))


def test_compiled_step_equals_eager_bit_for_bit():
    k = tokens(100)
    eager = lazy = init(CFG, 2, 3, 16)
    fast = compiled_step(CFG)
    for t in range(100):
        eager = step(eager, k[:, :, t : t + 1], k[:, :, t : t + 1], CFG)
        lazy = fast(lazy, k[:, :, t : t + 1], k[:, :, t : t + 1])
        for a, b in zip(eager, lazy):
            assert mx.array_equal(a, b), t


def test_no_retrace_over_1000_steps():
    traces = []

    def traced(state, key, value):
        traces.append(1)  # runs only while mx.compile traces
        return step(state, key, value, CFG)

    fast = mx.compile(traced)
    k = tokens(1000, B=1, H=2, D=8)
    state = init(CFG, 1, 2, 8)
    for t in range(1000):
        state = fast(state, k[:, :, t : t + 1], k[:, :, t : t + 1])
        if t % 100 == 0:
            mx.eval(state)
    mx.eval(state)
    assert len(traces) == 1
    assert state.seen.tolist() == [1000] and state.length.tolist() == [CFG.budget]


def test_oneshot_absorb_compiles_and_equals_eager():
    cfg = CFG._replace(prefill="oneshot")
    fast = mx.compile(lambda s, k, v: absorb(s, k, v, cfg))
    k = tokens(64)
    eager = compiled = init(cfg, 2, 3, 16)
    for start in range(0, 64, 16):
        chunk = k[:, :, start : start + 16]
        eager = absorb(eager, chunk, chunk, cfg)
        compiled = fast(compiled, chunk, chunk)
        for a, b in zip(eager, compiled):
            assert mx.array_equal(a, b)


def test_configs_whose_numbers_run_together_get_their_own_kernels():
    # mlx names a fused kernel after its literals' digits run together and caches it by
    # that name (also on disk): n_sink=1, grace=10 and n_sink=11, grace=0 read the same.
    # The core passes config numbers as computed scalars, so each config keeps its own.
    k = tokens(24, B=1, H=1, D=8)
    for cfg in (H2OConfig(budget=16, n_sink=11, grace=0, decay=0.5),
                H2OConfig(budget=16, n_sink=1, grace=10, decay=0.5),
                H2OConfig(budget=16, n_sink=2, grace=1, decay=0.9),
                H2OConfig(budget=32, n_sink=21, grace=0, decay=0.9)):
        eager = lazy = init(cfg, 1, 1, 8)
        fast = compiled_step(cfg)
        for t in range(24):
            eager = step(eager, k[:, :, t : t + 1], k[:, :, t : t + 1], cfg)
            lazy = fast(lazy, k[:, :, t : t + 1], k[:, :, t : t + 1])
        assert eager.positions.tolist() == lazy.positions.tolist(), cfg


def test_a_policy_is_its_config_and_op_bound_and_copies_as_a_value():
    """`h2o_fn.policy(config)`: its step is the compiled step of that config; it holds no
    compiled function, so it pickles and deep-copies (a cache holding it does too)."""
    import copy
    import pickle

    import pytest

    from h2o_fn import Policy, policy

    p = policy(CFG)
    k = tokens(40)
    a = b = p.init(2, 3, 16)
    fast = compiled_step(CFG)
    for t in range(40):
        a = p.step(a, k[:, :, t : t + 1], k[:, :, t : t + 1])
        b = fast(b, k[:, :, t : t + 1], k[:, :, t : t + 1])
    assert all(mx.array_equal(x, y) for x, y in zip(a, b))
    assert pickle.loads(pickle.dumps(p)) == p and copy.deepcopy(p) == p and isinstance(p, Policy)
    with pytest.raises(TypeError, match="expected an H2OConfig"):
        policy({"budget": 32})
    from h2o_fn.adapters.cache import H2OKVCache

    cache = H2OKVCache(CFG._replace(scoring="key"))
    cache.update_and_fetch(k[:, :, :40], k[:, :, :40])
    twin = copy.deepcopy(cache)
    assert twin.policy == cache.policy and twin.tokens_seen == 40 and twin.tokens_kept == cache.tokens_kept
