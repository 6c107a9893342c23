"""`python -m h2o_fn eval`: quality of H2O against the caches a user would otherwise pick.

Each section measures one thing on a real model (default: the bundled
SmolLM2-135M-Instruct) and returns its results; rendering (markdown, plots) reads
only those results. Caches are compared at the same budget: mlx-lm's full `KVCache`
(the ceiling), `RotatingKVCache` keeping as many first tokens as H2O's n_sink
(StreamingLLM), H2O with the key proxy and with true queries.

- ppl: streaming perplexity. A long real text (CPython's `pydoc_data.topics`) is fed
  in fixed chunks through the cache and every next token is scored; plus grace/decay
  ablations.
- frontier: streaming perplexity against KV bytes (fraction of a float16 full cache):
  full, mlx-lm's QuantizedKVCache, RotatingKVCache, H2O (key, query) x (kv_bits) x budgets.
- agree: greedy continuations of chat prompts; tokens until the first divergence from
  the full cache, repeated 4-grams, longest single-token run.
- retrieval: a pass key hidden in filler at several depths, asked for at the end, with
  the question inside the compressed prompt (query-aware) or after it (query-agnostic),
  plus cache_prompt's repeat-pass rows; several codes in one context compressed once and
  asked one by one.
- peak: peak memory while reading a long prompt, full prefill against cache_prompt.
- sweep: true-query H2O at one budget, decay, grace and the GQA reduction varied.
- mass: the oracle, the attention mass each query's best k keys hold (full cache).
- plots: a kept-positions map for one layer/head (and perplexity vs budget).
- ruler (only when named: it is the longest): RULER's synthetic tasks (needles, variable
  tracking, common and frequent words) on the noise and pydoc haystacks at 1k-4k tokens,
  each method of `quality/ruler_methods.py` at kvpress's compression ratios, the question
  after the compressed context (agnostic) or inside it (aware). `eval ruler --ruler-merge RUN...`
  measures nothing: it merges earlier runs by sample index into one report.

Writes results/eval/{eval.json, eval.md, *.png}; sections of earlier runs stay in
eval.json unless this run redoes them. Each section is one module of
`adapters/cli/quality/` with a `measure(run)` that returns its results and a
`render(results)` that reads only those; this module holds the flags and the order.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

from h2o_fn.allocation import POLICIES

from ..attention import query_scoring
from ..metrics import HAYSTACKS
from ..retention import CHUNK, POOL, SHARE, SURPRISAL, WIDTH, WINDOWS
from . import common, plots
from .quality import agree, frontier, kept_map, mass, passkey, peak, ppl, ruler, ruler_merge, sweep
from .quality.ruler_methods import METHODS as RULER_METHODS
from .quality.ruler_tasks import TASKS as RULER_TASKS, TEMPLATES as RULER_TEMPLATES
from .quality.specs import PROMPTS, RETRIEVAL_FAMILIES, Run
from .retrieval import PROTOCOLS


def _bits(text: str) -> Optional[int]:
    return None if text.lower() == "none" else int(text)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m h2o_fn eval", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="sections:\n" + "\n".join(
                                         f"  {name:10s} {section.measure.__doc__.splitlines()[0]}"
                                         for name, (_, section) in SECTIONS.items()))
    parser.add_argument("what", nargs="*", default=[s for s in SECTIONS if s not in OPT_IN],
                        help=f"sections to run, any of: {' '.join(SECTIONS)} (default: all but "
                        f"{' '.join(OPT_IN)})")
    common.add_run_flags(parser, "results/eval")
    common.add_policy_flags(parser, ("n_sink", "grace", "decay", "kv_bits", "kv_group_size", "window", "pool",
                                     "evict_every"))
    parser.add_argument("--allocations", nargs="+", choices=POLICIES, default=list(POLICIES),
                        help="per-layer budget policies compared in ppl (true-query H2O; default: all)")
    parser.add_argument("--tokens", type=int, default=2048, help="perplexity text length (default 2048)")
    parser.add_argument("--text-file", default=None, help="perplexity text (default: CPython's pydoc topics)")
    parser.add_argument("--chunk", type=int, default=16, help="tokens per forward pass in ppl (default 16)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512],
                        help="budgets of ppl, and the k of mass (default 64 128 256 512)")
    parser.add_argument("--prefills", nargs="+", default=["greedy", "oneshot"], choices=["greedy", "oneshot"],
                        help="H2O prefill modes compared in ppl (agree and retrieval use oneshot)")
    parser.add_argument("--no-ablations", action="store_true", help="ppl without the grace/decay ablations")
    parser.add_argument("--sweep-budget", type=int, default=512, help="budget of the sweep (default 512)")
    parser.add_argument("--frontier-budgets", type=int, nargs="+", default=[128, 256, 512, 1024],
                        help="H2O and RotatingKVCache budgets of frontier (default 128 256 512 1024)")
    parser.add_argument("--frontier-bits", type=_bits, nargs="+", default=[None, 8, 4], metavar="BITS",
                        help="H2O kv_bits of frontier ('none' = unquantized); the numbers also give "
                        "mlx-lm's QuantizedKVCache rows (default none 8 4)")
    parser.add_argument("--gen-tokens", type=int, default=160, help="greedy tokens per prompt in agree")
    parser.add_argument("--gen-budgets", type=int, nargs="+", default=[64, 128],
                        help="budgets of agree; the smallest is the kept-positions map's")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="chat prompts in agree (at most 4)")
    parser.add_argument("--passkey-context", type=int, default=768, help="filler tokens around the pass key")
    parser.add_argument("--passkey-budgets", type=int, nargs="+", default=[128, 256],
                        help="budgets of retrieval (default 128 256)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9],
                        help="where the pass key sits in the filler, 0 = start (default 5 depths)")
    parser.add_argument("--trials", type=int, default=3, help="pass keys per depth (default 3)")
    parser.add_argument("--passkey-haystacks", nargs="+", choices=HAYSTACKS, default=list(HAYSTACKS),
                        help="what hides the pass key: noise (RULER's repeated sentences), pydoc (CPython's docs, "
                        "the key on a line of its own), pydoc-inline (the key inside a line) (default all)")
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS),
                        help="retrieval protocols: the question inside the compressed prompt (aware) or "
                        "asked after it (agnostic) (default both)")
    add_repeat_flags(parser)
    parser.add_argument("--caches", nargs="+", choices=RETRIEVAL_FAMILIES, default=list(RETRIEVAL_FAMILIES),
                        help="cache families of retrieval and peak (the full cache always runs: the reference)")
    parser.add_argument("--facts", type=int, default=4, help="codes hidden in one context (at most 4)")
    parser.add_argument("--facts-trials", type=int, default=3, help="contexts of several facts (default 3; 0: none)")
    parser.add_argument("--peak-context", type=int, default=4096,
                        help="prompt tokens of the peak-memory measurement (default 4096)")
    parser.add_argument("--map-steps", type=int, default=200, help="decode steps of the kept-positions map")
    add_ruler_flags(parser)
    return parser


def add_repeat_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of cache_prompt's rows (retrieval, peak, ruler): its `chunk_size`, `pool`,
    `surprisal`, `share` and `width`."""
    parser.add_argument("--repeat-chunk", type=int, default=CHUNK,
                        help=f"prompt tokens per chunk of cache_prompt's repeat pass (default {CHUNK})")
    parser.add_argument("--repeat-pool", type=int, default=POOL,
                        help=f"cache_prompt's pooling of the repeat pass's scores, in tokens "
                        f"(odd; default {POOL}: none)")
    parser.add_argument("--repeat-surprisal", type=float, default=SURPRISAL,
                        help=f"cache_prompt's weight of each token's surprisal on its score "
                        f"(default {SURPRISAL}; 0: none)")
    parser.add_argument("--repeat-share", type=float, default=None,
                        help="cache_prompt's share of a head's budget for the best windows, kept whole in every "
                        f"head (not with uniform; default {SHARE} with a global selection, 0 with layer; 0: none)")
    parser.add_argument("--repeat-share-width", type=int, default=WIDTH,
                        help=f"cache_prompt's tokens per shared window (default {WIDTH})")
    parser.add_argument("--repeat-share-windows", type=common.count_or_none, default=WINDOWS,
                        help=f"cache_prompt's most shared windows in a prompt (0: no bound; default {WINDOWS})")


def add_ruler_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `eval ruler` (its methods: the registry of quality/ruler_methods.py)."""
    group = parser.add_argument_group("ruler (RULER's synthetic tasks; --protocols and --repeat-chunk apply)")
    group.add_argument("--ruler-tasks", nargs="+", choices=list(RULER_TASKS), default=list(RULER_TASKS),
                       metavar="TASK", help=f"RULER task names (default all: {' '.join(RULER_TASKS)})")
    group.add_argument("--ruler-lengths", type=int, nargs="+", default=[1024, 2048, 4096],
                       help="prompt plus generated tokens, as RULER's max_seq_length (default 1024 2048 4096)")
    group.add_argument("--ruler-haystacks", nargs="+", choices=ruler.RULER_HAYSTACKS, default=["ruler"],
                       help="ruler: each task's own haystack (noise, pydoc text for RULER's essays, distractor "
                       "needles); noise or essay: that one for every task with a filler haystack (default ruler)")
    group.add_argument("--ruler-ratios", type=float, nargs="*", default=list(ruler.RATIOS),
                       help="fractions of the context removed, kvpress's compression ratios "
                       f"(default {' '.join(map(str, ruler.RATIOS))})")
    group.add_argument("--ruler-budgets", type=int, nargs="*", default=[],
                       help="fixed budgets, tokens per layer and KV head (default none)")
    group.add_argument("--ruler-samples", type=int, default=4, help="samples per task (default 4)")
    group.add_argument("--ruler-first-sample", type=int, default=0,
                       help="index of the first sample: a run of samples 2-3 adds to one of 0-1 (default 0)")
    group.add_argument("--ruler-methods", nargs="+", choices=list(RULER_METHODS), default=list(RULER_METHODS),
                       help="methods compared (quality/ruler_methods.py; the full cache always runs: the "
                       "reference) (default all)")
    group.add_argument("--ruler-template", choices=RULER_TEMPLATES, default="base",
                       help="base: RULER's task template as is; chat: inside the tokenizer's chat template "
                       "(default base)")
    group.add_argument("--ruler-merge", nargs="+", metavar="RUN", default=None,
                       help="measure nothing: merge earlier runs' ruler sections (eval.json files or their "
                       "folders, oldest first; a later run replaces a sample it shares) into --out's report "
                       "and plot (quality/ruler_merge.py)")


# name -> (results key, section module); run in this order whatever order they are asked in
SECTIONS: Dict[str, tuple] = {
    "ppl": ("ppl", ppl),
    "frontier": ("frontier", frontier),
    "sweep": ("sweep", sweep),
    "mass": ("mass", mass),
    "agree": ("agree", agree),
    "retrieval": ("retrieval", passkey),
    "peak": ("peak", peak),
    "plots": ("kept_map", kept_map),
    "ruler": ("ruler", ruler),
}
OPT_IN = ("ruler",)  # run only when named

# results key -> its renderer, in the report's order (kept_map is drawn, not tabled)
RENDER: Dict[str, Callable[[dict], List[str]]] = {
    key: SECTIONS[key][1].render for key in ("ppl", "frontier", "mass", "sweep", "agree", "retrieval", "peak",
                                             "ruler")}


def markdown(results: dict) -> str:
    return common.report("Quality", results, RENDER)


def draw(results: dict, out: Path, what: List[str]) -> List[str]:
    """The figures of the sections run now; returns the file names written."""
    written = []
    if "plots" in what and "ppl" in results:
        plots.plot_ppl(results["ppl"]["rows"], results["ppl"]["full_ppl"], out / "ppl_vs_budget.png")
        written.append("ppl_vs_budget.png")
    if "plots" in what and "maps" in results.get("kept_map", {}):
        plots.plot_kept(results["kept_map"]["maps"], out / "kept_positions.png")
        written.append("kept_positions.png")
    if "plots" in what and "ppl" in results:
        layers = {f"{r['allocation']} (mean {r['budget']})": r["budgets"] for r in results["ppl"]["rows"]
                  if r.get("allocation")}
        if layers:
            plots.plot_budgets(layers, out / "layer_budgets.png")
            written.append("layer_budgets.png")
    if "frontier" in what and "frontier" in results:
        plots.plot_frontier(results["frontier"]["rows"], out / "frontier.png")
        written.append("frontier.png")
    if "ruler" in what and "ruler" in results:
        ruler.plot(results["ruler"], out / "ruler.png")
        written.append("ruler.png")
    return written


def main(argv: Optional[List[str]] = None) -> None:
    parser = setup_arg_parser()
    args = common.parse_sections(parser, argv, SECTIONS)
    budgets = {"ppl": args.budgets, "agree": args.gen_budgets, "plots": args.gen_budgets,
               "retrieval": args.passkey_budgets, "peak": args.passkey_budgets, "sweep": [args.sweep_budget]}
    for budget in {b for w in args.what for b in budgets.get(w, ())}:
        common.policy_or_error(parser, args, budget)  # a bad combination fails before any work
    for budget in args.frontier_budgets if "frontier" in args.what else ():
        common.policy_or_error(parser, args, budget)
    for bits in args.frontier_bits if "frontier" in args.what else ():
        common.storage_or_error(parser, bits, args.kv_group_size)
    if args.ruler_merge is not None and args.what != ["ruler"]:
        parser.error(f"--ruler-merge merges ruler sections only: expected the section ruler alone, not {args.what}")
    argv = list(sys.argv[1:] if argv is None else argv)
    out, header = common.start_run("eval", argv, args)
    previous = out / "eval.json"  # sections from earlier runs stay unless this run redoes them
    results = {**(json.loads(previous.read_text()) if previous.exists() else {}), **header}
    if args.ruler_merge is not None:
        parts = _runs(parser, args.ruler_merge)
        try:
            results["ruler"] = ruler_merge.merge(parts, header["command"])
        except ValueError as e:
            parser.error(f"--ruler-merge: {e}")
        for key in ("blas", "weights"):  # the runs' own, not this process's
            results[key] = "; ".join(dict.fromkeys(p[key] for p in parts))
        return _write(results, out, ["ruler"])
    model, tokenizer = common.load_or_exit("eval", args.model, dequantize=not args.quantized)
    run = Run(model, tokenizer, args, parser, header["command"])
    with query_scoring(model):  # the hook lives for this command only
        for name, (key, section) in SECTIONS.items():
            if name in args.what:
                results[key] = section.measure(run)
    _write(results, out, args.what)


def _runs(parser: argparse.ArgumentParser, runs: List[str]) -> List[dict]:
    """`--ruler-merge`'s runs (eval.json files or folders holding one), or the argparse error naming why not."""
    parts = []
    for run in runs:
        path = Path(run) / "eval.json" if Path(run).is_dir() else Path(run)
        if not path.is_file():
            parser.error(f"--ruler-merge {run} is invalid: expected an eval.json file or a folder holding one")
        part = json.loads(path.read_text())
        if "ruler" not in part:
            parser.error(f"--ruler-merge {run} is invalid: {path} has no ruler section (sections: {sorted(part)})")
        parts.append(part)
    return parts


def _write(results: dict, out: Path, what: List[str]) -> None:
    (out / "eval.json").write_text(json.dumps(results, indent=1))
    (out / "eval.md").write_text(markdown(results))
    figures = draw(results, out, what)
    print("\n" + markdown(results))
    print(f"wrote {out}/eval.json, eval.md" + "".join(f", {f}" for f in figures))
