"""Peak memory while reading a long prompt: the full cache's prefill against cache_prompt."""

from typing import List

from ...metrics import corpus_tokens
from ...retention import repeat_prefix
from .. import common
from ..retrieval import peak_bytes
from .passkey import retrieval_specs
from .specs import Run, build_cache, describe


def _peak_rows(run: Run, specs: List[dict], prefix: List[int]) -> dict:
    ids = corpus_tokens(run.tokenizer, run.args.peak_context, run.args.text_file)
    rows = []
    for spec in specs:
        peak = peak_bytes(run.model, spec, ids, build_cache(run.model, spec, run.options), prefix)
        rows.append({**describe(spec, run.options), "peak_bytes": peak})
        print(f"peak    {spec['name']:47s} budget {str(spec['budget']):>5s}  {peak / 2**20:8.1f} MiB", flush=True)
    return {"tokens": len(ids), "rows": rows}


def measure(run: Run) -> dict:
    """peak memory while reading a long prompt: full prefill against cache_prompt"""
    specs = [s for s in retrieval_specs(run) if s["family"] in ("full", "repeat")]
    return {"command": run.command, **_peak_rows(run, specs, repeat_prefix(run.tokenizer))}


def render(p: dict) -> List[str]:
    return common.section(
        f"Peak memory while reading a {p['tokens']}-token prompt", "cache:l | budget:r | peak above the weights, MiB:r",
        [(row["name"], row["budget"] or "-", f"{row['peak_bytes'] / 2**20:.1f}") for row in p["rows"]],
        p["command"],
        ["mx.get_peak_memory() above the memory live before reading: KV rows, activations, and the "
         "attention weights the scoring pass materialises (one layer at a time); float32 model. The full "
         "cache prefills in steps of 2048 tokens (generate_step's default); cache_prompt in chunks."])
