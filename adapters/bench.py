"""`python -m h2o_fn bench`: speed, every figure a ratio measured side by side in one run.

- update: one layer's cache update per decode token (B=1, the model's KV heads
  and head_dim, float32): H2O `step` eager and compiled, the adapter, vs
  mlx-lm's KVCache and RotatingKVCache, at budgets 128..2048.
- decode: model decode tokens/s after a 1k/4k/8k-token context: full KVCache,
  RotatingKVCache and H2O (key, query) at one budget. H2O's step should stay
  flat as the context grows; the full cache's grows with it.
- prefill: a 4,096-token prompt at budget 512: full vs H2O greedy vs oneshot.

Writes results/bench/{bench.json, bench.md}.
"""

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from h2o_fn import compiled_step, step

from .runs import add_run_flags, section, start_run
from .cli import config_for
from .evaluate import corpus_tokens
from .gguf import load_gguf
from .mlx_lm import H2OKVCache, make_h2o_cache


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() (fn evaluates what it computes)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ---------------------------------------------------------------- per-layer update


def bench_update(budgets, H=3, D=64, repeats=200) -> list:
    rows = []
    rand = lambda n: mx.random.normal((1, H, n, D))
    for budget in budgets:
        cfg = config_for(budget)
        context = rand(budget)
        tok = rand(1)
        mx.eval(context, tok)

        full = KVCache()
        full.update_and_fetch(context, context)
        rot = RotatingKVCache(max_size=budget, keep=4)
        rot.update_and_fetch(context, context)
        for _ in range(2):
            rot.update_and_fetch(tok, tok)
        adapter = H2OKVCache(cfg)
        adapter.update_and_fetch(context, context)
        adapter.update_and_fetch(tok, tok)
        state = adapter.core_state
        fast = compiled_step(cfg)
        mx.eval(full.state, rot.keys, state)

        def cache_call(cache):
            def go():
                k, v = cache.update_and_fetch(tok, tok)
                mx.eval(k, v)

            return go

        def core_call(fn):
            box = [state]

            def go():
                box[0] = fn(box[0])
                mx.eval(box[0])

            return go

        timings = {
            "KVCache": timed(cache_call(full), repeats),
            "RotatingKVCache": timed(cache_call(rot), repeats),
            "H2O step (eager)": timed(core_call(lambda s: step(s, tok, tok, cfg)), repeats),
            "H2O step (compiled)": timed(core_call(lambda s: fast(s, tok, tok)), repeats),
            "H2OKVCache.update_and_fetch": timed(cache_call(adapter), repeats),
        }
        base = timings["KVCache"]
        for name, sec in timings.items():
            rows.append({"budget": budget, "cache": name, "us": sec * 1e6, "vs_kvcache": sec / base})
        print(
            f"update budget {budget:5d}: " + "  ".join(f"{n} {s * 1e6:.0f}us" for n, s in timings.items()),
            flush=True,
        )
    return rows


# ---------------------------------------------------------------- where a step's time goes


def bench_profile(budgets=(512, 4096), layers=30, repeats=60) -> list:
    """A decode step's parts, compiled, evaluated once per `layers` chained calls (as in a model)."""
    from h2o_fn import absorb, init
    from h2o_fn.core import _proxy_weights, admit, evict, protected_argmin

    rows = []
    for budget in budgets:
        cfg = config_for(budget)
        ctx, tok = mx.random.normal((1, 3, budget, 64)), mx.random.normal((1, 3, 1, 64))
        start = absorb(init(cfg, 1, 3, 64, mx.float32), ctx, ctx, cfg)
        mx.eval(start, tok)
        parts = {
            "call + eval only": lambda s: s._replace(seen=s.seen + 1),
            "admit (write the row)": lambda s: admit(s, tok, tok),
            "proxy weights": lambda s: s._replace(
                scores=_proxy_weights(s.keys, s.positions >= 0, tok)[..., 0, :]
            ),
            "protected argmin": lambda s: s._replace(
                positions=s.positions
                + protected_argmin(s.scores, s.positions, s.seen, cfg.n_sink, cfg.grace)[..., None]
            ),
            "evict (argmin + free the slot)": lambda s: evict(s._replace(length=s.length + 1), cfg),
            "step": lambda s: step(s, tok, tok, cfg),
        }
        for name, part in parts.items():
            rows.append(
                {
                    "budget": budget,
                    "part": name,
                    "us_per_layer": _chained(mx.compile(part), start, layers, repeats),
                }
            )
        held = []  # an extra reference to the keys: MLX must copy the cache instead of writing in place
        rows.append(
            {
                "budget": budget,
                "part": "step, keys also referenced (forces a copy)",
                "us_per_layer": _chained(
                    mx.compile(lambda s: step(s, tok, tok, cfg)), start, layers, repeats, hold=held
                ),
            }
        )
        print(
            f"profile budget {budget}: "
            + "  ".join(f"{r['part']} {r['us_per_layer']:.0f}us" for r in rows if r["budget"] == budget),
            flush=True,
        )
    return rows


def _chained(fn, start, layers, repeats, hold=None) -> float:
    states, times = [start] * layers, []
    for _ in range(repeats):
        if hold is not None:
            hold[:] = [s.keys for s in states]
        t = time.perf_counter()
        states = [fn(s) for s in states]
        mx.eval(states)
        times.append(time.perf_counter() - t)
    return statistics.median(times[5:]) / layers * 1e6


# ---------------------------------------------------------------- model decode / prefill


def fill(model, cache, tokens, chunk: int) -> float:
    """Prefill `tokens` through `cache` in chunks; seconds."""
    ids = mx.array(tokens)
    t = time.perf_counter()
    for i in range(0, len(tokens), chunk):
        model(ids[None, i : i + chunk], cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - t


def decode_rate(model, cache, start: int, steps: int) -> float:
    """Greedy decode `steps` tokens after the context; seconds per token (median)."""
    y = mx.array([[start]])
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        logits = model(y, cache=cache)
        y = mx.argmax(logits[:, -1], axis=-1, keepdims=True)
        mx.eval(y)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def caches_at(model, budget: int):
    return {
        "full KVCache": lambda: [KVCache() for _ in model.layers],
        f"RotatingKVCache({budget}, keep=4)": lambda: [
            RotatingKVCache(max_size=budget, keep=4) for _ in model.layers
        ],
        f"H2O key ({budget})": lambda: make_h2o_cache(model, config_for(budget, prefill="oneshot")),
        f"H2O query ({budget})": lambda: make_h2o_cache(
            model, config_for(budget, scoring="query", prefill="oneshot")
        ),
    }


def bench_decode(model, tokens, contexts, budget, steps, chunk) -> list:
    rows = []
    for n in contexts:
        for name, make in caches_at(model, budget).items():
            cache = make()
            fill_s = fill(model, cache, tokens[:n], chunk)
            sec = decode_rate(model, cache, tokens[n], steps)
            rows.append(
                {"context": n, "cache": name, "step_ms": sec * 1e3, "tok_s": 1 / sec, "fill_s": fill_s}
            )
            print(
                f"decode ctx {n:5d} {name:32s} {sec * 1e3:7.1f} ms/token ({1 / sec:5.2f} tok/s)", flush=True
            )
    return rows


def bench_prefill(model, tokens, budget, chunk, repeats) -> list:
    rows = []
    variants = {
        "full KVCache": lambda: [KVCache() for _ in model.layers],
        f"H2O key greedy ({budget})": lambda: make_h2o_cache(model, config_for(budget, prefill="greedy")),
        f"H2O key oneshot ({budget})": lambda: make_h2o_cache(model, config_for(budget, prefill="oneshot")),
        f"H2O query oneshot ({budget})": lambda: make_h2o_cache(
            model, config_for(budget, scoring="query", prefill="oneshot")
        ),
    }
    for name, make in variants.items():
        sec = min(fill(model, make(), tokens, chunk) for _ in range(repeats))
        rows.append({"cache": name, "tokens": len(tokens), "seconds": sec})
        print(f"prefill {len(tokens)} tokens {name:30s} {sec:7.2f} s", flush=True)
    base = rows[0]["seconds"]
    for r in rows:
        r["vs_full"] = r["seconds"] / base
    return rows


# ---------------------------------------------------------------- report


def markdown(results: dict) -> str:
    out = [f"# Speed ({results['model']}, weights {results['weights']})", "", results["blas"], ""]
    if "profile" in results:
        out += section(
            "Where a decode step's time goes (compiled, one eval per 30 chained layers)",
            "budget:r | part:l | us per layer:r",
            [(r["budget"], r["part"], f"{r['us_per_layer']:.0f}") for r in results["profile"]],
        )
    if "update" in results:
        out += section(
            "Per-layer update, one decode token (B=1, H=3, D=64, float32)",
            "budget:r | cache:l | us/call:r | vs KVCache:r",
            [
                (r["budget"], r["cache"], f"{r['us']:.0f}", f"{r['vs_kvcache']:.2f}")
                for r in results["update"]
            ],
        )
    if "decode" in results:
        d = results["decode"]
        first = {}  # context -> (full, rotating) step times: the first two rows of each context
        for r in d["rows"]:
            first.setdefault(r["context"], []).append(r["step_ms"])
        out += section(
            f"Model decode after a context (budget {d['budget']}, prefill chunks of {d['chunk']})",
            "context:r | cache:l | ms/token:r | tokens/s:r | vs full:r | vs rotating:r",
            [
                (
                    r["context"],
                    r["cache"],
                    f"{r['step_ms']:.1f}",
                    f"{r['tok_s']:.2f}",
                    f"{r['step_ms'] / first[r['context']][0]:.2f}",
                    f"{first[r['context']][1] / r['step_ms']:.2f}x speed",
                )
                for r in d["rows"]
            ],
        )
    if "prefill" in results:
        out += section(
            "Prefill",
            "cache:l | tokens:r | seconds:r | vs full:r",
            [
                (r["cache"], r["tokens"], f"{r['seconds']:.2f}", f"{r['vs_full']:.2f}")
                for r in results["prefill"]
            ],
        )
    return "\n".join(out)


def main(argv=None) -> None:
    argv = list(sys.argv[2:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m h2o_fn bench", description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="*", default=["update", "profile", "decode", "prefill"])
    add_run_flags(parser, "results/bench")
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--profile-budgets", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--prefill-chunk", type=int, default=2048, help="mlx-lm's default prefill_step_size")
    args = parser.parse_args(argv)
    out, header = start_run("bench", argv, args)
    previous = out / "bench.json"  # sections from earlier runs stay unless this run redoes them
    results = {**(json.loads(previous.read_text()) if previous.exists() else {}), **header}
    if "update" in args.what:
        results["update"] = bench_update(args.budgets, repeats=args.repeats)
    if "profile" in args.what:
        results["profile"] = bench_profile(args.profile_budgets, repeats=max(args.repeats // 4, 6))
    if "decode" in args.what or "prefill" in args.what:
        model, tokenizer = load_gguf(args.model, dequantize=not args.quantized)
        need = max(args.contexts + [args.prefill_tokens]) + 1
        tokens = corpus_tokens(tokenizer, need)
    if "decode" in args.what:
        results["decode"] = {
            "budget": args.budget,
            "chunk": args.chunk,
            "rows": bench_decode(model, tokens, args.contexts, args.budget, args.steps, args.chunk),
        }
    if "prefill" in args.what:
        results["prefill"] = bench_prefill(
            model, tokens[: args.prefill_tokens], args.budget, args.prefill_chunk, 1
        )
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    (out / "bench.md").write_text(markdown(results))
    print("\n" + markdown(results))
    print(f"wrote {out}/bench.json, bench.md")
