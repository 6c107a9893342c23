"""`eval ruler --ruler-merge`: several runs of `eval ruler` as one report, without the model.

On 2 cores a RULER table is built a few samples at a time (`--ruler-first-sample`) and a
ratio is rerun after a default changes. `merge` puts the runs' rows together by sample
index, so the report and the plot of samples 0-3 come from the runs' own scores:

- a row is one (protocol, length, haystack, task, method, setting); each run's row holds
  samples `first_sample, first_sample + 1, ...` (its `scores`, in that order);
- where two runs hold the same sample of a row, the later run's counts (a rerun at a later
  commit replaces the earlier one: give the runs oldest first);
- a method's setting is reported where, in every task of its cell, it holds the samples the
  full cache holds there (so every gap compares the same prompts); the others are listed in
  `dropped` with the reason, never left out silently;
- the runs must share the template; `budget` and `seconds` are means over the samples kept
  (each sample counted at its run's row mean).

Example:
    >>> def part(first, scores):
    ...     rows = [{"protocol": "agnostic", "length": 1024, "haystack": "ruler", "task": "a", "method": m,
    ...              "label": m, "kind": k, "value": v, "scores": s, "score": sum(s) / len(s), "budget": 9,
    ...              "seconds": 1.0} for m, k, v, s in scores]
    ...     return {"command": "run", "date": "d", "ruler": {"template": "base", "first_sample": first,
    ...             "samples": len(scores[0][3]), "tasks": ["a"], "lengths": [1024], "haystacks": ["ruler"],
    ...             "protocols": ["agnostic"], "ratios": [0.5], "budgets": [], "methods": {"full": "full"},
    ...             "prompts": {}, "full_predictions": {}, "tasks_rows": rows}}
    >>> r = merge([part(0, [("full", "full", None, [100, 0]), ("h2o", "ratio", 0.5, [0, 0])]),
    ...            part(2, [("full", "full", None, [100, 100]), ("h2o", "ratio", 0.5, [100, 0])])], "merge")
    >>> [(t["method"], t["mean"], t["gap"]) for t in r["table"]], r["samples"], r["first_sample"]
    ([('full', 75.0, 0.0), ('h2o', 25.0, -50.0)], 4, 0)
"""

from typing import Dict, List, Sequence, Tuple

from .ruler import table

ROW_KEY = ("protocol", "length", "haystack", "task", "method", "kind", "value")


def _union(lists) -> list:
    return list(dict.fromkeys(x for xs in lists for x in xs))


def merge(parts: Sequence[dict], command: str) -> dict:
    """`parts`: whole `eval.json` dicts (each with its `ruler` section, `command` and `date`),
    oldest first -> one ruler section as `ruler.measure` returns it, plus `merged` (the runs'
    commands and dates) and `dropped` (settings left out, with the reason)."""
    if not parts:
        raise ValueError("merge needs at least one run: expected eval.json files with a ruler section")
    sections = [p["ruler"] for p in parts]
    templates = {s["template"] for s in sections}
    if len(templates) > 1:
        raise ValueError(f"runs of templates {sorted(templates)} cannot be merged: expected one template")
    samples: Dict[tuple, Dict[int, Tuple[float, float, float]]] = {}  # row key -> index -> (score, budget, s)
    labels: Dict[tuple, str] = {}
    predictions: Dict[str, Dict[int, str]] = {}
    for s in sections:
        first = s.get("first_sample", 0)
        for row in s["tasks_rows"]:
            key = tuple(row[k] for k in ROW_KEY)
            labels[key] = row["label"]
            for i, score in enumerate(row["scores"]):
                samples.setdefault(key, {})[first + i] = (score, row["budget"], row["seconds"])
        for cell, preds in s.get("full_predictions", {}).items():
            predictions.setdefault(cell, {}).update({first + i: p for i, p in enumerate(preds)})
    full = {k[:4]: set(v) for k, v in samples.items() if k[5] == "full"}
    groups: Dict[tuple, List[tuple]] = {}  # (protocol, length, haystack, method, kind, value) -> row keys
    for key in samples:
        groups.setdefault(key[:3] + key[4:], []).append(key)
    rows, dropped = [], []
    for group, keys in groups.items():
        tasks = {k[3] for k in keys}
        cell_tasks = {t[3] for t in full if t[:3] == group[:3]}
        short: Dict[tuple, List[str]] = {}  # (samples held, the full cache's) -> tasks
        for k in keys:
            if set(samples[k]) != full.get(k[:4]):
                short.setdefault((tuple(sorted(samples[k])), tuple(sorted(full.get(k[:4], ())))), []).append(k[3])
        if tasks != cell_tasks or short:
            why = f"tasks {sorted(cell_tasks - tasks)} missing" if tasks != cell_tasks else "; ".join(
                f"samples {list(have)} against the full cache's {list(want)} in "
                + (", ".join(sorted(ts)) if len(ts) <= 3 else f"{len(ts)} tasks") for (have, want), ts in short.items())
            dropped.append({"protocol": group[0], "length": group[1], "haystack": group[2], "method": group[3],
                            "kind": group[4], "value": group[5], "why": why})
            continue
        for key in keys:
            got = [samples[key][i] for i in sorted(samples[key])]
            rows.append({**dict(zip(ROW_KEY, key)), "label": labels[key], "samples": sorted(samples[key]),
                         "scores": [g[0] for g in got], "score": sum(g[0] for g in got) / len(got),
                         "budget": sum(g[1] for g in got) / len(got), "seconds": sum(g[2] for g in got) / len(got)})
    indices = {tuple(sorted(v)) for v in full.values()}
    if len(indices) != 1 or list(next(iter(indices))) != list(range(min(next(iter(indices))),
                                                                    max(next(iter(indices))) + 1)):
        raise ValueError(f"the full cache's samples per task are {sorted(indices)}: expected the same "
                         "consecutive indices in every task")
    (held,) = indices
    return {"command": command, "template": templates.pop(), "samples": len(held), "first_sample": held[0],
            "tasks": _union(s["tasks"] for s in sections), "lengths": _union(s["lengths"] for s in sections),
            "haystacks": _union(s["haystacks"] for s in sections),
            "protocols": _union(s["protocols"] for s in sections),
            "ratios": _union(s["ratios"] for s in sections), "budgets": _union(s["budgets"] for s in sections),
            "methods": {k: v for s in sections for k, v in s["methods"].items()},
            "prompts": {k: v for s in sections for k, v in s["prompts"].items()},
            "tasks_rows": rows, "table": table(rows), "dropped": dropped,
            "full_predictions": {c: [p[i] for i in sorted(p)] for c, p in predictions.items()},
            "merged": [{"command": p["command"], "date": p.get("date"), "first_sample": s.get("first_sample", 0),
                        "samples": s["samples"]} for p, s in zip(parts, sections)]}
