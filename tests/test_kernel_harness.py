"""CPU harness: the kernel body (`evict.BODY`) compiled by g++ vs the pure MLX path.

The exact body text that Metal and CUDA compile is wrapped in a per-thread
function whose signature mirrors MLX's generated one (tests/kernel_shim.h
supplies the built-ins), and an extern "C" launcher runs every thread of the
grid, rounded up to whole threadgroups as CUDA does. Slot choices must be
bit-identical to `h2o_fn.rule.protected_argmin`, and no thread may write past
the output (guard words after it must survive).
"""

import ctypes
import doctest
import os
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from h2o_fn import H2OConfig, core, rule
from h2o_fn.metal_ops import evict

SHIM = Path(__file__).with_name("kernel_shim.h")
CXX = os.environ.get("CXX", "g++")
THREADS = 32  # harness threadgroup: the grid rounds up to a multiple, like CUDA's
GUARD = np.int32(0x5A5A5A5A)
NAN, INF = float("nan"), float("inf")

# Parameter types as MLX's Metal signature spells them (see test_kernel_source.py).
PARAM_TYPES = {
    "scores": "const device float*",
    "positions": "const device int32_t*",
    "bounds": "const device int32_t*",
    "slot": "device int32_t*",
}

FAST = settings(max_examples=200, derandomize=True, deadline=None)


class Case(NamedTuple):
    scores: np.ndarray  # [B, H, C] float32
    positions: np.ndarray  # [B, H, C] int32, -1 free
    newest: object  # int, or a [B] list: each batch row's newest position
    n_sink: int
    grace: int

    def snippet(self) -> str:
        return (
            f"Case(np.array({self.scores.tolist()!r}, np.float32), "
            f"np.array({self.positions.tolist()!r}, np.int32), {self.newest}, {self.n_sink}, {self.grace})"
        )


# ---------------------------------------------------------------- build and run


def translation_unit(body: str) -> str:
    """C++ source: `body` as one thread's function, plus a launcher over the whole grid."""
    params = []
    for name in (*evict.INPUT_NAMES, *evict.OUTPUT_NAMES):
        params.append((PARAM_TYPES[name], name))
        if name in evict.INPUT_NAMES and f"{name}_shape" in body:  # MLX's binding rule
            params.append(("const constant int*", f"{name}_shape"))
    decl = ",\n    ".join(f"{t} {n}" for t, n in params)
    args = ", ".join(n for _, n in params)
    return f"""#include "kernel_shim.h"

static void h2o_thread(
    {decl},
    uint3 thread_position_in_grid) {{
{body}
}}

extern "C" void h2o_launch(
    {decl},
    int grid, int threads) {{
    const int total = (grid + threads - 1) / threads * threads;
    for (int i = 0; i < total; ++i) {{
        h2o_thread({args}, uint3{{unsigned(i), 0u, 0u}});
    }}
}}
"""


def build(body: str, directory: Path) -> ctypes.CDLL:
    """Compile `body` under the shim into `directory`/h2o_kernel.so and load it."""
    src, lib = directory / "h2o_kernel.cpp", directory / "h2o_kernel.so"
    src.write_text(translation_unit(body))
    cmd = [CXX, "-std=c++17", "-O2", "-Wall", "-Werror", "-shared", "-fPIC",
           f"-I{SHIM.parent}", "-o", str(lib), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr}"
    so = ctypes.CDLL(str(lib))
    so.h2o_launch.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int, ctypes.c_int]
    so.h2o_launch.restype = None
    return so


def launch_rows(so: ctypes.CDLL, scores: np.ndarray, positions: np.ndarray, bounds: np.ndarray):
    """(slots `[R]`, guards intact): the compiled body over `[R, C]` inputs and `[1 + R]` bounds.

    Inputs get THREADS padding rows (free slots) so rounded-up threads read in bounds.
    """
    rows, C = scores.shape
    s = np.zeros((rows + THREADS, C), np.float32)
    p = np.full((rows + THREADS, C), -1, np.int32)
    b = np.full(1 + rows + THREADS, bounds[0], np.int32)
    s[:rows], p[:rows], b[: 1 + rows] = scores, positions, bounds
    shape = np.array([rows, C], np.int32)
    out = np.full(rows + THREADS, GUARD, np.int32)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    so.h2o_launch(ptr(s), ptr(shape), ptr(p), ptr(b), ptr(out), rows, THREADS)
    return out[:rows], bool((out[rows:] == GUARD).all())


def run_harness(so: ctypes.CDLL, case: Case):
    """(slots `[B, H]` int32, guards intact) for `case` on the compiled body."""
    B, H, C = case.scores.shape
    limits = np.broadcast_to(np.reshape(case.newest, (-1, 1)) - case.grace, (B, H)).reshape(B * H)
    bounds = np.concatenate([[case.n_sink], limits]).astype(np.int32)
    out, guards = launch_rows(so, case.scores.reshape(B * H, C), case.positions.reshape(B * H, C), bounds)
    return out.reshape(B, H), guards


class HarnessKernel:
    """The g++-compiled body behind the call signature of an mx.fast kernel, so the
    dispatcher's own `launch` (reshapes, per-row bounds) runs on a CPU."""

    def __init__(self, so: ctypes.CDLL):
        self.so = so

    def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes, verbose, stream):
        del threadgroup, verbose, stream
        scores, positions, bounds = (np.array(x) for x in inputs)
        assert grid == (scores.shape[0], 1, 1) and output_shapes == [(scores.shape[0],)]
        assert output_dtypes == [mx.int32] and bounds.shape == (1 + scores.shape[0],)
        out, guards = launch_rows(self.so, scores, positions, bounds)
        assert guards
        return [mx.array(out)]


def run_pure(case: Case) -> np.ndarray:
    got = rule.protected_argmin(
        mx.array(case.scores), mx.array(case.positions),
        mx.array(case.newest, dtype=mx.int32), case.n_sink, case.grace,
    )
    return np.array(got)


def newest_per_row(c: Case) -> np.ndarray:
    return np.broadcast_to(np.reshape(c.newest, (-1,)), (c.scores.shape[0],))


def agrees(so: ctypes.CDLL, case: Case) -> bool:
    got, guards = run_harness(so, case)
    return guards and np.array_equal(got, run_pure(case))


@pytest.fixture(scope="module")
def kernel_so(tmp_path_factory):
    if shutil.which(CXX) is None:
        pytest.skip(f"no C++ compiler {CXX!r} on PATH: the CPU kernel harness needs g++")
    return build(evict.BODY, tmp_path_factory.mktemp("kernel"))


# ---------------------------------------------------------------- inputs

SPECIALS = [0.0, -0.0, 1.0, 0.5, NAN, INF, -INF]
TIE_POOL = np.array([0.0, -0.0, 1.0, 1.0, 0.25, NAN, INF, -INF], np.float32)


def random_positions(rng: np.random.Generator, shape, seen: int, fill: float) -> np.ndarray:
    """`[..., C]` int32: per row, distinct positions from [0, seen) in random slots, rest -1."""
    C = shape[-1]
    rows = np.full((int(np.prod(shape[:-1])), C), -1, np.int32)
    for row in rows:
        k = min(C, seen, round(fill * C))
        row[rng.permutation(C)[:k]] = rng.choice(seen, size=k, replace=False)
    return rows.reshape(shape)


@st.composite
def cases(draw, max_c=40):
    """Small B, H; C in [1, max_c]; tie-heavy scores with NaN/+-inf/+-0; sinks, grace, free slots."""
    B, H, C = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, max_c))
    elements = st.one_of(st.sampled_from(SPECIALS), st.floats(width=32))
    scores = draw(hnp.arrays(np.float32, (B, H, C), elements=elements))
    seen = draw(st.integers(0, 2 * C + 8))  # tokens absorbed; newest = seen - 1
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    positions = random_positions(rng, (B, H, C), seen, draw(st.sampled_from([0.0, 0.5, 1.0])))
    newest = seen - 1
    if draw(st.booleans()):  # rows of a batch at their own positions (each row's newest <= seen - 1)
        newest = [seen - 1 - draw(st.integers(0, min(seen, 6))) for _ in range(B)]
    return Case(scores, positions, newest, draw(st.integers(0, 5)), draw(st.integers(0, 5)))


def tie_cases(seed=0):
    """Fixed tie-heavy cases: pooled scores, shuffled slots, protection bounds hit exactly."""
    rng = np.random.default_rng(seed)
    out = []
    for C in (1, 2, 5, 17, 64):
        for n_sink, grace in ((0, 0), (1, 1), (2, 3), (4, 0)):
            shape = (2, 8, C)
            scores = rng.choice(TIE_POOL, size=shape).astype(np.float32)
            seen = C + 3
            positions = random_positions(rng, shape, seen, 1.0 if C > 2 else 0.5)
            newest = seen - 1 if grace != 1 else [seen - 1, seen - 2 - C % 3]  # rows apart
            out.append(Case(scores, positions, newest, n_sink, grace))
    return out


def large_case(C: int, seed: int) -> Case:
    rng = np.random.default_rng(seed)
    shape = (2, 3, C)
    scores = rng.choice(TIE_POOL, size=shape).astype(np.float32)
    scores[0, 0] = rng.standard_normal(C).astype(np.float32)  # one row without ties
    positions = random_positions(rng, shape, C + 40, 0.9)
    positions[1, 2] = -1
    positions[1, 2, rng.permutation(C)[:4]] = np.arange(4)  # sinks only: no candidate
    return Case(scores, positions, C + 39, 4, 8)


def case(scores, positions, newest, n_sink, grace) -> Case:
    return Case(
        np.array(scores, np.float32).reshape(1, 1, -1),
        np.array(positions, np.int32).reshape(1, 1, -1),
        newest, n_sink, grace,
    )


# ---------------------------------------------------------------- tests


@FAST
@given(c=cases())
@example(c=case([0.0], [-1], 5, 0, 0))  # C = 1, free slot: -1
@example(c=case([3.0], [0], 0, 0, 0))  # C = 1, one candidate
@example(c=case([1.0, 0.0, 2.0], [0, 1, 2], 2, 2, 1))  # sinks + grace cover all: -1
@example(c=case([1.0, 1.0, 1.0, 1.0], [7, 3, 5, 4], 9, 0, 0))  # tie: lowest position (slot 1)
@example(c=case([NAN, -INF, NAN, 0.0], [6, 2, 1, 3], 9, 0, 0))  # NaN == -inf tie: position 1
@example(c=case([0.0, -0.0, 0.0], [5, 4, 6], 9, 0, 0))  # -0.0 == +0.0: position 4
@example(c=case([INF, INF, -1.0], [2, 1, 9], 9, 0, 1))  # grace protects 9: +inf tie, position 1
@example(c=case([5.0, 1.0, 2.0], [3, 2, 4], 4, 3, 0))  # sink 2 protected: slot 2
def test_body_matches_pure_path(kernel_so, c):
    got, guards = run_harness(kernel_so, c)
    want = run_pure(c)
    assert guards, f"a thread wrote past the {c.scores.shape[:2]} output; repro: {c.snippet()}"
    assert np.array_equal(got, want), f"kernel {got.tolist()} != pure {want.tolist()}; repro: {c.snippet()}"


@FAST
@given(c=cases())
@example(c=case([0.0], [-1], 5, 0, 0))
@example(c=case([1.0, 1.0, 1.0, 1.0], [7, 3, 5, 4], 9, 0, 0))
@example(c=case([NAN, -INF, NAN, 0.0], [6, 2, 1, 3], 9, 0, 0))
@example(c=case([INF, INF, -1.0], [2, 1, 9], 9, 0, 1))
def test_the_victim_mask_is_the_pure_slot(c):
    """`evict`'s mask (`rule.lowest`, and the dispatcher's `victims` on the CPU) marks exactly
    the slot `protected_argmin` picks, nothing where it gives -1."""
    slot = run_pure(c)
    want = np.arange(c.scores.shape[-1]) == slot[..., None]  # -1 matches no slot
    args = mx.array(c.scores), mx.array(c.positions), mx.array(c.newest, dtype=mx.int32), c.n_sink, c.grace
    for got in (rule.lowest(*args), evict.protected_argmin.victims(*args), rule.protected_argmin.victims(*args)):
        assert np.array_equal(np.array(got), want), f"mask {np.array(got).tolist()} != slot {slot.tolist()}; " \
            f"repro: {c.snippet()}"


@pytest.mark.parametrize("C,seed", [(1000, 1), (2048, 2), (4096, 3)])
def test_body_matches_pure_path_large_c(kernel_so, C, seed):
    c = large_case(C, seed)
    got, guards = run_harness(kernel_so, c)
    assert guards
    assert np.array_equal(got, run_pure(c)), f"C={C}: kernel {got.tolist()} != pure {run_pure(c).tolist()}"
    assert got[1, 2] == -1  # the sinks-only row


def test_body_matches_pure_path_on_tie_cases(kernel_so):
    for c in tie_cases():
        assert agrees(kernel_so, c), f"repro: {c.snippet()}"


def test_tie_cases_are_tie_heavy():
    """The mutation inputs hold what the mutations break: ties, NaN winners, -1 rows, bounds."""
    ties = nan_wins = empty = 0
    for c in tie_cases():
        slots = run_pure(c).reshape(-1)
        C = c.scores.shape[-1]
        s, p = c.scores.reshape(-1, C), c.positions.reshape(-1, C)
        for row, slot in enumerate(slots):
            if slot < 0:
                empty += 1
                continue
            newest = np.repeat(newest_per_row(c), c.scores.shape[1])[row]
            cand = (p[row] >= c.n_sink) & (p[row] <= newest - c.grace)
            key = np.where(np.isnan(s[row]), -np.inf, s[row])
            ties += int(((key == key[slot]) & cand).sum() > 1)
            nan_wins += int(np.isnan(s[row, slot]))
    assert ties >= 50 and nan_wins >= 20 and empty >= 5, (ties, nan_wins, empty)


MUTATIONS = [
    ("s < best_score", "s <= best_score"),  # equal scores: last slot wins, not lowest position
    ("p < best_pos", "p > best_pos"),  # equal scores: highest position wins
    ("p > hi", "p >= hi"),  # grace window one position too wide
    ("p < lo", "p <= lo"),  # one sink too many
    ("best < 0", "best > 0"),  # first candidate only taken if its score beats 0.0
    ("row >= rows", "row > rows"),  # rounded-up thread `rows` writes past the output
    ("bounds[1 + row]", "bounds[1]"),  # every row judged by the first row's newest position
]


@pytest.mark.parametrize("old,new", MUTATIONS, ids=[m[1] for m in MUTATIONS])
def test_harness_catches_mutated_body(kernel_so, tmp_path, old, new):
    assert evict.BODY.count(old) == 1, f"{old!r} occurs {evict.BODY.count(old)} times in BODY: expected 1"
    mutant = build(evict.BODY.replace(old, new), tmp_path)
    tie = tie_cases()
    assert all(agrees(kernel_so, c) for c in tie)  # the real body passes the same set
    assert not all(agrees(mutant, c) for c in tie), f"harness missed mutation {old!r} -> {new!r}"


# ---------------------------------------------------------------- the dispatcher


def _mx(c: Case):
    return mx.array(c.scores), mx.array(c.positions), mx.array(c.newest, dtype=mx.int32)


def test_launch_packs_per_row_bounds_for_the_body(kernel_so):
    """`launch` (the GPU call path) with the compiled body as its kernel equals the pure path."""
    for c in [*tie_cases(seed=7), large_case(1000, 5)]:
        got = np.array(evict.launch(HarnessKernel(kernel_so), *_mx(c), c.n_sink, c.grace))
        assert np.array_equal(got, run_pure(c)), f"repro: {c.snippet()}"


@pytest.mark.skipif(evict.available_kernel() is None, reason="no Metal or CUDA back-end in this mlx build")
def test_gpu_kernel_matches_pure_path():
    for c in [*tie_cases(seed=3), large_case(4096, 4)]:
        got = np.array(evict.protected_argmin(*_mx(c), c.n_sink, c.grace, use_kernel=True))
        assert np.array_equal(got, run_pure(c)), f"repro: {c.snippet()}"


@pytest.mark.skipif(evict.available_kernel() is not None, reason="a GPU back-end is available")
def test_forcing_the_kernel_without_a_backend_raises():
    c = tie_cases()[0]
    with pytest.raises(RuntimeError, match="use_kernel=True but no GPU back-end"):
        evict.protected_argmin(*_mx(c), c.n_sink, c.grace, use_kernel=True)


def test_dispatcher_rejects_bad_inputs():
    s, p, t = mx.zeros((1, 2, 3)), mx.zeros((1, 2, 3), mx.int32), mx.array(4, dtype=mx.int32)
    with pytest.raises(TypeError, match="scores dtype .*float16.* expected float32"):
        evict.protected_argmin(s.astype(mx.float16), p, t, 0, 0)
    with pytest.raises(TypeError, match="positions dtype .*int64.* expected int32"):
        evict.protected_argmin(s, p.astype(mx.int64), t, 0, 0)
    with pytest.raises(ValueError, match=r"scores shape \(1, 2, 3\) != positions shape \(2, 3\)"):
        evict.protected_argmin(s, p[0], t, 0, 0)
    with pytest.raises(ValueError, match="use_kernel='yes' is invalid"):
        evict.protected_argmin(s, p, t, 0, 0, use_kernel="yes")


def test_dispatcher_is_a_drop_in_argmin_under_compile():
    """core.compiled_step(argmin=the dispatcher) keeps exactly what the default keeps."""
    cfg = H2OConfig(budget=6, n_sink=1, grace=2)
    a = b = core.init(cfg, batch=2, n_heads=2, head_dim=4)
    mx.random.seed(0)
    fused = core.compiled_step(cfg, evict.protected_argmin)
    plain = core.compiled_step(cfg)
    for _ in range(20):
        kv = mx.round(mx.random.normal((2, 2, 1, 4)))  # rounded keys: tied weights
        a, b = fused(a, kv, kv), plain(b, kv, kv)
        assert np.array_equal(np.array(a.positions), np.array(b.positions))


def test_docstring_example_runs():
    result = doctest.testmod(evict, verbose=False)
    assert result.attempted > 0 and result.failed == 0, result
