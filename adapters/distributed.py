"""Tensor parallel H2O: a model sharded by attention heads over `mx.distributed` ranks.

H2O's state is per KV head and needs no communication: once mlx-lm's `shard(group)`
has split the attention heads over the ranks, every rank builds H2O caches for its
own KV heads (`make_h2o_cache` sees the local head count), evicts locally, and keeps
exactly the positions one process keeps for those heads. Query scoring works the same
way: the hook sees the local query and KV heads.

Run a script under `mlx.launch --backend ring -n N python script.py` (loopback), or
across machines with `mlx.launch --hostfile hosts.json ...` (mlx's hostfile: one entry
per host with its ssh name and IPs).

Example:
    >>> from h2o_fn.adapters.distributed import kv_heads, shard
    >>> group = shard(model)  # a no-op on one process         # doctest: +SKIP
    >>> cache = make_h2o_cache(model, config)   # doctest: +SKIP
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn


def kv_heads(model: nn.Module) -> Optional[int]:
    """The model's KV head count as its config states it (None when it does not)."""
    args = getattr(model, "args", None)
    for name in ("num_key_value_heads", "n_kv_heads", "num_kv_heads"):
        value = getattr(args, name, None)
        if isinstance(value, int):
            return value
    return None


def shard(model: nn.Module, group: Optional[mx.distributed.Group] = None) -> mx.distributed.Group:
    """Shard `model` by heads over `group` (default: `mx.distributed.init()`) when it has
    more than one rank; return the group. One process: nothing changes.

    Raises ValueError when the KV heads do not divide over the ranks (each rank must hold
    whole KV heads for H2O to evict them locally) or the model has no `shard`.
    """
    group = group or mx.distributed.init()
    N = group.size()
    if N == 1:
        return group
    H = kv_heads(model)
    if H is not None and H % N:
        raise ValueError(
            f"{type(model).__name__} has {H} KV heads, which do not divide over {N} ranks: "
            f"expected a world size that divides {H}"
        )
    if not hasattr(model, "shard"):
        raise ValueError(f"{type(model).__name__} has no shard(group): mlx-lm cannot split it by heads")
    model.shard(group)
    return group
