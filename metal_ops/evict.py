"""The protected argmin as one kernel body for Metal, CUDA and the CPU test harness.

`BODY` is compiled unchanged by `mx.fast.metal_kernel`, `mx.fast.cuda_kernel` and
g++ (tests/test_kernel_harness.py). What differs per backend sits in a small
header of macros: `METAL_HEADER`, `CUDA_HEADER`, tests/kernel_shim.h. The body
only compares (no float arithmetic), so its slot choice is bit-identical to the
pure path `h2o_fn.rule.protected_argmin`, which is its spec.

Kernel contract (one thread per (b, h) row, R = B * H rows of C slots):
  scores    `[R, C]` float32     (`scores_shape` = {R, C} is bound by MLX)
  positions `[R, C]` int32, -1 for a free slot
  bounds    `[1 + R]` int32: {n_sink, then newest - grace per row}; row r's candidates
            lie in [n_sink, bounds[1 + r]] (rows of a batch count their own positions)
  slot      `[R]` int32 out: the lowest (score, position) candidate's slot, or -1

The body names the thread index `thread_position_in_grid.x` literally: MLX binds
the Metal attribute only when the body's text mentions it (a header macro is not
scanned), so CUDA and the shim define that name instead.
"""

import functools
from typing import Optional

import mlx.core as mx

from h2o_fn import rule

NAME = "h2o_protected_argmin"
INPUT_NAMES = ("scores", "positions", "bounds")
OUTPUT_NAMES = ("slot",)
THREADS = 256  # threads per threadgroup/block; CUDA rounds the grid up to a multiple

BODY = """
    // One thread per (b, h) row: the lowest (score, position) unprotected slot, or -1.
    const int rows = scores_shape[0];
    const int C = scores_shape[1];
    const int row = int(thread_position_in_grid.x);
    if (row >= rows) {
        return;
    }
    const int lo = bounds[0];  // n_sink: positions below are sinks
    const int hi = bounds[1 + row];  // newest - grace: positions above are in the grace window
    int best = -1;
    float best_score = 0.0f;
    int best_pos = 0;
    for (int c = 0; c < C; ++c) {
        const int p = positions[row * C + c];
        if (p < lo || p > hi) {
            continue;
        }
        float s = scores[row * C + c];
        if (H2O_ISNAN(s)) {
            s = H2O_NEG_INF;
        }
        if (best < 0 || s < best_score || (s == best_score && p < best_pos)) {
            best = c;
            best_score = s;
            best_pos = p;
        }
    }
    slot[row] = best;
"""

METAL_HEADER = """
#define H2O_ISNAN(x) metal::isnan(x)
#define H2O_NEG_INF (-metal::numeric_limits<float>::infinity())
"""

# Placed by MLX before `namespace mlx::core::cu`, after its own header (which
# already includes <cuda/std/limits> and defines the macro `inf`: never use that name).
CUDA_HEADER = """
#include <cuda/std/cmath>
#define H2O_ISNAN(x) cuda::std::isnan(x)
#define H2O_NEG_INF (-cuda::std::numeric_limits<float>::infinity())
#define thread_position_in_grid make_uint3( \\
    blockIdx.x * blockDim.x + threadIdx.x, \\
    blockIdx.y * blockDim.y + threadIdx.y, \\
    blockIdx.z * blockDim.z + threadIdx.z)
"""


def _make(factory, header: str):
    return factory(name=NAME, input_names=list(INPUT_NAMES), output_names=list(OUTPUT_NAMES),
                   source=BODY, header=header)


def make_metal_kernel():
    """A new `mx.fast.metal_kernel` for `BODY` (builds without Metal; runs only with it)."""
    return _make(mx.fast.metal_kernel, METAL_HEADER)


def make_cuda_kernel():
    """A new `mx.fast.cuda_kernel` for `BODY` (raises where MLX has no CUDA back-end)."""
    return _make(mx.fast.cuda_kernel, CUDA_HEADER)


@functools.lru_cache(maxsize=None)
def metal_kernel():
    """The cached Metal kernel, or None when `mx.metal.is_available()` is False."""
    return make_metal_kernel() if mx.metal.is_available() else None


@functools.lru_cache(maxsize=None)
def cuda_kernel():
    """The cached CUDA kernel, or None when `mx.cuda.is_available()` is False."""
    return make_cuda_kernel() if mx.cuda.is_available() else None


def available_kernel():
    """The kernel of this machine's GPU back-end (Metal first, then CUDA), or None."""
    return metal_kernel() or cuda_kernel()


def _check(scores: mx.array, positions: mx.array, newest) -> None:
    if scores.dtype != mx.float32:
        raise TypeError(f"scores dtype {scores.dtype} is invalid: expected float32")
    if positions.dtype != mx.int32:
        raise TypeError(f"positions dtype {positions.dtype} is invalid: expected int32")
    if scores.shape != positions.shape:
        raise ValueError(
            f"scores shape {tuple(scores.shape)} != positions shape {tuple(positions.shape)}: "
            "expected equal [B, H, C]"
        )
    if scores.ndim < 1 or scores.shape[-1] < 1:
        raise ValueError(f"scores shape {tuple(scores.shape)} is invalid: expected [..., C] with C >= 1")
    if scores.size >= 2**31:
        raise ValueError(f"scores has {scores.size} entries: expected fewer than 2**31 (int32 indexing)")
    if isinstance(newest, mx.array) and (
        newest.dtype != mx.int32 or newest.ndim > 1 or (newest.ndim == 1 and newest.shape[0] != scores.shape[0])
    ):
        raise TypeError(
            f"newest is {newest.dtype} of shape {tuple(newest.shape)}: expected an int, or an int32 "
            f"array of shape [] or [B={scores.shape[0] if scores.ndim else '?'}]"
        )


def launch(kernel, scores, positions, newest, n_sink: int, grace: int, *, verbose: bool = False):
    """Run `kernel` (Metal or CUDA, same call) on `[..., C]` inputs -> `[...]` int32 slots.

    Inputs are checked as in `protected_argmin`; the kernel runs on the GPU stream.
    """
    _check(scores, positions, newest)
    newest = newest if isinstance(newest, mx.array) else mx.array(newest, dtype=mx.int32)
    C = scores.shape[-1]
    rows = scores.size // C
    if rows == 0:  # no (b, h) rows: nothing to launch
        return mx.zeros(scores.shape[:-1], dtype=mx.int32)
    per_row = newest.reshape(-1, *([1] * (scores.ndim - 2))) if newest.ndim == 1 else newest
    limits = mx.broadcast_to(per_row - grace, scores.shape[:-1]).reshape(rows).astype(mx.int32)
    bounds = mx.concatenate([mx.array([n_sink], dtype=mx.int32), limits])
    (slot,) = kernel(
        inputs=[scores.reshape(rows, C), positions.reshape(rows, C), bounds],
        grid=(rows, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows,)],
        output_dtypes=[mx.int32],
        verbose=verbose,
        stream=mx.gpu,
    )
    return slot.reshape(scores.shape[:-1])


def protected_argmin(
    scores: mx.array,
    positions: mx.array,
    newest,
    n_sink: int,
    grace: int,
    *,
    use_kernel: Optional[bool] = None,
) -> mx.array:
    """The slot to free per (b, h): lowest (score, position) unprotected token, or -1.

    A drop-in for `argmin=` in `h2o_fn.core.step/evict/absorb` (also under `mx.compile`).

    Args:
      scores: `[B, H, C]` float32; NaN orders as -inf, +0.0 == -0.0.
      positions: `[B, H, C]` int32, -1 for a free slot.
      newest: `[]` int32 array (or int), the newest absorbed position t.
      n_sink, grace: positions `< n_sink` and `> t - grace` are protected.
      use_kernel: None picks the fused kernel when Metal or CUDA is available and the
        default device is the GPU, else the pure path; True forces the kernel (raises
        RuntimeError without a GPU back-end); False forces the pure path.

    Returns:
      `[B, H]` int32 slot index, or -1 where no slot is evictable. Bit-identical to
      `h2o_fn.rule.protected_argmin`.

    Example:
        >>> import mlx.core as mx
        >>> from h2o_fn.metal_ops import protected_argmin
        >>> scores = mx.array([[[0.5, 0.1, 0.1, 0.0, 0.3]]])
        >>> positions = mx.array([[[0, 4, 2, 6, 3]]], dtype=mx.int32)
        >>> protected_argmin(scores, positions, mx.array(6, dtype=mx.int32), n_sink=1, grace=1).tolist()
        [[2]]
    """
    if use_kernel not in (None, True, False):
        raise ValueError(f"use_kernel={use_kernel!r} is invalid: expected None, True or False")
    kernel = None
    if use_kernel is True:
        kernel = available_kernel()
        if kernel is None:
            raise RuntimeError(
                "use_kernel=True but no GPU back-end: mx.metal.is_available() and "
                "mx.cuda.is_available() are both False; expected one of them True "
                "(or pass use_kernel=None/False for the pure path)"
            )
    elif use_kernel is None:
        kernel = _default_kernel()
    if kernel is None:
        _check(scores, positions, newest)
        return rule.protected_argmin(scores, positions, newest, n_sink, grace)
    return launch(kernel, scores, positions, newest, n_sink, grace)


def _default_kernel():
    """The kernel `protected_argmin(use_kernel=None)` launches: one when the default device is
    the GPU and a back-end is available, else None (the pure path)."""
    return available_kernel() if mx.default_device().type == mx.gpu else None


def _victims(scores: mx.array, positions: mx.array, newest, n_sink: int, grace: int):
    """The victim as a `[B, H, C]` mask (`h2o_fn.rule.lowest`) where `protected_argmin` would
    take the pure path (use_kernel=None), else None: `evict` then asks the kernel for the slot."""
    if _default_kernel() is not None:
        return None
    _check(scores, positions, newest)
    return rule.lowest(scores, positions, newest, n_sink, grace)


protected_argmin.victims = _victims
