"""The sweep: true-query H2O at one budget, decay, grace and the GQA reduction varied one at a time."""

from typing import List

from mlx_lm.models.cache import make_prompt_cache

from ...metrics import streaming_ppl
from ...mlx_lm import h2o_caches, make_h2o_cache
from .. import common
from .specs import Run, vs


def measure(run: Run) -> dict:
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
        cache = make_h2o_cache(model, cfg, **run.options)
        for c in h2o_caches(cache):
            c.weights_reduce = reduce  # the hook reads each cache's own reduction (adapters/attention.py)
        r = streaming_ppl(model, cache, run.tokens(), args.chunk)
        rows.append({"name": label, "budget": budget, "config": common.policy_of(cfg, run.options).fields(),
                     "gqa": reduce, **r})
        print(f"sweep {label:20s} budget {budget}  {r['ppl']:.3f}", flush=True)
    return {"command": run.command, "budget": budget, "full_ppl": full, "rows": rows}


def render(w: dict) -> List[str]:
    return common.section(
        f"Sweep: H2O query oneshot at budget {w['budget']}, one change at a time",
        "variant:l | ppl:r | vs full:r",
        [(r["name"], f"{r['ppl']:.3f}", vs(r["ppl"], w["full_ppl"])) for r in w["rows"]],
        w["command"],
        [f"Full KVCache: {w['full_ppl']:.3f}"],
    )
