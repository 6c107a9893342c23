"""Per-layer budgets at the bytes of one uniform budget.

A policy turns (number of layers, mean budget) into one budget per layer with
sum <= n_layers * mean, every budget >= a floor (what n_sink + grace + 1 needs):

- `uniform`: the mean everywhere (one budget for every layer).
- `pyramid`: PyramidKV's linear rule, 1.5x the mean at the first layer down to 0.5x at
  the last (lower layers attend more diffusely).
- `from_need`: proportional to a measured per-layer need (for example the keys each
  layer needs to cover a share of its attention mass), mixed with uniform:
  b_l = mean * (mix * need_l / mean(need) + 1 - mix). `h2o_fn.adapters.allocation`
  measures the need on a calibration text.

Budgets are rounded down, then the remainder goes to the layers with the largest
fractional parts, so the sum is exactly n_layers * mean when the floors allow it.

Example:
    >>> from h2o_fn.allocation import pyramid, from_need, uniform
    >>> uniform(3, 100)
    [100, 100, 100]
    >>> pyramid(4, 128, floor=21)
    [192, 149, 107, 64]
    >>> from_need([10.0, 30.0], 100, floor=21, mix=1.0)
    [50, 150]
"""

import math
from typing import List, Sequence

POLICIES = ("uniform", "pyramid", "calibrated")


def _rounded(raw: Sequence[float], total: int, floor: int) -> List[int]:
    """Integers >= floor close to `raw`, summing to `total` (or to as little above it as
    the floors force)."""
    raw = [max(float(x), floor) for x in raw]
    scale = total / sum(raw) if sum(raw) > total else 1.0
    raw = [max(x * scale, floor) for x in raw]
    out = [max(int(math.floor(x)), floor) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - out[i], reverse=True)
    for i in order[: max(total - sum(out), 0)]:
        out[i] += 1
    while sum(out) > total and any(b > floor for b in out):  # floors pushed it over: take back
        i = max(range(len(out)), key=lambda j: out[j])
        out[i] -= 1
    return out


def uniform(n_layers: int, mean: int) -> List[int]:
    return [int(mean)] * n_layers


def pyramid(n_layers: int, mean: int, floor: int = 1) -> List[int]:
    """Linear from 1.5 * mean (first layer) to 0.5 * mean (last), sum n_layers * mean."""
    if n_layers == 1:
        return [int(mean)]
    raw = [mean * (1.5 - l / (n_layers - 1)) for l in range(n_layers)]
    return _rounded(raw, n_layers * int(mean), floor)


def from_need(need: Sequence[float], mean: int, floor: int = 1, mix: float = 0.5) -> List[int]:
    """Budgets proportional to `need` (one number per layer, > 0), mixed with uniform."""
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"mix={mix!r} is invalid: expected a float in [0, 1]")
    if not need or any(not math.isfinite(x) or x <= 0 for x in need):
        raise ValueError(f"need={list(need)!r} is invalid: expected positive finite numbers, one per layer")
    average = sum(need) / len(need)
    raw = [mean * (mix * x / average + 1 - mix) for x in need]
    return _rounded(raw, len(need) * int(mean), floor)
