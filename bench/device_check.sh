#!/usr/bin/env bash
# Device check for an NVIDIA GPU machine: the CUDA kernel vs the pure MLX path.
#
#   pip install -e '.[test]' 'mlx[cuda]'     # the CUDA build of mlx
#   bash bench/device_check.sh               # PYTHON=... to pick the interpreter
#
# For each shape it runs h2o_fn.metal_ops.protected_argmin with use_kernel=True
# (the CUDA kernel) and the pure path h2o_fn.rule.protected_argmin (on the GPU and
# on the CPU stream), on random tie-heavy inputs with NaN/+-inf/+-0 and free
# slots, and prints whether the slots match bit for bit and the median per-call
# times (eager and under mx.compile). It also runs core.compiled_step with the
# kernel as argmin= against the default. Exit status 0 only if everything matches;
# 2 when there is no CUDA back-end.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

"$PYTHON" - "$@" <<'EOF'
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from h2o_fn import H2OConfig, core, rule
from h2o_fn.metal_ops import evict

if not mx.cuda.is_available():
    print(f"no CUDA back-end in mlx {mx.__version__} (mx.cuda.is_available() is False): "
          "install mlx[cuda] on an NVIDIA machine", file=sys.stderr)
    sys.exit(2)

print(f"mlx {mx.__version__}, default device {mx.default_device()}")

# Build the kernel once with verbose=True so a compile error comes with the source.
try:
    s, p = mx.zeros((1, 1, 4)), mx.arange(4, dtype=mx.int32).reshape(1, 1, 4)
    mx.eval(evict.launch(evict.cuda_kernel(), s, p, mx.array(3, dtype=mx.int32), 0, 0, verbose=True))
except Exception as e:  # noqa: BLE001: report and stop
    print(f"CUDA kernel failed to build or run: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(1)

POOL = np.array([0.0, -0.0, 1.0, 0.5, np.nan, np.inf, -np.inf], np.float32)
# (B, H, C, n_sink, grace): 257 rows is one full block plus one thread (grid rounding).
SHAPES = [
    (1, 1, 1, 0, 0), (3, 5, 7, 1, 1), (1, 8, 128, 4, 8), (4, 8, 128, 4, 8),
    (1, 8, 512, 4, 8), (4, 8, 512, 4, 8), (1, 8, 2048, 4, 8), (4, 8, 2048, 4, 8),
    (2, 4, 4096, 4, 64), (257, 1, 33, 2, 3), (16, 32, 1024, 0, 0),
]


def inputs(B, H, C, seed):
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((B, H, C)).astype(np.float32)
    tied = rng.random(scores.shape) < 0.5
    scores[tied] = rng.choice(POOL, size=int(tied.sum()))
    seen = C + 10
    positions = np.full((B * H, C), -1, np.int32)
    for row in positions:
        k = int(rng.integers(0, C + 1))
        row[rng.permutation(C)[:k]] = rng.choice(seen, size=k, replace=False)
    return mx.array(scores), mx.array(positions.reshape(B, H, C)), mx.array(seen - 1, dtype=mx.int32)


def median_us(fn, args, repeats=50, warmup=5):
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        mx.eval(fn(*args))
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


ok = True
print(f"{'shape':>16} {'sink':>4} {'grace':>5} | {'match':>5} | {'kernel us':>9} {'pure us':>8} | "
      f"{'ckernel us':>10} {'cpure us':>8}")
for B, H, C, n_sink, grace in SHAPES:
    def kernel(s, p, t, n_sink=n_sink, grace=grace):
        return evict.protected_argmin(s, p, t, n_sink, grace, use_kernel=True)

    def pure(s, p, t, n_sink=n_sink, grace=grace):
        return rule.protected_argmin(s, p, t, n_sink, grace)

    match = True
    for seed in range(5):
        x = inputs(B, H, C, seed)
        got = np.array(kernel(*x))
        with mx.stream(mx.cpu):
            want_cpu = np.array(pure(*x))
        want_gpu = np.array(pure(*x))
        match &= np.array_equal(got, want_cpu) and np.array_equal(got, want_gpu)
    ok &= match
    x = inputs(B, H, C, 0)
    t = [median_us(f, x) for f in (kernel, pure, mx.compile(kernel), mx.compile(pure))]
    print(f"{str((B, H, C)):>16} {n_sink:>4} {grace:>5} | {str(match):>5} | {t[0]:>9.1f} {t[1]:>8.1f} | "
          f"{t[2]:>10.1f} {t[3]:>8.1f}")

# The kernel as the core's argmin= under mx.compile, token by token.
cfg = H2OConfig(budget=64, n_sink=4, grace=8)
a = b = core.init(cfg, batch=2, n_heads=8, head_dim=16)
fused, plain = core.compiled_step(cfg, evict.protected_argmin), core.compiled_step(cfg)
mx.random.seed(0)
same = True
for _ in range(300):
    kv = mx.round(mx.random.normal((2, 8, 1, 16)))  # rounded keys: tied weights
    a, b = fused(a, kv, kv), plain(b, kv, kv)
    same &= bool(mx.array_equal(a.positions, b.positions).item())
print(f"compiled_step with the kernel as argmin= keeps the same positions over 300 tokens: {same}")
ok &= same

print("ALL MATCH" if ok else "MISMATCH")
sys.exit(0 if ok else 1)
EOF
