"""cache_prompt: compress a prompt so that questions it never saw still find their answer.

The prompt (a document, a system prompt, a conversation so far) is read chunk by chunk.
For each chunk every layer holds its kept rows plus the chunk, nothing evicted, while
the model makes two passes:

1. the chunk itself (its keys and values, attending to the kept rows and itself), and each
   token's surprisal under the model's own next-token logits (`read`: made a slice of tokens
   at a time, never for the whole chunk at once);
2. a repeat pass: an optional instruction (`repeat_prefix`, e.g. "Repeat the previous
   context") and the chunk again, teacher-forced. Its attention weights over the kept
   rows and the chunk are collected explicitly (the attention hook) and scored by
   `h2o_fn.retention` (KVzip's rule: the largest weight any repeat query pays a key),
   optionally pooled over the chunk (`pool`: a kept token keeps its neighbours), then
   weighed by the surprisals (`surprisal`: what the model could not predict is kept first);
   with a global selection the best windows of `width` tokens are then kept whole in every
   head (`share` of the budget, `share_windows`). The repeat tokens' own keys and values
   are thrown away.

Both passes attend a slice of queries at a time (`weights_per_slice`: the hook's
protocol), so a layer's attention weights stay within SLICE floats (one query's at the
least), however many rows a layer keeps. Then each H2O layer absorbs the chunk with those scores
(`prefill.absorb_scored`) and is back at its budget. Peak memory: the kept rows + one
chunk + its repeat per layer, plus one slice's weights, whatever the prompt's length.
Layers that are not H2O (sliding-window caches) take the chunk as usual and read the
repeat pass through a throwaway copy.

Example:
    >>> from h2o_fn import H2OConfig                                                            # doctest: +SKIP
    >>> from h2o_fn.adapters.gguf import load_gguf                                              # doctest: +SKIP
    >>> from h2o_fn.adapters.mlx_lm import cache_prompt, make_h2o_cache                         # doctest: +SKIP
    >>> model, tokenizer = load_gguf()                                                          # doctest: +SKIP
    >>> cache = make_h2o_cache(model, H2OConfig(budget=128))                                    # doctest: +SKIP
    >>> cache_prompt(model, tokenizer.encode(document), cache)   # at most 128 tokens per head  # doctest: +SKIP
    >>> mlx_lm.generate(model, tokenizer, question, prompt_cache=cache)                         # doctest: +SKIP
"""

import copy
from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask

from h2o_fn import budgets as spread
from h2o_fn import retention
from h2o_fn.state import RESERVED

from .attention import query_scoring
from .cache import H2OKVCache

# what the repeat pass is told before the chunk is read again (KVzip's instruction, shortened)
REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"
CHUNK = 512  # prompt tokens read (and scored) per chunk
SLICE = 2**20  # at most this many attention weights (float32) per slice of queries, in both passes
# how cache_prompt spreads the budget: by the share kept, across layers and heads, across each
# layer's heads, or per head
BUDGETS = ("auto", "global", "layer", "uniform")
LAYER_FROM = 0.45  # "auto": per layer once a head's budget is this share of the tokens read (BENCHMARKS)
TAIL = 32  # with budgets="global": new tokens each head takes after the prompt before evicting again
POOL = 1  # no pooling of the repeat pass's scores: 5 lost the natural-text key at 256 (BENCHMARKS, "Natural text")
# each chunk token's score times 1 + SURPRISAL * its surprisal over the chunk's mean (`retention.weigh`)
SURPRISAL = 10.0
# share of a head's budget for the best windows, kept whole in every head, with a global selection
# (`share_windows`): the natural-text key at 8 / 16% kept 0.57 / 0.50 -> 0.72 / 0.82; RULER at three quarters
# removed level (1k 45.7 -> 46.0, 2k 42.0 -> 42.5; full 45.3 / 42.9); at 87.5% 1k -5.7, 2k +4.8 (BENCHMARKS)
# 2k-token prompts lose a little (the key at 8% kept 8 -> 6 of 20, serve 11 -> 8 of 20): a chunk holds ~1 window
SHARE = 0.5
WIDTH = 16  # tokens per window (`retention.shared`)
WINDOWS = 4  # at most this many windows in a prompt: a few spans, not half a long prompt's budget (RULER at 2k)


def repeat_prefix(tokenizer) -> List[int]:
    """REPEAT_PROMPT's token ids, without the BOS a tokenizer may add to a text."""
    return tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False)


class ScoringPass:
    """One H2O layer's cache during `cache_prompt`'s two passes over a chunk: the kept
    rows `[B, H, K, D]` (dense, sorted by position), then the chunk, then the repeat
    tokens; nothing is evicted. The second pass asks for its attention weights (the
    hook's protocol) and turns them into `scores` `[B, H, K + N]`."""

    weights_reduce = "none"  # the hook hands the weights of every query head: KVzip takes the max
    weights_per_slice = SLICE  # the hook attends a slice of queries at a time (memory: BENCHMARKS, peak)

    def __init__(self, cache: H2OKVCache, pool: int = POOL, surprisal: float = SURPRISAL):
        self.cache, self.pool, self.surprisal = cache, pool, surprisal
        self.surprisals = None  # [B, N] the chunk tokens' surprisals (`score_chunk`), when surprisal > 0
        cache.compact()
        s = cache.layer_state
        self.span = max(s.lengths, default=0)  # the kept rows (and reserved slots) are the first `span` slots
        self.offset = cache.tokens_seen
        self.kept = cache.kept_rows() if self.span else None
        # heads of their own budgets (an earlier selection): each head's reserved slots are masked
        self.held = (s.core.positions[..., : self.span] != RESERVED) if self.span and s.reserved else None
        self.chunk = None  # (keys, values) of pass 1, [B, H, N, D]
        self.scores = None  # [B, H, span + N] after pass 2
        self.shared = None  # [B, N] bool: the chunk's windows kept in every head (`share_windows`)
        self.wants_weights = False

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        parts = [p for p in (self.kept, self.chunk) if p is not None]
        if self.chunk is None:
            self.chunk = (keys, values)
        else:
            self.wants_weights = True
        self.offset += keys.shape[2]
        parts.append((keys, values))
        return tuple(mx.concatenate([p[i] for p in parts], axis=2) if len(parts) > 1 else parts[0][i]
                     for i in range(2))

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        del window_size
        if N == 1:
            return None
        held = self.span + (0 if self.chunk is None else self.chunk[0].shape[2])
        return create_causal_mask(N, offset=held) if return_array else "causal"

    def attention_mask(self, N: int, mask):
        """Per KV head `[B, H, 1, N, L]` when kept heads hold reserved slots (causal over the
        rest, as `make_mask`), else mlx-lm's `mask` as it is."""
        if self.held is None:
            return mask
        L = self.span + (0 if self.chunk is None or not self.wants_weights else self.chunk[0].shape[2]) + N
        causal = mx.arange(L - N, L)[:, None] >= mx.arange(L)[None]  # [N, L]
        held = mx.pad(self.held, [(0, 0), (0, 0), (0, L - self.span)], constant_values=True)
        return held[:, :, None, None] & causal

    @property
    def kv_heads(self) -> int:
        return self.chunk[0].shape[1]

    def can_take(self, keys) -> bool:
        return self.wants_weights and keys.shape[1] == self.kv_heads

    def receive_weights(self, weights: mx.array) -> None:
        """The repeat pass's weights `[B, Hq, S, L]` over kept rows, chunk and repeat tokens, for
        one slice of its queries at a time (`weights_per_slice`): each key keeps its largest."""
        context = self.span + self.chunk[0].shape[2]
        scores = retention.aggregate(weights[..., :context], self.kv_heads)
        self.scores = scores if self.scores is None else mx.maximum(self.scores, scores)
        mx.eval(self.scores)  # now: left lazy, every slice's weights would stay alive until the pass ends

    def absorb(self) -> None:
        """The chunk into the H2O cache with the scores of the repeat pass (a uniform budget per head)."""
        self.cache.absorb_scored(*self.chunk, self._scores(), self.span)

    def select_inputs(self):
        """This layer's `(scores, positions)` `[B, H, C + N]` for a selection across layers."""
        return self.cache.select_inputs(*self.chunk, self._scores(), self.span)

    def onto(self, cache: H2OKVCache) -> "ScoringPass":
        """This pass's chunk and scores for another empty cache of the same layer (another
        budget): one scoring of a prompt that fits one chunk serves any budget."""
        if self.span or cache.tokens_seen:
            raise ValueError(f"onto: the pass scored a chunk after {self.span} kept rows and the cache holds "
                             f"{cache.tokens_seen} tokens: expected both empty (the chunk is the whole prompt)")
        other = copy.copy(self)
        other.cache = cache
        return other

    def _scores(self) -> mx.array:
        if self.scores is None:
            raise RuntimeError("the repeat pass never handed its attention weights to this layer: "
                               "its attention does not go through mlx_lm's scaled_dot_product_attention")
        scores = retention.pool(self.scores, self.pool, self.span)
        if self.surprisals is not None:
            scores = retention.weigh(scores, self.surprisals, self.surprisal, self.span)
        if self.shared is None:
            return scores
        lift = mx.pad(self.shared[:, None].astype(mx.float32) * retention.SHARED, [(0, 0), (0, 0), (self.span, 0)])
        return scores + lift

    def chunk_scores(self) -> mx.array:
        """`[B, H, N]`: the chunk tokens' scores as the selection reads them (pooled, weighed, lifted)."""
        return self._scores()[..., self.span :]

    def shared_before(self) -> mx.array:
        """`[B]`: kept tokens that earlier chunks shared (`share_windows`; a shared token is in
        every head, so head 0 counts them)."""
        if not self.span:
            return mx.zeros((self.chunk[0].shape[0],), mx.int32)
        core = self.cache.layer_state.core
        held = (core.positions[:, 0, : self.span] >= 0) & (core.scores[:, 0, : self.span] >= retention.SHARED / 2)
        return mx.sum(held, axis=-1).astype(mx.int32)


def share_windows(passes: List[ScoringPass], share: float, width: int = WIDTH, part: float = 1.0,
                  windows: Optional[int] = WINDOWS) -> None:
    """Mark in every pass the chunk's best windows of `width` tokens (`h2o_fn.retention.shared`,
    by each token's best score over every layer and head): their scores are raised by `SHARED`,
    so every selection keeps them whole in every head, first after the sinks, and a later
    chunk keeps them too. With the windows earlier chunks shared they take at most `part` x
    the smaller of `share` x a head's budget and `windows` x `width` tokens (`part`: the share
    of the prompt read once this chunk is, so that the first chunks of a long prompt leave room
    to the later ones; `windows` None: no bound); share 0: none."""
    if share <= 0:
        return
    most = share * passes[0].cache.target_budget
    room = int(part * (most if windows is None else min(most, windows * width))) - passes[0].shared_before()
    mask = retention.shared([p.chunk_scores() for p in passes], width, room)
    for p in passes:
        p.shared = mask


def check_share(share: Optional[float]) -> None:
    """Raise unless `share` is None (cache_prompt's default) or within 0-1 (of a head's budget)."""
    if share is not None and not 0 <= share <= 1:
        raise ValueError(f"share={share} is invalid: expected 0 <= share <= 1 (of a head's budget; 0: none)")


def reading_for(layers: Sequence[Any], n: int, budgets: str, share: Optional[float]) -> Tuple[str, float]:
    """`cache_prompt`'s `budgets` and `share` resolved for a prompt of `n` more tokens read into
    `layers`, as `keep_chunk` takes them: the spread by `spread_for`; the share as given, else
    `SHARE` where the spread is "global" and 0 with "layer" or "uniform"."""
    spread = spread_for(layers, n, budgets)
    return spread, (SHARE if spread == "global" else 0.0) if share is None else share


def _layers(cache: Sequence[Any]) -> List[Any]:
    bad = [type(c).__name__ for c in cache if isinstance(c, mlx_cache.CacheList)]
    if bad:
        raise ValueError(f"cache_prompt got layers of {sorted(set(bad))}: expected one cache per layer "
                         "(layers holding several KV caches in lockstep are not supported yet)")
    if not any(isinstance(c, H2OKVCache) for c in cache):
        raise ValueError("cache_prompt got no H2OKVCache layer: build the cache with make_h2o_cache(model, config)")
    return list(cache)


def select_across(passes: List[ScoringPass], tail: int, cap: Optional[int] = None, per_layer: bool = False) -> None:
    """Each pass's chunk into its cache by one selection over every layer and KV head
    (`h2o_fn.budgets.select`): the caches' target budgets summed (tokens per head times heads)
    are kept where the repeat pass's scores are highest, sinks first; then each layer's
    budget becomes its most kept tokens per head + `tail` (`H2OKVCache.absorb_selected`);
    `cap`: at most that many tokens per head (None: no bound). `per_layer`: one selection
    per layer instead, over its heads only, of its own budget times its heads."""
    inputs = [p.select_inputs() for p in passes]
    B = inputs[0][0].shape[0]
    config = passes[0].cache.config

    def chosen(group):
        total = sum(passes[i].cache.target_budget * passes[i].kv_heads for i in group)
        return spread.select([inputs[i][0] for i in group], [inputs[i][1] for i in group],
                             mx.full((B,), total, mx.int32), config.n_sink, cap)

    groups = [[i] for i in range(len(passes))] if per_layer else [list(range(len(passes)))]
    keep = [k for g in groups for k in chosen(g)]
    held = mx.stack([mx.max(mx.sum(k, axis=-1)) for k in keep]).tolist()
    for p, (scores, _), k, h in zip(passes, inputs, keep, held):
        h = max(int(h), 1)
        c = p.cache.config
        p.cache.absorb_selected(*p.chunk, scores, k, h, max(h + tail, c.n_sink + c.grace + 1))


def absorb_passes(passes: List[ScoringPass], budgets: str, tail: int, cap: Optional[int] = None) -> None:
    """Each pass's chunk into its cache as `cache_prompt`'s `budgets` says: one selection
    across layers and heads ("global", `select_across`), across each layer's heads ("layer")
    or every head at its budget ("uniform")."""
    if budgets in ("global", "layer"):
        select_across(passes, tail, cap, per_layer=budgets == "layer")
    elif budgets == "uniform":
        for p in passes:
            p.absorb()
    else:  # "auto" is resolved by the caller, who knows how many tokens are read (`spread_for`)
        raise ValueError(f"budgets={budgets!r} is invalid here: expected 'global', 'layer' or 'uniform'")


def cache_prompt(model: nn.Module, prompt_ids: Sequence[int], cache: List[Any], *,
                 repeat_prefix: Sequence[int] = (), chunk_size: int = CHUNK, budgets: str = "auto",
                 tail: int = TAIL, cap: Optional[int] = None, pool: int = POOL,
                 surprisal: float = SURPRISAL, share: Optional[float] = None,
                 width: int = WIDTH, windows: Optional[int] = WINDOWS,
                 within: Optional[Tuple[int, int]] = None) -> List[Any]:
    """Feed `prompt_ids` into `cache` (from `make_h2o_cache`) scored for questions not yet
    asked: afterwards every H2O layer and head holds at most its budget.

    Args:
      prompt_ids: the prompt's token ids (one sequence). A cache that already holds tokens
        is continued: the prompt follows them, and kept tokens can lose their place to it.
      repeat_prefix: token ids read before each chunk's repeat (the instruction, e.g.
        `tokenizer.encode(REPEAT_PROMPT)`); empty: the chunk is simply read again.
      chunk_size: prompt tokens per chunk; peak KV memory per layer is its kept rows + 2 * chunk + prefix.
      budgets: "auto" (default): "layer" when each head's budget is at least `LAYER_FROM`
        of the tokens read (those the cache holds and `prompt_ids`), else "global".
        "global": one selection over every layer and KV head keeps the caches' budgets
        summed where the scores are (`h2o_fn.budgets`); each layer's budget then becomes
        its most kept tokens per head + `tail`, and every head keeps its own share.
        "layer": one selection per layer, across its heads only (its budget times its
        heads; kvpress's KVzip `layerwise=True`). "uniform": every head keeps its own
        budget (as the caches were built). On natural text "global" keeps a key best at
        8-16% of the prompt kept, and a UUID up to 40%, where "layer" loses some of its pieces;
        "layer" is level or better from half kept (BENCHMARKS, "Natural text").
      tail: with "global" or "layer", the new tokens (a question, an answer, a next turn) every head
        takes after the prompt before the rule evicts again.
      cap: with "global", at most this many tokens per head (None: no bound). A layer's
        slots follow its fullest head, so the cap bounds the bytes a selection can take.
      pool: each chunk token's score is the largest within `pool // 2` places of it (odd;
        1, the default: KVzip's scores as they are), so that kept tokens keep their
        neighbours. 5 found the natural-text key in 0.42 / 0.50 of prompts at 16% / 32%
        kept against 0.45 / 0.68 (BENCHMARKS, "Natural text").
      surprisal: each chunk token's score times `1 + surprisal * s / mean(s)`, s its surprisal
        under the model reading it (`h2o_fn.retention.weigh`): what the model could not predict
        is kept first. 0: KVzip's scores as they are (and the logits are never made). 100
        finds more codes and names on natural text, and fewer of the most frequent words
        (BENCHMARKS, "Natural text").
      share: the share of a head's budget (0-1) given to the prompt's best windows of `width`
        tokens, kept whole in every layer and head (`share_windows`); the rest is spread as
        `budgets` says. 0: none; None (the default): `SHARE` where the budget is spread by one
        selection over every layer ("global", and "auto" below `LAYER_FROM`), 0 with "layer"
        and "uniform" ("uniform" refuses more: each head keeps its own budget by the eviction
        rule, which pools scores).
      width: tokens per window (>= 1).
      windows: at most this many windows in the prompt (>= 1; None: as many as `share` holds).
      within: `(start, total)` when `prompt_ids` is the slice from token `start` of a prompt of
        `total` tokens, read one slice per call (serve): the spread and the windows' room are the
        whole prompt's, so the slices keep what one call would (None: `prompt_ids` is the prompt).

    Returns `cache`, for chaining. Costs about two prefills (the repeat pass attends over
    the kept rows and the chunk and materialises its weights, SLICE floats at a time).
    """
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("prompt_ids is empty: expected at least one token")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} is invalid: expected >= 1")
    if budgets not in BUDGETS:
        raise ValueError(f"budgets={budgets!r} is invalid: expected one of {BUDGETS}")
    if tail < 1:
        raise ValueError(f"tail={tail} is invalid: expected >= 1 (slots for the tokens after the prompt)")
    if pool < 1 or pool % 2 == 0:
        raise ValueError(f"pool={pool} is invalid: expected an odd number >= 1 (1: no pooling)")
    if not 0 <= surprisal < float("inf"):  # as `retention.weigh`, before the passes: NaN and inf refused too
        raise ValueError(f"surprisal={surprisal} is invalid: expected a finite number >= 0 (0: scores as they are)")
    check_share(share)
    if budgets == "uniform" and share:
        raise ValueError(f"share={share} is invalid with budgets='uniform': expected 0 or None (windows are "
                         "shared by a selection across heads: 'global', 'layer' or 'auto')")
    if width < 1:
        raise ValueError(f"width={width} is invalid: expected >= 1 (tokens per window)")
    if windows is not None and windows < 1:
        raise ValueError(f"windows={windows} is invalid: expected >= 1 or None (no bound)")
    first, total = (0, len(ids)) if within is None else within
    if first < 0 or first + len(ids) > total:
        raise ValueError(f"within={within} is invalid: expected (start, total) with 0 <= start and start + "
                         f"{len(ids)} (the slice's tokens) <= total")
    layers = _layers(cache)
    budgets, share = reading_for(layers, total - first, budgets, share)
    for start in range(0, len(ids), chunk_size):
        passes = score_chunk(model, ids[start : start + chunk_size], layers, repeat_prefix, pool, surprisal)
        keep_chunk(passes, budgets, share, width, (first + min(start + chunk_size, len(ids))) / total, tail, cap,
                   windows)
        mx.eval([c.state for c in layers])  # nothing lazy is left: serve hands the cache across threads
    return cache


def keep_chunk(passes: List[ScoringPass], budgets: str, share: float = 0.0, width: int = WIDTH,
               part: float = 1.0, tail: int = TAIL, cap: Optional[int] = None,
               windows: Optional[int] = WINDOWS) -> None:
    """One scored chunk into its caches, as `cache_prompt` keeps each: its best windows shared by
    every head (`share_windows`, `part` the share of the prompt read with it), then every cache
    keeps its budget as `budgets` spreads it (`absorb_passes`). `budgets` and `share` as resolved
    for the whole prompt (`reading_for`)."""
    share_windows(passes, share, width, part, windows)
    absorb_passes(passes, budgets, tail, cap)


def spread_for(layers: Sequence[Any], n: int, budgets: str = "auto") -> str:
    """`budgets` as `absorb_passes` takes it: any but "auto" as given; "auto" is "layer" when
    every H2O layer's budget per head is at least `LAYER_FROM` of the tokens it will have
    read after `n` more, else "global"."""
    if budgets != "auto":
        return budgets
    h2o = [c for c in layers if isinstance(c, H2OKVCache)]
    shares = [c.target_budget / (c.tokens_seen + n) for c in h2o if c.tokens_seen + n]  # a quotient: exact at the edge
    return "layer" if all(share >= LAYER_FROM for share in shares) else "global"


def _body_and_head(model: nn.Module):
    """`(body, head, vocabulary)` where mlx-lm's layout names them (`model.model`, then `lm_head` or
    the tied embeddings): the hidden states, then the logits of a few of them at a time; else None."""
    body = getattr(model, "model", None)
    if body is None:
        return None
    if isinstance(getattr(model, "lm_head", None), nn.Module) and hasattr(model.lm_head, "weight"):
        return body, model.lm_head, model.lm_head.weight.shape[0]
    if getattr(getattr(model, "args", None), "tie_word_embeddings", False) and hasattr(body, "embed_tokens"):
        return body, body.embed_tokens.as_linear, body.embed_tokens.weight.shape[0]
    return None


def read(model: nn.Module, ids: mx.array, cache: List[Any], surprisals: bool) -> Optional[mx.array]:
    """The chunk `ids` `[1, N]` through `cache`; with `surprisals`, each token's surprisal `[1, N]`
    under the model reading it (`retention.surprisal`; the first token's prediction is the
    previous chunk's: NaN, which `weigh` counts as the mean). The logits are made SLICE floats at
    a time where the model's head is known (`_body_and_head`), else all at once; without
    `surprisals` the head never runs (None)."""
    if not surprisals:
        model(ids, cache=cache)
        return None
    N, split = ids.shape[1], _body_and_head(model)
    if split is None:  # the whole logits at once
        logits = model(ids, cache=cache)
        logits_of, step = (lambda a, b: logits[:, a:b]), N
    else:
        body, head, V = split
        hidden = body(ids, cache=cache)
        logits_of, step = (lambda a, b: head(hidden[:, a:b])), max(SLICE // V, 1)
    out = [mx.full((1, 1), mx.nan)]
    for a in range(0, N - 1, step):
        b = min(a + step, N - 1)
        out.append(retention.surprisal(logits_of(a, b), ids[:, a + 1 : b + 1]))
        mx.eval(out[-1])
    return mx.concatenate(out, axis=1)


def score_chunk(model: nn.Module, chunk: Sequence[int], layers: List[Any],
                repeat_prefix: Sequence[int] = (), pool: int = POOL, surprisal: float = SURPRISAL) -> List[ScoringPass]:
    """`cache_prompt`'s two passes over one chunk: the layers that are not H2O take it as
    usual; each H2O layer's `ScoringPass` holds the chunk's keys and values and the repeat
    pass's scores, nothing absorbed yet (`ScoringPass.absorb`, or `select_across` for
    all of them at once). The caches `layers` must come from one `make_h2o_cache` list."""
    prefix = [int(t) for t in repeat_prefix]
    chunk = [int(t) for t in chunk]
    with query_scoring(model):
        probes = [ScoringPass(c, pool, surprisal) if isinstance(c, H2OKVCache) else c for c in layers]
        surprisals = read(model, mx.array(chunk)[None], probes, surprisal > 0)
        mx.eval([p.chunk for p in probes if isinstance(p, ScoringPass)],
                [c.state for c in layers if not isinstance(c, H2OKVCache)])
        for p in probes:
            if isinstance(p, ScoringPass):
                p.surprisals = surprisals
        scratch = [p if isinstance(p, ScoringPass) else copy.deepcopy(p) for p in probes]
        model(mx.array(prefix + chunk)[None], cache=scratch)
    return [p for p in probes if isinstance(p, ScoringPass)]
