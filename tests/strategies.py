"""Hypothesis strategies for h2o-fn: configs, storages, shapes and token streams.

Keys come from a seeded NumPy generator (the seed is drawn), not from floats
drawn one by one: shrinking then cannot manufacture float32-vs-float64
near-ties, while exact ties stay covered by the "zeros" and "grid" key styles
(identical keys give identical, exactly tied weights in both implementations).

Degenerate keys are paired with mild decay only (>= 0.9). Under strong decay,
tokens with identical keys converge to one fixed-point score; their exact
float64 scores then differ below float32 resolution, a tie for the float32 core
and not for the float64 reference. Which of two such tokens goes is float noise,
not semantics (`test_degenerate_ties_under_strong_decay` pins the core's rule).

Grid query weights (multiples of 1/4, exact ties) go with decay 1.0 only: under
any other decay two different weight histories can land within 1e-10 of each
other (0.25 d^3 + 0.75 vs 0.75 d + 0.25 differ by 0.25 (1 - d)^2 (d + 2)), a
tie in float32 and not in float64.

Key scale 3.0 goes with 4 <= head_dim <= 16 only: wider keys at that scale saturate
the softmax (logit gaps of 50), and a weight of 1e-15 on top of 1.0 is a float32 tie.
Below 4 a logit is the product of one to three pairs of normals, heavy-tailed, and the
same gaps come back: a D = 1 stream at scale 3.0 (keys to +-7.7, logits to 60) kept
different tokens in float32 and float64 under greedy prefill and decay 1.0.
"""

from typing import NamedTuple

import numpy as np
from hypothesis import strategies as st

from h2o_fn import H2OConfig, Prompt, Storage

DECAYS = st.one_of(st.sampled_from([1.0, 0.98, 0.5]), st.floats(0.05, 1.0))


@st.composite
def prompts(draw):
    """Any prompt scoring; plain oneshot (window 0, pool 1) in about one draw in four."""
    return Prompt(window=draw(st.sampled_from([0, 0, 0, 1, 3, 8])), pool=draw(st.sampled_from([1, 1, 3, 5])))


def storages():
    """How rows are stored: quantized (8 or 4 bits, groups of 32) in about one draw in three."""
    return st.builds(Storage, st.sampled_from([None, None, None, None, 8, 4]), st.just(32))


@st.composite
def configs(draw, scoring=None, prefill=None, max_budget=64):
    """Any valid config."""
    budget = draw(st.integers(1, max_budget))
    n_sink = draw(st.integers(0, budget - 1))
    grace = draw(st.integers(0, budget - 1 - n_sink))
    return H2OConfig(
        budget=budget,
        n_sink=n_sink,
        grace=grace,
        decay=draw(DECAYS),
        scoring=scoring or draw(st.sampled_from(["key", "query"])),
        prefill=prefill or draw(st.sampled_from(["greedy", "oneshot"])),
    )


class Shape(NamedTuple):
    B: int
    H: int
    D: int


def shapes(max_b=2, max_h=3, max_d=64, kv=None):
    """B, H, D; D a multiple of the group size when `kv` (a Storage) quantizes rows."""
    if kv is not None and kv.bits is not None:
        dims = st.sampled_from([kv.group_size, 2 * kv.group_size])
    else:
        dims = st.one_of(st.just(1), st.integers(1, max_d))
    return st.builds(Shape, st.integers(1, max_b), st.integers(1, max_h), dims)


class Stream(NamedTuple):
    """A token stream: keys/values `[B, H, T, D]` float32 and query weights `[B, H, T, T]`.

    weights[b, h, t, p] is token t's weight on position p (used when scoring="query").
    """

    keys: np.ndarray
    values: np.ndarray
    weights: np.ndarray


MILD_DECAY = 0.9


def make_stream(shape: Shape, T: int, seed: int, style: str, scale: float, decay: float = 1.0) -> Stream:
    rng = np.random.default_rng(seed)
    B, H, D = shape
    if style == "zeros":
        keys = np.zeros((B, H, T, D))
    elif style == "grid":
        keys = rng.integers(-1, 2, (B, H, T, D)).astype(np.float64)
    else:
        keys = rng.standard_normal((B, H, T, D)) * scale
    weights = rng.random((B, H, T, T))
    if style == "grid" and decay == 1.0:
        weights = np.round(weights * 4) / 4
    return Stream(keys.astype(np.float32), rng.standard_normal((B, H, T, D)).astype(np.float32),
                  weights.astype(np.float32))


@st.composite
def streams(draw, shape, min_len=1, max_len=96, decay=1.0):
    """A stream for `shape`; degenerate key styles only when decay >= MILD_DECAY."""
    T = draw(st.integers(min_len, max_len))
    styles = ["normal", "normal", "normal"] + (["zeros", "grid"] if decay >= MILD_DECAY else [])
    return make_stream(
        shape,
        T,
        draw(st.integers(0, 2**31 - 1)),
        draw(st.sampled_from(styles)),
        draw(st.sampled_from([0.3, 1.0, 3.0] if 4 <= shape.D <= 16 else [0.3, 1.0])),  # see the docstring
        decay,
    )


def draw_alive(data, sizes, B: int):
    """Per chunk, B real-token counts (the rest of the chunk is padding): row 0 takes whole
    chunks; in about half the draws the other rows take fewer, so rows drift apart."""
    ragged = B > 1 and data.draw(st.booleans())
    return [[n] + [data.draw(st.integers(0, n)) if ragged else n for _ in range(B - 1)] for n in sizes]


def chunk_sizes(total: int):
    """Strategy for a list of positive chunk sizes summing to `total`."""

    @st.composite
    def split(draw):
        sizes, left = [], total
        while left:
            n = draw(st.integers(1, min(left, 40)))
            sizes.append(n)
            left -= n
        return sizes

    return split()
