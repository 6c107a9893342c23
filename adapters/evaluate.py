"""`python -m h2o_fn eval`: quality of H2O against the caches a user would otherwise pick.

Three measurements on a real model (default SmolLM2-135M-Instruct), each cache
at the same budget: mlx-lm's full `KVCache` (the ceiling), `RotatingKVCache`
with keep=4 (StreamingLLM), H2O with the key proxy and with true queries, and
grace/decay ablations.

- ppl: streaming perplexity. A long real text (CPython's `pydoc_data.topics`)
  is fed in fixed chunks through the cache and every next token is scored.
- agree: greedy continuations of chat prompts; tokens until the first
  divergence from the full cache, and the fraction of repeated 4-grams.
- retrieval: a pass key hidden in filler at several depths, asked for at the end.
- plots: perplexity vs budget, and a kept-positions map for one layer/head.

Writes results/eval/{eval.json, eval.md, *.png}; prints progress and tables.
"""

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache

from h2o_fn import H2OConfig, kept_positions

from .runs import add_run_flags, section, start_run
from .attention import attention_with_weights, install_query_hook, model_modules, remove_query_hook
from .cli import build_prompt, config_for, first_divergence
from .gguf import load_gguf
from .mlx_lm import make_h2o_cache

PROMPTS = [
    "Explain photosynthesis in detail.",
    "Write a short story about a robot who learns to paint.",
    "Explain how a computer's CPU executes a program, step by step.",
    "What were the main causes of the French Revolution? Answer in detail.",
]
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. " "There and back again. "


# ---------------------------------------------------------------- caches


def cache_specs(budgets: List[int], ablations: bool, prefills=("oneshot",)) -> List[dict]:
    """Every cache to compare: name, family, budget, and the H2O config where there is one."""
    specs = [{"name": "full KVCache", "family": "full", "budget": None}]
    for b in budgets:
        specs.append({"name": "RotatingKVCache keep=4", "family": "rotating", "budget": b})
        for scoring in ("key", "query"):
            for prefill in prefills:
                cfg = config_for(b, scoring=scoring, prefill=prefill)
                specs.append(
                    {
                        "name": f"H2O {scoring}" + (f" {prefill}" if len(prefills) > 1 else ""),
                        "family": f"h2o-{scoring}",
                        "budget": b,
                        "config": cfg,
                    }
                )
    if ablations:
        b = budgets[min(1, len(budgets) - 1)]
        for scoring in ("key", "query"):
            base = config_for(b, scoring=scoring)
            for label, change in (
                ("grace=0 decay=1 (Algorithm 1)", dict(n_sink=0, grace=0, decay=1.0)),
                ("grace=0", dict(grace=0)),
                ("decay=1", dict(decay=1.0)),
            ):
                specs.append(
                    {
                        "name": f"H2O {scoring} {label}",
                        "family": f"ablation-{scoring}",
                        "budget": b,
                        "config": base._replace(**change),
                    }
                )
    return specs


def build_cache(model: nn.Module, spec: dict) -> list:
    if spec["family"] == "full":
        return [KVCache() for _ in model.layers]
    if spec["family"] == "rotating":
        return [RotatingKVCache(max_size=spec["budget"], keep=4) for _ in model.layers]
    return make_h2o_cache(model, spec["config"])


def describe(spec: dict) -> dict:
    out = {k: spec[k] for k in ("name", "family", "budget")}
    if "config" in spec:
        out["config"] = spec["config"]._asdict()
    return out


# ---------------------------------------------------------------- measurements


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


def streaming_ppl(model, cache, tokens: List[int], chunk: int) -> dict:
    """Feed `tokens` in chunks through `cache`, scoring every next token."""
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
        "kept": max(c.size() for c in cache),
    }


def repeated_4grams(ids: List[int]) -> float:
    """Fraction of 4-grams that already occurred earlier in the sequence (0 = no repetition)."""
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def longest_run(ids: List[int]) -> int:
    best = run = 1 if ids else 0
    for a, b in zip(ids, ids[1:]):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return best


def greedy(model, prompt_ids: List[int], cache, n: int, prefill_step_size=2048) -> List[int]:
    steps = generate_step(
        mx.array(prompt_ids), model, max_tokens=n, prompt_cache=cache, prefill_step_size=prefill_step_size
    )
    return [t for t, _ in steps]


def passkey_prompt(tokenizer, depth: float, n_filler: int, key: str) -> List[int]:
    filler = tokenizer.encode(FILLER * (n_filler // 20 + 2))[:n_filler]
    cut = int(depth * len(filler))
    needle = tokenizer.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = tokenizer.encode(" What is the pass key? The pass key is")
    return filler[:cut] + needle + filler[cut:] + question


def sweep(model, tokens, budget: int, chunk: int) -> List[dict]:
    """True-query oneshot at one budget: decay, grace and the GQA reduction varied one at a time."""
    base = config_for(budget, scoring="query", prefill="oneshot")
    variants = [("defaults", base, "mean")]
    variants += [(f"decay={d}", base._replace(decay=d), "mean") for d in (0.95, 0.99, 0.995, 1.0)]
    variants += [(f"grace={g}", base._replace(grace=g), "mean") for g in (32, 64) if base.n_sink + g < budget]
    variants += [("GQA max", base, "max")]
    rows = []
    for label, cfg, reduce in variants:
        remove_query_hook(model)
        install_query_hook(model, reduce)
        r = {
            "name": label,
            "budget": budget,
            "config": cfg._asdict(),
            "gqa": reduce,
            **streaming_ppl(model, make_h2o_cache(model, cfg), tokens, chunk),
        }
        rows.append(r)
        print(f"sweep {label:20s} budget {budget}  {r['ppl']:.3f}", flush=True)
    remove_query_hook(model)
    return rows


def oracle_mass(model, tokens, budgets, start: int) -> List[dict]:
    """Attention mass the best k keys capture, per query, with the full cache (an upper bound).

    One forward pass over `tokens` with explicit attention; for every query at
    position >= start and every layer, the share of its attention mass on its own
    top-k keys. Any cache that keeps k tokens captures at most this (H2O keeps one
    set for all later queries, so less).
    """
    stats = []
    original = {m: m.scaled_dot_product_attention for m in model_modules(model)}

    def recording(queries, keys, values, cache, scale, mask, sinks=None):
        out, w = attention_with_weights(queries, keys, values, scale, mask, sinks)
        top = mx.cumsum(mx.sort(w[:, :, start:], axis=-1)[..., ::-1], axis=-1)  # [B, Hq, N', L]
        stats.append([top[..., k - 1].mean().item() for k in budgets])
        return out

    try:
        for m in original:
            m.scaled_dot_product_attention = recording
        model(mx.array(tokens)[None], cache=[KVCache() for _ in model.layers])
    finally:
        for m, fn in original.items():
            m.scaled_dot_product_attention = fn
    return [{"layer": i, **{str(k): v for k, v in zip(budgets, row)}} for i, row in enumerate(stats)]


# ---------------------------------------------------------------- plots


def plot_ppl(rows: List[dict], full_ppl: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    names = [
        n
        for n in dict.fromkeys(
            r["name"] for r in rows if r["budget"] and not r["family"].startswith("ablation")
        )
    ]
    for name in names:
        pts = sorted((r["budget"], r["ppl"]) for r in rows if r["name"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.axhline(full_ppl, color="k", ls="--", lw=1, label="full KVCache")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("budget (tokens kept per layer)")
    ax.set_ylabel("streaming perplexity")
    ax.set_title("Perplexity vs budget (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def kept_map(model, tokenizer, config: H2OConfig, steps: int, layer: int) -> List[List[int]]:
    """Kept positions of (layer, head 0) after each decode step of the photosynthesis prompt."""
    cache = make_h2o_cache(model, config)
    ids = build_prompt(tokenizer, PROMPTS[0], True)
    rows = []
    for _, _ in zip(generate_step(mx.array(ids), model, max_tokens=steps, prompt_cache=cache), range(steps)):
        rows.append([p for p in kept_positions(cache[layer].core_state)[0, 0].tolist() if p >= 0])
    return rows


def plot_kept(maps: Dict[str, List[List[int]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(maps), figsize=(5.5 * len(maps), 4.5), sharey=True)
    width = max(max(r) for rows in maps.values() for r in rows) + 1  # one position axis for all
    for ax, (title, rows) in zip(np.atleast_1d(axes), maps.items()):
        img = np.zeros((len(rows), width))
        for i, r in enumerate(rows):
            img[i, r] = 1
        ax.imshow(img, aspect="auto", origin="lower", cmap="Greys", interpolation="nearest")
        ax.set_xlabel("token position (black: kept)")
        ax.set_title(title, fontsize=9)
    np.atleast_1d(axes)[0].set_ylabel("decode step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- report


def markdown(results: dict) -> str:
    out = [f"# Quality ({results['model']}, weights {results['weights']})", "", results["blas"], ""]
    if "ppl" in results:
        p = results["ppl"]
        full = p["full_ppl"]
        out += section(
            f"Streaming perplexity: {p['tokens']} tokens of {p['text']}, chunks of {p['chunk']}",
            "cache:l | budget:r | ppl:r | vs full:r | wall s (not a benchmark):r",
            [
                (
                    r["name"],
                    r["budget"],
                    f"{r['ppl']:.3f}",
                    f"{100 * (r['ppl'] / full - 1):+.1f}%",
                    f"{r['seconds']:.1f}",
                )
                for r in p["rows"]
                if r["budget"]
            ],
            p["command"],
            [f"Full KVCache: **{full:.3f}**"],
        )
    if "mass" in results:
        m = results["mass"]
        mean = lambda k: sum(r[str(k)] for r in m["rows"]) / len(m["rows"])
        worst = lambda k: min(r[str(k)] for r in m["rows"])
        out += section(
            f"Oracle attention mass: the best k keys per query (full cache, queries >= {m['start']})",
            "k:r | mean over layers:r | worst layer:r",
            [(k, f"{mean(k):.4f}", f"{worst(k):.4f}") for k in m["budgets"]],
            m["command"],
            ["Upper bound for any cache keeping k tokens (each query picks its own best k)."],
        )
    if "sweep" in results:
        w = results["sweep"]
        out += section(
            f"Sweep: H2O query oneshot at budget {w['budget']}, one change at a time",
            "variant:l | ppl:r | vs full:r",
            [
                (r["name"], f"{r['ppl']:.3f}", f"{100 * (r['ppl'] / w['full_ppl'] - 1):+.1f}%")
                for r in w["rows"]
            ],
            w["command"],
            [f"Full KVCache: {w['full_ppl']:.3f}"],
        )
    if "agree" in results:
        a = results["agree"]
        out += section(
            f"Generation agreement: {len(a['prompts'])} chat prompts, {a['tokens']} greedy tokens",
            "cache:l | budget:r | agree (mean):r | per prompt:l | repeated 4-grams:r | longest run:r",
            [
                (
                    r["name"],
                    r["budget"],
                    f"{r['agree_mean']:.1f}",
                    r["agree"],
                    f"{r['repeat_mean']:.3f}",
                    r["longest_run"],
                )
                for r in a["rows"]
            ],
            a["command"],
            [
                "Tokens until the first divergence from the full cache (mean over prompts; "
                f"{a['tokens']} = never diverged), repeated 4-grams (full cache: "
                f"{a['full_repeat']:.3f}) and the longest single-token run."
            ],
        )
    if "retrieval" in results:
        r = results["retrieval"]
        out += section(
            f"Pass-key retrieval: {r['context']} tokens, depths {r['depths']}, {r['trials']} keys each",
            "cache:l | budget:r | accuracy:r",
            [(row["name"], row["budget"] or "-", f"{row['accuracy']:.2f}") for row in r["rows"]],
            r["command"],
        )
    return "\n".join(out)


def main(argv=None) -> None:
    argv = list(sys.argv[2:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m h2o_fn eval", description=__doc__.split("\n")[0])
    parser.add_argument(
        "what",
        nargs="*",
        default=["ppl", "agree", "retrieval", "plots", "sweep", "mass"],
        help="any of: ppl agree retrieval plots sweep mass (default: all)",
    )
    add_run_flags(parser, "results/eval")
    parser.add_argument("--tokens", type=int, default=2048, help="perplexity text length")
    parser.add_argument("--text-file", default=None, help="perplexity text (default: pydoc topics)")
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument(
        "--prefills",
        nargs="+",
        default=["greedy", "oneshot"],
        choices=["greedy", "oneshot"],
        help="H2O prefill modes to compare in ppl (agree and retrieval use oneshot)",
    )
    parser.add_argument("--no-ablations", action="store_true")
    parser.add_argument("--sweep-budget", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=160)
    parser.add_argument("--gen-budgets", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--passkey-context", type=int, default=768)
    parser.add_argument("--passkey-budgets", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--map-steps", type=int, default=200)
    args = parser.parse_args(argv)
    out, header = start_run("eval", argv, args)
    previous = out / "eval.json"  # sections from earlier runs stay unless this run redoes them
    results = {**(json.loads(previous.read_text()) if previous.exists() else {}), **header}
    model, tokenizer = load_gguf(args.model, dequantize=not args.quantized)

    if "ppl" in args.what:
        tokens = corpus_tokens(tokenizer, args.tokens, args.text_file)
        rows = []
        for spec in cache_specs(args.budgets, not args.no_ablations, tuple(args.prefills)):
            r = {**describe(spec), **streaming_ppl(model, build_cache(model, spec), tokens, args.chunk)}
            rows.append(r)
            print(
                f"ppl  {r['name']:40s} budget {str(r['budget']):>5s}  {r['ppl']:9.3f}  ({r['seconds']:.0f}s)",
                flush=True,
            )
        full = rows[0]["ppl"]
        results["ppl"] = {
            "command": header["command"],
            "tokens": args.tokens,
            "chunk": args.chunk,
            "full_ppl": full,
            "rows": rows,
            "text": args.text_file or "pydoc_data.topics",
        }
        if "plots" in args.what:
            plot_ppl(rows, full, out / "ppl_vs_budget.png")

    if "sweep" in args.what:
        tokens = corpus_tokens(tokenizer, args.tokens, args.text_file)
        full = streaming_ppl(model, [KVCache() for _ in model.layers], tokens, args.chunk)["ppl"]
        results["sweep"] = {
            "command": header["command"],
            "budget": args.sweep_budget,
            "full_ppl": full,
            "rows": sweep(model, tokens, args.sweep_budget, args.chunk),
        }

    if "mass" in args.what:
        tokens = corpus_tokens(tokenizer, args.tokens, args.text_file)
        results["mass"] = {
            "command": header["command"],
            "budgets": args.budgets,
            "start": args.tokens // 2,
            "rows": oracle_mass(model, tokens, args.budgets, args.tokens // 2),
        }

    if "agree" in args.what:
        prompts = [build_prompt(tokenizer, p, True) for p in PROMPTS[: args.prompts]]
        fulls = [greedy(model, p, [KVCache() for _ in model.layers], args.gen_tokens) for p in prompts]
        rows = []
        for spec in cache_specs(args.gen_budgets, False):
            if spec["family"] == "full":
                continue
            outs = [greedy(model, p, build_cache(model, spec), args.gen_tokens) for p in prompts]
            agree = [first_divergence(o, f) for o, f in zip(outs, fulls)]
            agree = [args.gen_tokens if a is None else a for a in agree]
            rows.append(
                {
                    **describe(spec),
                    "agree": agree,
                    "agree_mean": sum(agree) / len(agree),
                    "repeat": [repeated_4grams(o) for o in outs],
                    "repeat_mean": sum(map(repeated_4grams, outs)) / len(outs),
                    "longest_run": max(map(longest_run, outs)),
                    "samples": [tokenizer.decode(o) for o in outs],
                }
            )
            print(
                f"agree {rows[-1]['name']:40s} budget {spec['budget']:5d}  {agree}  "
                f"repeat {rows[-1]['repeat_mean']:.3f}",
                flush=True,
            )
        results["agree"] = {
            "command": header["command"],
            "tokens": args.gen_tokens,
            "prompts": PROMPTS[: args.prompts],
            "rows": rows,
            "full_repeat": sum(map(repeated_4grams, fulls)) / len(fulls),
            "full_samples": [tokenizer.decode(f) for f in fulls],
        }

    if "retrieval" in args.what:
        rng = random.Random(0)
        keys = [str(rng.randint(10000, 99999)) for _ in range(args.trials)]
        cases = [
            (d, k, passkey_prompt(tokenizer, d, args.passkey_context, k)) for d in args.depths for k in keys
        ]
        rows = []
        for spec in cache_specs(args.passkey_budgets, False):
            hits = [
                k in tokenizer.decode(greedy(model, ids, build_cache(model, spec), 8)) for _, k, ids in cases
            ]
            rows.append(
                {
                    **describe(spec),
                    "accuracy": sum(hits) / len(hits),
                    "by_depth": {
                        str(d): sum(h for (dd, _, _), h in zip(cases, hits) if dd == d) / len(keys)
                        for d in args.depths
                    },
                }
            )
            print(
                f"passkey {spec['name']:38s} budget {str(spec['budget']):>5s}  {rows[-1]['accuracy']:.2f}",
                flush=True,
            )
        results["retrieval"] = {
            "command": header["command"],
            "context": len(cases[0][2]),
            "depths": args.depths,
            "trials": args.trials,
            "rows": rows,
        }

    if "plots" in args.what:
        layer = len(model.layers) // 2
        b = min(args.gen_budgets)
        maps = {
            f"grace=0, decay=1.0 (Algorithm 1), budget {b}": kept_map(
                model, tokenizer, H2OConfig(budget=b, n_sink=0, grace=0, decay=1.0), args.map_steps, layer
            ),
            f"defaults (n_sink=4, grace={config_for(b).grace}, decay=0.98), budget {b}": kept_map(
                model, tokenizer, config_for(b), args.map_steps, layer
            ),
        }
        plot_kept(maps, out / "kept_positions.png")
        results["kept_map"] = {
            "command": header["command"],
            "layer": layer,
            "head": 0,
            "final": {k: v[-1] for k, v in maps.items()},
        }

    (out / "eval.json").write_text(json.dumps(results, indent=1))
    (out / "eval.md").write_text(markdown(results))
    print("\n" + markdown(results))
    print(f"wrote {out}/eval.json, eval.md" + (", *.png" if "plots" in args.what else ""))
