"""The executable spec: H2O per head in plain NumPy, float64, one loop per token.

Same names as `h2o_fn.core` (`init`, `admit`, `accumulate`, `evict`, `settle`, `step`,
`absorb`, `absorb_scored`, `rewind`, `kept_positions`, `key_weights`) and `h2o_fn.budgets`
(`select`, `absorb_selected`, `widen`, `tokens`, `reserved`), written for obviousness, not
speed. A head is a list of `Token`s; there are no slots. A head's reserved slots are a
count beside its tokens (`RefState.reserved`): its budget is the config's minus them. Tie rule, stated once:
evict the unprotected token with the lowest score, and among equal scores the
lowest position (NaN scores count as -inf). The core keeps float32 scores: where
two exact scores differ by less than float32 resolution the core sees a tie the
spec does not (see tests/strategies.py).

Query weights are indexed by absolute position, so they need no slot layout:
`weights[b, h, i, p]` is chunk query i's weight on row b's token at position p.
Rows count on their own (`seen[b]`); padding (`alive`, `n_alive`) is skipped.
Quantized storage is not modelled (each twin takes the core's `kv` and ignores it):
feed the spec the keys the core stores (dequantized), and it keeps the same positions.

Example:
    >>> import numpy as np
    >>> from h2o_fn import H2OConfig
    >>> from h2o_fn import reference as ref
    >>> cfg = H2OConfig(budget=3, n_sink=1, grace=1, decay=1.0)
    >>> s = ref.absorb(ref.init(cfg, 1, 1, 2), np.zeros((1, 1, 5, 2)), np.zeros((1, 1, 5, 2)), cfg)
    >>> ref.kept_positions(s)
    [[[0, 1, 4]]]
"""

import math
from dataclasses import dataclass, field, replace
from typing import List

import numpy as np

from .prompt import Prompt


@dataclass
class Token:
    position: int
    key: np.ndarray  # [D] float64
    value: np.ndarray  # [D] float64
    score: float = 0.0


@dataclass
class RefState:
    heads: List[List[List[Token]]]  # [B][H] -> kept tokens, in arrival order
    seen: List[int] = field(default_factory=list)  # [B] tokens absorbed per row
    head_dim: int = 0
    reserved: List[List[int]] = field(default_factory=list)  # [B][H] reserved slots ([] = none anywhere)

    def held_back(self, b: int, h: int) -> int:
        """Reserved slots of head (b, h): its budget is the config's minus these."""
        return self.reserved[b][h] if self.reserved else 0

    @property
    def length(self) -> List[int]:
        return [len(row[0]) + self.held_back(b, 0) if row else 0 for b, row in enumerate(self.heads)]


def init(config, batch: int, n_heads: int, head_dim: int, dtype=None, value_dim=None, room: int = 1,
         kv=None) -> RefState:
    del config, dtype, value_dim, room, kv  # the reference keeps lists: no slots to size
    return RefState([[[] for _ in range(n_heads)] for _ in range(batch)], [0] * batch, head_dim)


def _copy(state: RefState) -> RefState:
    heads = [[[replace(t) for t in head] for head in row] for row in state.heads]
    return replace(state, heads=heads, seen=list(state.seen), reserved=[list(r) for r in state.reserved])


def clean(w: float) -> float:
    """Non-finite and negative weights count as 0."""
    return w if math.isfinite(w) and w > 0 else 0.0


def _softmax_weights(stored: List[Token], query: np.ndarray) -> List[float]:
    """softmax_j(K_j . q / sqrt(D)) over `stored`; [] when nothing is stored."""
    if not stored:
        return []
    with np.errstate(all="ignore"):
        logits = np.array([float(np.dot(t.key, query)) for t in stored]) / math.sqrt(len(query))
        w = np.exp(logits - np.max(logits))
        w = w / w.sum()
    return [clean(float(x)) for x in w]


def key_weights(state: RefState, queries, kv=None) -> List[List[List[List[float]]]]:
    """Proxy weights [b][h][i] -> one weight per kept token (arrival order)."""
    del kv
    queries = np.asarray(queries, dtype=np.float64)
    return [[[_softmax_weights(head, q) for q in queries[b, h]] for h, head in enumerate(row)]
            for b, row in enumerate(state.heads)]


def _order(t: Token):
    return (-math.inf if math.isnan(t.score) else t.score, t.position)


def _protected(t: Token, newest: int, config) -> bool:
    return t.position < config.n_sink or t.position > newest - config.grace


def _evict_head(head: List[Token], newest: int, config, reserved: int = 0) -> List[Token]:
    while len(head) + reserved > config.budget:
        victim = min((t for t in head if not _protected(t, newest, config)), key=_order)
        head = [t for t in head if t is not victim]
    return head


def evict(state: RefState, config, argmin=None) -> RefState:
    """Every row down to budget, one lowest (score, position) unprotected token at a time."""
    del argmin
    state = _copy(state)
    state.heads = [[_evict_head(head, state.seen[b] - 1, config, state.held_back(b, h)) for h, head in enumerate(row)]
                   for b, row in enumerate(state.heads)]
    return state


def _alive(alive, b: int) -> bool:
    return True if alive is None else bool(np.asarray(alive)[b])


def admit(state: RefState, key, value, kv=None, alive=None) -> RefState:
    """Append one token `[B, H, 1, D]` with score 0 to every alive row."""
    del kv
    state = _copy(state)
    key, value = np.asarray(key, np.float64), np.asarray(value, np.float64)
    for b, row in enumerate(state.heads):
        if _alive(alive, b):
            for h, head in enumerate(row):
                head.append(Token(state.seen[b], key[b, h, 0], value[b, h, 0]))
            state.seen[b] += 1
    return state


def admit_chunk(state: RefState, keys, values, start: int, kv=None) -> RefState:
    """Append a chunk `[B, H, N, D]` with score 0 to every row (`start`, the core's slot, has
    no place in a reference without slots)."""
    del start, kv
    state = _copy(state)
    keys, values = np.asarray(keys, np.float64), np.asarray(values, np.float64)
    for b, row in enumerate(state.heads):
        for h, head in enumerate(row):
            head.extend(Token(state.seen[b] + i, keys[b, h, i], values[b, h, i]) for i in range(keys.shape[2]))
        state.seen[b] += keys.shape[2]
    return state


def settle_chunk(admitted: RefState, keys, config, start: int, weights=None, prompt: Prompt = Prompt(),
                 kv=None) -> RefState:
    """The admitted chunk (every row's N newest tokens) scored as `absorb` scores it, which
    evicts nothing here; `weights` `[B, H, N, P]` by position for scoring="query"."""
    del start
    N = np.asarray(keys).shape[2]
    values = np.array([[[t.value for t in head[-N:]] for head in row] for row in admitted.heads])
    return absorb(rewind(admitted, N), keys, values, config, weights, prompt=prompt, kv=kv)


def accumulate(state: RefState, weights, config, alive=None) -> RefState:
    """s <- decay * s + w for alive rows; `weights` `[B, H, P]` by position."""
    state = _copy(state)
    weights = np.asarray(weights, np.float64)
    for b, row in enumerate(state.heads):
        if _alive(alive, b):
            for h, head in enumerate(row):
                for t in head:
                    t.score = config.decay * t.score + clean(weights[b, h, t.position])
    return state


def settle(admitted: RefState, weights, config, argmin=None, alive=None) -> RefState:
    return evict(accumulate(admitted, weights, config, alive), config)


def settle_key(admitted: RefState, key, config, argmin=None, alive=None, kv=None, logits=None) -> RefState:
    """The rest of a key-scored step: each alive row's newest token (the last admitted) scores
    the tokens before it with `key` `[B, H, 1, D]` (as stored), then evict. `logits` (the
    core's shortcut for logits attention computed) would be the same dot products: ignored."""
    del argmin, kv, logits
    state = _copy(admitted)
    key = np.asarray(key, np.float64)
    for b, row in enumerate(state.heads):
        if _alive(alive, b):
            for h, head in enumerate(row):
                for t, w in zip(head[:-1], _softmax_weights(head[:-1], key[b, h, 0])):
                    t.score = config.decay * t.score + w
    return evict(state, config)


def _one_token(head, key, value, position, config, weight_of=None, reserved: int = 0):
    """Steps 1-4 for one head; `weight_of(p)` gives query weights (None: key proxy)."""
    if weight_of is None:
        w, own = _softmax_weights(head, key), 0.0
    else:
        w, own = [clean(weight_of(t.position)) for t in head], clean(weight_of(position))
    for t, wj in zip(head, w):
        t.score = config.decay * t.score + wj
    head = head + [Token(position, key, value, own)]
    return _evict_head(head, position, config, reserved)


def step(state: RefState, key, value, config, weights=None, argmin=None, alive=None, kv=None) -> RefState:
    """One token `[B, H, 1, D]`; `weights` `[B, H, 1, P]` by position for scoring="query"."""
    del argmin, kv
    n_alive = None if alive is None else np.asarray(alive).astype(int)
    return absorb(state, key, value, config._replace(prefill="greedy"), weights, n_alive=n_alive)


def absorb(state: RefState, keys, values, config, weights=None, argmin=None, n_alive=None,
           prompt: Prompt = Prompt(), kv=None) -> RefState:
    """N tokens `[B, H, N, D]`; `weights` `[B, H, N, P]` by position for scoring="query";
    row b's tokens from n_alive[b] on are padding."""
    del argmin, kv
    keys = np.asarray(keys, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    weights = None if weights is None else np.asarray(weights, dtype=np.float64)
    state = _copy(state)
    B, H, N, _ = keys.shape
    for b in range(B):
        n = N if n_alive is None else int(np.asarray(n_alive)[b])
        for h in range(H):
            head = state.heads[b][h]
            if config.prefill == "greedy":
                for i in range(n):
                    weight_of = None if weights is None else (lambda p, i=i: weights[b, h, i, p])
                    head = _one_token(head, keys[b, h, i], values[b, h, i], state.seen[b] + i,
                                      config, weight_of, state.held_back(b, h))
            elif n:
                head = _oneshot_head(head, keys[b, h, :n], values[b, h, :n], state.seen[b], config,
                                     None if weights is None else weights[b, h], prompt, state.held_back(b, h))
            state.heads[b][h] = head
        state.seen[b] += n
    return state


def _oneshot_head(head, keys, values, seen, config, weights, prompt, reserved: int = 0):
    """All of a chunk's weights at once, decayed sums, then evict down to budget."""
    N = len(keys)
    chunk = [Token(seen + i, keys[i], values[i]) for i in range(N)]
    everyone = head + chunk
    for t in head:
        t.score = config.decay**N * t.score
    first = N - prompt.window if prompt.window and N > prompt.window else 0
    for i in range(N):
        if i < first:  # a long chunk scores by its last `window` queries only
            continue
        if weights is None:  # query i sees S and the chunk before it
            seen_by_i = head + chunk[:i]
            w = _softmax_weights(seen_by_i, keys[i])
        else:  # ... and itself
            seen_by_i = head + chunk[: i + 1]
            w = [clean(weights[i, t.position]) for t in seen_by_i]
        for t, wj in zip(seen_by_i, w):
            t.score += config.decay ** (N - 1 - i) * wj
    r = prompt.pool // 2 if N > prompt.window else 0  # pooling ranks long chunks only
    return _keep_best(everyone, seen + N - 1, r, config, reserved)


def _keep_best(everyone: List[Token], newest: int, r: int, config, reserved: int = 0) -> List[Token]:
    """Evict the lowest (rank, position) unprotected tokens down to budget (less the head's
    reserved slots), all at once; a token's rank is the best score within r positions of it."""
    k = len(everyone) + reserved - config.budget
    if k <= 0:
        return everyone
    rank = {id(t): max(u.score for u in everyone if abs(u.position - t.position) <= r) for t in everyone}
    candidates = sorted((t for t in everyone if not _protected(t, newest, config)),
                        key=lambda t: (rank[id(t)], t.position))
    gone = {id(t) for t in candidates[:k]}
    return [t for t in everyone if id(t) not in gone]


def absorb_scored(state: RefState, keys, values, scores, config, prompt: Prompt = Prompt(), kv=None) -> RefState:
    """N tokens `[B, H, N, D]` whose scores are given: `scores[b, h, p]` is the new score of
    row b's token at position p (kept or in the chunk); then evict down to budget."""
    del kv
    keys, values = np.asarray(keys, np.float64), np.asarray(values, np.float64)
    scores = np.asarray(scores, np.float64)
    state = _copy(state)
    B, H, N, _ = keys.shape
    for b in range(B):
        seen = state.seen[b]
        for h in range(H):
            everyone = state.heads[b][h] + [Token(seen + i, keys[b, h, i], values[b, h, i]) for i in range(N)]
            for t in everyone:
                t.score = clean(scores[b, h, t.position])
            state.heads[b][h] = _keep_best(everyone, seen + N - 1, prompt.pool // 2, config, state.held_back(b, h))
        state.seen[b] += N
    return state


def aggregate(weights, kv_heads: int) -> np.ndarray:
    """`[B, Hq, N, L]` -> `[B, H, L]`: per key, the largest weight of any query of any query
    head q with q // (Hq / H) == h."""
    weights = np.asarray(weights, np.float64)
    B, Hq, N, L = weights.shape
    rep = Hq // kv_heads
    out = np.zeros((B, kv_heads, L))
    for b in range(B):
        for h in range(kv_heads):
            for j in range(L):
                out[b, h, j] = max(weights[b, q, i, j] for q in range(h * rep, (h + 1) * rep) for i in range(N))
    return out


def pool(scores, window: int, start: int = 0) -> np.ndarray:
    """`[B, H, L]`: from `start` on, the largest score among those from `start` on within
    `window // 2` places; before `start` unchanged."""
    scores = np.asarray(scores, np.float64)
    out, r, L = scores.copy(), window // 2, scores.shape[-1]
    for j in range(start, L):
        out[..., j] = scores[..., max(start, j - r) : min(L, j + r + 1)].max(axis=-1)
    return out


def surprisal(logits, targets) -> np.ndarray:
    """`[B, N]`: -log of the softmax of logits[b, i] at targets[b, i]."""
    logits = np.asarray(logits, np.float64)
    B, N, _ = logits.shape
    out = np.zeros((B, N))
    for b in range(B):
        for i in range(N):
            row = logits[b, i]
            top = row.max()
            out[b, i] = top + np.log(np.exp(row - top).sum()) - row[targets[b][i]]
    return out


def weigh(scores, surprisals, weight: float, start: int = 0) -> np.ndarray:
    """`[B, H, L]`: from `start` on, score * (1 + weight * s / m), s the token's surprisal (a NaN
    one: m), m the mean of the row's known ones (1 when it is 0)."""
    scores = np.asarray(scores, np.float64)
    surprisals = np.asarray(surprisals, np.float64)
    out = scores.copy()
    for b in range(scores.shape[0]):
        known = [x for x in surprisals[b] if not np.isnan(x)]
        m = sum(known) / len(known) if known else 0.0
        for i, x in enumerate(surprisals[b]):
            x = m if np.isnan(x) else x
            out[b, :, start + i] = scores[b, :, start + i] * (1 + weight * x / (m if m > 0 else 1.0))
    return out


def shared(scores, width: int, room) -> np.ndarray:
    """`[B, N]` bool: per row, each token's best clean score over every layer and head; windows
    of `width` tokens from the first; the best by mean (ties: the earlier) taken whole while
    their tokens fit `room[b]`, stopping at the first that does not."""
    scores = [np.asarray(s, np.float64) for s in scores]
    B, N = scores[0].shape[0], scores[0].shape[-1]
    room = np.broadcast_to(np.asarray(room, np.float64).reshape(-1), (B,))
    out = np.zeros((B, N), bool)
    for b in range(B):
        best = [max(clean(s[b, h, i]) for s in scores for h in range(s.shape[1])) for i in range(N)]
        windows = [list(range(a, min(a + width, N))) for a in range(0, N, width)]
        order = sorted(range(len(windows)), key=lambda w: (-sum(best[t] for t in windows[w]) / len(windows[w]), w))
        used = 0
        for w in order:
            if used + len(windows[w]) > room[b]:
                break
            used += len(windows[w])
            out[b, windows[w]] = True
    return out


def chunk_scores(state: RefState, scores, span=None) -> List[List[dict]]:
    """New scores by position per (b, h): `scores[b, h, p]` for the chunk's positions
    (p >= seen[b]), max(old score, scores[b, h, p]) for a kept token at position p."""
    del span
    scores = np.asarray(scores, np.float64)
    out = []
    for b, row in enumerate(state.heads):
        per_head = []
        for h, head in enumerate(row):
            new = {p: float(scores[b, h, p]) for p in range(state.seen[b], scores.shape[-1])}
            new.update({t.position: max(t.score, float(scores[b, h, t.position])) for t in head})
            per_head.append(new)
        out.append(per_head)
    return out


def absorb_staged(state: RefState, keys, values, config, weights=None, prompt: Prompt = Prompt(),
                  kv=None, logits=None) -> RefState:
    """The N newest tokens of `state` (admitted, unscored) scored as one oneshot chunk from
    the state before them; `weights` `[B, H, N, P]` by position. `logits` (the core's
    shortcut for the proxy's logits attention computed while staging) would be the same
    dot products: ignored."""
    del kv, logits
    before = rewind(state, np.asarray(keys).shape[2])
    return absorb(before, keys, values, config._replace(prefill="oneshot"), weights, prompt=prompt)


def rewind(state: RefState, n: int) -> RefState:
    """Forget every row's n newest tokens (scores keep what they received from them)."""
    state = _copy(state)
    state.seen = [s - n for s in state.seen]
    state.heads = [[[t for t in head if t.position < state.seen[b]] for head in row]
                   for b, row in enumerate(state.heads)]
    return state


def kept_positions(state: RefState) -> List[List[List[int]]]:
    """Sorted kept positions per (b, h)."""
    return [[sorted(t.position for t in head) for head in row] for row in state.heads]


def scores_by_position(state: RefState) -> List[List[dict]]:
    """{position: score} per (b, h)."""
    return [[{t.position: t.score for t in head} for head in row] for row in state.heads]


def rows_by_position(state: RefState, which: str = "value") -> List[List[dict]]:
    """{position: key or value row} per (b, h): what the stored rows must hold."""
    return [[{t.position: getattr(t, which) for t in head} for head in row] for row in state.heads]


# ---------------------------------------------------------------- budgets across heads and layers


def tokens(state: RefState) -> List[List[int]]:
    """Tokens kept per (b, h)."""
    return [[len(head) for head in row] for row in state.heads]


def reserved(state: RefState) -> List[List[int]]:
    """Reserved slots per (b, h)."""
    return [[state.held_back(b, h) for h in range(len(row))] for b, row in enumerate(state.heads)]


def select(scores, positions, total, n_sink: int, cap=None) -> List[np.ndarray]:
    """Keep masks `[B, H, M_l]` per layer: per batch row, every (layer, head, slot) holding a
    token ranked by (sink first, score, position, earlier layer, earlier head), best first;
    the first total[b] are kept, skipping a head's tokens after its best `cap`."""
    B = np.asarray(scores[0]).shape[0]
    total = np.broadcast_to(np.asarray(total), (B,))
    out = [np.zeros(np.asarray(s).shape, dtype=bool) for s in scores]
    for b in range(B):
        entries = []
        for layer, (s, p) in enumerate(zip(scores, positions)):
            s, p = np.asarray(s, np.float64), np.asarray(p)
            for h in range(s.shape[1]):
                for j in range(s.shape[2]):
                    if p[b, h, j] >= 0:
                        rank = math.inf if p[b, h, j] < n_sink else clean(float(np.float32(s[b, h, j])))
                        entries.append(((rank, int(p[b, h, j])), (-layer, -h), (layer, h, j)))
        entries.sort(reverse=True)
        per_head: dict = {}  # (layer, head) -> tokens kept
        kept = 0
        for _, _, (layer, h, j) in entries:
            if kept == int(total[b]):
                break
            if cap is None or per_head.get((layer, h), 0) < cap:
                per_head[(layer, h)] = per_head.get((layer, h), 0) + 1
                out[layer][b, h, j] = True
                kept += 1
    return out


def absorb_selected(state: RefState, keys, values, scores, keep, held: int, capacity: int = 0, kv=None) -> RefState:
    """A chunk `[B, H, N, D]` and the kept tokens reduced to the `keep[b, h, p]` ones (by
    position), each scored `scores[b, h, p]`; every head then holds `held` slots: its tokens
    and held - len(tokens) reserved ones."""
    del capacity, kv
    keys, values = np.asarray(keys, np.float64), np.asarray(values, np.float64)
    scores, keep = np.asarray(scores, np.float64), np.asarray(keep, bool)
    state = _copy(state)
    B, H, N, _ = keys.shape
    state.reserved = [[0] * H for _ in range(B)]
    for b in range(B):
        seen = state.seen[b]
        for h in range(H):
            everyone = state.heads[b][h] + [Token(seen + i, keys[b, h, i], values[b, h, i]) for i in range(N)]
            kept = [replace(t, score=clean(scores[b, h, t.position])) for t in everyone if keep[b, h, t.position]]
            if len(kept) > held:
                raise ValueError(f"head ({b}, {h}) keeps {len(kept)} tokens: expected at most held={held}")
            state.heads[b][h] = sorted(kept, key=lambda t: t.position)
            state.reserved[b][h] = held - len(kept)
        state.seen[b] += N
    return state


def widen(state: RefState, extra: int) -> RefState:
    """`extra` more reserved slots in every head."""
    state = _copy(state)
    state.reserved = [[state.held_back(b, h) + extra for h in range(len(row))] for b, row in enumerate(state.heads)]
    return state
