"""RULER-style suite (`eval ruler`): RULER's synthetic tasks (`ruler_tasks`) read through each
method of `ruler_methods` at kvpress's compression ratios and at fixed budgets.

For each context length, haystack, task and sample, every method reads the context into a
cache per budget, then the rest of the prompt is fed and the answer decoded greedily (at
most RULER's tokens_to_generate, `metrics.greedy`'s `generate_step`). Two protocols
(`adapters/cli/retrieval.py`):

- agnostic (the main table): the context part of RULER's template is compressed, then the
  question and RULER's answer prefix are the prompt (kvpress's protocol, a prompt cache
  asked later);
- aware: the whole prompt but its last token is compressed (the question's queries score
  the context), decoding starts from that token.

A ratio r removes that fraction of what the cache reads: `round((1 - r) * n)` tokens per
layer and KV head for n tokens read (`budget_at`). The full cache reads each context once
and serves both protocols (nothing is evicted, so both read the same tokens in order).

Decoding stops early at the end-of-sequence token, at the end of a one-line answer (the
newline after its first letter or digit: the needles with one answer, and vt and cwe,
whose worked examples answer on one line; never for the lists a model may write one item
a line: multivalue, multiquery, fwe), or once every reference is in the text (RULER's
scores only look for them, so more text cannot change the score).
"""

import re
import time
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import generate_step

from .. import common
from .ruler_methods import METHODS
from .ruler_tasks import METRICS, TASKS, Sample, found_all, generate, postprocess, task_haystack
from .specs import Run

RULER_HAYSTACKS = ("ruler", "noise", "essay")  # "ruler": each task's own (RULER's scripts/synthetic.yaml)
RATIOS = (0.25, 0.5, 0.75, 0.875)  # kvpress's leaderboard
UNINFORMATIVE = 10.0  # a task the full cache scores at most this on says nothing about compression


def budget_at(ratio: float, n: int) -> int:
    """Tokens kept per layer and KV head when `ratio` of `n` tokens is removed (at least 1).

    >>> budget_at(0.5, 901), budget_at(0.875, 1000), budget_at(0.75, 2)
    (450, 125, 1)
    """
    if not 0 <= ratio < 1:
        raise ValueError(f"compression ratio {ratio} is invalid: expected 0 <= ratio < 1 (the fraction removed)")
    return max(1, round((1 - ratio) * n))


def split(sample: Sample, protocol: str) -> Tuple[List[int], List[int]]:
    """`(ids the cache reads, ids fed after it)` of `sample` under `protocol`."""
    if protocol == "agnostic":
        return sample.context, sample.question
    if protocol == "aware":
        return sample.prompt[:-1], sample.prompt[-1:]
    raise ValueError(f"protocol {protocol!r} is invalid: expected 'aware' or 'agnostic'")


def stops(text: str, one_line: bool) -> bool:
    """A one-line answer has ended: a newline after its first letter or digit (a list may
    span lines: never).

    >>> stops(" 4721049.", True), stops(":\\n 4721049.\\n", True), stops(":\\n 4721049.", True), stops("a\\n", False)
    (False, True, False, False)
    """
    start = re.search(r"[^\W_]", text)
    return one_line and start is not None and "\n" in text[start.start():]


def respond(model, tokenizer, ask: Sequence[int], cache: list, sample: Sample) -> Tuple[str, int]:
    """`(prediction, tokens decoded)`: greedy tokens after `ask` through `cache`, up to the
    sample's max_tokens, stopping early where the score cannot change (module docstring)."""
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    out: List[int] = []
    text = ""
    for token, _ in generate_step(mx.array(ask), model, max_tokens=sample.max_tokens, prompt_cache=cache):
        if token in eos:
            break
        out.append(int(token))
        text = tokenizer.decode(out)
        if stops(text, sample.one_line) or found_all(text, sample.answers):
            break
    return postprocess(text), len(out)


def _settings(args, n: int) -> List[Tuple[str, float, int]]:
    """`(kind, value, budget)` per ratio and fixed budget, for a context of n tokens read."""
    return ([("ratio", r, budget_at(r, n)) for r in args.ruler_ratios]
            + [("budget", b, b) for b in args.ruler_budgets])


def check(run: Run) -> None:
    """Bad flags as argparse errors, before the model does any work."""
    args = run.args
    for r in args.ruler_ratios:
        if not 0 <= r < 1:
            run.parser.error(f"--ruler-ratios {r} is invalid: expected 0 <= ratio < 1 (the fraction removed)")
    for b in args.ruler_budgets:
        if b < 1:
            run.parser.error(f"--ruler-budgets {b} is invalid: expected >= 1")
        run.policy(b)  # the H2O config at b, or the argparse error naming why not
    if args.ruler_samples < 1:
        run.parser.error(f"--ruler-samples {args.ruler_samples} is invalid: expected >= 1")
    if args.ruler_first_sample < 0:
        run.parser.error(f"--ruler-first-sample {args.ruler_first_sample} is invalid: expected >= 0")
    if not args.ruler_ratios and not args.ruler_budgets:
        run.parser.error("eval ruler needs --ruler-ratios or --ruler-budgets: expected at least one")


def _cell(run: Run, methods: dict, length: int, haystack: Optional[str], task: str) -> dict:
    """Every method, setting and protocol on the samples of one (length, haystack, task):
    `{"samples": [...], "results": {(protocol, method, kind, value): [(score, budget, seconds, pred)]}}`."""
    args, model, tokenizer = run.args, run.model, run.tokenizer
    metric = METRICS[TASKS[task].family]
    first = args.ruler_first_sample
    samples = [generate(tokenizer, task, length, i, haystack, args.ruler_template)
               for i in range(first, first + args.ruler_samples)]
    results: Dict[tuple, list] = {}
    for s in samples:
        reference = None
        for protocol in args.protocols:
            read, ask = split(s, protocol)
            settings = _settings(args, len(read))
            for name, method in methods.items():
                if not method.budgeted:
                    if reference is None:  # read once: both protocols read the same tokens, nothing evicted
                        start = time.perf_counter()
                        cache = method.compress(model, s.context, None)
                        seconds = time.perf_counter() - start
                        pred, _ = respond(model, tokenizer, s.question, cache, s)
                        reference = (metric([pred], [s.answers]), len(s.context), seconds, pred)
                    results.setdefault((protocol, name, "full", None), []).append(reference)
                    continue
                start = time.perf_counter()
                caches = method.compress_many(model, read, [b for _, _, b in settings])
                seconds = (time.perf_counter() - start) / len(settings)
                if len(caches) != len(settings):
                    raise ValueError(f"method {name!r} returned {len(caches)} caches for {len(settings)} "
                                     "budgets: expected one per budget, in order")
                for (kind, value, budget), cache in zip(settings, caches):
                    pred, _ = respond(model, tokenizer, ask, cache, s)
                    results.setdefault((protocol, name, kind, value), []).append(
                        (metric([pred], [s.answers]), budget, seconds, pred))
        print(f"ruler {length} {s.haystack or '-':6s} {task:16s} sample {s.index}: " + "  ".join(
            f"{p[:3]} {n} {k[0]}{v if v is not None else ''} {r[-1][0]:.0f}"
            for (p, n, k, v), r in results.items()), flush=True)
    return {"samples": samples, "results": results}


def measure(run: Run) -> dict:
    """RULER's synthetic tasks (NIAH, variable tracking, common/frequent words) at compression ratios"""
    check(run)
    args = run.args
    names = ["full"] + [m for m in args.ruler_methods if m != "full"]
    methods = {name: METHODS[name](run) for name in names}
    for method in methods.values():
        method.prepare(run.model)
    rows, prompts, predictions, done = [], {}, {}, {}
    for length in args.ruler_lengths:
        for mode in args.ruler_haystacks:
            haystack = None if mode == "ruler" else mode
            for task in args.ruler_tasks:
                key = (length, task_haystack(task, haystack), task)
                if key not in done:  # a task whose haystack the mode does not change is run once
                    done[key] = _cell(run, methods, length, haystack, task)
                cell = done[key]
                prompts[f"{length}/{mode}/{task}"] = {
                    "haystack": cell["samples"][0].haystack,
                    "context": sum(len(s.context) for s in cell["samples"]) / len(cell["samples"]),
                    "question": sum(len(s.question) for s in cell["samples"]) / len(cell["samples"])}
                for (protocol, name, kind, value), got in cell["results"].items():
                    rows.append({"protocol": protocol, "length": length, "haystack": mode, "task": task,
                                 "method": name, "label": methods[name].label, "kind": kind, "value": value,
                                 "score": sum(g[0] for g in got) / len(got), "scores": [g[0] for g in got],
                                 "budget": sum(g[1] for g in got) / len(got),
                                 "seconds": sum(g[2] for g in got) / len(got)})
                    if name == "full" and protocol == args.protocols[0]:
                        predictions[f"{length}/{mode}/{task}"] = [g[3] for g in got]
    return {"command": run.command, "template": args.ruler_template, "samples": args.ruler_samples,
            "first_sample": args.ruler_first_sample,
            "tasks": list(args.ruler_tasks), "lengths": list(args.ruler_lengths),
            "haystacks": list(args.ruler_haystacks), "protocols": list(args.protocols),
            "ratios": list(args.ruler_ratios), "budgets": list(args.ruler_budgets),
            "methods": {name: m.label for name, m in methods.items()}, "prompts": prompts,
            "tasks_rows": rows, "table": table(rows), "full_predictions": predictions}


def table(rows: List[dict]) -> List[dict]:
    """One entry per (protocol, length, haystack, method, setting): the per-task scores, their
    mean, the mean over the tasks the full cache does not fail (> UNINFORMATIVE), the gap
    to the full cache's means, the mean budget and the mean seconds reading a context."""
    groups: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["protocol"], r["length"], r["haystack"], r["method"], r["kind"], r["value"]), {})[
            r["task"]] = r
    full = {k[:3]: g for k, g in groups.items() if k[4] == "full"}
    out = []
    for (protocol, length, haystack, method, kind, value), tasks in groups.items():
        ref = full[(protocol, length, haystack)]
        informative = [t for t in tasks if ref[t]["score"] > UNINFORMATIVE]
        mean = sum(r["score"] for r in tasks.values()) / len(tasks)
        full_mean = sum(r["score"] for r in ref.values()) / len(ref)
        inf = sum(tasks[t]["score"] for t in informative) / len(informative) if informative else None
        inf_full = sum(ref[t]["score"] for t in informative) / len(informative) if informative else None
        out.append({"protocol": protocol, "length": length, "haystack": haystack, "method": method,
                    "label": next(iter(tasks.values()))["label"], "kind": kind, "value": value,
                    "scores": {t: r["score"] for t, r in tasks.items()}, "mean": mean, "gap": mean - full_mean,
                    "informative": informative, "mean_informative": inf,
                    "gap_informative": None if inf is None else inf - inf_full,
                    "budget": sum(r["budget"] for r in tasks.values()) / len(tasks),
                    "seconds": sum(r["seconds"] for r in tasks.values()) / len(tasks)})
    return out


PROTOCOL_TITLES = {"agnostic": "query-agnostic (context compressed, then the question)",
                   "aware": "query-aware (the question inside the compressed prompt)"}


def _setting(row: dict) -> str:
    if row["kind"] == "ratio":
        return f"{row['value']:g} removed"
    return f"budget {row['value']}" if row["kind"] == "budget" else "-"


def _merge_notes(r: dict, cell: tuple) -> List[str]:
    """What a merged report (`ruler_merge.merge`) came from, and the settings it left out in `cell`."""
    notes = []
    if r.get("merged"):
        notes.append("Merged by sample index (a later run replaces a sample an earlier one holds): " + "; ".join(
            f"samples {m['first_sample']}-{m['first_sample'] + m['samples'] - 1} of `{m['command']}` ({m['date']})"
            for m in r["merged"]) + ".")
    out = [d for d in r.get("dropped", ()) if (d["protocol"], d["length"], d["haystack"]) == cell]
    if out:
        notes.append("Left out: " + "; ".join(f"{d['method']} {_setting(d)} ({d['why']})" for d in out) + ".")
    return notes


def render(r: dict) -> List[str]:
    out = []
    for protocol in sorted(r["protocols"], key=("agnostic", "aware").index):  # the main table first
        for length in r["lengths"]:
            for haystack in r["haystacks"]:
                rows = [t for t in r["table"] if (t["protocol"], t["length"], t["haystack"]) ==
                        (protocol, length, haystack)]
                if not rows:
                    continue
                tasks, informative = r["tasks"], set(rows[0]["informative"])
                full = next(t for t in rows if t["kind"] == "full")
                dead = [t for t in tasks if t not in informative]
                first = r.get("first_sample", 0)
                notes = [f"{r['samples']} samples per task (from index {first}), template {r['template']}; "
                         f"haystack {haystack} "
                         f"({'each task as RULER defines it' if haystack == 'ruler' else 'instead of RULER filler'}"
                         "). Scores: RULER's string_match_all, percent. kept/head: mean tokens kept per layer "
                         "and KV head (a ratio r keeps round((1 - r) n) of the n read). vs full: the mean's gap "
                         "to the full cache. read s: seconds to read (compress) one context per budget."]
                notes += _merge_notes(r, (protocol, length, haystack))
                if dead:
                    notes.append(f"Uninformative here (the full cache scores <= {UNINFORMATIVE:g}): "
                                 f"{', '.join(dead)} (marked *); 'informative' averages the other tasks.")
                out += common.section(
                    f"RULER-style, {PROTOCOL_TITLES[protocol]}: {length} tokens, haystack {haystack}",
                    "method:l | setting:l | kept/head:r | " + " | ".join(
                        f"{t}{'' if t in informative else '*'}:r" for t in tasks)
                    + " | mean:r | vs full:r | informative:r | vs full:r | read s:r",
                    [(t["label"], _setting(t), f"{t['budget']:.0f}", *(f"{t['scores'][k]:.0f}" for k in tasks),
                      f"{t['mean']:.1f}", "-" if t is full else f"{t['gap']:+.1f}",
                      "-" if t["mean_informative"] is None else f"{t['mean_informative']:.1f}",
                      "-" if t is full or t["gap_informative"] is None else f"{t['gap_informative']:+.1f}",
                      f"{t['seconds']:.1f}") for t in rows],
                    r["command"], notes)
    return out


def plot(r: dict, path) -> None:
    """Mean score against the compression ratio, one line per method (the full cache at
    ratio 0 and as a dashed line), one panel per protocol, length and haystack (kvpress's
    leaderboard plot)."""
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - the bench extra installs it
        raise SystemExit("plots need matplotlib: pip install matplotlib (or the project's [bench] extra)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(p, n, h) for p in sorted(r["protocols"], key=("agnostic", "aware").index) for n in r["lengths"]
              for h in r["haystacks"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False, sharey=True)
    for ax, (protocol, length, haystack) in zip(axes[0], panels):
        rows = [t for t in r["table"] if (t["protocol"], t["length"], t["haystack"]) == (protocol, length, haystack)]
        full = next(t for t in rows if t["kind"] == "full")
        for method in dict.fromkeys(t["method"] for t in rows if t["kind"] == "ratio"):
            pts = sorted((t["value"], t["mean"]) for t in rows if t["method"] == method and t["kind"] == "ratio")
            pts = [(0.0, full["mean"])] + pts
            label = next(t["label"] for t in rows if t["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(full["mean"], color="k", ls="--", lw=1, label=full["label"])
        ax.set_xlabel("compression ratio (fraction of the context removed)")
        ax.set_title(f"{protocol}, {length} tokens, haystack {haystack}", fontsize=9)
        ax.grid(alpha=0.3)
    top = max(t["mean"] for t in r["table"])
    axes[0][0].set_ylim(0, min(100, top + 10))  # from 0: a few points' gap is drawn as a few points
    axes[0][0].set_ylabel("RULER mean score")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
