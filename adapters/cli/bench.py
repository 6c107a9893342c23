"""`python -m h2o_fn bench`: speed, every figure a ratio measured side by side in one run.

- update: one layer's cache update per decode token (B=1, the model's KV heads
  and head_dim, float32): H2O `step` eager and compiled, the adapter, vs
  mlx-lm's KVCache and RotatingKVCache, at budgets 128..2048.
- decode: model decode tokens/s after a 1k/4k/8k-token context: full KVCache,
  RotatingKVCache and H2O (key, query) at one budget. H2O's step should stay
  flat as the context grows; the full cache's grows with it. With --explicit-baseline,
  also the rotating cache attending through the hook's explicit attention (what H2O's
  caches attend with on the CPU): how much of a ratio is the attention, not the cache.
  With --mx-ops-baseline, also H2O key and query running each decode token as the core's
  mlx ops beside the C++ ops the adapter takes on the CPU (`h2o_fn.metal_ops.cpu_step`).
- prefill: a 4,096-token prompt at budget 512: full vs H2O greedy vs oneshot, and the
  reading cost of `cache_prompt` (KVzip's repeat pass), with and without shared windows.
- profile: where a compiled decode step's time goes, part by part (the core's public
  parts: admit, key_weights, protected_argmin, evict, step; and admit + settle_key from
  the logits attention computed: what key scoring pays outside attention under the hook);
  then decode through 30 chained layers of cache + attention without the model, rotating
  beside H2O key and query with the paired ratio: the caches' share of a token, in seconds.

With --kv-bits B, decode and prefill (and update) add rows with H2O storing its rows in
B bits, and decode mlx-lm's QuantizedKVCache(B), next to the unquantized ones.

Writes results/bench/{bench.json, bench.md}.
"""

import argparse
import contextlib
import json
import statistics
import sys
import time
from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.base import scaled_dot_product_attention as base_attention
from mlx_lm.models.cache import RotatingKVCache

from h2o_fn import (
    absorb,
    absorb_staged,
    admit,
    compiled_step,
    evict,
    init,
    key_weights,
    protected_argmin,
    rewind,
    settle_key,
    step,
)
from h2o_fn import metal_ops
from h2o_fn.softmax import exp as fast_exp
from h2o_fn.softmax import softmax as fast_softmax

from .. import attention
from ..attention import query_scoring
from ..metrics import corpus_tokens
from ..mlx_lm import DEFAULT_PROMPT, H2OKVCache, make_h2o_cache
from ..retention import CHUNK, cache_prompt, repeat_prefix
from . import baselines, common
from .baselines import Baseline


def h2o_cache(model, config, **options) -> list:
    """`make_h2o_cache` with the commands' default prompt scoring (`DEFAULT_PROMPT`: bench
    has no --window/--pool flags) unless `options` say otherwise."""
    return make_h2o_cache(model, config, **{"prompt": DEFAULT_PROMPT, **options})


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() (fn evaluates what it computes)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ---------------------------------------------------------------- per-layer update


def _cache_call(cache, tok):
    """One timed call: update `cache` with `tok` and evaluate what it returns."""
    def go():
        k, v = cache.update_and_fetch(tok, tok)
        mx.eval(k, v)

    return go


def _core_call(fn, state):
    """One timed call: state <- fn(state), evaluated."""
    box = [state]

    def go():
        box[0] = fn(box[0])
        mx.eval(box[0])

    return go


def _adapter_at(cfg, context, tok, kv_bits: Optional[int] = None, kv_group_size: int = 64) -> H2OKVCache:
    adapter = H2OKVCache(cfg, kv_bits=kv_bits, kv_group_size=kv_group_size)
    adapter.update_and_fetch(context, context)
    adapter.update_and_fetch(tok, tok)
    mx.eval(adapter.core_state)
    return adapter


def _update_timings(cfg, budget: int, kv_bits: Optional[int], group_size: int, H: int, D: int,
                    repeats: int) -> dict:
    """Seconds per one-token update at `budget`: mlx-lm's caches, the core step, the adapter."""
    context, tok = mx.random.normal((1, H, budget, D)), mx.random.normal((1, H, 1, D))
    mx.eval(context, tok)
    full = baselines.layer_cache(Baseline("full"))
    full.update_and_fetch(context, context)
    rot = baselines.layer_cache(Baseline("rotating", budget=budget, keep=cfg.n_sink))
    rot.update_and_fetch(context, context)
    for _ in range(2):
        rot.update_and_fetch(tok, tok)
    mx.eval(full.state, rot.keys)
    adapter = _adapter_at(cfg, context, tok)
    state, fast = adapter.core_state, compiled_step(cfg)
    timings = {
        "KVCache": timed(_cache_call(full, tok), repeats),
        "RotatingKVCache": timed(_cache_call(rot, tok), repeats),
        "H2O step (eager)": timed(_core_call(lambda s: step(s, tok, tok, cfg), state), repeats),
        "H2O step (compiled)": timed(_core_call(lambda s: fast(s, tok, tok), state), repeats),
        "H2OKVCache.update_and_fetch": timed(_cache_call(adapter, tok), repeats),
    }
    if kv_bits:
        qadapter = _adapter_at(cfg, context, tok, kv_bits, group_size)
        qfast = compiled_step(cfg, kv=qadapter.policy.kv)
        timings[f"H2O step (compiled, {kv_bits}-bit)"] = timed(
            _core_call(lambda s: qfast(s, tok, tok), qadapter.core_state), repeats)
        timings[f"H2OKVCache.update_and_fetch ({kv_bits}-bit)"] = timed(_cache_call(qadapter, tok), repeats)
    return timings


def bench_update(configs, kv_bits: Optional[int], group_size: int = 64, H=3, D=64, repeats=200) -> list:
    """`configs`: budget -> the key-scoring H2O config at that budget."""
    rows = []
    for budget, cfg in configs.items():
        timings = _update_timings(cfg, budget, kv_bits, group_size, H, D, repeats)
        base = timings["KVCache"]
        for name, sec in timings.items():
            rows.append({"budget": budget, "cache": name, "us": sec * 1e6, "vs_kvcache": sec / base})
        print(
            f"update budget {budget:5d}: " + "  ".join(f"{n} {s * 1e6:.0f}us" for n, s in timings.items()),
            flush=True,
        )
    return rows


# ---------------------------------------------------------------- where a step's time goes


def bench_profile(configs, layers=30, repeats=60) -> list:
    """A decode step's parts, compiled, evaluated once per `layers` chained calls (as in a model:
    each layer its own state, so a part that reads the keys reads `layers` stores from memory).

    `configs`: budget -> the key-scoring H2O config at that budget. The parts are the
    core's public functions (`admit`, `key_weights`, `protected_argmin`, `evict`, `step`),
    beside two floors: one read of the keys, and the hook's softmax over attention's rows.
    """
    rows = []
    for budget, cfg in configs.items():
        ctx, tok = mx.random.normal((1, 3, budget, 64)), mx.random.normal((1, 3, 1, 64))
        start = absorb(init(cfg, 1, 3, 64, mx.float32), ctx, ctx, cfg)
        logits = mx.random.normal(start.scores.shape)  # as the hook's product hands them over
        query_logits = mx.random.normal((1, 3, 3, start.scores.shape[-1]))  # 9 query heads, 3 per KV head
        mx.eval(start, tok, logits, query_logits)
        parts = {
            "call + eval only": lambda s: s._replace(seen=s.seen + 1),
            "admit (write the row)": lambda s: admit(s, tok, tok),
            "read the keys once (a sum over D: what any pass over them costs)": lambda s: s._replace(
                scores=s.keys.sum(-1)),
            "proxy weights": lambda s: s._replace(scores=key_weights(s, tok)[..., 0, :]),
            "protected argmin": lambda s: s._replace(
                positions=s.positions
                + protected_argmin(s.scores, s.positions, s.seen, cfg.n_sink, cfg.grace)[..., None]
            ),
            "evict (argmin + free the slot)": lambda s: evict(s._replace(length=s.length + 1), cfg),
            "mx.exp of C scores per KV head (mlx's CPU exponential)": lambda s: s._replace(
                scores=mx.exp(-s.scores)),
            "h2o_fn.softmax.exp of C scores per KV head (the proxy's)": lambda s: s._replace(
                scores=fast_exp(-s.scores)),
            "h2o_fn.softmax over 3 query rows per KV head (the hook's attention weights)": lambda s: s._replace(
                scores=fast_softmax(query_logits)[:, :, 0]),
            "step": lambda s: step(s, tok, tok, cfg),
            "admit + settle_key from attention's logits (the step outside attention, hooked)": lambda s: settle_key(
                admit(s, tok, tok), tok, cfg, logits=logits),
        }
        for name, part in parts.items():
            rows.append({"budget": budget, "part": name,
                         "us_per_layer": _chained(mx.compile(part), start, layers, repeats)})
        rows += _staged_rows(cfg, ctx, budget, layers, repeats)
        held = []  # an extra reference to the keys: MLX must copy the cache instead of writing in place
        rows.append({
            "budget": budget,
            "part": "step, keys also referenced (forces a copy)",
            "us_per_layer": _chained(mx.compile(lambda s: step(s, tok, tok, cfg)), start, layers, repeats,
                                     hold=held),
        })
        print(
            f"profile budget {budget}: "
            + "  ".join(f"{r['part']} {r['us_per_layer']:.0f}us" for r in rows if r["budget"] == budget),
            flush=True,
        )
    return rows


def bench_layers(configs, layers: int = 30, rounds: int = 4, steps: int = 16, past: int = 64) -> list:
    """Decode tokens through `layers` chained layers of cache + attention, without the model:
    RotatingKVCache (mlx-lm's attention) beside H2O key and query (the hook's), each layer
    holding `budget + past` tokens (read in chunks of 512). A layer's output is the next one's
    queries, and its first KV heads' rows the next keys and values: one chain, as in a model.
    Rounds interleave the caches; 'paired' is the median over rounds of rotating's time over
    this cache's.

    `configs`: budget -> the key-scoring H2O config at that budget (B=1, 9 query heads over
    3 KV heads, D=64: the bundled model's shape)."""
    hooked = attention.hooked(base_attention)
    rows = []
    for budget, cfg in configs.items():
        ctx = mx.random.normal((1, 9, budget + past, 64), key=mx.random.key(budget))
        kinds = {
            f"RotatingKVCache({budget}, keep={cfg.n_sink})":
                lambda: baselines.layer_cache(Baseline("rotating", budget=budget, keep=cfg.n_sink)),
            f"H2O key ({budget})": lambda: H2OKVCache(cfg, prompt=DEFAULT_PROMPT),
            f"H2O query ({budget})": lambda: H2OKVCache(cfg._replace(scoring="query"), prompt=DEFAULT_PROMPT),
        }
        caches = {name: [build() for _ in range(layers)] for name, build in kinds.items()}
        for cache in caches.values():
            for i in range(0, ctx.shape[2], 512):
                mx.eval(_through_layers(hooked, cache, ctx[:, :, i : i + 512]))
        times = {name: [] for name in caches}
        x = ctx[:, :, -1:]
        for _ in range(rounds):
            for name, cache in caches.items():
                mx.eval(_through_layers(hooked, cache, x))  # a warm token
                t = time.perf_counter()
                for _ in range(steps):
                    mx.eval(_through_layers(hooked, cache, x))
                times[name].append((time.perf_counter() - t) / steps * 1e3)
        rotating = times[next(iter(times))]
        for name, ms in times.items():
            median = statistics.median(ms)
            rows.append({"budget": budget, "cache": name, "ms_per_token": median,
                         "us_per_layer": median * 1e3 / layers, "paired": _paired_ratio(rotating, ms)})
        print(f"layers budget {budget}: " + "  ".join(
            f"{r['cache']} {r['us_per_layer']:.0f}us ({r['paired']:.2f}x)" for r in rows if r["budget"] == budget),
            flush=True)
    return rows


def _through_layers(attend, caches, x: mx.array) -> mx.array:
    """x `[1, 9, N, 64]` through one cache + attention per layer: the last layer's output."""
    mask = create_attention_mask(x.transpose(0, 2, 1, 3), caches[0])
    for cache in caches:
        keys, values = cache.update_and_fetch(x[:, :3], x[:, 3:6])
        x = attend(x, keys, values, cache=cache, scale=0.125, mask=mask)
    return x


def _staged_rows(cfg, ctx, budget: int, layers: int, repeats: int, k: int = 8) -> list:
    """evict_every = k, per token: k admits (row writes) then the k judged as one chunk, in
    place (`absorb_staged`, what the adapter runs; key scoring under the hook, from the
    proxy's logits attention computed) and by `absorb` from the state before them (every
    row of the C slots rewritten), and that absorb alone."""
    tok8 = mx.random.normal((1, 3, k, 64))
    start8 = absorb(init(cfg, 1, 3, 64, mx.float32, room=k), ctx, ctx, cfg)
    logits8 = mx.random.normal((1, 3, k, start8.scores.shape[-1]))  # as the hook hands them over while staging
    mx.eval(start8, logits8)

    def admitted(s):
        for i in range(k):
            s = admit(s, tok8[:, :, i : i + 1], tok8[:, :, i : i + 1])
        return s

    parts = {
        f"oneshot absorb of {k} staged tokens, per token": lambda s: absorb(s, tok8, tok8, cfg),
        f"{k} admits + absorb from before them, per token": lambda s: absorb(rewind(admitted(s), k), tok8, tok8, cfg),
        f"{k} admits + absorb_staged (in place), per token": lambda s: absorb_staged(admitted(s), tok8, tok8, cfg),
        f"{k} admits + absorb_staged from attention's logits (hooked), per token": lambda s: absorb_staged(
            admitted(s), tok8, tok8, cfg, logits=logits8),
    }
    return [{"budget": budget, "part": name, "us_per_layer": _chained(mx.compile(fn), start8, layers, repeats) / k}
            for name, fn in parts.items()]


def _chained(fn, start, layers, repeats, hold=None) -> float:
    states, times = [_copied(start) for _ in range(layers)], []
    mx.eval(states)
    for _ in range(repeats):
        if hold is not None:
            hold[:] = [s.keys for s in states]
        t = time.perf_counter()
        states = [fn(s) for s in states]
        mx.eval(states)
        times.append(time.perf_counter() - t)
    return statistics.median(times[min(5, len(times) - 1):]) / layers * 1e6


def _copied(tree):
    """A copy of every array in a state (nested tuples of arrays): a layer's own buffers."""
    if isinstance(tree, tuple):
        return type(tree)(*map(_copied, tree)) if hasattr(tree, "_fields") else tuple(map(_copied, tree))
    return tree + mx.zeros((), tree.dtype)  # a new buffer with the same values


# ---------------------------------------------------------------- model decode / prefill


def fill(model, cache, tokens, chunk: int) -> float:
    """Prefill `tokens` through `cache` in chunks; seconds."""
    ids = mx.array(tokens)
    t = time.perf_counter()
    for i in range(0, len(tokens), chunk):
        model(ids[None, i : i + chunk], cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - t


def decode_rate(model, cache, start: int, steps: int, warm: int = 8) -> float:
    """Greedy decode `warm` tokens, then `steps` more; mean seconds per token of those.

    The mean, not the median: with evict_every = k the steps differ (k - 1 row writes,
    then one chunk scored), and a user waits for all of them; `steps` should be a multiple
    of k."""
    y = mx.array([[start]])

    def one(y):
        logits = model(y, cache=cache)
        y = mx.argmax(logits[:, -1], axis=-1, keepdims=True)
        mx.eval(y)
        return y

    for _ in range(warm):
        y = one(y)
    t = time.perf_counter()
    for _ in range(steps):
        y = one(y)
    return (time.perf_counter() - t) / steps


class ExplicitRotating(RotatingKVCache):
    """A RotatingKVCache that attends through the hook's explicit attention (under
    `explicit_attention`): the rotating baseline with the attention H2O's caches use."""


@contextlib.contextmanager
def explicit_attention(model):
    """Inside the block, `ExplicitRotating` caches of `model` attend with
    `attention.attention_with_weights`; every other cache as before."""
    saved = [(m, getattr(m, attention.NAME)) for m in attention.model_modules(model)]
    for module, inner in saved:
        def sdpa(queries, keys, values, cache, scale, mask, sinks=None, inner=inner):
            if isinstance(cache, ExplicitRotating):
                return attention.attention_with_weights(queries, keys, values, scale, mask, sinks)[0]
            return inner(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

        setattr(module, attention.NAME, sdpa)
    try:
        yield model
    finally:
        for module, inner in saved:
            setattr(module, attention.NAME, inner)


def caches_at(model, policy, budget: int, kv_bits: Optional[int], group_size: int,
              evict_every: Sequence[int] = (), explicit: bool = False, mx_ops: bool = False) -> dict:
    """name -> a function building that cache: the decode section's rows.

    `policy(budget, **changes)` gives the H2O config; the rotating baseline keeps as many
    first tokens as its n_sink. `explicit`: add `ExplicitRotating` (needs `explicit_attention`).
    `mx_ops`: add H2O key and query with each decode token as mlx ops (`mx_ops_argmin`) beside the
    C++ ops (`h2o_fn.metal_ops.cpu_step`)."""
    key, query = policy(budget, scoring="key"), policy(budget, scoring="query")
    rotating = Baseline("rotating", budget=budget, keep=key.n_sink)
    out = {
        "full KVCache": lambda: baselines.build(model, Baseline("full")),
        rotating.name: lambda: baselines.build(model, rotating),
        f"H2O key ({budget})": lambda: h2o_cache(model, key),
        f"H2O query ({budget})": lambda: h2o_cache(model, query),
    }
    if mx_ops:
        out[f"H2O key ({budget}, mx ops)"] = lambda: h2o_cache(model, key, argmin=mx_ops_argmin)
        out[f"H2O query ({budget}, mx ops)"] = lambda: h2o_cache(model, query, argmin=mx_ops_argmin)
    if explicit:
        out[f"{rotating.name}, explicit attention"] = lambda: [
            ExplicitRotating(max_size=budget, keep=key.n_sink) for _ in model.layers]
    for k in evict_every:  # decode tokens scored k at a time
        out[f"H2O key ({budget}, evict_every {k})"] = lambda k=k: h2o_cache(model, key, evict_every=k)
        out[f"H2O query ({budget}, evict_every {k})"] = lambda k=k: h2o_cache(model, query, evict_every=k)
    if kv_bits:
        quantized = Baseline("quantized", bits=kv_bits, group_size=group_size)
        out[quantized.name] = lambda: baselines.build(model, quantized)
        out[f"H2O key ({budget}, {kv_bits}-bit)"] = lambda: h2o_cache(
            model, key, kv_bits=kv_bits, kv_group_size=group_size)
        out[f"H2O query ({budget}, {kv_bits}-bit)"] = lambda: h2o_cache(
            model, query, kv_bits=kv_bits, kv_group_size=group_size)
    return out


def mx_ops_argmin(*args, **kwargs):
    """The adapter's eviction op (`h2o_fn.metal_ops.protected_argmin`, its victim mask included)
    under another name: `cpu_step.fused` takes only the rule's own ops, so a cache evicting with
    this one runs each decode token as the core's mlx ops (`--mx-ops-baseline`)."""
    return metal_ops.protected_argmin(*args, **kwargs)


mx_ops_argmin.victims = metal_ops.protected_argmin.victims


PAST = 400  # with several decode budgets, tokens past a budget when no --contexts exceeds it


def decode_contexts(contexts: Sequence[int], budget: int, several: bool) -> List[int]:
    """The contexts one budget decodes after: every one of `contexts`, or with several budgets
    those longer than the budget (a cache below its budget evicts nothing), else budget + PAST."""
    if not several:
        return list(contexts)
    return [n for n in contexts if n > budget] or [budget + PAST]


def bench_decode(model, tokens, contexts, caches: dict, steps, chunk, rounds: int = 1) -> list:
    """Per context: every cache prefilled, then `rounds` rounds that each decode `steps`
    tokens with every cache in turn (the machine's drift then falls on all of them alike);
    a row's ms/token is the median over its rounds, with the fastest and slowest round."""
    rows = []
    for n in contexts:
        if rounds == 1:  # one cache alive at a time
            built = {}
            for name, make in caches.items():
                cache = make()
                built[name] = (fill(model, cache, tokens[:n], chunk), [decode_rate(model, cache, tokens[n], steps)])
        else:
            live = {name: make() for name, make in caches.items()}
            built = {name: (fill(model, cache, tokens[:n], chunk), []) for name, cache in live.items()}
            for _ in range(rounds):
                for name, cache in live.items():
                    built[name][1].append(decode_rate(model, cache, tokens[n], steps))
        for name, (fill_s, secs) in built.items():
            sec = statistics.median(secs)
            rows.append({"context": n, "cache": name, "step_ms": sec * 1e3, "tok_s": 1 / sec, "fill_s": fill_s,
                         "rounds_ms": [s * 1e3 for s in secs]})
            print(f"decode ctx {n:5d} {name:32s} {sec * 1e3:7.1f} ms/token ({1 / sec:5.2f} tok/s), rounds "
                  f"{min(secs) * 1e3:.1f}-{max(secs) * 1e3:.1f}", flush=True)
    return rows


def read_prompt(model, tokens, cache, prefix, share) -> float:
    """`cache_prompt` of `tokens` into `cache` (its defaults; `share` of the budget in shared windows, None:
    its default); seconds."""
    t = time.perf_counter()
    cache_prompt(model, tokens, cache, repeat_prefix=prefix, share=share)
    return time.perf_counter() - t


def bench_prefill(model, tokens, policy, budget, kv_bits, group_size, chunk, repeats, prefix=()) -> list:
    """Each cache reads `tokens` (in steps of `chunk`; `cache_prompt`'s rows in its own chunks of
    CHUNK, with the repeat instruction `prefix`), the best of `repeats`: seconds and peak."""
    oneshot = lambda scoring, **options: lambda: h2o_cache(model, policy(budget, scoring=scoring, prefill="oneshot"),
                                                           **options)
    variants = {
        "full KVCache": lambda: baselines.build(model, Baseline("full")),
        f"H2O key greedy ({budget})": lambda: h2o_cache(model, policy(budget, scoring="key", prefill="greedy")),
        f"H2O key oneshot ({budget})": oneshot("key"),
        f"H2O query oneshot ({budget})": oneshot("query"),
    }
    if kv_bits:
        for scoring in ("key", "query"):
            variants[f"H2O {scoring} oneshot ({budget}, {kv_bits}-bit)"] = oneshot(
                scoring, kv_bits=kv_bits, kv_group_size=group_size)
    reads = {}  # rows read otherwise than by `fill`: cache_prompt as it is, and without shared windows
    for share in (None, 0.0):
        name = f"H2O cache_prompt ({budget}, chunks of {CHUNK}{'' if share is None else ', no shared windows'})"
        variants[name] = oneshot("query")
        reads[name] = lambda cache, share=share: read_prompt(model, tokens, cache, prefix, share)
    rows = []
    for name, make in variants.items():
        runs = []
        for _ in range(repeats):
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            cache = make()
            seconds = reads[name](cache) if name in reads else fill(model, cache, tokens, chunk)
            runs.append((seconds, mx.get_peak_memory() - base))
        sec, peak = min(runs)
        rows.append({"cache": name, "tokens": len(tokens), "chunk": chunk, "seconds": sec, "peak_bytes": peak})
        print(f"prefill {len(tokens)} tokens {name:30s} {sec:7.2f} s, peak {peak / 2**20:7.1f} MiB above the weights",
              flush=True)
    for r in rows:
        r["vs_full"] = r["seconds"] / rows[0]["seconds"]
        r["peak_vs_full"] = r["peak_bytes"] / rows[0]["peak_bytes"]
    return rows


# ---------------------------------------------------------------- report


def render_profile(rows: list) -> List[str]:
    return common.section(
        "Where a decode step's time goes (compiled, one eval per 30 chained layers)",
        "budget:r | part:l | us per layer:r",
        [(r["budget"], r["part"], f"{r['us_per_layer']:.0f}") for r in rows],
    )


def render_layers(rows: list) -> List[str]:
    return common.section(
        "Decode through 30 layers of cache + attention, no model (B=1, 9 query / 3 KV heads, D=64)",
        "budget:r | cache:l | ms/token:r | us per layer:r | vs rotating, paired:r",
        [(r["budget"], r["cache"], f"{r['ms_per_token']:.2f}", f"{r['us_per_layer']:.0f}", f"{r['paired']:.2f}x")
         for r in rows],
        notes=["rounds interleave the caches; 'paired' is the median over rounds of the rotating cache's "
               "time over this cache's; the model's matmuls, norms and RoPE are not in it"],
    )


def render_update(rows: list) -> List[str]:
    return common.section(
        "Per-layer update, one decode token (B=1, H=3, D=64, float32)",
        "budget:r | cache:l | us/call:r | vs KVCache:r",
        [(r["budget"], r["cache"], f"{r['us']:.0f}", f"{r['vs_kvcache']:.2f}") for r in rows],
    )


def render_decode(d: dict) -> List[str]:
    first = {}  # (budget, context) -> its rows: the first two are full and rotating
    for r in d["rows"]:
        first.setdefault((r.get("budget", d["budget"]), r["context"]), []).append(r)
    budgets = ", ".join(map(str, d.get("budgets", [d["budget"]])))
    return common.section(
        f"Model decode after a context (budget {budgets}, prefill chunks of {d['chunk']})",
        "budget:r | context:r | cache:l | ms/token:r | tokens/s:r | vs full:r | vs rotating:r | "
        "vs rotating, paired:r | rounds (ms):r",
        [
            (b, n, r["cache"], f"{r['step_ms']:.1f}", f"{r['tok_s']:.2f}",
             f"{r['step_ms'] / first[b, n][0]['step_ms']:.2f}",
             f"{first[b, n][1]['step_ms'] / r['step_ms']:.2f}x speed",
             _paired(first[b, n][1].get("rounds_ms", []), r.get("rounds_ms", [])),
             _spread(r.get("rounds_ms", [])))
            for r in d["rows"] for b, n in [(r.get("budget", d["budget"]), r["context"])]
        ],
        notes=[f"{d.get('rounds', 1)} rounds of {d.get('steps', '?')} steps per cache, every cache in turn "
               "each round; ms/token is the median round; 'paired' is the median over rounds of the "
               "rotating cache's time over this cache's in the same round (the machine's drift cancels)"]
        if d.get("rounds", 1) > 1 else (),
    )


def _paired_ratio(rotating_ms: List[float], ms: List[float]) -> float:
    """Median over rounds of rotating / this cache, each round against its own."""
    return statistics.median(a / b for a, b in zip(rotating_ms, ms))


def _paired(rotating_ms: List[float], ms: List[float]) -> str:
    """`_paired_ratio` as the table prints it (or '' without rounds to pair)."""
    if len(ms) < 2 or len(rotating_ms) != len(ms):
        return ""
    return f"{_paired_ratio(rotating_ms, ms):.2f}x"


def _spread(ms: List[float]) -> str:
    return f"{min(ms):.1f}-{max(ms):.1f}" if len(ms) > 1 else ""


def render_prefill(rows: list) -> List[str]:
    return common.section(
        f"Prefill (chunks of {rows[0].get('chunk', '?')} tokens; peak: mx.get_peak_memory() above what was live "
        "before, i.e. KV rows, activations and scoring weights, not the model's weights)",
        "cache:l | tokens:r | seconds:r | vs full:r | peak MiB:r | peak vs full:r",
        [(r["cache"], r["tokens"], f"{r['seconds']:.2f}", f"{r['vs_full']:.2f}",
          f"{r['peak_bytes'] / 2**20:.1f}" if "peak_bytes" in r else "-",
          f"{r['peak_vs_full']:.2f}" if "peak_bytes" in r else "-") for r in rows],
    )


RENDER = {"profile": render_profile, "layers": render_layers, "update": render_update, "decode": render_decode,
          "prefill": render_prefill}
SECTIONS = ("update", "profile", "decode", "prefill")


def markdown(results: dict) -> str:
    return common.report("Speed", results, RENDER)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m h2o_fn bench", description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="*", default=list(SECTIONS),
                        help=f"sections to run, any of: {' '.join(SECTIONS)} (default: all)")
    common.add_run_flags(parser, "results/bench")
    common.add_policy_flags(parser, ("budget", "n_sink", "grace", "decay", "kv_bits", "kv_group_size"),
                            budget_help="the H2O and rotating budget of decode and prefill (default "
                            f"{common.DEFAULT_CONFIG.budget})")
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512, 1024, 2048],
                        help="budgets of the per-layer update (default 128 ... 2048)")
    parser.add_argument("--repeats", type=int, default=200,
                        help="timed calls per update row (profile: a quarter)")
    parser.add_argument("--profile-budgets", type=int, nargs="+", default=[512, 4096],
                        help="budgets of profile (default 512 4096)")
    parser.add_argument("--decode-budgets", type=int, nargs="+", metavar="B",
                        help="decode: one table row group per budget, in one run (default: --budget); with "
                        f"several, each decodes after the --contexts longer than it, else after B + {PAST}")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192],
                        help="context lengths before decode (default 1024 4096 8192)")
    parser.add_argument("--steps", type=int, default=32,
                        help="decode steps timed per row, after 8 untimed (mean; a multiple of each K of "
                        "--evict-every-rows)")
    parser.add_argument("--evict-every-rows", type=int, nargs="*", default=[8], metavar="K",
                        help="extra decode rows with H2O scoring decode tokens K at a time (evict_every; "
                        "default 8)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="decode: R > 1 keeps every cache alive and times R rounds of --steps with each "
                        "in turn (the median round; the machine's drift falls on all alike); default 1")
    parser.add_argument("--explicit-baseline", action="store_true",
                        help="decode: add the rotating cache attending through the hook's explicit attention "
                             "(what H2O's caches attend with on the CPU)")
    parser.add_argument("--mx-ops-baseline", action="store_true",
                        help="decode: add H2O key and query with their decode tokens as mlx ops (the core's path) "
                             "beside the C++ ops (metal_ops/cpu_step.py) the adapter takes on the CPU")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk size before decode")
    parser.add_argument("--prefill-tokens", type=int, default=4096, help="prompt length of prefill")
    parser.add_argument("--prefill-chunk", type=int, default=2048, help="mlx-lm's default prefill_step_size")
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    parser = setup_arg_parser()
    args = common.parse_sections(parser, argv, SECTIONS)
    if args.kv_bits and "update" in args.what and 64 % args.kv_group_size:
        parser.error(f"--kv-group-size {args.kv_group_size} does not divide the update section's head_dim 64")
    policy = lambda budget, **changes: common.policy_or_error(parser, args, budget, **changes)
    keyed = lambda budgets: {b: policy(b, scoring="key") for b in budgets}
    for budget in {*args.budgets, *args.profile_budgets, args.budget, *(args.decode_budgets or [])}:
        policy(budget)  # a bad combination fails before any work
    argv = list(sys.argv[1:] if argv is None else argv)
    out, header = common.start_run("bench", argv, args)
    previous = out / "bench.json"  # sections from earlier runs stay unless this run redoes them
    results = {**(json.loads(previous.read_text()) if previous.exists() else {}), **header}
    if "update" in args.what:
        results["update"] = bench_update(keyed(args.budgets), args.kv_bits, args.kv_group_size, repeats=args.repeats)
    if "profile" in args.what:
        results["profile"] = bench_profile(keyed(args.profile_budgets), repeats=max(args.repeats // 4, 6))
        results["layers"] = bench_layers(keyed(args.profile_budgets), rounds=max(args.rounds, 3), steps=args.steps)
    if "decode" in args.what or "prefill" in args.what:
        model, tokenizer = common.load_or_exit("bench", args.model, dequantize=not args.quantized)
        need = max(args.contexts + [args.prefill_tokens] + [b + PAST for b in args.decode_budgets or []]) + 1
        tokens = corpus_tokens(tokenizer, need)
        explicit = explicit_attention(model) if args.explicit_baseline else contextlib.nullcontext()
        with explicit, query_scoring(model):  # the hooks live for this command only
            if "decode" in args.what:
                budgets, rows = args.decode_budgets or [args.budget], []
                for budget in budgets:
                    caches = caches_at(model, policy, budget, args.kv_bits, args.kv_group_size,
                                       args.evict_every_rows, args.explicit_baseline, args.mx_ops_baseline)
                    rows += [{"budget": budget, **r} for r in bench_decode(
                        model, tokens, decode_contexts(args.contexts, budget, len(budgets) > 1), caches,
                        args.steps, args.chunk, args.rounds)]
                results["decode"] = {"budget": budgets[0], "budgets": budgets, "chunk": args.chunk,
                                     "kv_bits": args.kv_bits, "rounds": args.rounds, "steps": args.steps,
                                     "rows": rows}
            if "prefill" in args.what:
                results["prefill"] = bench_prefill(model, tokens[: args.prefill_tokens], policy, args.budget,
                                                   args.kv_bits, args.kv_group_size, args.prefill_chunk, 1,
                                                   repeat_prefix(tokenizer))
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    (out / "bench.md").write_text(markdown(results))
    print("\n" + markdown(results))
    print(f"wrote {out}/bench.json, bench.md")
