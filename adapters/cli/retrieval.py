"""Retrieval under two protocols, for `eval retrieval`.

- query-aware: the question is part of the prompt the cache compresses (its queries
  score the context while it is read); today's protocol.
- query-agnostic: the context is compressed first, then the question is fed and
  answered (kvpress's protocol; a prompt cache asked later). Every cache reads the
  context the same way except the repeat-pass rows, which compress it with
  `cache_prompt` (and "repeat-kvcache", which then re-lays it as plain KVCaches).

Each cache is a spec from `quality.specs.cache_specs` (family "repeat" for `cache_prompt`).
"""

import copy
import time
from typing import List, Sequence

import mlx.core as mx

from ..export import to_kvcache
from ..metrics import greedy
from ..retention import POOL, SURPRISAL, WIDTH, WINDOWS, cache_prompt

PROTOCOLS = ("aware", "agnostic")
PREFILL_STEP = 2048  # generate_step's prefill step: the context is one chunk here


def prefill(model, ids: Sequence[int], cache: list) -> None:
    """Feed `ids` through `cache` as `generate_step` prefills a prompt (steps of 2048)."""
    for i in range(0, len(ids), PREFILL_STEP):
        model(mx.array(ids[i : i + PREFILL_STEP])[None], cache=cache)
        mx.eval([c.state for c in cache])


def compress(model, spec: dict, ids: Sequence[int], cache: list, repeat_prefix: Sequence[int]) -> float:
    """Read `ids` into `cache` the way the spec's cache reads a prompt; returns seconds."""
    start = time.perf_counter()
    if spec["family"].startswith("repeat"):  # cache_prompt's rows (`quality.passkey.retrieval_specs`)
        cache_prompt(model, ids, cache, repeat_prefix=repeat_prefix, chunk_size=spec["chunk"],
                     budgets=spec.get("spread", "auto"), pool=spec.get("pool", POOL),
                     surprisal=spec.get("surprisal", SURPRISAL), share=spec.get("share"),
                     width=spec.get("width", WIDTH), windows=spec.get("windows", WINDOWS))
        if spec["family"] == "repeat-kvcache":  # what unmodified mlx-lm would load (cache-prompt --kvcache)
            cache[:] = to_kvcache(model, cache)
    else:
        prefill(model, ids, cache)
    return time.perf_counter() - start


def answer(model, spec: dict, cache: list, context: List[int], question: List[int], protocol: str,
           repeat_prefix: Sequence[int], n: int = 8) -> tuple:
    """`(n greedy tokens, seconds compressing)` after `context` then `question`.

    aware: everything but the question's last token is compressed, then decoding starts
    from that token (for prefilled caches this is what generate_step does with the whole
    prompt); agnostic: the context is compressed, then the question is the prompt."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r} is invalid: expected one of {PROTOCOLS}")
    read, ask = (context + question[:-1], question[-1:]) if protocol == "aware" else (context, question)
    seconds = compress(model, spec, read, cache, repeat_prefix)
    return greedy(model, ask, cache, n), seconds


def answers_per_question(model, spec: dict, cache: list, context: List[int], questions: List[List[int]],
                         repeat_prefix: Sequence[int], n: int = 8) -> List[List[int]]:
    """Compress `context` once (query-agnostic), then answer each question from its own
    `copy.deepcopy` of the compressed cache."""
    compress(model, spec, context, cache, repeat_prefix)
    return [greedy(model, q, copy.deepcopy(cache), n) for q in questions]


def peak_bytes(model, spec: dict, ids: Sequence[int], cache: list, repeat_prefix: Sequence[int]) -> int:
    """Bytes allocated above what was live before, at the peak of compressing `ids`
    (KV rows, activations and the scoring pass's weights; not the model's weights)."""
    mx.eval([c.state for c in cache])
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    compress(model, spec, ids, cache, repeat_prefix)
    return mx.get_peak_memory() - base
