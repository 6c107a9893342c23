"""h2o-fn: heavy-hitter (H2O) KV-cache eviction for MLX.

The pure core: `init`, `step`, `absorb`, `evict`, `remap`, `kept_positions`
over an immutable `H2OState`, configured by a validated `H2OConfig` (the rule), a
`Prompt` (how a prompt is scored) and a `Storage` (how rows are stored, dense or
quantized), all three bound to the eviction op as one value by `policy`, plus the
attention view an adapter slices (`h2o_fn.view`). Adapters for mlx-lm live in
`h2o_fn.adapters`, the fused kernel op in `h2o_fn.metal_ops`; this package
imports neither.

Example:
    >>> import mlx.core as mx
    >>> import h2o_fn
    >>> cfg = h2o_fn.H2OConfig(budget=16, n_sink=2, grace=4)
    >>> kv = mx.random.normal((1, 2, 40, 8))
    >>> state = h2o_fn.absorb(h2o_fn.init(cfg, 1, 2, 8), kv, kv, cfg)
    >>> state.length.tolist(), state.seen.tolist(), h2o_fn.check_invariants(state, cfg)
    ([16], [40], [])
"""

from .config import H2OConfig
from .core import (
    admit,
    compiled_admit,
    compiled_settle,
    compiled_settle_key,
    compiled_step,
    init,
    kept_positions,
    rewind,
    settle,
    settle_key,
    step,
)
from .prefill import absorb, absorb_scored, absorb_staged, compiled_absorb, compiled_absorb_staged, pooled
from .rule import evict, evict_lowest, protected_argmin
from .scoring import accumulate, key_weights, scored_queries
from .invariants import assert_invariants, check_invariants
from .policy import Policy, policy
from .prompt import Prompt
from .rope import remap
from .state import H2OState, capacity, state_nbytes
from .storage import Storage

__all__ = [
    "H2OConfig",
    "H2OState",
    "Policy",
    "Prompt",
    "Storage",
    "absorb",
    "absorb_scored",
    "absorb_staged",
    "accumulate",
    "admit",
    "assert_invariants",
    "capacity",
    "check_invariants",
    "compiled_absorb",
    "compiled_absorb_staged",
    "compiled_admit",
    "compiled_settle",
    "compiled_settle_key",
    "compiled_step",
    "evict",
    "evict_lowest",
    "init",
    "kept_positions",
    "key_weights",
    "policy",
    "pooled",
    "protected_argmin",
    "remap",
    "rewind",
    "scored_queries",
    "settle",
    "settle_key",
    "state_nbytes",
    "step",
]
