"""Demo: kept positions over time, Algorithm 1 as published vs grace + decay.

A synthetic stream whose keys drift slowly (a rotating direction plus noise),
so tokens attend most to their neighbours in time, like text does. With
grace=0 and decay=1 the newest token scores 0, is evicted at once, and the
kept set freezes on the first `budget` tokens; with grace and decay the
window follows the stream while the sinks stay.

Run: python -m h2o_fn demo [--budget 32] [--tokens 240]
"""

import argparse
import math
from typing import List, Optional

import mlx.core as mx

from .config import H2OConfig
from .core import compiled_step, init, kept_positions


def drifting_keys(T: int, D: int = 16, seed: int = 0) -> mx.array:
    """`[1, 1, T, D]` float32 keys: a direction turning with t, plus noise."""
    t = mx.arange(T, dtype=mx.float32)[:, None]
    freq = mx.arange(1, D // 2 + 1, dtype=mx.float32)[None] * (2 * math.pi / 400)
    base = mx.concatenate([mx.cos(t * freq), mx.sin(t * freq)], axis=-1) * 2.0
    noise = mx.random.normal((T, D), key=mx.random.key(seed)) * 0.5
    return (base + noise)[None, None]


def ranges(positions) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2 5 7-8'."""
    out, start, prev = [], None, None
    for p in positions + [None]:
        if start is not None and (p is None or p != prev + 1):
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = None
        if p is not None and start is None:
            start = p
        prev = p
    return " ".join(out)


def run(config: H2OConfig, keys: mx.array, report_at) -> dict:
    """Step the stream through the core; kept positions (head 0) at each report step."""
    state = init(config, 1, 1, keys.shape[-1], dtype=mx.float32)
    fast, out = compiled_step(config), {}
    for t in range(keys.shape[2]):
        state = fast(state, keys[:, :, t : t + 1], keys[:, :, t : t + 1])
        if t + 1 in report_at:
            out[t + 1] = [p for p in kept_positions(state)[0, 0].tolist() if p >= 0]
    return out


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m h2o_fn demo",
        description="Kept positions over time on a synthetic stream: Algorithm 1 as published "
        "freezes, the defaults (sinks, grace, decay) advance.",
    )
    parser.add_argument("--budget", type=int, default=32, help="tokens kept per head (default 32)")
    parser.add_argument("--tokens", type=int, default=240, help="length of the stream (default 240)")
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    try:
        published = H2OConfig(budget=args.budget, n_sink=0, grace=0, decay=1.0)
        defaults = H2OConfig().at_budget(args.budget)  # the defaults, grace scaled to the budget
    except ValueError as e:
        parser.error(str(e))
    keys = drifting_keys(args.tokens)
    report_at = sorted({args.budget, args.tokens // 4, args.tokens // 2, 3 * args.tokens // 4, args.tokens})
    for name, cfg in (
        ("Algorithm 1 as published (grace=0, decay=1.0): freezes", published),
        (f"h2o-fn defaults (n_sink={defaults.n_sink}, grace={defaults.grace}, decay={defaults.decay}): "
         "the window advances", defaults),
    ):
        print(f"{name}\n  {cfg}")
        for t, kept in run(cfg, keys, report_at).items():
            print(f"  after {t:4d} tokens: kept {len(kept):3d}: {ranges(kept)}")
        print()
