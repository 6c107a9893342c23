"""The core's argument checks: a chunk's shapes against a state, and the weights a
scoring rule needs. Errors name the bad value and the expected one."""

from typing import Optional

import mlx.core as mx

from . import storage
from .config import H2OConfig
from .prompt import Prompt
from .scoring import scored_queries
from .state import H2OState
from .storage import Storage


def check_kv(state: H2OState, kv: Storage) -> None:
    """Raise unless `kv` is how `state` stores its keys and values (`storage.check_store`)."""
    storage.check_store(state.keys, kv, "keys")
    storage.check_store(state.values, kv, "values")


def check_chunk(state: H2OState, keys: mx.array, values: mx.array, kv: Storage,
                n: Optional[int] = None) -> int:
    B, H, _ = state.positions.shape
    check_kv(state, kv)
    widths = (("keys", keys, storage.width(state.keys, kv.bits)),
              ("values", values, storage.width(state.values, kv.bits)))
    for name, x, D in widths:
        if x.ndim != 4 or x.shape[0] != B or x.shape[1] != H or x.shape[3] != D:
            raise ValueError(
                f"{name} shape {tuple(x.shape)} is invalid: expected [B={B}, H={H}, N, D={D}]"
            )
    if keys.shape[2] != values.shape[2]:
        raise ValueError(f"keys have {keys.shape[2]} tokens but values have {values.shape[2]}")
    N = keys.shape[2]
    if N == 0:
        raise ValueError("empty chunk: expected N >= 1 tokens")
    if n is not None and N != n:
        raise ValueError(f"keys shape {tuple(keys.shape)} is invalid: expected {n} token(s)")
    return N


def check_weights(state: H2OState, keys: mx.array, config: H2OConfig, weights, n_alive=None,
                  prompt: Prompt = Prompt()) -> None:
    if (weights is None) != (config.scoring == "key"):
        raise ValueError(
            f"got weights={None if weights is None else tuple(weights.shape)} with "
            f"config.scoring={config.scoring!r}: expected weights [B, H, N, C + N] exactly "
            "when scoring='query'"
        )
    if weights is not None:
        B, H, N = keys.shape[:3]
        rows = {N, scored_queries(N, config, n_alive, prompt)}
        if weights.ndim != 4 or tuple(weights.shape[:2]) != (B, H) or weights.shape[2] not in rows or \
                weights.shape[3] != state.positions.shape[-1] + N:
            M = " or ".join(str(m) for m in sorted(rows))
            raise ValueError(f"weights shape {tuple(weights.shape)} is invalid: expected "
                             f"({B}, {H}, {M}, {state.positions.shape[-1] + N})")


def check_staged_logits(state: H2OState, keys: mx.array, config: H2OConfig, logits: mx.array) -> None:
    """Raise unless `logits` fit `prefill.absorb_staged` of the staged `keys` `[B, H, N, D]`:
    `[B, H, N, C]`, with scoring="key" and oneshot prefill (greedy judges one token at a time)."""
    if config.scoring != "key" or config.prefill != "oneshot":
        raise ValueError(f"got staged proxy logits with scoring={config.scoring!r}, prefill={config.prefill!r}: "
                         "expected scoring='key' and prefill='oneshot' (greedy judges each token after the "
                         "evictions before it, not over the staging slots)")
    want = (*keys.shape[:3], state.positions.shape[-1])
    if tuple(logits.shape) != want:
        raise ValueError(f"logits shape {tuple(logits.shape)} is invalid: expected {want}")
