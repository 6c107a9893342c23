"""Streaming perplexity: a long real text fed in fixed chunks through each cache, every
next token scored; plus the grace/decay ablations."""

from typing import List

from ...metrics import streaming_ppl
from .. import common
from .specs import Run, build_cache, cache_specs, describe, vs


def measure(run: Run) -> dict:
    """streaming perplexity of every cache at every budget, plus ablations"""
    args, rows = run.args, []
    allocations = [p for p in args.allocations if p != "uniform"]  # uniform: the plain H2O rows
    for spec in cache_specs(run, args.budgets, not args.no_ablations, tuple(args.prefills), allocations):
        cache = build_cache(run.model, spec, run.options)
        r = {**describe(spec, run.options), **streaming_ppl(run.model, cache, run.tokens(), args.chunk)}
        rows.append(r)
        print(f"ppl  {r['name']:40s} budget {str(r['budget']):>5s}  {r['ppl']:9.3f}  ({r['seconds']:.0f}s)",
              flush=True)
    return {"command": run.command, "tokens": args.tokens, "chunk": args.chunk, "full_ppl": rows[0]["ppl"],
            "rows": rows, "text": args.text_file or "pydoc_data.topics"}


def render(p: dict) -> List[str]:
    full = p["full_ppl"]
    return common.section(
        f"Streaming perplexity: {p['tokens']} tokens of {p['text']}, chunks of {p['chunk']}",
        "cache:l | budget:r | ppl:r | vs full:r | wall s (not a benchmark):r",
        [(r["name"], r["budget"], f"{r['ppl']:.3f}", vs(r["ppl"], full), f"{r['seconds']:.1f}")
         for r in p["rows"] if r["budget"]],
        p["command"],
        [f"Full KVCache: **{full:.3f}**"],
    )
