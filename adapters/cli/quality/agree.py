"""Generation agreement: greedy continuations of chat prompts, tokens until the first
divergence from the full cache, repeated 4-grams, the longest single-token run."""

from typing import List

from mlx_lm.models.cache import make_prompt_cache

from ...metrics import build_prompt, first_divergence, greedy, longest_run, repeated_4grams
from .. import common
from .specs import PROMPTS, Run, build_cache, cache_specs, describe


def measure(run: Run) -> dict:
    """greedy continuations of chat prompts: agreement with the full cache, repetition"""
    args, model, tokenizer = run.args, run.model, run.tokenizer
    prompts = [build_prompt(tokenizer, p, True) for p in PROMPTS[: args.prompts]]
    fulls = [greedy(model, p, make_prompt_cache(model), args.gen_tokens) for p in prompts]
    rows = []
    for spec in cache_specs(run, args.gen_budgets, False):
        if spec["family"] == "full":
            continue
        outs = [greedy(model, p, build_cache(model, spec, run.options), args.gen_tokens) for p in prompts]
        agree = [first_divergence(o, f) for o, f in zip(outs, fulls)]
        agree = [args.gen_tokens if a is None else a for a in agree]
        rows.append({
            **describe(spec, run.options),
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


def render(a: dict) -> List[str]:
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
