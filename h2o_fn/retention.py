"""Query-agnostic retention: scores for a prompt whose questions have not been asked yet.

A prompt cached once (a document, a system prompt, a conversation so far) must answer
questions that arrive after it was compressed, so the questions cannot score it. The
rule here is KVzip's (Kim et al., 2025, arXiv:2505.23416): after a chunk of the prompt
is read, the model reads it a second time ("repeat the context") and every key is
scored by the largest attention that any query of that repeat pass, on any query head
sharing its KV head, pays to it. What the model needs to reproduce the context is what
a later question can ask for; a pass key gets the attention of the digits that copy it.

The model passes live in the adapter (`h2o_fn.adapters.retention`); this module holds
the pure parts, with twins of the same names in `h2o_fn.reference`:

- `aggregate`: the repeat pass's weights `[B, Hq, N, L]` -> one score per key `[B, H, L]`;
- `pool`: each chunk token's score raised to the largest of its neighbours' (a window of
  `window` tokens centred on it), so that a kept token keeps the tokens around it (an
  option of `cache_prompt`, off by default: BENCHMARKS, "Natural text");
- `surprisal`: the first pass's logits -> each chunk token's surprisal (-log p, nats);
- `weigh`: each chunk token's score times `1 + weight * s / mean(s)` (s its surprisal): a
  token the model could not predict from what came before (a code, a name, a number) carries
  what a compressed cache cannot rebuild, so it is kept before the predictable text around it
  (Selective Context's self-information, Li et al., 2023, as a prior on KVzip's scores);
- `shared`: the chunk's best windows of consecutive tokens, to keep whole in every layer
  and head (by each token's best score over all of them): a fact sits in a run of tokens,
  and one selection token by token keeps pieces of it in some heads and other pieces in
  others; `SHARED` is what the adapter adds to their scores so that every selection keeps
  them first;
- `chunk_scores`: those scores over (kept rows, chunk) -> the core's `[B, H, C + N]`
  layout for `absorb_scored`, raising each kept token's score to its new one (max).

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn import H2OConfig, init, absorb_scored, kept_positions
    >>> from h2o_fn.retention import aggregate, chunk_scores
    >>> cfg = H2OConfig(budget=3, n_sink=1, grace=1)
    >>> w = mx.array([[[[0.5, 0.125, 0.25, 0.125, 0.0], [0.25, 0.0, 0.0, 0.125, 0.5]]]] * 2).reshape(1, 2, 2, 5)
    >>> s = aggregate(w, kv_heads=1)            # [1, 1, 5]: max over queries and query heads
    >>> s.tolist()
    [[[0.5, 0.125, 0.25, 0.125, 0.5]]]
    >>> state = init(cfg, 1, 1, 4)
    >>> kv = mx.zeros((1, 1, 5, 4))
    >>> kept_positions(absorb_scored(state, kv, kv, chunk_scores(state, s, span=0), cfg))[0, 0].tolist()
    [0, 2, 4, -1]
"""

from typing import Sequence

import mlx.core as mx

from .scoring import clean_weights
from .state import H2OState

SHARED = 1e5  # added to a shared window's scores: above any score a repeat pass and `weigh` give


def aggregate(weights: mx.array, kv_heads: int) -> mx.array:
    """Attention weights `[B, Hq, N, L]` of a scoring pass -> `[B, H, L]` float32: each key's
    largest weight over the N queries and the Hq / H query heads that share its KV head
    (query head q reads KV head q // (Hq / H), mlx-lm's GQA layout)."""
    B, Hq, N, L = weights.shape
    if Hq % kv_heads:
        raise ValueError(f"{Hq} query heads is invalid for kv_heads={kv_heads}: expected a multiple")
    w = weights.astype(mx.float32).reshape(B, kv_heads, (Hq // kv_heads) * N, L)
    return mx.max(w, axis=2)


def pool(scores: mx.array, window: int, start: int = 0) -> mx.array:
    """Scores `[B, H, L]` -> `[B, H, L]`: from `start` on (the chunk: consecutive positions),
    each the largest score within `window // 2` places of it, among those from `start` on;
    the first `start` (kept rows, not neighbours of each other) as they are. `window` 1: unchanged.

    >>> pool(mx.array([[[9.0, 0.0, 0.0, 5.0, 0.0, 0.0, 1.0]]]), 3, start=1).tolist()
    [[[9.0, 0.0, 5.0, 5.0, 5.0, 1.0, 1.0]]]
    """
    if window < 1 or window % 2 == 0:
        raise ValueError(f"window={window} is invalid: expected an odd number >= 1")
    if not 0 <= start <= scores.shape[-1]:
        raise ValueError(f"start={start} is invalid for {scores.shape[-1]} scores: expected 0..{scores.shape[-1]}")
    r, N = window // 2, scores.shape[-1] - start
    if r == 0 or N == 0:
        return scores
    chunk = mx.pad(scores[..., start:], [(0, 0), (0, 0), (r, r)], constant_values=-mx.inf)
    pooled = mx.max(mx.stack([chunk[..., i : i + N] for i in range(2 * r + 1)]), axis=0)
    return mx.concatenate([scores[..., :start], pooled], axis=-1)


def surprisal(logits: mx.array, targets: mx.array) -> mx.array:
    """Logits `[B, N, V]` and the tokens they predict `[B, N]` -> `[B, N]` float32: each
    target's surprisal, -log softmax(logits)[target], in nats.

    >>> [round(x, 4) for x in surprisal(mx.array([[[0.0, 0.0], [9.0, -9.0]]]), mx.array([[1, 0]]))[0].tolist()]
    [0.6931, 0.0]
    """
    if logits.shape[:2] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} are invalid: "
                         "expected [B, N, V] and [B, N]")
    x = logits.astype(mx.float32)
    return mx.logsumexp(x, axis=-1) - mx.take_along_axis(x, targets[..., None], axis=-1)[..., 0]


def weigh(scores: mx.array, surprisals: mx.array, weight: float, start: int = 0) -> mx.array:
    """Scores `[B, H, L]` -> `[B, H, L]`: from `start` on (the chunk), each times
    `1 + weight * s / mean(s)`, s its token's surprisal `[B, L - start]` (NaN: the row's mean,
    a token nothing predicted) and the mean over the row's chunk; the first `start` (kept rows,
    weighed when their chunk was) as they are. `weight` 0: unchanged.

    >>> weigh(mx.array([[[0.5, 0.5, 0.5]]]), mx.array([[1.0, 3.0]]), 1.0, start=1).tolist()
    [[[0.5, 0.75, 1.25]]]
    """
    N = scores.shape[-1] - start
    if not 0 <= weight < float("inf") or not 0 <= start <= scores.shape[-1]:  # `not`: NaN is refused too
        raise ValueError(f"weight={weight}, start={start} are invalid for {scores.shape[-1]} scores: "
                         f"expected a finite weight >= 0 and start in 0..{scores.shape[-1]}")
    if surprisals.shape != (scores.shape[0], N):
        raise ValueError(f"surprisals {tuple(surprisals.shape)} are invalid: expected ({scores.shape[0]}, {N})")
    if weight == 0 or N == 0:
        return scores
    s = surprisals.astype(mx.float32)
    known = ~mx.isnan(s)
    mean = mx.sum(mx.where(known, s, 0.0), axis=-1, keepdims=True) / mx.maximum(mx.sum(known, axis=-1, keepdims=True), 1)
    s = mx.where(known, s, mean)
    factor = 1 + weight * s / mx.where(mean > 0, mean, 1.0)  # [B, N]; a row predicted perfectly: 1 + weight * 0
    return mx.concatenate([scores[..., :start], scores[..., start:] * factor[:, None]], axis=-1)


def shared(scores: Sequence[mx.array], width: int, room) -> mx.array:
    """The chunk's best windows, whole: per layer scores `[B, H_l, N]` over the same N chunk
    tokens -> `[B, N]` bool.

    Each token's score is its largest over every layer and head (NaN, inf and negatives count
    as 0); the chunk is cut into windows of `width` tokens from its first (the last may be
    shorter), ranked by their mean score (ties: the earlier window first); the best are taken
    whole while their tokens add up to at most `room[b]` (`[B]` or a number); the first window
    that would not fit ends the choice.

    >>> s = mx.array([[[0.0, 0.9, 0.1, 0.2, 0.2, 0.8, 0.1]]])
    >>> shared([s], 2, 4).astype(mx.int32).tolist()     # windows' means .45 .15 .5 .1: the 3rd, the 1st
    [[1, 1, 0, 0, 1, 1, 0]]
    >>> shared([s], 2, 3).astype(mx.int32).tolist()     # the 1st would not fit after the 3rd: none after it
    [[0, 0, 0, 0, 1, 1, 0]]
    """
    if width < 1:
        raise ValueError(f"width={width} is invalid: expected >= 1 (tokens per window)")
    if not scores:
        raise ValueError("scores is empty: expected one [B, H, N] array per layer")
    best = mx.max(mx.stack([mx.max(clean_weights(s), axis=1) for s in scores]), axis=0)  # [B, N]
    B, N = best.shape
    W = -(-N // width)
    sums = mx.pad(best, [(0, 0), (0, W * width - N)]).reshape(B, W, width).sum(axis=-1)
    sizes = mx.minimum(width, N - width * mx.arange(W)).astype(mx.float32)  # [W]
    mean = sums / sizes
    i = mx.arange(W)
    first = (mean[:, :, None] > mean[:, None, :]) | (  # [B, v, w]: window v is ranked before window w
        (mean[:, :, None] == mean[:, None, :]) & (i[:, None] < i[None, :]))
    before = mx.sum(first * sizes[None, :, None], axis=1)  # [B, W]: tokens of the windows ranked before
    room = mx.broadcast_to(mx.array(room).astype(mx.float32).reshape(-1), (B,))
    take = before + sizes <= room[:, None]
    return mx.repeat(take, width, axis=1)[:, :N]


def chunk_scores(state: H2OState, scores: mx.array, span: int) -> mx.array:
    """Scores `[B, H, span + N]` over a scoring view (the state's first `span` slots, then
    the N chunk tokens) -> `[B, H, C + N]` for `absorb_scored(state, ...)`: a kept token
    keeps the larger of its score and its new one; free slots and slots past `span` keep
    their score (free slots are ignored by `absorb_scored`)."""
    C = state.positions.shape[-1]
    if span > C or scores.shape[-1] < span:
        raise ValueError(f"span={span} is invalid for scores {tuple(scores.shape)} over {C} slots: "
                         "expected span <= C and span <= L")
    on_slots = mx.pad(scores[..., :span], [(0, 0), (0, 0), (0, C - span)])
    slots = mx.where(state.positions >= 0, mx.maximum(state.scores, on_slots), state.scores)
    return mx.concatenate([slots, scores[..., span:].astype(mx.float32)], axis=-1)
