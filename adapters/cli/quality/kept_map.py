"""Kept positions of one layer and head over decode: Algorithm 1 against the defaults (a plot)."""

from typing import List

import mlx.core as mx
from mlx_lm.generate import generate_step

from h2o_fn import H2OConfig, kept_positions

from ...metrics import build_prompt
from ...mlx_lm import h2o_caches, make_h2o_cache
from .specs import PROMPTS, Run


def kept_map(model, tokenizer, config: H2OConfig, steps: int, layer: int, options: dict) -> List[List[int]]:
    """Kept positions of (H2O layer `layer`, head 0) after each decode step of the
    photosynthesis prompt."""
    cache = make_h2o_cache(model, config, prompt=options["prompt"], kv_bits=options["kv_bits"],
                           kv_group_size=options["kv_group_size"])
    ids = build_prompt(tokenizer, PROMPTS[0], True)
    rows = []
    for _, _ in zip(generate_step(mx.array(ids), model, max_tokens=steps, prompt_cache=cache), range(steps)):
        rows.append([p for p in kept_positions(h2o_caches(cache)[layer].core_state)[0, 0].tolist() if p >= 0])
    return rows


def measure(run: Run) -> dict:
    """kept positions of the middle layer, head 0, over decode: Algorithm 1 vs the defaults"""
    args = run.args
    layer, b = len(run.model.layers) // 2, min(args.gen_budgets)
    published = run.policy(b, scoring="key", n_sink=0, grace=0, decay=1.0)
    defaults = run.policy(b, scoring="key")
    maps = {
        f"grace=0, decay=1.0 (Algorithm 1), budget {b}":
            kept_map(run.model, run.tokenizer, published, args.map_steps, layer, run.options),
        f"defaults (n_sink={defaults.n_sink}, grace={defaults.grace}, decay={defaults.decay}), budget {b}":
            kept_map(run.model, run.tokenizer, defaults, args.map_steps, layer, run.options),
    }
    return {"command": run.command, "layer": layer, "head": 0, "final": {k: v[-1] for k, v in maps.items()},
            "maps": maps}
