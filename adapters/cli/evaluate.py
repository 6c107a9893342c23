"""`python -m h2o_fn eval`: quality of H2O against the caches a user would otherwise pick.

Each section measures one thing on a real model (default: the bundled
SmolLM2-135M-Instruct) and returns its results; rendering (markdown, plots) reads
only those results. Caches are compared at the same budget: mlx-lm's full `KVCache`
(the ceiling), `RotatingKVCache` keeping as many first tokens as H2O's n_sink
(StreamingLLM), H2O with the key proxy and with true queries.

- ppl: streaming perplexity. A long real text (CPython's `pydoc_data.topics`) is fed
  in fixed chunks through the cache and every next token is scored; plus grace/decay
  ablations.
- frontier: streaming perplexity against KV bytes (fraction of a float16 full cache):
  full, mlx-lm's QuantizedKVCache, RotatingKVCache, H2O (key, query) x (kv_bits) x budgets.
- agree: greedy continuations of chat prompts; tokens until the first divergence from
  the full cache, repeated 4-grams, longest single-token run.
- retrieval: a pass key hidden in filler at several depths, asked for at the end, with
  the question inside the compressed prompt (query-aware) or after it (query-agnostic),
  plus cache_prompt's repeat-pass rows; several codes in one context compressed once and
  asked one by one.
- peak: peak memory while reading a long prompt, full prefill against cache_prompt.
- sweep: true-query H2O at one budget, decay, grace and the GQA reduction varied.
- mass: the oracle, the attention mass each query's best k keys hold (full cache).
- plots: a kept-positions map for one layer/head (and perplexity vs budget).

Writes results/eval/{eval.json, eval.md, *.png}; sections of earlier runs stay in
eval.json unless this run redoes them.
"""

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from h2o_fn import H2OConfig, kept_positions
from h2o_fn.allocation import POLICIES

from ..attention import install_query_hook, query_scoring, remove_query_hook
from ..metrics import (
    build_prompt,
    corpus_tokens,
    first_divergence,
    greedy,
    h2o_overhead_fraction,
    kv_fraction,
    longest_run,
    oracle_mass,
    PASSKEY_QUESTION,
    facts_prompt,
    passkey_prompt,
    repeated_4grams,
    streaming_ppl,
)
from .. import allocation
from ..mlx_lm import h2o_caches, h2o_layer_count, make_h2o_cache
from ..retention import CHUNK, repeat_prefix
from . import baselines, common, plots
from .baselines import Baseline
from .retrieval import PROTOCOLS, answer, answers_per_question, peak_bytes, prefill

PROMPTS = [
    "Explain photosynthesis in detail.",
    "Write a short story about a robot who learns to paint.",
    "Explain how a computer's CPU executes a program, step by step.",
    "What were the main causes of the French Revolution? Answer in detail.",
]


RETRIEVAL_FAMILIES = ("rotating", "h2o-key", "h2o-query", "repeat", "repeat-kvcache")


def _bits(text: str) -> Optional[int]:
    return None if text.lower() == "none" else int(text)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m h2o_fn eval", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="sections:\n" + "\n".join(
                                         f"  {name:10s} {fn.__doc__.splitlines()[0]}"
                                         for name, (_, fn) in SECTIONS.items()))
    parser.add_argument("what", nargs="*", default=list(SECTIONS),
                        help=f"sections to run, any of: {' '.join(SECTIONS)} (default: all)")
    common.add_run_flags(parser, "results/eval")
    common.add_policy_flags(parser, ("n_sink", "grace", "decay", "kv_bits", "kv_group_size", "window", "pool",
                                     "evict_every"))
    parser.add_argument("--allocations", nargs="+", choices=POLICIES, default=list(POLICIES),
                        help="per-layer budget policies compared in ppl (true-query H2O; default: all)")
    parser.add_argument("--tokens", type=int, default=2048, help="perplexity text length (default 2048)")
    parser.add_argument("--text-file", default=None, help="perplexity text (default: CPython's pydoc topics)")
    parser.add_argument("--chunk", type=int, default=16, help="tokens per forward pass in ppl (default 16)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512],
                        help="budgets of ppl, and the k of mass (default 64 128 256 512)")
    parser.add_argument("--prefills", nargs="+", default=["greedy", "oneshot"], choices=["greedy", "oneshot"],
                        help="H2O prefill modes compared in ppl (agree and retrieval use oneshot)")
    parser.add_argument("--no-ablations", action="store_true", help="ppl without the grace/decay ablations")
    parser.add_argument("--sweep-budget", type=int, default=512, help="budget of the sweep (default 512)")
    parser.add_argument("--frontier-budgets", type=int, nargs="+", default=[128, 256, 512, 1024],
                        help="H2O and RotatingKVCache budgets of frontier (default 128 256 512 1024)")
    parser.add_argument("--frontier-bits", type=_bits, nargs="+", default=[None, 8, 4], metavar="BITS",
                        help="H2O kv_bits of frontier ('none' = unquantized); the numbers also give "
                        "mlx-lm's QuantizedKVCache rows (default none 8 4)")
    parser.add_argument("--gen-tokens", type=int, default=160, help="greedy tokens per prompt in agree")
    parser.add_argument("--gen-budgets", type=int, nargs="+", default=[64, 128],
                        help="budgets of agree; the smallest is the kept-positions map's")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="chat prompts in agree (at most 4)")
    parser.add_argument("--passkey-context", type=int, default=768, help="filler tokens around the pass key")
    parser.add_argument("--passkey-budgets", type=int, nargs="+", default=[128, 256],
                        help="budgets of retrieval (default 128 256)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9],
                        help="where the pass key sits in the filler, 0 = start (default 5 depths)")
    parser.add_argument("--trials", type=int, default=3, help="pass keys per depth (default 3)")
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS),
                        help="retrieval protocols: the question inside the compressed prompt (aware) or "
                        "asked after it (agnostic) (default both)")
    parser.add_argument("--repeat-chunk", type=int, default=CHUNK,
                        help=f"prompt tokens per chunk of cache_prompt's repeat pass (default {CHUNK})")
    parser.add_argument("--caches", nargs="+", choices=RETRIEVAL_FAMILIES, default=list(RETRIEVAL_FAMILIES),
                        help="cache families of retrieval and peak (the full cache always runs: the reference)")
    parser.add_argument("--facts", type=int, default=4, help="codes hidden in one context (at most 4)")
    parser.add_argument("--facts-trials", type=int, default=3, help="contexts of several facts (default 3)")
    parser.add_argument("--peak-context", type=int, default=4096,
                        help="prompt tokens of the peak-memory measurement (default 4096)")
    parser.add_argument("--map-steps", type=int, default=200, help="decode steps of the kept-positions map")
    return parser


class Run:
    """What every section reads: the model, the tokenizer, the flags, and the policy."""

    def __init__(self, model, tokenizer, args, parser, command: str):
        self.model, self.tokenizer, self.args, self.parser = model, tokenizer, args, parser
        self.command = command
        self._tokens = None

    def tokens(self) -> List[int]:
        if self._tokens is None:
            self._tokens = corpus_tokens(self.tokenizer, self.args.tokens, self.args.text_file)
        return self._tokens

    def policy(self, budget: int, **changes) -> H2OConfig:
        return common.policy_or_error(self.parser, self.args, budget, **changes)

    def budgets(self, policy: str, config: H2OConfig) -> List[int]:
        """The per-layer budgets of an allocation policy at this config (spelled out)."""
        return allocation.describe(allocation.budgets_for(self.model, policy, config, self.tokenizer),
                                   config, h2o_layer_count(self.model))


# ---------------------------------------------------------------- caches


def _h2o_name(scoring: str, cfg: H2OConfig, extra: str = "") -> str:
    return f"H2O {scoring}{extra}" + (f" {cfg.kv_bits}-bit" if cfg.kv_bits else "")


def cache_specs(run: Run, budgets: List[int], ablations: bool, prefills=("oneshot",),
                allocations=()) -> List[dict]:
    """Every cache to compare: name, family, budget, and the H2O config where there is one."""
    specs = [{"name": "full KVCache", "family": "full", "budget": None}]
    for b in budgets:
        keep = run.policy(b).n_sink  # the baseline keeps as many first tokens as H2O's sinks
        specs.append({"name": f"RotatingKVCache keep={keep}", "family": "rotating", "budget": b,
                      "keep": keep})
        for scoring in ("key", "query"):
            for prefill in prefills:
                cfg = run.policy(b, scoring=scoring, prefill=prefill)
                extra = f" {prefill}" if len(prefills) > 1 else ""
                specs.append({"name": _h2o_name(scoring, cfg, extra), "family": f"h2o-{scoring}", "budget": b,
                              "config": cfg})
        for policy in allocations:  # per-layer budgets at the same bytes (true query, oneshot)
            cfg = run.policy(b, scoring="query", prefill="oneshot")
            specs.append({"name": f"H2O query {policy}", "family": "allocation", "budget": b, "config": cfg,
                          "allocation": policy, "budgets": run.budgets(policy, cfg)})
    if ablations:
        b = budgets[min(1, len(budgets) - 1)]
        for scoring in ("key", "query"):
            base = run.policy(b, scoring=scoring)
            for label, change in (
                ("grace=0 decay=1 (Algorithm 1)", dict(n_sink=0, grace=0, decay=1.0)),
                ("grace=0", dict(grace=0)),
                ("decay=1", dict(decay=1.0)),
            ):
                specs.append({"name": f"H2O {scoring} {label}", "family": f"ablation-{scoring}", "budget": b,
                              "config": base._replace(**change)})
    return specs


# the spec families that are mlx-lm baselines (ppl and retrieval name them by kind, the
# frontier by class: its plot labels its series by family)
BASELINE_FAMILIES = {"full": "full", "full KVCache": "full", "rotating": "rotating",
                     "RotatingKVCache": "rotating", "QuantizedKVCache": "quantized"}


def build_cache(model, spec: dict) -> list:
    family = BASELINE_FAMILIES.get(spec["family"])
    if family is not None:
        return baselines.build(model, Baseline(family, budget=spec.get("budget"), keep=spec.get("keep", 0),
                                               bits=spec.get("bits"), group_size=spec.get("group_size", 64)))
    return make_h2o_cache(model, spec["config"], budgets=spec.get("budgets"))


def describe(spec: dict) -> dict:
    out = {k: v for k, v in spec.items() if k != "config"}
    if "config" in spec:
        out["config"] = spec["config"]._asdict()
    return out


# ---------------------------------------------------------------- sections: each measures one thing


def measure_ppl(run: Run) -> dict:
    """streaming perplexity of every cache at every budget, plus ablations"""
    args, rows = run.args, []
    allocations = [p for p in args.allocations if p != "uniform"]  # uniform: the plain H2O rows
    for spec in cache_specs(run, args.budgets, not args.no_ablations, tuple(args.prefills), allocations):
        cache = build_cache(run.model, spec)
        r = {**describe(spec), **streaming_ppl(run.model, cache, run.tokens(), args.chunk)}
        rows.append(r)
        print(f"ppl  {r['name']:40s} budget {str(r['budget']):>5s}  {r['ppl']:9.3f}  ({r['seconds']:.0f}s)",
              flush=True)
    return {"command": run.command, "tokens": args.tokens, "chunk": args.chunk, "full_ppl": rows[0]["ppl"],
            "rows": rows, "text": args.text_file or "pydoc_data.topics"}


def frontier_specs(run: Run) -> List[dict]:
    args, group = run.args, run.args.kv_group_size
    specs = [{"name": "full KVCache", "family": "full KVCache", "budget": None, "bits": None}]
    for bits in [b for b in args.frontier_bits if b is not None]:
        specs.append({"name": f"QuantizedKVCache {bits}-bit", "family": "QuantizedKVCache", "budget": None,
                      "bits": bits, "group_size": group})
    for budget in args.frontier_budgets:
        keep = run.policy(budget).n_sink
        specs.append({"name": f"RotatingKVCache keep={keep}", "family": "RotatingKVCache", "budget": budget,
                      "bits": None, "keep": keep})
    for scoring in ("key", "query"):
        for bits in args.frontier_bits:
            for budget in args.frontier_budgets:
                cfg = run.policy(budget, scoring=scoring, kv_bits=bits, kv_group_size=group)
                name = _h2o_name(scoring, cfg)
                specs.append({"name": name, "family": name, "budget": budget, "bits": bits,
                              "group_size": group, "config": cfg})
    return specs


def measure_frontier(run: Run) -> dict:
    """streaming perplexity against KV bytes: full, quantized, rotating and H2O caches"""
    args, rows, row_elements = run.args, [], None
    for spec in frontier_specs(run):
        cache = build_cache(run.model, spec)
        r = {**describe(spec), **streaming_ppl(run.model, cache, run.tokens(), args.chunk)}
        if row_elements is None:  # the full cache (first): Dk + Dv per token and KV head
            row_elements = cache[0].keys.shape[-1] + cache[0].values.shape[-1]
        seen, kept = r["tokens"], r["kept"]
        r["rows_bytes"] = kv_fraction(kept, seen, spec["bits"], spec.get("group_size", args.kv_group_size))
        r["h2o_bytes"] = h2o_overhead_fraction(kept, seen, row_elements) if "config" in spec else 0.0
        r["bytes"] = r["rows_bytes"] + r["h2o_bytes"]
        r["nbytes"] = sum(c.nbytes for c in cache)
        rows.append(r)
        print(f"frontier {r['name']:28s} budget {str(r['budget']):>5s}  bytes {r['bytes']:6.1%}  "
              f"ppl {r['ppl']:9.3f}  ({r['seconds']:.0f}s)", flush=True)
    front = plots.pareto([(r["bytes"], r["ppl"]) for r in rows])
    for i, r in enumerate(rows):
        r["pareto"] = i in front
    return {"command": run.command, "tokens": args.tokens, "chunk": args.chunk, "full_ppl": rows[0]["ppl"],
            "group_size": args.kv_group_size, "row_elements": row_elements, "rows": rows,
            "text": args.text_file or "pydoc_data.topics"}


def measure_sweep(run: Run) -> dict:
    """true-query H2O at one budget: decay, grace and the GQA reduction varied one at a time"""
    args, model = run.args, run.model
    budget = args.sweep_budget
    full = streaming_ppl(model, make_prompt_cache(model), run.tokens(), args.chunk)["ppl"]
    base = run.policy(budget, scoring="query", prefill="oneshot")
    variants = [("defaults", base, "mean")]
    variants += [(f"decay={d}", base._replace(decay=d), "mean") for d in (0.95, 0.99, 0.995, 1.0)]
    variants += [(f"grace={g}", base._replace(grace=g), "mean") for g in (32, 64) if base.n_sink + g < budget]
    variants += [("GQA max", base, "max")]
    rows = []
    for label, cfg, reduce in variants:
        remove_query_hook(model)  # a hook keeps its reduction: take it off to change it
        with query_scoring(model, reduce):
            r = streaming_ppl(model, make_h2o_cache(model, cfg), run.tokens(), args.chunk)
        rows.append({"name": label, "budget": budget, "config": cfg._asdict(), "gqa": reduce, **r})
        print(f"sweep {label:20s} budget {budget}  {r['ppl']:.3f}", flush=True)
    install_query_hook(model)  # back to the default reduction for the sections after this one
    return {"command": run.command, "budget": budget, "full_ppl": full, "rows": rows}


def measure_mass(run: Run) -> dict:
    """the oracle: attention mass of each query's best k keys, full cache"""
    start = run.args.tokens // 2
    return {"command": run.command, "budgets": run.args.budgets, "start": start,
            "rows": oracle_mass(run.model, run.tokens(), run.args.budgets, start)}


def measure_agree(run: Run) -> dict:
    """greedy continuations of chat prompts: agreement with the full cache, repetition"""
    args, model, tokenizer = run.args, run.model, run.tokenizer
    prompts = [build_prompt(tokenizer, p, True) for p in PROMPTS[: args.prompts]]
    fulls = [greedy(model, p, make_prompt_cache(model), args.gen_tokens) for p in prompts]
    rows = []
    for spec in cache_specs(run, args.gen_budgets, False):
        if spec["family"] == "full":
            continue
        outs = [greedy(model, p, build_cache(model, spec), args.gen_tokens) for p in prompts]
        agree = [first_divergence(o, f) for o, f in zip(outs, fulls)]
        agree = [args.gen_tokens if a is None else a for a in agree]
        rows.append({
            **describe(spec),
            "agree": agree,
            "agree_mean": sum(agree) / len(agree),
            "repeat": [repeated_4grams(o) for o in outs],
            "repeat_mean": sum(map(repeated_4grams, outs)) / len(outs),
            "longest_run": max(map(longest_run, outs)),
            "samples": [tokenizer.decode(o) for o in outs],
        })
        print(f"agree {rows[-1]['name']:40s} budget {spec['budget']:5d}  {agree}  "
              f"repeat {rows[-1]['repeat_mean']:.3f}", flush=True)
    return {"command": run.command, "tokens": args.gen_tokens, "prompts": PROMPTS[: args.prompts],
            "rows": rows, "full_repeat": sum(map(repeated_4grams, fulls)) / len(fulls),
            "full_samples": [tokenizer.decode(f) for f in fulls]}


def retrieval_specs(run: Run) -> List[dict]:
    """cache_specs at the retrieval budgets, plus cache_prompt's repeat-pass rows."""
    specs = cache_specs(run, run.args.passkey_budgets, False)
    for b in run.args.passkey_budgets:
        specs.append({"name": f"H2O repeat (cache_prompt, chunk {run.args.repeat_chunk})", "family": "repeat",
                      "budget": b, "config": run.policy(b), "chunk": run.args.repeat_chunk})
        specs.append({"name": "H2O repeat, saved as KVCache (re-rotated)", "family": "repeat-kvcache",
                      "budget": b, "config": run.policy(b), "chunk": run.args.repeat_chunk})
    return [s for s in specs if s["family"] == "full" or s["family"] in run.args.caches]


def _passkey_rows(run: Run, specs: List[dict], protocol: str, cases: list, prefix: List[int]) -> List[dict]:
    model, tokenizer, depths = run.model, run.tokenizer, run.args.depths
    question = tokenizer.encode(PASSKEY_QUESTION)
    rows = []
    for spec in specs:
        hits, seconds = [], []
        for _, key, ids in cases:
            out, t = answer(model, spec, build_cache(model, spec), ids[: -len(question)], question, protocol, prefix)
            hits.append(key in tokenizer.decode(out))
            seconds.append(t)
        by_depth = {str(d): sum(h for (dd, _, _), h in zip(cases, hits) if dd == d) / (len(cases) // len(depths))
                    for d in depths}
        rows.append({**describe(spec), "accuracy": sum(hits) / len(hits), "by_depth": by_depth,
                     "seconds": sum(seconds) / len(seconds)})
        print(f"passkey {protocol:8s} {spec['name']:38s} budget {str(spec['budget']):>5s}  "
              f"{rows[-1]['accuracy']:.2f}  " + " ".join(f"{d}:{a:.2f}" for d, a in by_depth.items()), flush=True)
    return rows


def _facts_rows(run: Run, specs: List[dict], prefix: List[int]) -> dict:
    args, model, tokenizer = run.args, run.model, run.tokenizer
    rng = random.Random(1)
    trials = [[str(rng.randint(10000, 99999)) for _ in range(args.facts)] for _ in range(args.facts_trials)]
    prompts = [(codes, *facts_prompt(tokenizer, args.passkey_context, codes)) for codes in trials]
    rows = []
    for spec in specs:
        hits = []
        for codes, context, questions in prompts:
            outs = answers_per_question(model, spec, build_cache(model, spec), context, questions, prefix)
            hits += [code in tokenizer.decode(o) for code, o in zip(codes, outs)]
        rows.append({**describe(spec), "found": sum(hits), "asked": len(hits)})
        print(f"facts   {spec['name']:47s} budget {str(spec['budget']):>5s}  {sum(hits)}/{len(hits)}", flush=True)
    return {"context": len(prompts[0][1]), "facts": args.facts, "trials": args.facts_trials, "rows": rows}


def _peak_rows(run: Run, specs: List[dict], prefix: List[int]) -> dict:
    ids = corpus_tokens(run.tokenizer, run.args.peak_context, run.args.text_file)
    rows = []
    for spec in specs:
        peak = peak_bytes(run.model, spec, ids, build_cache(run.model, spec), prefix)
        rows.append({**describe(spec), "peak_bytes": peak})
        print(f"peak    {spec['name']:47s} budget {str(spec['budget']):>5s}  {peak / 2**20:8.1f} MiB", flush=True)
    return {"tokens": len(ids), "rows": rows}


def measure_retrieval(run: Run) -> dict:
    """pass-key retrieval, query-aware and query-agnostic; several facts asked one by one"""
    args, model, tokenizer = run.args, run.model, run.tokenizer
    rng = random.Random(0)
    keys = [str(rng.randint(10000, 99999)) for _ in range(args.trials)]
    cases = [(d, k, passkey_prompt(tokenizer, d, args.passkey_context, k)) for d in args.depths for k in keys]
    prefix = repeat_prefix(tokenizer)
    specs = retrieval_specs(run)
    prefill(model, cases[0][2], make_prompt_cache(model))  # warm-up: the first timed prefill is not the slowest
    protocols = {p: _passkey_rows(run, specs, p, cases, prefix) for p in args.protocols}
    full = [s for s in specs if s["family"] == "full"]
    facts = _facts_rows(run, full + [s for s in specs if s["budget"] == max(args.passkey_budgets)], prefix)
    return {"command": run.command, "context": len(cases[0][2]), "depths": args.depths, "trials": args.trials,
            "protocols": protocols, "facts": facts}


def measure_peak(run: Run) -> dict:
    """peak memory while reading a long prompt: full prefill against cache_prompt"""
    specs = [s for s in retrieval_specs(run) if s["family"] in ("full", "repeat")]
    return {"command": run.command, **_peak_rows(run, specs, repeat_prefix(run.tokenizer))}


def kept_map(model, tokenizer, config: H2OConfig, steps: int, layer: int) -> List[List[int]]:
    """Kept positions of (H2O layer `layer`, head 0) after each decode step of the
    photosynthesis prompt."""
    cache = make_h2o_cache(model, config)
    ids = build_prompt(tokenizer, PROMPTS[0], True)
    rows = []
    for _, _ in zip(generate_step(mx.array(ids), model, max_tokens=steps, prompt_cache=cache), range(steps)):
        rows.append([p for p in kept_positions(h2o_caches(cache)[layer].core_state)[0, 0].tolist() if p >= 0])
    return rows


def measure_kept_map(run: Run) -> dict:
    """kept positions of the middle layer, head 0, over decode: Algorithm 1 vs the defaults"""
    args = run.args
    layer, b = len(run.model.layers) // 2, min(args.gen_budgets)
    published = run.policy(b, scoring="key", n_sink=0, grace=0, decay=1.0)
    defaults = run.policy(b, scoring="key")
    maps = {
        f"grace=0, decay=1.0 (Algorithm 1), budget {b}":
            kept_map(run.model, run.tokenizer, published, args.map_steps, layer),
        f"defaults (n_sink={defaults.n_sink}, grace={defaults.grace}, decay={defaults.decay}), budget {b}":
            kept_map(run.model, run.tokenizer, defaults, args.map_steps, layer),
    }
    return {"command": run.command, "layer": layer, "head": 0, "final": {k: v[-1] for k, v in maps.items()},
            "maps": maps}


# name -> (results key, measure); run in this order whatever order they are asked in
SECTIONS: Dict[str, tuple] = {
    "ppl": ("ppl", measure_ppl),
    "frontier": ("frontier", measure_frontier),
    "sweep": ("sweep", measure_sweep),
    "mass": ("mass", measure_mass),
    "agree": ("agree", measure_agree),
    "retrieval": ("retrieval", measure_retrieval),
    "peak": ("peak", measure_peak),
    "plots": ("kept_map", measure_kept_map),
}


# ---------------------------------------------------------------- rendering: reads results only


def _vs(ppl: float, full: float) -> str:
    return f"{100 * (ppl / full - 1):+.1f}%"


def render_ppl(p: dict) -> List[str]:
    full = p["full_ppl"]
    return common.section(
        f"Streaming perplexity: {p['tokens']} tokens of {p['text']}, chunks of {p['chunk']}",
        "cache:l | budget:r | ppl:r | vs full:r | wall s (not a benchmark):r",
        [(r["name"], r["budget"], f"{r['ppl']:.3f}", _vs(r["ppl"], full), f"{r['seconds']:.1f}")
         for r in p["rows"] if r["budget"]],
        p["command"],
        [f"Full KVCache: **{full:.3f}**"],
    )


def render_frontier(f: dict) -> List[str]:
    full, g = f["full_ppl"], f["group_size"]
    rows = sorted(f["rows"], key=lambda r: r["bytes"])
    return common.section(
        f"Memory frontier: streaming perplexity against KV bytes, {f['tokens']} tokens of {f['text']}, "
        f"chunks of {f['chunk']}",
        "cache:l | budget:r | bits:r | KV rows:r | + H2O scores, positions:r | total bytes:r | ppl:r | "
        "vs full:r | Pareto:l",
        [(r["name"], r["budget"] or "-", r["bits"] or 16, f"{r['rows_bytes']:.1%}",
          f"{r['h2o_bytes']:.1%}" if r["h2o_bytes"] else "-", f"{r['bytes']:.1%}", f"{r['ppl']:.3f}",
          _vs(r["ppl"], full), "yes" if r["pareto"] else "") for r in rows],
        f["command"],
        [
            "Bytes are a fraction of a float16 full cache of the same tokens (seen = tokens fed), "
            "from the tokens each cache holds at the end (kept): rows kept/seen for float16 rows, "
            f"kept/seen x (bits + 32/{g})/16 for quantized rows (mx.quantize's packed bits plus a float16 "
            f"scale and bias per group of {g} elements, as mlx-lm's QuantizedKVCache stores them). "
            "H2O also holds a float32 score and an int32 position per kept token and KV head: kept/seen "
            f"x 8 / (2 x {f['row_elements']}) (Dk + Dv = {f['row_elements']} float16 elements per row), "
            "in its own column and in the total. Not counted: H2O's spare slots (budget + evict_every allocated, "
            "+1/budget) and mlx-lm's allocation in steps of 256 tokens. The model runs in float32 here; "
            "the bytes are those of the layouts a float16 model stores (nbytes as held here is in the JSON).",
            f"Full KVCache: **{full:.3f}**. Pareto: no other row has fewer bytes and lower perplexity.",
        ],
    )


def render_mass(m: dict) -> List[str]:
    rows = m["rows"]
    mean = lambda k, key=None: sum((r[key] if key else r)[str(k)] for r in rows) / len(rows)
    worst = lambda k, key=None: min((r[key] if key else r)[str(k)] for r in rows)
    per_query = str(m["budgets"][0]) in rows[0]
    per_kv = "kv" in rows[0]
    cols = ["k:r"]
    cols += ["each query head, mean over layers:r", "worst layer:r"] if per_query else []
    cols += ["KV head (GQA mean), mean over layers:r", "worst layer:r"] if per_kv else []
    table = []
    for k in m["budgets"]:
        row = [k]
        row += [f"{mean(k):.4f}", f"{worst(k):.4f}"] if per_query else []
        row += [f"{mean(k, 'kv'):.4f}", f"{worst(k, 'kv'):.4f}"] if per_kv else []
        table.append(row)
    return common.section(
        f"Oracle attention mass: the best k keys per query (full cache, queries >= {m['start']})",
        " | ".join(cols),
        table,
        m["command"],
        ["Upper bound for any cache keeping k tokens. Each query head: every query head picks its own "
         "best k keys (a looser bound; the figures BENCHMARKS.md quotes). KV head: the best k keys of the "
         "weights averaged over the query heads sharing a KV head, the weights the attention hook hands "
         "to a cache (one kept set per KV head, as H2O keeps). Both read through the hook with a "
         "recording cache (explicit float32 attention)."],
    )


def render_sweep(w: dict) -> List[str]:
    return common.section(
        f"Sweep: H2O query oneshot at budget {w['budget']}, one change at a time",
        "variant:l | ppl:r | vs full:r",
        [(r["name"], f"{r['ppl']:.3f}", _vs(r["ppl"], w["full_ppl"])) for r in w["rows"]],
        w["command"],
        [f"Full KVCache: {w['full_ppl']:.3f}"],
    )


def render_agree(a: dict) -> List[str]:
    return common.section(
        f"Generation agreement: {len(a['prompts'])} chat prompts, {a['tokens']} greedy tokens",
        "cache:l | budget:r | agree (mean):r | per prompt:l | repeated 4-grams:r | longest run:r",
        [(r["name"], r["budget"], f"{r['agree_mean']:.1f}", r["agree"], f"{r['repeat_mean']:.3f}",
          r["longest_run"]) for r in a["rows"]],
        a["command"],
        ["Tokens until the first divergence from the full cache (mean over prompts; "
         f"{a['tokens']} = never diverged), repeated 4-grams (full cache: {a['full_repeat']:.3f}) and the "
         "longest single-token run."],
    )


PROTOCOL_TITLES = {
    "aware": "query-aware (the question inside the compressed prompt)",
    "agnostic": "query-agnostic (the context compressed first, then the question)",
}


def _per_cache(title: str, column: str, rows: List[dict], value: Callable[[dict], str], note: str) -> List[str]:
    return common.section(title, f"cache:l | budget:r | {column}:r",
                          [(row["name"], row["budget"] or "-", value(row)) for row in rows], None, [note])


def render_retrieval(r: dict) -> List[str]:
    depths = [str(d) for d in r["depths"]]
    if "protocols" not in r:  # a results file from before the two protocols
        r = {**r, "protocols": {"aware": r["rows"]}}
    out = []
    for protocol, rows in r["protocols"].items():
        full = next(row["seconds"] for row in rows if row["family"] == "full") if "seconds" in rows[0] else None
        out += common.section(
            f"Pass-key retrieval, {PROTOCOL_TITLES[protocol]}: {r['context']} tokens, depths {r['depths']}, "
            f"{r['trials']} keys each",
            "cache:l | budget:r | accuracy:r | " + " | ".join(f"depth {d}:r" for d in depths)
            + " | reading the prompt, x full prefill:r",
            [(row["name"], row["budget"] or "-", f"{row['accuracy']:.2f}",
              *(f"{row['by_depth'][d]:.2f}" for d in depths),
              f"{row['seconds'] / full:.2f}" if full else "-") for row in rows],
            r["command"],
            ["Accuracy: the share of pass keys found in the first 8 greedy tokens after the question. "
             "Reading the prompt: mean seconds to read (and compress) what precedes the first decoded "
             "token, as a multiple of the full KVCache's (its plain prefill), in the same run."],
        )
    if "facts" in r:
        f = r["facts"]
        out += _per_cache(f"Several facts, compressed once: {f['facts']} codes in {f['context']} tokens, "
                          f"{f['trials']} contexts", "codes found", f["rows"],
                          lambda row: f"{row['found']}/{row['asked']}",
                          "Each context is read (compressed) once; each code is then asked from its own "
                          "copy.deepcopy of the cache (query-agnostic).")
    return out


def render_peak(p: dict) -> List[str]:
    return common.section(
        f"Peak memory while reading a {p['tokens']}-token prompt", "cache:l | budget:r | peak above the weights, MiB:r",
        [(row["name"], row["budget"] or "-", f"{row['peak_bytes'] / 2**20:.1f}") for row in p["rows"]],
        p["command"],
        ["mx.get_peak_memory() above the memory live before reading: KV rows, activations, and the "
         "attention weights the scoring pass materialises (one layer at a time); float32 model. The full "
         "cache prefills in steps of 2048 tokens (generate_step's default); cache_prompt in chunks."])


RENDER: Dict[str, Callable[[dict], List[str]]] = {
    "ppl": render_ppl,
    "frontier": render_frontier,
    "mass": render_mass,
    "sweep": render_sweep,
    "agree": render_agree,
    "retrieval": render_retrieval,
    "peak": render_peak,
}


def markdown(results: dict) -> str:
    return common.report("Quality", results, RENDER)


def draw(results: dict, out: Path, what: List[str]) -> List[str]:
    """The figures of the sections run now; returns the file names written."""
    written = []
    if "plots" in what and "ppl" in results:
        plots.plot_ppl(results["ppl"]["rows"], results["ppl"]["full_ppl"], out / "ppl_vs_budget.png")
        written.append("ppl_vs_budget.png")
    if "plots" in what and "maps" in results.get("kept_map", {}):
        plots.plot_kept(results["kept_map"]["maps"], out / "kept_positions.png")
        written.append("kept_positions.png")
    if "plots" in what and "ppl" in results:
        layers = {f"{r['allocation']} (mean {r['budget']})": r["budgets"] for r in results["ppl"]["rows"]
                  if r.get("allocation")}
        if layers:
            plots.plot_budgets(layers, out / "layer_budgets.png")
            written.append("layer_budgets.png")
    if "frontier" in what and "frontier" in results:
        plots.plot_frontier(results["frontier"]["rows"], out / "frontier.png")
        written.append("frontier.png")
    return written


def main(argv: Optional[List[str]] = None) -> None:
    parser = setup_arg_parser()
    args = common.parse_sections(parser, argv, SECTIONS)
    budgets = {"ppl": args.budgets, "agree": args.gen_budgets, "plots": args.gen_budgets,
               "retrieval": args.passkey_budgets, "peak": args.passkey_budgets, "sweep": [args.sweep_budget]}
    for budget in {b for w in args.what for b in budgets.get(w, ())}:
        common.policy_or_error(parser, args, budget)  # a bad combination fails before any work
    for budget in args.frontier_budgets if "frontier" in args.what else ():
        for bits in args.frontier_bits:
            common.policy_or_error(parser, args, budget, kv_bits=bits)
    argv = list(sys.argv[1:] if argv is None else argv)
    out, header = common.start_run("eval", argv, args)
    previous = out / "eval.json"  # sections from earlier runs stay unless this run redoes them
    results = {**(json.loads(previous.read_text()) if previous.exists() else {}), **header}
    model, tokenizer = common.load_or_exit("eval", args.model, dequantize=not args.quantized)
    run = Run(model, tokenizer, args, parser, header["command"])
    with query_scoring(model):  # the hook lives for this command only
        for name, (key, measure) in SECTIONS.items():
            if name in args.what:
                results[key] = measure(run)
    (out / "eval.json").write_text(json.dumps(results, indent=1))
    (out / "eval.md").write_text(markdown(results))
    figures = draw(results, out, args.what)
    print("\n" + markdown(results))
    print(f"wrote {out}/eval.json, eval.md" + "".join(f", {f}" for f in figures))
