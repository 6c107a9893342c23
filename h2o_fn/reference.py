"""The executable spec: H2O per head in plain NumPy, float64, one loop per token.

Same names as `h2o_fn.core` (`init`, `step`, `absorb`, `evict`, `kept_positions`),
written for obviousness, not speed. A head is a list of `Token`s; there are no
slots. Tie rule, stated once: evict the unprotected token with the lowest
score, and among equal scores the lowest position (NaN scores count as -inf).
The core keeps float32 scores: where two exact scores differ by less than
float32 resolution the core sees a tie the spec does not (see tests/strategies.py).

Query weights are indexed by absolute position, so they need no slot layout:
`weights[b, h, i, p]` is chunk query i's weight on the token at position p.
"""

import math
from dataclasses import dataclass, replace
from typing import List

import numpy as np


@dataclass
class Token:
    position: int
    key: np.ndarray  # [D] float64
    value: np.ndarray  # [D] float64
    score: float = 0.0


@dataclass
class RefState:
    heads: List[List[List[Token]]]  # [B][H] -> kept tokens, in arrival order
    seen: int = 0
    head_dim: int = 0

    @property
    def length(self) -> int:
        return len(self.heads[0][0]) if self.heads and self.heads[0] else 0


def init(config, batch: int, n_heads: int, head_dim: int, dtype=None) -> RefState:
    del config, dtype
    return RefState([[[] for _ in range(n_heads)] for _ in range(batch)], 0, head_dim)


def _copy(state: RefState) -> RefState:
    heads = [[[replace(t) for t in head] for head in row] for row in state.heads]
    return replace(state, heads=heads)


def clean(w: float) -> float:
    """Non-finite and negative weights count as 0."""
    return w if math.isfinite(w) and w > 0 else 0.0


def key_weights(stored: List[Token], query: np.ndarray) -> List[float]:
    """softmax_j(K_j . q / sqrt(D)) over `stored`; [] when nothing is stored."""
    if not stored:
        return []
    with np.errstate(all="ignore"):
        logits = np.array([float(np.dot(t.key, query)) for t in stored]) / math.sqrt(len(query))
        w = np.exp(logits - np.max(logits))
        w = w / w.sum()
    return [clean(float(x)) for x in w]


def _order(t: Token):
    return (-math.inf if math.isnan(t.score) else t.score, t.position)


def _protected(t: Token, newest: int, config) -> bool:
    return t.position < config.n_sink or t.position > newest - config.grace


def _evict_head(head: List[Token], newest: int, config) -> List[Token]:
    while len(head) > config.budget:
        victim = min((t for t in head if not _protected(t, newest, config)), key=_order)
        head = [t for t in head if t is not victim]
    return head


def evict(state: RefState, config) -> RefState:
    state = _copy(state)
    newest = state.seen - 1
    state.heads = [[_evict_head(h, newest, config) for h in row] for row in state.heads]
    return state


def _one_token(head, key, value, position, config, weight_of=None):
    """Steps 1-4 for one head; `weight_of(p)` gives query weights (None: key proxy)."""
    if weight_of is None:
        w, own = key_weights(head, key), 0.0
    else:
        w, own = [clean(weight_of(t.position)) for t in head], clean(weight_of(position))
    for t, wj in zip(head, w):
        t.score = config.decay * t.score + wj
    head = head + [Token(position, key, value, own)]
    return _evict_head(head, position, config)


def step(state: RefState, key, value, config) -> RefState:
    """One token `[B, H, 1, D]`, key-proxy scoring."""
    assert config.scoring == "key"
    return absorb(state, key, value, config._replace(prefill="greedy"))


def absorb(state: RefState, keys, values, config, weights=None) -> RefState:
    """N tokens `[B, H, N, D]`; `weights` `[B, H, N, P]` by position for scoring="query"."""
    keys = np.asarray(keys, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    weights = None if weights is None else np.asarray(weights, dtype=np.float64)
    state = _copy(state)
    B, H, N, _ = keys.shape
    for b in range(B):
        for h in range(H):
            head = state.heads[b][h]
            if config.prefill == "greedy":
                for i in range(N):
                    weight_of = None if weights is None else (lambda p, i=i: weights[b, h, i, p])
                    head = _one_token(head, keys[b, h, i], values[b, h, i], state.seen + i,
                                      config, weight_of)
            else:
                head = _oneshot_head(head, keys[b, h], values[b, h], state.seen, config,
                                     None if weights is None else weights[b, h])
            state.heads[b][h] = head
    state.seen += N
    return state


def _oneshot_head(head, keys, values, seen, config, weights):
    """All of a chunk's weights at once, decayed sums, then evict down to budget."""
    N = len(keys)
    chunk = [Token(seen + i, keys[i], values[i]) for i in range(N)]
    everyone = head + chunk
    for t in head:
        t.score = config.decay**N * t.score
    for i in range(N):
        if weights is None:  # query i sees S and the chunk before it
            seen_by_i = head + chunk[:i]
            w = key_weights(seen_by_i, keys[i])
        else:  # ... and itself
            seen_by_i = head + chunk[: i + 1]
            w = [clean(weights[i, t.position]) for t in seen_by_i]
        for t, wj in zip(seen_by_i, w):
            t.score += config.decay ** (N - 1 - i) * wj
    newest = seen + N - 1
    k = len(everyone) - config.budget
    if k <= 0:
        return everyone
    candidates = sorted((t for t in everyone if not _protected(t, newest, config)), key=_order)
    gone = {id(t) for t in candidates[:k]}
    return [t for t in everyone if id(t) not in gone]


def kept_positions(state: RefState) -> List[List[List[int]]]:
    """Sorted kept positions per (b, h)."""
    return [[sorted(t.position for t in head) for head in row] for row in state.heads]


def scores_by_position(state: RefState) -> List[List[dict]]:
    """{position: score} per (b, h)."""
    return [[{t.position: t.score for t in head} for head in row] for row in state.heads]
