"""The memory frontier: streaming perplexity against KV bytes (a fraction of a float16 full
cache) for full, mlx-lm's QuantizedKVCache, RotatingKVCache and H2O (key, query) x kv_bits x budgets."""

from typing import List

from ...metrics import h2o_overhead_fraction, kv_fraction, streaming_ppl
from .. import common, plots
from .specs import Run, build_cache, describe, h2o_name, vs


def specs(run: Run) -> List[dict]:
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
                cfg = run.policy(budget, scoring=scoring)
                name = h2o_name(scoring, bits=bits)
                specs.append({"name": name, "family": name, "budget": budget, "bits": bits,
                              "group_size": group, "config": cfg})
    return specs


def measure(run: Run) -> dict:
    """streaming perplexity against KV bytes: full, quantized, rotating and H2O caches"""
    args, rows, row_elements = run.args, [], None
    for spec in specs(run):
        cache = build_cache(run.model, spec, run.options)
        r = {**describe(spec, run.options), **streaming_ppl(run.model, cache, run.tokens(), args.chunk)}
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


def render(f: dict) -> List[str]:
    full, g = f["full_ppl"], f["group_size"]
    rows = sorted(f["rows"], key=lambda r: r["bytes"])
    return common.section(
        f"Memory frontier: streaming perplexity against KV bytes, {f['tokens']} tokens of {f['text']}, "
        f"chunks of {f['chunk']}",
        "cache:l | budget:r | bits:r | KV rows:r | + H2O scores, positions:r | total bytes:r | ppl:r | "
        "vs full:r | Pareto:l",
        [(r["name"], r["budget"] or "-", r["bits"] or 16, f"{r['rows_bytes']:.1%}",
          f"{r['h2o_bytes']:.1%}" if r["h2o_bytes"] else "-", f"{r['bytes']:.1%}", f"{r['ppl']:.3f}",
          vs(r["ppl"], full), "yes" if r["pareto"] else "") for r in rows],
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
