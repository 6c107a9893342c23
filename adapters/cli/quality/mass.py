"""The oracle: the attention mass each query's best k keys hold (full cache)."""

from typing import List

from ...metrics import oracle_mass
from .. import common
from .specs import Run


def measure(run: Run) -> dict:
    """the oracle: attention mass of each query's best k keys, full cache"""
    start = run.args.tokens // 2
    return {"command": run.command, "budgets": run.args.budgets, "start": start,
            "rows": oracle_mass(run.model, run.tokens(), run.args.budgets, start)}


def render(m: dict) -> List[str]:
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
