"""Command line: `python -m h2o_fn {demo,generate,cache-prompt,eval,bench,serve}` (also the `h2o-fn` script).

Every command is a module with `setup_arg_parser()` and `main(argv=None)`, loaded by
name when asked for: only `demo` lives in the core package; the others need mlx-lm
and live in `h2o_fn.adapters.cli`.
"""

import importlib
import sys

COMMANDS = {
    "generate": "h2o_fn.adapters.cli.generate",
    "cache-prompt": "h2o_fn.adapters.cli.cache_prompt",
    "eval": "h2o_fn.adapters.cli.evaluate",
    "bench": "h2o_fn.adapters.cli.bench",
    "serve": "h2o_fn.adapters.cli.serve",
    "demo": "h2o_fn.demo",
}

SUMMARIES = {
    "generate": "generate text with an H2O cache (--demo: side by side with mlx-lm's caches)",
    "cache-prompt": "compress a prompt once (query-agnostic) into a prompt-cache file generate answers from",
    "eval": "quality: streaming perplexity, agreement, retrieval, memory frontier, oracle mass",
    "bench": "speed: per-layer update, decode vs context, prefill",
    "serve": "mlx-lm's OpenAI-compatible server (mlx_lm.server) with H2O caches",
    "demo": "the pure core on a synthetic stream: Algorithm 1's freeze vs grace + decay",
}


def usage() -> str:
    lines = [f"usage: python -m h2o_fn {{{','.join(COMMANDS)}}} [options]  (-h for each)", ""]
    lines += [f"  {name:12s} {SUMMARIES[name]}" for name in COMMANDS]
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        helped = bool(argv) and argv[0] in ("-h", "--help")
        print(usage(), file=sys.stdout if helped else sys.stderr)
        if argv and not helped:
            print(f"\nunknown command {argv[0]!r}", file=sys.stderr)
        raise SystemExit(0 if helped else 2)
    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
