"""mlx-lm's own caches, the baselines every command sets beside H2O: one registry.

`Baseline` is a spec value (which family, its budget, kept first tokens, bits), `build`
makes the per-layer cache list for a model and `name` the label generate and bench
print. `generate --compare`, `eval` and `bench` build their baselines here.

Example:
    >>> Baseline("rotating", budget=256, keep=4).name
    'RotatingKVCache(256, keep=4)'
    >>> Baseline("quantized", bits=8).name
    'QuantizedKVCache(8 bits)'
"""

from typing import Any, List, NamedTuple, Optional

from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

FAMILIES = ("full", "rotating", "quantized")


class Baseline(NamedTuple):
    """family: "full" (mlx-lm's KVCache), "rotating" (RotatingKVCache: the last `budget`
    tokens, the first `keep` kept), "quantized" (QuantizedKVCache: `bits` per element in
    groups of `group_size`)."""

    family: str
    budget: Optional[int] = None
    keep: int = 0
    bits: Optional[int] = None
    group_size: int = 64

    @property
    def name(self) -> str:
        if self.family == "rotating":
            return f"RotatingKVCache({self.budget}, keep={self.keep})"
        if self.family == "quantized":
            return f"QuantizedKVCache({self.bits} bits)"
        return "full KVCache"


def layer_cache(spec: Baseline) -> Any:
    """One layer's cache of the family."""
    if spec.family == "full":
        return KVCache()
    if spec.family == "rotating":
        if spec.budget is None or spec.budget < 1:
            raise ValueError(f"budget={spec.budget} is invalid for a RotatingKVCache: expected >= 1")
        return RotatingKVCache(max_size=spec.budget, keep=spec.keep)
    if spec.family == "quantized":
        if spec.bits is None:
            raise ValueError("bits=None is invalid for a QuantizedKVCache: expected 2-8")
        return QuantizedKVCache(group_size=spec.group_size, bits=spec.bits)
    raise ValueError(f"family={spec.family!r} is invalid: expected one of {FAMILIES}")


def build(model, spec: Baseline) -> List[Any]:
    """The cache list for `prompt_cache=`: the model's own caches for "full" (its
    sliding-window layers stay sliding), one cache of the family per layer otherwise."""
    if spec.family == "full":
        return make_prompt_cache(model)
    return [layer_cache(spec) for _ in model.layers]
