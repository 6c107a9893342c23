"""Comparison helpers shared by the tests: core state <-> reference state."""

import numpy as np
import mlx.core as mx

from h2o_fn import H2OState
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


def assert_matches(state: H2OState, rstate: ref.RefState, rtol=1e-5, atol=1e-7, where=""):
    assert int(state.seen.item()) == rstate.seen, where
    assert kept(state) == ref.kept_positions(rstate), where
    got, want = scores(state), ref.scores_by_position(rstate)
    for grow, wrow in zip(got, want):
        for g, w in zip(grow, wrow):
            ps = sorted(w)
            np.testing.assert_allclose([g[p] for p in ps], [w[p] for p in ps], rtol=rtol, atol=atol,
                                       err_msg=where)


def core_weights(state: H2OState, by_position: np.ndarray, capacity: int) -> mx.array:
    """Position-indexed weights `[B, H, N, P]` -> the core's `[B, H, N, C + N]` layout.

    Column j < C takes the weight of the token in slot j, column C + i that of
    chunk token i (position seen + i).
    """
    B, H, N, _ = by_position.shape
    seen = int(state.seen.item())
    pos = np.array(state.positions)  # [B, H, C]
    out = np.zeros((B, H, N, capacity + N), dtype=np.float32)
    b, h = np.meshgrid(np.arange(B), np.arange(H), indexing="ij")
    for j in range(capacity):
        p = pos[:, :, j]
        out[:, :, :, j] = np.where(p[..., None] >= 0, by_position[b, h, :, np.maximum(p, 0)], 0)
    out[..., capacity:] = by_position[..., seen : seen + N]
    return mx.array(out)


def chunk_weights(stream, start: int, n: int) -> np.ndarray:
    """The stream's position-indexed weights of tokens [start, start + n)."""
    return stream.weights[:, :, start : start + n, :]
