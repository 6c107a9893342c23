"""Per-layer budgets for a model: `h2o_fn.allocation`'s policies, one calibrated on the
model's own attention.

- "uniform": the config's budget in every H2O layer.
- "pyramid": PyramidKV's linear rule (1.5x the mean at the first layer, 0.5x at the last).
- "calibrated": one forward pass over a calibration text with explicit attention
  (`metrics.oracle_mass`, per KV head, full cache); a layer's need is the square root
  of the attention mass its best `budget` keys miss (queries in the text's second
  half), mixed half and half with uniform (`allocation.from_need`). Layers whose
  attention is diffuse get more.

All spend the bytes of the uniform budget (sum <= n_layers * budget) and give every
layer at least n_sink + grace + 1. BENCHMARKS.md measures them: on the bundled model
none beats uniform, which therefore stays the default.

Example:
    >>> budgets = budgets_for(model, "pyramid", H2OConfig(budget=128))   # doctest: +SKIP
    >>> cache = make_h2o_cache(model, config, budgets=budgets)          # doctest: +SKIP
"""

from typing import List, Optional

from h2o_fn import H2OConfig
from h2o_fn.allocation import POLICIES, from_need, pyramid, uniform

from .metrics import oracle_mass
from .mlx_lm import h2o_layer_count

CALIBRATION_TOKENS = 1024
DEFAULT_ALLOCATION = "uniform"  # no policy beat it in BENCHMARKS.md (equal bytes, bundled model)


def calibration_tokens(tokenizer, n: int = CALIBRATION_TOKENS) -> List[int]:
    """The first n tokens of CPython's pydoc topics in reverse order: real text that ships
    everywhere and is not the text the perplexity figures are measured on (its start)."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics, reverse=True)))
    return ids[:n]


def layer_need(model, tokens: List[int], budget: int) -> List[float]:
    """Per layer: sqrt of the attention mass the best `budget` keys miss (second half's queries)."""
    rows = oracle_mass(model, tokens, [budget], len(tokens) // 2)
    return [max(1.0 - r["kv"][str(budget)], 1e-6) ** 0.5 for r in rows]


def budgets_for(model, policy: str, config: H2OConfig, tokenizer=None) -> Optional[List[int]]:
    """Per-layer budgets for `make_h2o_cache(..., budgets=)`, or None for uniform."""
    if policy not in POLICIES:
        raise ValueError(f"allocation {policy!r} is invalid: expected one of {POLICIES}")
    if policy == "uniform":
        return None
    n = h2o_layer_count(model)
    floor = config.n_sink + config.grace + 1
    if policy == "pyramid":
        return pyramid(n, config.budget, floor)
    if tokenizer is None:
        raise ValueError("allocation 'calibrated' needs the model's tokenizer (for its calibration text)")
    if n != len(model.layers):
        raise ValueError(
            f"allocation 'calibrated' measures every layer, but {type(model).__name__} has "
            f"{len(model.layers)} layers and {n} H2O layers: expected one per layer"
        )
    return from_need(layer_need(model, calibration_tokens(tokenizer), config.budget), config.budget, floor)


def describe(budgets: Optional[List[int]], config: H2OConfig, n: int) -> List[int]:
    """The per-layer budgets a cache list really gets (uniform spelled out)."""
    return uniform(n, config.budget) if budgets is None else list(budgets)
