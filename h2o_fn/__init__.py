"""h2o-fn: heavy-hitter (H2O) KV-cache eviction for MLX.

The pure core: `init`, `step`, `absorb`, `evict`, `remap`, `kept_positions`
over an immutable `H2OState`, configured by a validated `H2OConfig`.
Adapters for mlx-lm live in `h2o_fn.adapters`, the fused kernel op in
`h2o_fn.metal_ops`; this package imports neither.
"""

from .config import H2OConfig
from .core import (
    absorb,
    accumulate,
    admit,
    compiled_step,
    evict,
    init,
    kept_positions,
    key_weights,
    protected_argmin,
    rewind,
    step,
)
from .invariants import assert_invariants, check_invariants
from .rope import remap
from .state import H2OState

__all__ = [
    "H2OConfig",
    "H2OState",
    "absorb",
    "accumulate",
    "admit",
    "assert_invariants",
    "check_invariants",
    "compiled_step",
    "evict",
    "init",
    "kept_positions",
    "key_weights",
    "protected_argmin",
    "remap",
    "rewind",
    "step",
]
