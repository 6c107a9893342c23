"""Retrieval: a pass key hidden in filler at several depths, asked for at the end, with the
question inside the compressed prompt (query-aware) or after it (query-agnostic), plus
cache_prompt's repeat-pass rows; several codes in one context compressed once and asked
one by one (the protocols: `adapters/cli/retrieval.py`)."""

import random
from typing import Callable, List

from mlx_lm.models.cache import make_prompt_cache

from ...metrics import PASSKEY_QUESTION, facts_prompt, passkey_prompt
from ...retention import repeat_prefix
from .. import common
from ..retrieval import answer, answers_per_question, prefill
from .specs import REPEAT_ROWS, Run, build_cache, cache_specs, describe


def retrieval_specs(run: Run) -> List[dict]:
    """cache_specs at the retrieval budgets, plus cache_prompt's repeat-pass rows."""
    specs = cache_specs(run, run.args.passkey_budgets, False)
    chunk = run.args.repeat_chunk
    for b in run.args.passkey_budgets:
        for family, name, spread in REPEAT_ROWS:
            spec = {"name": name.format(chunk=chunk), "family": family, "budget": b, "config": run.policy(b),
                    "chunk": chunk, "pool": run.args.repeat_pool,
                    "surprisal": run.args.repeat_surprisal,
                    "share": None if spread == "uniform" else run.args.repeat_share,
                    "width": run.args.repeat_share_width, "windows": run.args.repeat_share_windows}
            specs.append(spec if spread is None else {**spec, "spread": spread})
    return [s for s in specs if s["family"] == "full" or s["family"] in run.args.caches]


def _passkey_rows(run: Run, specs: List[dict], protocol: str, cases: list, prefix: List[int]) -> List[dict]:
    model, tokenizer, depths = run.model, run.tokenizer, run.args.depths
    question = tokenizer.encode(PASSKEY_QUESTION)
    rows = []
    for spec in specs:
        hits, seconds = [], []
        for _, key, ids in cases:
            cache = build_cache(model, spec, run.options)
            out, t = answer(model, spec, cache, ids[: -len(question)], question, protocol, prefix)
            hits.append(key in tokenizer.decode(out))
            seconds.append(t)
        by_depth = {str(d): sum(h for (dd, _, _), h in zip(cases, hits) if dd == d) / (len(cases) // len(depths))
                    for d in depths}
        rows.append({**describe(spec, run.options), "accuracy": sum(hits) / len(hits), "by_depth": by_depth,
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
            outs = answers_per_question(model, spec, build_cache(model, spec, run.options), context, questions,
                                        prefix)
            hits += [code in tokenizer.decode(o) for code, o in zip(codes, outs)]
        rows.append({**describe(spec, run.options), "found": sum(hits), "asked": len(hits)})
        print(f"facts   {spec['name']:47s} budget {str(spec['budget']):>5s}  {sum(hits)}/{len(hits)}", flush=True)
    return {"context": len(prompts[0][1]), "facts": args.facts, "trials": args.facts_trials, "rows": rows}


def measure(run: Run) -> dict:
    """pass-key retrieval, query-aware and query-agnostic; several facts asked one by one"""
    args, model, tokenizer = run.args, run.model, run.tokenizer
    rng = random.Random(0)
    keys = [str(rng.randint(10000, 99999)) for _ in range(args.trials)]
    prefix = repeat_prefix(tokenizer)
    specs = retrieval_specs(run)
    haystacks, context = {}, 0
    for haystack in args.passkey_haystacks:
        cases = [(d, k, passkey_prompt(tokenizer, d, args.passkey_context, k, haystack))
                 for d in args.depths for k in keys]
        if not haystacks:
            prefill(model, cases[0][2], make_prompt_cache(model))  # warm-up: the first timed prefill is slowest
        print(f"haystack {haystack}", flush=True)
        haystacks[haystack] = {p: _passkey_rows(run, specs, p, cases, prefix) for p in args.protocols}
        context = len(cases[0][2])
    out = {"command": run.command, "context": context, "depths": args.depths, "trials": args.trials,
           "haystacks": haystacks}
    if args.facts_trials > 0:  # --facts-trials 0: no facts section
        full = [s for s in specs if s["family"] == "full"]
        out["facts"] = _facts_rows(run, full + [s for s in specs if s["budget"] == max(args.passkey_budgets)], prefix)
    return out


HAYSTACK_TITLES = {
    "noise": "RULER's repeated sentences",
    "pydoc": "CPython's pydoc text, the key on a line of its own",
    "pydoc-inline": "CPython's pydoc text, the key inside a line",
}
PROTOCOL_TITLES = {
    "aware": "query-aware (the question inside the compressed prompt)",
    "agnostic": "query-agnostic (the context compressed first, then the question)",
}


def _per_cache(title: str, column: str, rows: List[dict], value: Callable[[dict], str], note: str) -> List[str]:
    return common.section(title, f"cache:l | budget:r | {column}:r",
                          [(row["name"], row["budget"] or "-", value(row)) for row in rows], None, [note])


def render(r: dict) -> List[str]:
    depths = [str(d) for d in r["depths"]]
    if "protocols" not in r and "haystacks" not in r:  # a results file from before the two protocols
        r = {**r, "protocols": {"aware": r["rows"]}}
    if "haystacks" not in r:  # ... and from before the natural-text haystacks
        r = {**r, "haystacks": {"noise": r["protocols"]}}
    out = []
    for haystack, protocol, rows in ((h, p, rows) for h, ps in r["haystacks"].items() for p, rows in ps.items()):
        full = next(row["seconds"] for row in rows if row["family"] == "full") if "seconds" in rows[0] else None
        out += common.section(
            f"Pass-key retrieval, {PROTOCOL_TITLES[protocol]}, haystack {haystack} ({HAYSTACK_TITLES[haystack]}): "
            f"{r['context']} tokens, depths {r['depths']}, {r['trials']} keys each",
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
