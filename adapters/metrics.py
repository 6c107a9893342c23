"""Measurements shared by the commands and the tests: this module imports no command.

- prompts: `build_prompt` (chat template or raw text), `passkey_prompt`, `corpus_tokens`;
- quality: `streaming_ppl`, `greedy`, `first_divergence`, `repeated_4grams`, `longest_run`;
- memory: `kv_fraction` (KV bytes as a fraction of a float16 full cache);
- the oracle: `oracle_mass`, the attention mass each query's best k keys hold, read
  through the attention hook by a recording cache (`MassRecorder`).

Example:
    >>> repeated_4grams([7, 7, 7, 7, 7]), longest_run([5, 5, 5, 2]), first_divergence([1, 2], [1, 3])
    (0.5, 3, 1)
    >>> round(kv_fraction(kept=512, seen=2048, bits=8, group_size=64), 4)
    0.1328
"""

import math
import random
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

from h2o_fn import Storage

from .attention import query_scoring

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


# ---------------------------------------------------------------- prompts and texts


def build_prompt(tokenizer, prompt: str, chat: bool = True, system: Optional[str] = None) -> List[int]:
    """Token ids of `prompt`: through the tokenizer's chat template when it has one and
    `chat`, else the raw text."""
    if chat and tokenizer.chat_template is not None:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(prompt)


def corpus_tokens(tokenizer, n: int, text_file=None) -> List[int]:
    """The first n tokens of a text file, or of CPython's pydoc topics (ships everywhere)."""
    if text_file:
        text = Path(text_file).read_text()
    else:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer.encode(text)
    if len(ids) < n:
        raise ValueError(f"the text has {len(ids)} tokens: expected at least --tokens={n}")
    return ids[:n]


HAYSTACKS = ("noise", "pydoc", "pydoc-inline")  # what hides a pass key (`haystack_tokens`)
_PYDOC: Dict[int, List[int]] = {}  # tokenizer id -> CPython's pydoc topics, tokenized once


def haystack_tokens(tokenizer, n: int, haystack: str, seed: int) -> List[int]:
    """`n` filler tokens: "noise" is RULER's repeated sentences (every filler token has
    identical copies: the easy haystack); "pydoc" and "pydoc-inline" are natural text, n
    tokens of CPython's pydoc topics from an offset drawn with `seed`."""
    if haystack == "noise":
        return tokenizer.encode(FILLER * (n // 20 + 2))[:n]
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack={haystack!r} is invalid: expected one of {HAYSTACKS}")
    if id(tokenizer) not in _PYDOC:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
        _PYDOC[id(tokenizer)] = tokenizer.encode(text[:400_000], add_special_tokens=False)
    ids = _PYDOC[id(tokenizer)]
    if len(ids) < n:
        raise ValueError(f"n={n} filler tokens is invalid: the pydoc text has {len(ids)}")
    start = random.Random(seed).randrange(0, len(ids) - n + 1)
    return ids[start : start + n]


def passkey_prompt(tokenizer, depth: float, n_filler: int, key: str, haystack: str = "noise") -> List[int]:
    """`n_filler` tokens of filler (`haystack_tokens`) with a pass key hidden at `depth`
    (0 = start, 1 = end), then the question. In "pydoc" the key's sentences stand on a line
    of their own; in "noise" and "pydoc-inline" they sit in the running text."""
    filler = haystack_tokens(tokenizer, n_filler, haystack, seed=int(key))
    cut = int(depth * len(filler))
    text = f"The pass key is {key}. Remember it. {key} is the pass key."
    needle = tokenizer.encode(f"\n{text}\n" if haystack == "pydoc" else f" {text} ", add_special_tokens=False)
    return filler[:cut] + needle + filler[cut:] + tokenizer.encode(PASSKEY_QUESTION)


PASSKEY_QUESTION = " What is the pass key? The pass key is"
FACTS = ("door", "safe", "locker", "vault")  # words the filler does not use


def facts_prompt(tokenizer, n_filler: int, codes: List[str]):
    """`n_filler` tokens of filler with one code per name of FACTS (as many as `codes`)
    spread evenly through it; returns `(context ids, [question ids per code])`."""
    filler = tokenizer.encode(FILLER * (n_filler // 20 + 2))[:n_filler]
    names = FACTS[: len(codes)]
    if len(codes) > len(FACTS):
        raise ValueError(f"{len(codes)} codes is invalid: expected at most {len(FACTS)} (one per name of FACTS)")
    ids, last = [], 0
    for i, (name, code) in enumerate(zip(names, codes)):
        cut = (i + 1) * len(filler) // (len(codes) + 1)
        ids += filler[last:cut] + tokenizer.encode(
            f" The code of the {name} is {code}. Remember it. {code} is the code of the {name}. ")
        last = cut
    questions = [tokenizer.encode(f" What is the code of the {name}? The code of the {name} is") for name in names]
    return ids + filler[last:], questions


# ---------------------------------------------------------------- quality


def streaming_ppl(model, cache, tokens: List[int], chunk: int) -> dict:
    """Feed `tokens` in chunks through `cache`, scoring every next token.

    Returns ppl, mean nll, tokens scored, wall seconds, and `kept` (the most tokens
    any layer holds at the end, `held_tokens`).
    """
    ids = mx.array(tokens)
    nll, count, start = mx.array(0.0), 0, time.perf_counter()
    for i in range(0, len(tokens) - 1, chunk):
        x = ids[i : min(i + chunk, len(tokens) - 1)]
        logits = model(x[None], cache=cache)[0].astype(mx.float32)
        y = ids[i + 1 : i + 1 + x.size]
        nll = nll + nn.losses.cross_entropy(logits, y, reduction="sum")
        count += x.size
        mx.eval(nll, [c.state for c in cache])
    mean = nll.item() / count
    return {
        "ppl": math.exp(mean),
        "nll": mean,
        "tokens": count,
        "seconds": time.perf_counter() - start,
        "kept": max(held_tokens(c) for c in cache),
    }


def held_tokens(cache) -> int:
    """Tokens one layer's cache holds now (mlx-lm's QuantizedKVCache has no size(): its offset)."""
    return cache.size() or getattr(cache, "offset", 0)


def kept_summary(layers) -> dict:
    """What H2O layers (one cache list's `H2OKVCache`s) keep, batch row 0: tokens in all, per
    KV head on average, the least and the most in one head, each layer's budget, and the
    budget per head the caches were built with (`target`). Reads the states: not for a
    decode loop.

    Example:
        >>> from h2o_fn import H2OConfig
        >>> from h2o_fn.adapters.cache import H2OKVCache
        >>> import mlx.core as mx
        >>> c = H2OKVCache(H2OConfig(budget=8, n_sink=1, grace=2, scoring="key"))
        >>> _ = c.update_and_fetch(mx.zeros((1, 2, 5, 4)), mx.zeros((1, 2, 5, 4)))
        >>> kept_summary([c])
        {'total': 10, 'mean': 5.0, 'least': 5, 'most': 5, 'budgets': [8], 'target': 8, 'heads': 2}
    """
    per_head = [n for c in layers for n in (c.tokens_per_head[0] if c.tokens_per_head else [])]
    return {"total": sum(per_head), "mean": sum(per_head) / max(len(per_head), 1), "least": min(per_head, default=0),
            "most": max(per_head, default=0), "budgets": [c.config.budget for c in layers],
            "target": layers[0].target_budget if layers else 0, "heads": len(per_head)}


def describe_kept(summary: dict) -> str:
    """One line for `kept_summary`: "16 per layer and KV head" when every head keeps the
    same, else the mean and the spread (budgets across heads, `cache_prompt`)."""
    if summary["least"] == summary["most"]:
        return f"{summary['most']} per layer and KV head"
    return (f"{summary['mean']:.1f} per layer and KV head on average ({summary['total']} in {summary['heads']} "
            f"heads, {summary['least']} to {summary['most']} in one head: the budget {summary['target']} spread "
            "where the scores are)")


def greedy(model, prompt_ids: List[int], cache, n: int, prefill_step_size: int = 2048) -> List[int]:
    """The first `n` greedy tokens after the prompt (mlx-lm's `generate_step`)."""
    steps = generate_step(
        mx.array(prompt_ids), model, max_tokens=n, prompt_cache=cache, prefill_step_size=prefill_step_size
    )
    return [t for t, _ in steps]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first differing token, or None when one is a prefix of the other."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def repeated_4grams(ids: Sequence[int]) -> float:
    """Fraction of 4-grams that already occurred earlier in the sequence (0 = no repetition)."""
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def longest_run(ids: Sequence[int]) -> int:
    """The longest run of one token repeated back to back."""
    best = run = 1 if ids else 0
    for a, b in zip(ids, ids[1:]):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return best


# ---------------------------------------------------------------- memory


def kv_fraction(kept: int, seen: int, bits: Optional[int] = None, group_size: int = 64) -> float:
    """Key/value bytes of `kept` rows over those of a float16 full cache of `seen` tokens.

    Quantized rows (mlx's affine quantization, as mlx-lm's `QuantizedKVCache` and H2O
    with `kv_bits` store them) cost `bits` per element plus a float16 scale and bias per
    group: kept/seen x (bits + 32/group)/16 (`Storage.bytes_per_element`).
    """
    return kept / seen * Storage(bits, group_size).bytes_per_element(model_bits=16)


def h2o_overhead_fraction(kept: int, seen: int, row_elements: int) -> float:
    """H2O's float32 score and int32 position per kept token and head, over the float16
    full cache's key + value row (`row_elements` = Dk + Dv elements of 2 bytes)."""
    return kept / seen * 8 / (2 * row_elements)


# ---------------------------------------------------------------- the oracle


class MassRecorder(KVCache):
    """A full cache that asks the attention hook for its weights and records, for the
    queries at positions >= `start`, the attention mass of each query's best k keys.

    It speaks the hook's protocol (`wants_weights`, `can_take`, `kv_heads`,
    `receive_weights`), so `query_scoring(model)` hands it the explicit attention
    weights of every forward pass. The hook averages the weights over the query heads
    sharing each of `kv_heads` groups: with `query_heads` given, the recorder asks for
    one group per query head (each query head's own weights) and averages them per KV
    head itself, so it records both bounds; without it, only the KV-head one.
    """

    wants_weights = True

    def __init__(self, budgets: Sequence[int], start: int, query_heads: Optional[int] = None):
        super().__init__()
        self.budgets, self.start, self.query_heads = list(budgets), start, query_heads
        self.mass: Dict[str, List[float]] = {}

    @property
    def kv_heads(self) -> int:
        return self.query_heads or self.keys.shape[1]

    def can_take(self, keys) -> bool:
        return True

    def receive_weights(self, weights: mx.array) -> None:
        """Weights `[B, kv_heads, N, L]` of one forward pass over the whole text (offset 0)."""
        w = weights[:, :, self.start :]
        if self.query_heads:
            B, Hq, N, L = w.shape
            H = self.keys.shape[1]
            self.mass["query"] = _top_mass(w, self.budgets)
            w = w.reshape(B, H, Hq // H, N, L).mean(axis=2)
        self.mass["kv"] = _top_mass(w, self.budgets)


def _top_mass(weights: mx.array, budgets: Sequence[int]) -> List[float]:
    """Mean over queries and heads of the mass on each query's k largest weights."""
    top = mx.cumsum(mx.sort(weights, axis=-1)[..., ::-1], axis=-1)
    return [top[..., min(k, top.shape[-1]) - 1].mean().item() for k in budgets]


def query_head_count(model) -> Optional[int]:
    """The model's query heads per layer, when its args say (mlx-lm models' `args`)."""
    args = getattr(model, "args", None)
    return getattr(args, "num_attention_heads", None)


def oracle_mass(model, tokens: List[int], budgets: Sequence[int], start: int) -> List[dict]:
    """Attention mass the best k keys capture, per query, with the full cache (an upper bound).

    One forward pass over `tokens` through `MassRecorder` caches under the attention hook
    (explicit float32 attention). Per layer: "query", each query head's own best k keys
    (when the model's query head count is known); "kv", the best k keys of the weights
    averaged over the query heads sharing a KV head, the bound for a cache that keeps one
    set per KV head, as H2O does (lower or equal). Any cache that keeps k tokens captures
    at most this; H2O keeps one set for all later queries, so less.
    """
    heads = query_head_count(model)
    caches = [MassRecorder(budgets, start, heads) for _ in model.layers]
    with query_scoring(model):
        model(mx.array(tokens)[None], cache=caches)
    rows = []
    for i, c in enumerate(caches):
        row = {"layer": i, "kv": {str(k): v for k, v in zip(budgets, c.mass["kv"])}}
        if "query" in c.mass:
            row.update({str(k): v for k, v in zip(budgets, c.mass["query"])})
        rows.append(row)
    return rows
