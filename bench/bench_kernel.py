"""Per-call time of the protected argmin: the dispatcher's default path vs the pure path.

Usage: python bench/bench_kernel.py [--repeats 100] [--warmup 10]

Shapes `[B, H, C]` with C in {128, 512, 2048} and B * H in {8, 32}. Each repeat
times the op and the pure path back to back (eager, then each under `mx.compile`),
with `mx.eval` on the result; the table shows medians in microseconds. Where no
Metal/CUDA back-end exists the dispatcher takes the pure path, so both columns
time the same function: the table says so.
"""

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from h2o_fn import rule
from h2o_fn.metal_ops import evict

SHAPES = [(1, 8, C) for C in (128, 512, 2048)] + [(4, 8, C) for C in (128, 512, 2048)]
N_SINK, GRACE = 4, 8
POOL = np.array([0.0, -0.0, 1.0, 0.5, np.nan, np.inf, -np.inf], np.float32)


def inputs(shape, seed=0):
    """Scores with ties/NaN/+-inf and a full cache of distinct positions `[B, H, C]`."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal(shape).astype(np.float32)
    tied = rng.random(shape) < 0.3
    scores[tied] = rng.choice(POOL, size=int(tied.sum()))
    C = shape[-1]
    positions = np.stack([rng.permutation(C) for _ in range(shape[0] * shape[1])]).reshape(shape)
    return mx.array(scores), mx.array(positions.astype(np.int32)), mx.array(C - 1, dtype=mx.int32)


def op(scores, positions, newest):
    return evict.protected_argmin(scores, positions, newest, N_SINK, GRACE)


def pure(scores, positions, newest):
    return rule.protected_argmin(scores, positions, newest, N_SINK, GRACE)


def bench(fns, args, repeats, warmup):
    """Median microseconds per call for each of `fns`, timed back to back per repeat."""
    times = [[] for _ in fns]
    for i in range(warmup + repeats):
        for fn, t in zip(fns, times):
            start = time.perf_counter()
            mx.eval(fn(*args))
            if i >= warmup:
                t.append((time.perf_counter() - start) * 1e6)
    return [statistics.median(t) for t in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()

    kernel = evict.available_kernel()
    on_gpu = mx.default_device().type == mx.gpu
    backend = ("metal" if mx.metal.is_available() else "cuda") if kernel is not None else None
    print(f"mlx {mx.__version__}, default device {mx.default_device()}")
    if kernel is not None and on_gpu:
        print(f"op = fused {backend} kernel (dispatcher default); pure = h2o_fn.rule.protected_argmin")
    else:
        print(
            f"kernel NOT available (mx.metal.is_available()={mx.metal.is_available()}, "
            f"mx.cuda.is_available()={mx.cuda.is_available()}, default device {mx.default_device()}): "
            "the dispatcher takes the pure path, so 'op' and 'pure' time the same function"
        )
    cop, cpure = mx.compile(op), mx.compile(pure)
    header = f"{'B*H':>4} {'C':>5} | {'op us':>8} {'pure us':>8} {'ratio':>6} | " \
             f"{'cop us':>8} {'cpure us':>8} {'ratio':>6} | match"
    print(header)
    print("-" * len(header))
    for shape in SHAPES:
        x = inputs(shape)
        match = np.array_equal(np.array(op(*x)), np.array(pure(*x)))
        t_op, t_pure, t_cop, t_cpure = bench([op, pure, cop, cpure], x, args.repeats, args.warmup)
        print(f"{shape[0] * shape[1]:>4} {shape[2]:>5} | {t_op:>8.1f} {t_pure:>8.1f} {t_op / t_pure:>6.2f} | "
              f"{t_cop:>8.1f} {t_cpure:>8.1f} {t_cop / t_cpure:>6.2f} | {match}")


if __name__ == "__main__":
    main()
