"""The core against the NumPy reference (the spec), token by token and chunk by chunk.

`TWINS` pairs every core function with its reference twin by name (jax's
lax_reference habit); one generic check runs each pair from the same state.
"""

import inspect

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import h2o_fn
from h2o_fn import H2OConfig, absorb, admit, assert_invariants, init, step
from h2o_fn import budgets, core, packing, prefill, rule, scoring, storage, view
from h2o_fn import reference as ref

from helpers import admitted_weights, assert_matches, chunk_weights, core_weights, dequantized
from strategies import chunk_sizes, configs, draw_alive, prompts, shapes, storages, streams


def as_stored(x: np.ndarray, kv) -> np.ndarray:
    """What the reference is fed: the rows the core stores (dequantized when `kv.bits`)."""
    return x if kv.bits is None else dequantized(x, kv)


def padded_chunk(stream, starts, counts, n):
    """Keys, values `[B, H, n, D]`: row b's real tokens stream[starts[b] : + counts[b]], then
    NaN padding (padding must never be read into a score)."""
    B, H, _, D = stream.keys.shape
    k = np.full((B, H, n, D), np.nan, np.float32)
    v = np.full((B, H, n, D), np.nan, np.float32)
    for b in range(B):
        k[b, :, : counts[b]] = stream.keys[b, :, starts[b] : starts[b] + counts[b]]
        v[b, :, : counts[b]] = stream.values[b, :, starts[b] : starts[b] + counts[b]]
    return k, v


def run_chunks(cfg, shape, stream, sizes, alive=None, check_every=True, room=1, prompt=h2o_fn.Prompt(),
               kv=h2o_fn.Storage()):
    """Absorb `stream` in chunks of `sizes` into core and reference; compare after each.

    `alive[c][b]`: how many of chunk c's tokens are real in row b (default: all);
    `room`: the core's slots beyond the budget; `prompt`: how oneshot scores long chunks;
    `kv`: how the core stores rows.
    """
    state = init(cfg, shape.B, shape.H, shape.D, dtype=mx.float32, room=room, kv=kv)
    rstate = ref.init(cfg, shape.B, shape.H, shape.D)
    starts = [0] * shape.B
    alive = alive or [[n] * shape.B for n in sizes]
    for n, counts in zip(sizes, alive):
        k, v = padded_chunk(stream, starts, counts, n)
        ragged = counts != [n] * shape.B
        n_alive = mx.array(counts, dtype=mx.int32) if ragged else None
        pw = chunk_weights(stream, starts, n) if cfg.scoring == "query" else None
        cw = None if pw is None else core_weights(state, pw)
        state = absorb(state, mx.array(k), mx.array(v), cfg, weights=cw, n_alive=n_alive, prompt=prompt, kv=kv)
        rstate = ref.absorb(rstate, as_stored(k, kv), as_stored(v, kv), cfg, weights=pw,
                            n_alive=None if n_alive is None else counts, prompt=prompt)
        starts = [s + c for s, c in zip(starts, counts)]
        if check_every:
            assert_invariants(state, cfg)
            assert_matches(state, rstate, where=f"after {starts} tokens, {cfg}", kv=kv)
    return state, rstate


# The two token-by-token properties below check every token of every stream (an eval and a
# NumPy copy each): half the "ci" profile's examples keeps them at ~15 s each on 2 cores.
SLOW = settings(max_examples=max(1, settings.default.max_examples // 2))


@SLOW
@given(st.data())
def test_step_matches_reference_every_token(data):
    cfg, kv = data.draw(configs(scoring="key", prefill="greedy")), data.draw(storages())
    shape = data.draw(shapes(kv=kv))
    stream = data.draw(streams(shape, decay=cfg.decay))
    state = init(cfg, shape.B, shape.H, shape.D, dtype=mx.float32, kv=kv)
    rstate = ref.init(cfg, shape.B, shape.H, shape.D)
    for t in range(stream.keys.shape[2]):
        k, v = stream.keys[:, :, t : t + 1], stream.values[:, :, t : t + 1]
        state = step(state, mx.array(k), mx.array(v), cfg, kv=kv)
        rstate = ref.step(rstate, as_stored(k, kv), as_stored(v, kv), cfg)
        assert_invariants(state, cfg)
        assert_matches(state, rstate, where=f"token {t}, {cfg}", kv=kv)


@given(st.data())
def test_absorb_matches_reference_every_chunk(data):
    """Both prefills, both scorings, quantized rows, chunks straddling the budget, and
    batch rows that drift apart (padding in the chunks)."""
    cfg, kv = data.draw(configs()), data.draw(storages())
    shape = data.draw(shapes(max_d=16, kv=kv))
    stream = data.draw(streams(shape, decay=cfg.decay))
    sizes = data.draw(chunk_sizes(stream.keys.shape[2]))
    run_chunks(cfg, shape, stream, sizes, draw_alive(data, sizes, shape.B), prompt=data.draw(prompts()), kv=kv)


@SLOW
@given(st.data())
def test_query_single_tokens_match_reference(data):
    """scoring="query", one token per absorb: the decode path of true-query scoring."""
    cfg, kv = data.draw(configs(scoring="query", prefill="greedy")), data.draw(storages())
    shape = data.draw(shapes(max_d=8, kv=kv))
    stream = data.draw(streams(shape, max_len=80, decay=cfg.decay))
    sizes = [1] * stream.keys.shape[2]
    run_chunks(cfg, shape, stream, sizes, draw_alive(data, sizes, shape.B), kv=kv)


# ---------------------------------------------------------------- the twin table


def _prefix(data, cfg, kv, max_len=None, selection=True):
    """A core state and its reference twin after a random prefix (possibly ragged rows), in
    about a third of the draws ending with a selection (`_selected`) when `selection`."""
    shape = data.draw(shapes(max_b=2, max_h=2, max_d=8, kv=kv))
    stream = data.draw(streams(shape, max_len=max_len or 2 * cfg.budget + 4, decay=cfg.decay))
    sizes = data.draw(chunk_sizes(stream.keys.shape[2]))
    alive = draw_alive(data, sizes, shape.B)
    room = data.draw(st.sampled_from([1, 1, 1, 3]))  # 3: the slots of three staged decode tokens
    state, rstate = run_chunks(cfg._replace(prefill="oneshot"), shape, stream, sizes, alive, False, room,
                               data.draw(prompts()), kv)
    if selection and cfg.budget > 1 and data.draw(st.integers(0, 2)) == 0:  # heads of their own budgets: a selection's reserved slots
        state, rstate = _selected(data, cfg, kv, shape, state, rstate, room)
    return shape, state, rstate


def _selected(data, cfg, kv, shape, s, r, room):
    """`s`, `r` and a chunk reduced by `absorb_selected` to a random keep per head (sinks and
    the grace window always kept, so every later invariant holds), `held` < budget."""
    n = data.draw(st.integers(1, 8))
    k, v, w = _token(data, shape, n)
    by_position = w[:, :, 0]
    held = data.draw(st.integers(max(1, cfg.n_sink + cfg.grace), cfg.budget - 1))
    seen = np.array(s.seen)
    C = h2o_fn.capacity(s)
    positions = np.concatenate([np.array(s.positions), np.broadcast_to((seen[:, None] + np.arange(n))[:, None],
                                                                        (shape.B, shape.H, n))], axis=-1)
    keep = np.zeros(positions.shape, bool)
    by_pos_keep = np.zeros(by_position.shape, bool)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    for b in range(shape.B):
        newest = seen[b] + n - 1
        for h in range(shape.H):
            have = [j for j in range(positions.shape[-1]) if positions[b, h, j] >= 0]
            must = [j for j in have if positions[b, h, j] < cfg.n_sink or positions[b, h, j] > newest - cfg.grace]
            rest = [j for j in have if j not in must]
            extra = rng.permutation(rest)[: rng.integers(0, max(0, held - len(must)) + 1)]
            for j in [*must, *extra]:
                keep[b, h, j] = True
                by_pos_keep[b, h, positions[b, h, j]] = True
    scores = mx.concatenate([_slot_weights(s, by_position),
                             mx.array(np.take_along_axis(by_position, seen[:, None, None] + np.arange(n), axis=-1))],
                            axis=-1)
    got = budgets.absorb_selected(s, mx.array(k), mx.array(v), scores, mx.array(keep), held, cfg.budget + room, kv)
    want = ref.absorb_selected(r, as_stored(k, kv), as_stored(v, kv), by_position, by_pos_keep, held)
    assert C + n >= held
    return got, want


def _token(data, shape, n=1):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    k = rng.standard_normal((shape.B, shape.H, n, shape.D)).astype(np.float32)
    v = rng.standard_normal((shape.B, shape.H, n, shape.D)).astype(np.float32)
    w = rng.random((shape.B, shape.H, n, 512)).astype(np.float32)  # by position (P >= any seen)
    return k, v, w


def _alive(data, B):
    return None if B == 1 or not data.draw(st.booleans()) else [True] + [data.draw(st.booleans())
                                                                          for _ in range(B - 1)]


def _slot_weights(state, by_position):
    """`[B, H, P]` position-indexed weights -> `[B, H, C]` over the state's slots."""
    pos = np.array(state.positions)
    got = np.take_along_axis(by_position, np.maximum(pos, 0), axis=-1)
    return mx.array(np.where(pos >= 0, got, 0).astype(np.float32))


def twin_init(data, cfg, kv):
    shape = data.draw(shapes(kv=kv))
    return (init(cfg, *shape, dtype=mx.float32, kv=kv), ref.init(cfg, *shape, kv=kv))


def twin_admit(data, cfg, kv):
    shape, s, r = _prefix(data, cfg, kv)
    k, v, _ = _token(data, shape)
    alive = _alive(data, shape.B)
    a = None if alive is None else mx.array(alive)
    return (h2o_fn.admit(s, mx.array(k), mx.array(v), kv, a),
            ref.admit(r, as_stored(k, kv), as_stored(v, kv), kv, alive))


def _with_room(data, cfg, kv):
    """A state whose every row and head holds its tokens (and reserved slots) first and has
    room for a chunk of n (nothing evicted), its twin, the chunk and where it goes."""
    shape = data.draw(shapes(max_b=2, max_h=2, max_d=8, kv=kv))
    stream = data.draw(streams(shape, min_len=cfg.budget, max_len=cfg.budget, decay=cfg.decay))
    prefix = data.draw(st.integers(0, cfg.budget - 1))
    room = data.draw(st.sampled_from([1, 3]))
    s, r = run_chunks(cfg._replace(prefill="oneshot"), shape, stream, [prefix] if prefix else [], None, False, room,
                      data.draw(prompts()), kv)
    if prefix and cfg.budget > 2 and data.draw(st.booleans()):  # a selection's reserved slots, then room
        s, r = _selected(data, cfg, kv, shape, s, r, room)
    start = int(s.length[0].item())
    n = data.draw(st.integers(1, cfg.budget - start))
    k, v, w = _token(data, shape, n)
    return shape, s, r, start, k, v, w


def twin_admit_chunk(data, cfg, kv):
    _, s, r, start, k, v, _ = _with_room(data, cfg, kv)
    return (h2o_fn.prefill.admit_chunk(s, mx.array(k), mx.array(v), start, kv),
            ref.admit_chunk(r, as_stored(k, kv), as_stored(v, kv), start, kv))


def twin_settle_chunk(data, cfg, kv):
    cfg = cfg._replace(prefill="oneshot")
    _, s, r, start, k, v, w = _with_room(data, cfg, kv)
    n, C = k.shape[2], h2o_fn.capacity(s)
    rw = None
    if cfg.scoring == "query":  # by position: query i sees the held tokens and chunk tokens up to i
        seen = np.array(s.seen)[:, None, None, None]
        rw = np.where(np.arange(w.shape[-1]) <= seen + np.arange(n)[:, None], w, 0.0).astype(np.float32)
    cw = None if rw is None else admitted_weights(core_weights(s, rw), C, start)
    prompt = data.draw(prompts())
    admitted = h2o_fn.prefill.admit_chunk(s, mx.array(k), mx.array(v), start, kv)
    radmitted = ref.admit_chunk(r, as_stored(k, kv), as_stored(v, kv), start, kv)
    return (h2o_fn.prefill.settle_chunk(admitted, mx.array(k), cfg, start, cw, prompt, kv),
            ref.settle_chunk(radmitted, as_stored(k, kv), cfg, start, rw, prompt, kv), cfg)


def twin_accumulate(data, cfg, kv):
    shape, s, r = _prefix(data, cfg, kv)
    _, _, w = _token(data, shape)
    alive = _alive(data, shape.B)
    a = None if alive is None else mx.array(alive)
    return (h2o_fn.accumulate(s, _slot_weights(s, w[:, :, 0]), cfg, a),
            ref.accumulate(r, w[:, :, 0], cfg, alive))


def twin_evict(data, cfg, kv):
    shape, s, r = _prefix(data, cfg, kv)
    k, v, w = _token(data, shape)
    s = h2o_fn.admit(s, mx.array(k), mx.array(v), kv)
    s = h2o_fn.accumulate(s, _slot_weights(s, w[:, :, 0]), cfg)
    r = ref.accumulate(ref.admit(r, as_stored(k, kv), as_stored(v, kv)), w[:, :, 0], cfg)
    return h2o_fn.evict(s, cfg), ref.evict(r, cfg)


def twin_settle(data, cfg, kv):
    shape, s, r = _prefix(data, cfg, kv)
    k, v, w = _token(data, shape)
    s = h2o_fn.admit(s, mx.array(k), mx.array(v), kv)
    r = ref.admit(r, as_stored(k, kv), as_stored(v, kv))
    return h2o_fn.settle(s, _slot_weights(s, w[:, :, 0]), cfg), ref.settle(r, w[:, :, 0], cfg)


def twin_settle_key(data, cfg, kv):
    shape, s, r = _prefix(data, cfg, kv)
    k, v, _ = _token(data, shape)
    alive = _alive(data, shape.B)
    a = None if alive is None else mx.array(alive)
    s = h2o_fn.admit(s, mx.array(k), mx.array(v), kv, a)
    r = ref.admit(r, as_stored(k, kv), as_stored(v, kv), kv, alive)
    logits = None
    if data.draw(st.booleans()):  # as attention computes them: the proxy's row times every slot's key
        rows = view.proxy_query(s, mx.array(k), kv)
        logits = storage.matmul_t(rows, s.keys, kv.bits, kv.group_size)[:, :, 0]
    return (h2o_fn.settle_key(s, mx.array(k), cfg, alive=a, kv=kv, logits=logits),
            ref.settle_key(r, as_stored(k, kv), cfg, alive=alive, kv=kv))


def twin_step(data, cfg, kv):
    shape, s, r = _prefix(data, cfg, kv)
    k, v, w = _token(data, shape)
    alive = _alive(data, shape.B)
    a = None if alive is None else mx.array(alive)
    cw = None if cfg.scoring == "key" else core_weights(s, w)
    rw = None if cfg.scoring == "key" else w
    return (step(s, mx.array(k), mx.array(v), cfg, cw, alive=a, kv=kv),
            ref.step(r, as_stored(k, kv), as_stored(v, kv), cfg, rw, alive=alive, kv=kv))


def twin_absorb(data, cfg, kv):
    shape, s, r = _prefix(data, cfg, kv)
    n = data.draw(st.integers(1, 2 * cfg.budget + 2))
    k, v, w = _token(data, shape, n)
    counts = draw_alive(data, [n], shape.B)[0]
    n_alive = None if counts == [n] * shape.B else counts
    cw = None if cfg.scoring == "key" else core_weights(s, w)
    rw = None if cfg.scoring == "key" else w
    prompt = data.draw(prompts())
    return (absorb(s, mx.array(k), mx.array(v), cfg, cw,
                   n_alive=None if n_alive is None else mx.array(n_alive), prompt=prompt, kv=kv),
            ref.absorb(r, as_stored(k, kv), as_stored(v, kv), cfg, rw, n_alive=n_alive, prompt=prompt, kv=kv))


def twin_absorb_scored(data, cfg, kv):
    shape, s, r = _prefix(data, cfg, kv)
    n = data.draw(st.integers(1, 2 * cfg.budget + 2))
    k, v, w = _token(data, shape, n)
    by_position = w[:, :, 0]  # [B, H, P]: the given score of each row's token at position p
    seen = np.array(s.seen)[:, None, None]
    chunk = np.take_along_axis(by_position, seen + np.arange(n), axis=-1)
    scores = mx.concatenate([_slot_weights(s, by_position), mx.array(chunk)], axis=-1)
    prompt = data.draw(prompts())
    return (h2o_fn.absorb_scored(s, mx.array(k), mx.array(v), scores, cfg, prompt, kv),
            ref.absorb_scored(r, as_stored(k, kv), as_stored(v, kv), by_position, cfg, prompt, kv))


def twin_absorb_staged(data, cfg, kv):
    shape, s, r = _prefix(data, cfg, kv)
    n = data.draw(st.integers(1, h2o_fn.capacity(s) - cfg.budget))  # the free slots staging may fill
    k, v, w = _token(data, shape, n)
    before = s
    for i in range(n):
        s = admit(s, mx.array(k[:, :, i : i + 1]), mx.array(v[:, :, i : i + 1]), kv)
        r = ref.admit(r, as_stored(k[:, :, i : i + 1], kv), as_stored(v[:, :, i : i + 1], kv), kv)
    cw = None if cfg.scoring == "key" else core_weights(before, w)
    prompt = data.draw(prompts())
    logits = None
    if cfg.scoring == "key" and cfg.prefill == "oneshot" and data.draw(st.booleans()):
        # as the hook computes them while staging: each token's proxy row times every slot's key
        logits = storage.matmul_t(view.proxy_query(s, mx.array(k), kv), s.keys, kv.bits, kv.group_size)
    return (prefill.absorb_staged(s, mx.array(k), mx.array(v), cfg, cw, prompt, kv, logits),
            ref.absorb_staged(r, as_stored(k, kv), as_stored(v, kv), cfg, None if cfg.scoring == "key" else w,
                              prompt, kv))


def twin_rewind(data, cfg, kv):
    big = cfg._replace(budget=64)  # rewinding is exact only before any eviction
    shape, s, r = _prefix(data, big, kv, max_len=big.budget, selection=False)  # a selection evicts
    n = data.draw(st.integers(0, min(s.seen.tolist())))
    return h2o_fn.rewind(s, n), ref.rewind(r, n), big


def twin_kept_positions(data, cfg, kv):
    _, s, r = _prefix(data, cfg, kv)
    assert_matches(s, r, kv=kv)
    got = [[[p for p in head if p >= 0] for head in row] for row in h2o_fn.kept_positions(s).tolist()]
    return got, ref.kept_positions(r)


def twin_key_weights(data, cfg, kv):
    shape, s, r = _prefix(data, cfg, kv)
    q, _, _ = _token(data, shape, data.draw(st.integers(1, 3)))
    got = np.array(h2o_fn.key_weights(s, mx.array(q), kv))  # [B, H, N, C] by slot
    pos = s.positions.tolist()
    by_position = [[[{p: got[b, h, i, j] for j, p in enumerate(pos[b][h]) if p >= 0}
                     for i in range(q.shape[2])] for h in range(shape.H)] for b in range(shape.B)]
    want = ref.key_weights(r, q, kv)  # stored keys dequantized in both; queries as given
    for b, row in enumerate(want):
        for h, head in enumerate(row):
            order = [t.position for t in r.heads[b][h]]
            for i, w in enumerate(head):
                np.testing.assert_allclose([by_position[b][h][i][p] for p in order], w, rtol=1e-4, atol=1e-6)
    return None, None  # compared above: weights are per kept token, not a state


def twin_absorb_selected(data, cfg, kv):
    cfg = cfg._replace(budget=max(cfg.budget, 2))  # held < budget
    shape, s, r = _prefix(data, cfg, kv)
    return (*_selected(data, cfg, kv, shape, s, r, h2o_fn.capacity(s) - cfg.budget), cfg)


def twin_widen(data, cfg, kv):
    shape, s, r = _prefix(data, cfg, kv)
    extra = data.draw(st.integers(0, 4))
    big = cfg._replace(budget=cfg.budget + extra)
    return budgets.widen(s, extra), ref.widen(r, extra), big


def twin_tokens(data, cfg, kv):
    _, s, r = _prefix(data, cfg, kv)
    return budgets.tokens(s).tolist(), ref.tokens(r)


def twin_reserved(data, cfg, kv):
    _, s, r = _prefix(data, cfg, kv)
    return budgets.reserved(s).tolist(), ref.reserved(r)


TWINS = {name[len("twin_"):]: fn for name, fn in globals().items() if name.startswith("twin_")}


@pytest.mark.parametrize("name", sorted(TWINS))
@settings(max_examples=40)
@given(data=st.data())
def test_core_function_equals_its_reference_twin(name, data):
    cfg, kv = data.draw(configs(max_budget=12)), data.draw(storages())
    got, want, cfg = (*TWINS[name](data, cfg, kv), cfg)[:3]  # a twin may run under its own config
    if isinstance(got, h2o_fn.H2OState):
        if name != "admit":  # an admitted state may hold budget + 1 until it settles
            assert_invariants(got, cfg)
        assert_matches(got, want, where=f"{name}, {cfg}", kv=kv)
    else:
        assert got == want


CORE_MODULES = (core, prefill, rule, scoring, budgets)  # the core's transitions, split by concern


def test_every_core_function_has_a_reference_twin():
    """Every public function of the core's modules taking a state (or building one) has a
    reference function of the same name and a row in TWINS."""
    public = {n: f for m in CORE_MODULES for n, f in inspect.getmembers(m, inspect.isfunction)
              if not n.startswith("_") and f.__module__ == m.__name__}
    on_states = {n for n, f in public.items()
                 if "state" in inspect.signature(f).parameters or n == "init"
                 or "admitted" in inspect.signature(f).parameters}
    assert on_states == set(TWINS), (on_states, set(TWINS))
    for name in on_states:
        assert callable(getattr(ref, name)), name
        core_params = list(inspect.signature(public[name]).parameters)
        ref_params = list(inspect.signature(getattr(ref, name)).parameters)
        assert ref_params[: len(core_params)] == core_params, (name, core_params, ref_params)


def test_evict_matches_reference_on_an_over_budget_state():
    """evict takes exactly the (score, position) minimum among the unprotected."""
    cfg = H2OConfig(budget=4, n_sink=1, grace=1, decay=1.0)
    state = init(cfg, 1, 1, 2, dtype=mx.float32)
    state = state._replace(
        scores=mx.array([[[5.0, 0.5, 0.25, 0.25, 0.0]]]),
        positions=mx.array([[[0, 1, 2, 3, 4]]], dtype=mx.int32),
        length=mx.array([5], dtype=mx.int32),
        seen=mx.array([5], dtype=mx.int32),
    )
    rstate = ref.init(cfg, 1, 1, 2)
    rstate.heads[0][0] = [ref.Token(p, np.zeros(2), np.zeros(2), s)
                          for p, s in zip(range(5), [5.0, 0.5, 0.25, 0.25, 0.0])]
    rstate.seen = [5]
    out, rout = h2o_fn.evict(state, cfg), ref.evict(rstate, cfg)
    assert ref.kept_positions(rout) == [[[0, 1, 3, 4]]]  # tie 2 vs 3 -> lower position; 4 in grace
    assert_matches(out, rout)


@settings(max_examples=40)
@given(data=st.data())
def test_a_packed_state_unpacks_to_one_that_continues_as_the_state_would(data):
    """`packing`: the rows of the slots holding tokens, and nothing else, survive pack and
    unpack; the unpacked state then matches the reference after a step, as the state did."""
    cfg, kv = data.draw(configs(max_budget=12)), data.draw(storages())
    shape, s, r = _prefix(data, cfg, kv)
    p = packing.pack(s)
    u = packing.unpack(p)
    held = np.array(s.positions) >= 0
    assert p.slots.tolist() == np.flatnonzero(held).tolist()
    for got, want in zip(storage.parts(u.keys) + storage.parts(u.values), storage.parts(s.keys) + storage.parts(s.values)):
        got, want = np.array(got), np.array(want)
        assert got.shape == want.shape and np.array_equal(got[held], want[held]) and not got[~held].any()
    for name in ("scores", "positions", "length", "seen"):
        assert mx.array_equal(getattr(u, name), getattr(s, name)), name
    rows = sum(x.nbytes for x in storage.parts(s.keys) + storage.parts(s.values))
    assert packing.packed_nbytes(p) == h2o_fn.state_nbytes(s) - rows + rows * held.sum() // held.size + 4 * held.sum()
    k, v, w = _token(data, shape)
    cw = None if cfg.scoring == "key" else core_weights(u, w)
    assert_matches(step(u, mx.array(k), mx.array(v), cfg, cw, kv=kv),
                   ref.step(r, as_stored(k, kv), as_stored(v, kv), cfg, None if cfg.scoring == "key" else w, kv=kv),
                   where=f"a step after unpack, {cfg}", kv=kv)
