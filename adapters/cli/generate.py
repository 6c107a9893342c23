"""`python -m h2o_fn generate`: mlx-lm's generate with an H2O cache, and a side-by-side mode.

Flags mirror `mlx_lm.generate` (--model, --prompt, --max-tokens, --temp, --top-p, --seed,
--kv-bits, --kv-group-size; chat template on by default) plus the H2O policy (--budget,
--n-sink, --grace, --decay, --scoring, --prefill). The default model is the bundled
SmolLM2-135M-Instruct GGUF, so no argument is needed.

Under `mlx.launch` (more than one rank in `mx.distributed.init()`) the model is sharded by
attention heads over the ranks (mlx-lm's `shard`); each rank evicts its own KV heads and
rank 0 prints (see h2o_fn.adapters.distributed).

`--compare` runs the same prompt again with mlx-lm's full `KVCache` and a
`RotatingKVCache` of the same budget (and `QuantizedKVCache` with --kv-bits), then
prints a side-by-side summary. `--demo` is what `make run` shows: --compare, 300 new
tokens and a budget sized so that H2O evicts several times over (both only when not
given), and it says so.
"""

import argparse
import json
import math
import os
import sys
import textwrap
from typing import List, Optional

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

from h2o_fn import kept_positions

from ..attention import query_scoring
from ..metrics import build_prompt, describe_kept, first_divergence, held_tokens, kept_summary, repeated_4grams
from ..mlx_lm import DEFAULT_CONFIG, h2o_caches, make_h2o_cache
from .. import allocation
from . import baselines, common
from .baselines import Baseline

DEFAULT_TEXT = "Explain photosynthesis in detail."
DEFAULT_MAX_TOKENS = 256  # mlx_lm.generate's
DEMO_MAX_TOKENS = 300
DEMO_COMPRESSION = 2.5  # the demonstration's budget keeps at most 1 / 2.5 of the tokens


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m h2o_fn generate",
        description="Generate text with an H2O KV cache (mlx-lm), optionally side by side with "
        "mlx-lm's own caches.",
    )
    common.add_model_flag(parser)
    parser.add_argument("--prompt", "-p", default=DEFAULT_TEXT,
                        help=f"the prompt ('-' reads stdin; default {DEFAULT_TEXT!r})")
    parser.add_argument("--max-tokens", "-m", type=int, default=None,
                        help=f"tokens to generate (default {DEFAULT_MAX_TOKENS}; {DEMO_MAX_TOKENS} "
                        "with --demo)")
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sampling top-p (default 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    parser.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    parser.add_argument("--ignore-chat-template", action="store_true",
                        help="feed the prompt as raw text, without the tokenizer's chat template")
    parser.add_argument("--prefill-step-size", type=int, default=2048,
                        help="prompt tokens per forward pass (mlx-lm's default 2048)")
    common.add_policy_flags(
        parser,
        budget_help=f"tokens kept per layer and KV head (default {DEFAULT_CONFIG.budget}; with --demo, "
        f"sized to the run: the largest power of two at most (prompt + max tokens) / {DEMO_COMPRESSION})",
    )
    parser.set_defaults(budget=None)
    common.add_allocation_flag(parser)
    parser.add_argument("--compare", action="store_true",
                        help="also run mlx-lm's full KVCache and RotatingKVCache(budget, keep=n_sink) "
                        "(and QuantizedKVCache with --kv-bits), then a side-by-side summary")
    parser.add_argument("--demo", action="store_true",
                        help="the demonstration `make run` shows: --compare, --max-tokens "
                        f"{DEMO_MAX_TOKENS} and a budget sized so H2O evicts several times over, "
                        "unless you give them")
    parser.add_argument("--prompt-cache-file", default=None,
                        help="a prompt cache to start from (h2o-fn cache-prompt's or mlx_lm.cache_prompt's); "
                        "--prompt then continues it, and the cache's own policy applies")
    parser.add_argument("--kept-map", metavar="PATH", default=None,
                        help="save a picture (PNG) of the positions one layer/head of the H2O cache "
                        "kept after each generated token")
    parser.add_argument("--kept-map-layer", type=int, default=None,
                        help="the H2O layer of --kept-map (default: the middle one); head 0")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the run as JSON: the policy and one row per cache (text, token ids, "
                        "kept/seen, KV bytes, speeds, repetition, first divergence from the full cache)")
    return parser


def demo_budget(total_tokens: int) -> int:
    """The largest power of two <= total / DEMO_COMPRESSION (at least 16): H2O then
    keeps at most 40% of the tokens, evicting the rest one at a time.

    >>> demo_budget(35 + 300), demo_budget(1035), demo_budget(20)
    (128, 256, 16)
    """
    return max(16, 2 ** int(math.floor(math.log2(max(total_tokens / DEMO_COMPRESSION, 1)))))


def run_one(model, tokenizer, prompt_ids, cache, args, label: str, echo: bool, kept_map=None) -> dict:
    """Generate with `cache`; stream the text when `echo`; return text, ids and figures.

    `kept_map` (a list) gets the kept positions of the H2O layer `args.kept_map_layer`,
    head 0, after each token.
    """
    mx.random.seed(args.seed)
    sampler = make_sampler(args.temp, args.top_p)
    text, ids, last = [], [], None
    tokens_bar = None if echo else common.Progress(label, args.max_tokens)
    prompt_bar = []

    def on_prompt(done, total):
        if total > 512:  # long prompts only: a short one is done before anyone looks
            if not prompt_bar:
                prompt_bar.append(common.Progress(f"{label}: prompt", total))
            prompt_bar[0].update(done)

    layer = h2o_caches(cache)[args.kept_map_layer] if kept_map is not None else None
    for response in stream_generate(
        model,
        tokenizer,
        prompt_ids,
        max_tokens=args.max_tokens,
        sampler=sampler,
        prompt_cache=cache,
        prefill_step_size=args.prefill_step_size,
        prompt_progress_callback=on_prompt,
    ):
        text.append(response.text)
        ids.append(response.token)
        last = response
        if echo:
            print(response.text, end="", flush=True)
        if tokens_bar is not None:
            tokens_bar.update(len(ids))
        if layer is not None:
            kept_map.append([p for p in kept_positions(layer.core_state)[0, 0].tolist() if p >= 0])
    for bar in prompt_bar + ([tokens_bar] if tokens_bar else []):
        bar.close()
    h2o = h2o_caches(cache)
    return {
        "label": label,
        "text": "".join(text),
        "ids": ids,
        "prompt_tokens": last.prompt_tokens,
        "prompt_tps": last.prompt_tps,
        "generation_tokens": last.generation_tokens,
        "generation_tps": last.generation_tps,
        "peak_memory_gb": last.peak_memory,
        "kv_bytes": sum(c.nbytes for c in cache),
        "tokens_kept": h2o[0].tokens_kept if h2o else max(held_tokens(c) for c in cache),
        "tokens_seen": h2o[0].tokens_seen if h2o else max(c.offset for c in cache),
    }


def results(rows: List[dict], full: Optional[dict], **run) -> dict:
    """What `--json` writes: `run` (model, policy, ...) and the rows, each with its repetition
    and, beside a full cache, the first generated token that differs from it (None: never)."""
    out = []
    for r in rows:
        extra = {"repeated_4grams": repeated_4grams(r["ids"])}
        if full is not None and r is not full:
            extra["diverges_at"] = first_divergence(r["ids"], full["ids"])
        out.append({**r, **extra})
    return {"command": "generate", **run, "rows": out}


def write_json(path: Optional[str], data: dict) -> None:
    if path is not None:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
        print(f"results: {path}")


def report(r: dict) -> None:
    print(f"Prompt: {r['prompt_tokens']} tokens, {r['prompt_tps']:.1f} tokens-per-sec")
    print(f"Generation: {r['generation_tokens']} tokens, {r['generation_tps']:.2f} tokens-per-sec")
    ratio = r["tokens_seen"] / max(r["tokens_kept"], 1)
    print(
        f"KV cache: {r['tokens_kept']} kept / {r['tokens_seen']} seen tokens per layer "
        f"(compression {ratio:.2f}x), {r['kv_bytes'] / 2**20:.2f} MiB"
    )
    print(f"Peak memory: {r['peak_memory_gb']:.3f} GB")


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def summary(rows: List[dict], full: dict) -> List[str]:
    """The side-by-side table: one line per cache, the full cache as the reference."""
    head = (f"{'cache':34s} {'kept/seen':>9s} {'KV bytes':>10s} {'of full':>7s} {'tok/s':>6s} "
            f"{'diverges at':>11s} {'rep. 4-grams':>12s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        d = first_divergence(r["ids"], full["ids"])
        lines.append(
            f"{r['label']:34s} {str(r['tokens_kept']) + '/' + str(r['tokens_seen']):>9s} "
            f"{human_bytes(r['kv_bytes']):>10s} {r['kv_bytes'] / max(full['kv_bytes'], 1):7.0%} "
            f"{r['generation_tps']:6.1f} {('-' if r is full else 'never' if d is None else str(d)):>11s} "
            f"{repeated_4grams(r['ids']):12.3f}"
        )
    notes = (
        "kept/seen: tokens held / tokens fed, per layer and KV head. KV bytes: each cache's nbytes over "
        "all layers (mlx-lm's caches grow in steps of 256 tokens; H2O holds budget + evict_every slots plus a "
        "float32 score and an int32 position per slot). diverges at: the first generated token that "
        "differs from the full cache's, counted from 0 (never: the same tokens). rep. 4-grams: the "
        "share of generated 4-grams seen before (0 = no repetition)."
    )
    return lines + [""] + textwrap.wrap(notes, width=max(len(head), 80))


def file_policy(h2o: list):
    """The policy a file's H2O layers were built with: layer 0's, at the budget per head they
    were built with (a selection across layers gives each layer a budget of its own)."""
    policy = h2o[0].policy
    return policy._replace(config=policy.config._replace(budget=h2o[0].target_budget))


def answer_from_file(parser, args) -> None:
    """generate --prompt-cache-file: load the cache, check it fits the model, continue it."""
    from .cache_prompt import load, question_ids

    model, tokenizer = common.load_or_exit("generate", args.model)
    with query_scoring(model):  # query-scoring layers of the file need the hook too
        try:
            cache, meta = load(args.prompt_cache_file, model, args.model)
        except ValueError as e:
            parser.error(str(e))
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        ids = question_ids(tokenizer, prompt, meta)
        h2o = h2o_caches(cache)
        seen = max(c.offset for c in cache)
        print(f"h2o-fn generate: {common.model_name(args.model)}")
        if h2o:
            summary = kept_summary(h2o)
            print(f"H2O policy (from the file): {common.describe_policy(file_policy(h2o))}")
            print(f"Prompt cache {args.prompt_cache_file}: {seen} tokens kept as {describe_kept(summary)} "
                  f"(budget {summary['target']}, compression {seen / max(summary['mean'], 1):.2f}x), "
                  f"{sum(c.nbytes for c in cache) / 2**20:.2f} MiB of KV")
        else:
            print(f"Prompt cache {args.prompt_cache_file}: {seen} tokens, no H2O layer (mlx-lm's caches)")
        print("=" * 10, flush=True)
        r = run_one(model, tokenizer, ids, cache, args, "prompt cache", True)
    print("\n" + "=" * 10)
    report(r)
    policy = file_policy(h2o).fields() if h2o else None
    write_json(args.json, results([r], None, model=args.model, prompt_cache_file=args.prompt_cache_file,
                                  policy=policy, evict_every=h2o[0].evict_every if h2o else None))


def _budget_for_run(args, n_prompt: int) -> Optional[str]:
    """Set args.budget when not given; with --demo, the sentence saying why it was chosen."""
    if args.budget is not None:
        return None
    total = n_prompt + args.max_tokens
    args.budget = demo_budget(total) if args.demo else DEFAULT_CONFIG.budget
    if not args.demo:
        return None
    return (f"budget {args.budget} chosen for this demonstration: {n_prompt} prompt + "
            f"{args.max_tokens} new tokens = {total}, {total / args.budget:.1f}x the budget, "
            f"so H2O evicts about {total - args.budget} tokens per layer and head, one at a "
            "time (give --budget to choose your own)")


def _header(args, policy, group, chosen: Optional[str]) -> None:
    print(f"h2o-fn generate: {common.model_name(args.model)}")
    print(f"H2O policy: {common.describe_policy(policy)}")
    if group.size() > 1:
        print(f"tensor parallel: {group.size()} ranks over mx.distributed; each evicts its own KV heads, "
              "and KV bytes below are rank 0's share")
    if chosen:
        print(chosen)
    print("=" * 10, flush=True)


def _run_h2o(parser, args, model, tokenizer, ids, config, options: dict) -> dict:
    """Generate with H2O (inside `query_scoring(model)`); report it and the kept map."""
    bits = f", {options['kv_bits']}-bit" if options["kv_bits"] else ""
    label = f"H2O {config.scoring} (budget {config.budget}{bits})"
    budgets = allocation.budgets_for(model, args.allocation, config, tokenizer)
    if budgets is not None:
        print(f"per-layer budgets ({args.allocation}): {budgets}")
    cache = make_h2o_cache(model, config, budgets=budgets, **options)
    kept_map = None
    if args.kept_map is not None:
        n = len(h2o_caches(cache))
        args.kept_map_layer = n // 2 if args.kept_map_layer is None else args.kept_map_layer
        if not 0 <= args.kept_map_layer < n:
            parser.error(f"--kept-map-layer {args.kept_map_layer} is invalid: expected 0..{n - 1}")
        kept_map = []
    h2o = run_one(model, tokenizer, ids, cache, args, label, True, kept_map)
    print("\n" + "=" * 10)
    report(h2o)
    if kept_map is not None:
        from .plots import plot_kept

        title = f"{label}, layer {args.kept_map_layer}, head 0"
        plot_kept({title: kept_map}, args.kept_map)
        print(f"kept-positions map: {args.kept_map}")
    return h2o


def _baselines(args, model, tokenizer, ids, config, options: dict) -> List[dict]:
    """The same prompt with mlx-lm's full and rotating caches (and quantized with --kv-bits)."""
    others = [Baseline("full"), Baseline("rotating", budget=config.budget, keep=config.n_sink)]
    if options["kv_bits"]:
        others.append(Baseline("quantized", bits=options["kv_bits"], group_size=options["kv_group_size"]))
    rows = []
    for spec in others:
        r = run_one(model, tokenizer, ids, baselines.build(model, spec), args, spec.name, echo=False)
        print(f"\n--- {spec.name} ---\n{r['text']}\n---")
        report(r)
        rows.append(r)
    return rows


def main(argv: Optional[List[str]] = None) -> None:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if args.demo:
        args.compare = True
    if args.max_tokens is None:
        args.max_tokens = DEMO_MAX_TOKENS if args.demo else DEFAULT_MAX_TOKENS
    if args.max_tokens < 1:
        parser.error(f"--max-tokens {args.max_tokens} is invalid: expected at least 1")

    if args.prompt_cache_file is not None:
        if args.compare or args.demo or args.budget is not None or args.kept_map:
            parser.error("--prompt-cache-file is invalid with --compare, --demo, --budget or --kept-map: "
                         "expected the cache's own policy, alone")
        return answer_from_file(parser, args)
    if args.budget is not None:  # a bad combination fails before the model loads
        common.policy_or_error(parser, args, args.budget)
    model, tokenizer = common.load_or_exit("generate", args.model)
    group = common.shard_or_exit("generate", model)  # under mlx.launch: heads split over ranks
    if group.rank() != 0:  # every rank runs the same steps; rank 0 alone prints
        sys.stdout = sys.stderr = open(os.devnull, "w")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    ids = build_prompt(tokenizer, prompt, not args.ignore_chat_template, args.system_prompt)
    chosen = _budget_for_run(args, len(ids))
    config = common.policy_or_error(parser, args, args.budget)
    options = common.cache_options(parser, args)
    policy = common.policy_of(config, options)
    _header(args, policy, group, chosen)
    run = dict(model=args.model, policy=policy.fields(),
               evict_every=options["evict_every"], budget=config.budget, budget_chosen=chosen is not None,
               max_tokens=args.max_tokens)
    with query_scoring(model):  # the hook lives for this command only (make_h2o_cache uses it)
        h2o = _run_h2o(parser, args, model, tokenizer, ids, config, options)
        if not args.compare:
            return write_json(args.json, results([h2o], None, **run))
        rows = [h2o] + _baselines(args, model, tokenizer, ids, config, options)
    print("\n" + "=" * 10)
    print(f"Summary: {len(ids)} prompt + up to {args.max_tokens} generated tokens"
          + (f"; budget {config.budget} chosen for this demonstration" if chosen else ""))
    print("\n".join(summary(rows, rows[1])))
    write_json(args.json, results(rows, rows[1], **run))
