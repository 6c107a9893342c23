"""Comparison helpers shared by the tests: core state <-> reference state."""

import numpy as np
import mlx.core as mx

from h2o_fn import H2OState, storage
from h2o_fn import reference as ref


def kept(state: H2OState):
    """Sorted kept positions per (b, h) as nested lists."""
    return [[sorted(p for p in head if p >= 0) for head in row] for row in state.positions.tolist()]


def scores(state: H2OState):
    """{position: score} per (b, h)."""
    out = []
    for prow, srow in zip(state.positions.tolist(), state.scores.tolist()):
        out.append([{p: s for p, s in zip(ps, ss) if p >= 0} for ps, ss in zip(prow, srow)])
    return out


def rows(state: H2OState, which: str, kv) -> list:
    """{position: stored row (dequantized, float64)} per (b, h) for keys or values."""
    store = storage.dense(getattr(state, which), kv.bits, kv.group_size)
    data = np.array(store.astype(mx.float32), dtype=np.float64)
    out = []
    for b, prow in enumerate(state.positions.tolist()):
        out.append([{p: data[b, h, j] for j, p in enumerate(ps) if p >= 0} for h, ps in enumerate(prow)])
    return out


def assert_matches(state: H2OState, rstate: ref.RefState, rtol=1e-5, atol=1e-7, where="", kv=None):
    """Same seen counts, kept positions and scores; with `kv` (the state's Storage), also the
    stored key and value rows of every kept position (what attention will read)."""
    assert state.seen.tolist() == rstate.seen, where
    assert state.length.tolist() == rstate.length, where
    assert kept(state) == ref.kept_positions(rstate), (
        f"{where}\ncore kept {kept(state)} scores {scores(state)}\n"
        f"spec kept {ref.kept_positions(rstate)} scores {ref.scores_by_position(rstate)}")
    got, want = scores(state), ref.scores_by_position(rstate)
    for grow, wrow in zip(got, want):
        for g, w in zip(grow, wrow):
            ps = sorted(w)
            np.testing.assert_allclose([g[p] for p in ps], [w[p] for p in ps], rtol=rtol, atol=atol,
                                       err_msg=where)
    if kv is None:
        return
    for which in ("key", "value"):
        got, want = rows(state, which + "s", kv), ref.rows_by_position(rstate, which)
        for grow, wrow in zip(got, want):
            for g, w in zip(grow, wrow):
                if w:  # one comparison per head: row i of each side is position ps[i]
                    ps = sorted(w)
                    np.testing.assert_allclose(np.stack([g[p] for p in ps]), np.stack([w[p] for p in ps]),
                                               rtol=1e-6, atol=1e-6,
                                               err_msg=f"{which} rows of positions {ps} (in that order) {where}")


def admitted_weights(w: mx.array, C: int, start: int) -> mx.array:
    """`absorb`'s weights `[B, H, M, C + N]` (C slots, then the chunk's tokens) -> over the
    slots of the state `prefill.admit_chunk` wrote the chunk into at [start, start + N), `[B, H, M, C]`."""
    N = w.shape[-1] - C
    return mx.concatenate([w[..., :start], w[..., C:], w[..., start + N : C]], axis=-1)


def same(a, b) -> bool:
    """Two arrays or stores (quantized triples) equal bit for bit."""
    pa, pb = storage.parts(a), storage.parts(b)
    return len(pa) == len(pb) and all(mx.array_equal(x, y) for x, y in zip(pa, pb))


def core_weights(state: H2OState, by_position: np.ndarray) -> mx.array:
    """Position-indexed weights `[B, H, N, P]` -> the core's `[B, H, N, C + N]` layout.

    Column j < C takes the weight of the token in slot j, column C + i that of
    chunk token i (position seen[b] + i).
    """
    B, H, N, P = by_position.shape
    seen = state.seen.tolist()
    pos = np.array(state.positions)  # [B, H, C]
    capacity = pos.shape[-1]
    out = np.zeros((B, H, N, capacity + N), dtype=np.float32)
    b, h = np.meshgrid(np.arange(B), np.arange(H), indexing="ij")
    for j in range(capacity):
        p = pos[:, :, j]
        out[:, :, :, j] = np.where(p[..., None] >= 0, by_position[b, h, :, np.maximum(p, 0)], 0)
    for bi in range(B):
        take = by_position[bi, :, :, seen[bi] : seen[bi] + N]
        out[bi, :, :, capacity : capacity + take.shape[-1]] = take
    return mx.array(out)


def chunk_weights(stream, start, n: int) -> np.ndarray:
    """The stream's position-indexed weights of chunk tokens [start, start + n) per row.

    `start` is an int or per row (rows at different positions): row b's query i is
    stream token start[b] + i; columns stay positions.
    """
    B = stream.weights.shape[0]
    starts = np.broadcast_to(np.asarray(start), (B,))
    out = np.zeros((*stream.weights.shape[:2], n, stream.weights.shape[-1]), np.float32)
    for b, s in enumerate(starts):
        take = stream.weights[b, :, s : s + n]
        out[b, :, : take.shape[1]] = take
    return out


def dequantized(keys: np.ndarray, kv, dtype=mx.float32) -> np.ndarray:
    """What a state storing rows as `kv` (a quantizing Storage) holds for these rows, read
    back as float64."""
    stored = storage.quantize(mx.array(keys).astype(dtype), kv.bits, kv.group_size)
    return np.array(storage.dense(stored, kv.bits, kv.group_size).astype(mx.float32), dtype=np.float64)
