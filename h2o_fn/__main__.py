"""Command line: `python -m h2o_fn {demo,generate,eval,bench}` (also the `h2o-fn` script).

Only `demo` lives in the core package; the other commands need mlx-lm and are
loaded from `h2o_fn.adapters` when asked for.
"""

import argparse
import importlib
import sys


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "h2o_fn.demo", "generate": "h2o_fn.adapters.cli",
                "eval": "h2o_fn.adapters.evaluate", "bench": "h2o_fn.adapters.bench"}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m h2o_fn {{{','.join(commands)}}} [options]  (-h for each)")
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    command, rest = argv[0], argv[1:]
    if command == "demo":
        parser = argparse.ArgumentParser(prog="python -m h2o_fn demo",
                                         description="Kept positions over time: freeze vs defaults.")
        parser.add_argument("--budget", type=int, default=32)
        parser.add_argument("--tokens", type=int, default=240)
        args = parser.parse_args(rest)
        importlib.import_module(commands[command]).main(args.budget, args.tokens)
        return
    importlib.import_module(commands[command]).main(rest)


if __name__ == "__main__":
    main()
