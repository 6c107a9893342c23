"""make_h2o_cache and use_h2o: H2O caches for an mlx-lm model, layer by layer.

Full-attention layers (mlx-lm's plain `KVCache`) get an `H2OKVCache`
(`h2o_fn.adapters.cache`); a `CacheList` holding several of them (one layer, several
caches: DeepSeek sparse attention's indexer, two attention sublayers) keeps them in
lockstep (`h2o_fn.adapters.lockstep`); sliding-window, chunked and recurrent layers
keep the model's own cache. The names users need are re-exported here.

One policy, one set of defaults: `make_h2o_cache(model, budget=N)` (also `use_h2o`,
`H2OKVCache(budget=N)`) is the recommended policy at N, what `h2o-fn generate --budget N`
runs: `recommended(N)` (`DEFAULT_CONFIG.at_budget(N)`) with `DEFAULT_PROMPT`. A config
you pass instead is the rule exactly as given, `scoring` included (`H2OConfig`'s own
default is "key"; the recommended one is "query"), and keeps `DEFAULT_PROMPT` unless you
pass `prompt=`.

Example:
    >>> from mlx_lm import generate                                    # doctest: +SKIP
    >>> from h2o_fn.adapters.gguf import load_gguf
    >>> from h2o_fn.adapters.mlx_lm import make_h2o_cache
    >>> model, tokenizer = load_gguf()                                 # doctest: +SKIP
    >>> cache = make_h2o_cache(model, budget=128)                      # doctest: +SKIP
    >>> text = generate(model, tokenizer, "Hello", max_tokens=20, prompt_cache=cache)  # doctest: +SKIP
"""

import numbers
import warnings
from typing import Any, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache

from h2o_fn import H2OConfig, Prompt, Storage
from h2o_fn.allocation import POLICIES, pyramid
from h2o_fn.metal_ops import protected_argmin

from .attention import install_query_hook, is_hooked
from .cache import (DEFAULT_CONFIG, DEFAULT_PROMPT, BatchH2OKVCache, H2OKVCache, cache_policy, config_for, prompt_for,
                    recommended)
from .lockstep import H2OCacheList, H2OFollower
from .retention import REPEAT_PROMPT, cache_prompt, repeat_prefix

__all__ = ["DEFAULT_CONFIG", "DEFAULT_PROMPT", "REPEAT_PROMPT", "BatchH2OKVCache", "H2OCacheList", "H2OFollower",
           "H2OKVCache", "cache_policy", "cache_prompt", "config_for", "h2o_caches", "h2o_layer_count",
           "layer_evict_every", "make_h2o_cache", "plan_layers", "prompt_for", "recommended", "repeat_prefix", "use_h2o"]


def _kv_per_layer(caches: Sequence[Any]) -> List[int]:
    """Per H2O layer a cache list gets, the KV caches it holds: 1 for every plain `KVCache`,
    n for a `CacheList` that holds n >= 1 (its first leads, the others follow)."""
    counts = [1 if type(c) is KVCache else
              sum(type(m) is KVCache for m in c.caches) if isinstance(c, mlx_cache.CacheList) else 0
              for c in caches]
    return [n for n in counts if n]


def _leaders(caches: Sequence[Any]) -> int:
    """How many H2O layers a cache list gets."""
    return len(_kv_per_layer(caches))


def _build(model: nn.Module, configs: List[H2OConfig], argmin, every: Sequence[int],
           prompt: Prompt, kv: Storage) -> List[Any]:
    """The model's own caches with H2O in every full-attention layer (configs and
    evict_every in layer order)."""
    own = _model_caches(model)
    per_layer, shared = iter(zip(configs, every)), shares_kv(model, own)

    def h2o():
        config, k = next(per_layer)
        return H2OKVCache(config, argmin, evict_every=k, prompt=prompt, kv_bits=kv.bits,
                          kv_group_size=kv.group_size, keeps_view=shared)

    def convert(c):
        if type(c) is KVCache:
            return h2o()
        if not isinstance(c, mlx_cache.CacheList):
            return c
        members = list(c.caches)
        kv = [j for j, m in enumerate(members) if type(m) is KVCache]
        if not kv:
            return c
        members[kv[0]] = h2o()
        for j in kv[1:]:
            members[j] = H2OFollower()
        if len(kv) > 1:
            return H2OCacheList(*members)
        c.caches = tuple(members)
        return c

    return [convert(c) for c in own]


def h2o_caches(caches: Sequence[Any]) -> List[H2OKVCache]:
    """The H2O caches in a cache list (also inside `CacheList`s), in layer order."""
    out = []
    for c in caches:
        if isinstance(c, H2OKVCache):
            out.append(c)
        elif isinstance(c, mlx_cache.CacheList):
            out.extend(h2o_caches(c.caches))
    return out


def h2o_layer_count(model: nn.Module) -> int:
    """How many H2O layers `make_h2o_cache(model)` builds (the length `budgets=` needs)."""
    return _leaders(_model_caches(model))


def make_h2o_cache(
    model: nn.Module,
    config: Optional[H2OConfig] = None,
    budgets: Union[None, str, Sequence[int]] = None,
    argmin=protected_argmin,
    evict_every: int = 1,
    prompt: Optional[Prompt] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    *,
    budget: Optional[int] = None,
) -> List[Any]:
    """The per-layer cache list for `prompt_cache=` in mlx-lm's generate functions.

    Full-attention layers (mlx-lm's plain `KVCache`, also inside a `CacheList`) get an
    `H2OKVCache`; sliding-window, chunked and recurrent layers keep the model's own cache.
    `make_h2o_cache(model, budget=256)` is the recommended policy at 256, the policy of
    `h2o-fn generate --budget 256`.

    Args:
      config: the eviction rule, used exactly as given, `scoring` included (`H2OConfig()`
        scores by the key proxy; the recommended policy by the model's queries). Default:
        the recommended policy at `budget` (`recommended`; `DEFAULT_CONFIG` without one).
      budgets: optional per-layer budgets, one per H2O layer, each with the policy's
        n_sink and grace (a budget that cannot hold them is an error naming the layer),
        or an allocation policy's name: "uniform" or "pyramid" ("calibrated" needs the
        tokenizer: `allocation.budgets_for(model, "calibrated", config, tokenizer)`).
      evict_every: decode tokens judged at a time (`H2OKVCache`'s; layers that hold
        several KV caches in lockstep take 1, with a warning naming them).
      prompt: how prompt chunks are scored (`h2o_fn.Prompt`: SnapKV's window and pooling;
        default `DEFAULT_PROMPT`, with a config of your own too; `Prompt()` is plain oneshot).
      kv_bits, kv_group_size: store the kept rows quantized, as mlx-lm's `kv_bits` and
        `kv_group_size` do (`h2o_fn.Storage`; default None: the model's dtype). mlx-lm
        then attends through its quantized attention.
      budget: tokens kept per layer and KV head, for the recommended policy (instead of
        `config`; passing both is an error naming both).

    What it installs: the attention hook on the model's modules (`h2o_fn.adapters.attention`;
    `remove_query_hook(model)` takes it off; it falls through for every other cache). Query
    scoring and per-layer budgets of different sizes need it; key scoring uses it on the CPU
    to compute its proxy in attention's own product, and scores the key itself without it.
    With query scoring it runs one probe token through throwaway caches (a lazy graph,
    never evaluated) to see which layers hand their weights to the hook; layers that
    cannot (attention outside mlx-lm's `scaled_dot_product_attention`, heads the cache
    does not hold) fall back to key scoring, with a warning naming them.
    """
    policy = cache_policy(config, argmin, prompt, kv_bits, kv_group_size, budget=budget)
    configs = plan_layers(model, policy.config, budgets, argmin, policy.kv)
    return _build(model, configs, argmin, layer_evict_every(model, evict_every), policy.prompt, policy.kv)


def use_h2o(model: nn.Module, config: Optional[H2OConfig] = None,
            budgets: Union[None, str, Sequence[int]] = None, argmin=protected_argmin, evict_every: int = 1,
            prompt: Optional[Prompt] = None, kv_bits: Optional[int] = None, kv_group_size: int = 64, *,
            budget: Optional[int] = None):
    """Make H2O the cache mlx-lm builds for `model` everywhere: `make_prompt_cache(model)`,
    `batch_generate`, `BatchGenerator` and `mlx_lm.server` then get `make_h2o_cache`'s
    list, with the same arguments and defaults (planned once: per-layer configs and the
    query-scoring probe are not redone). Sets `model.make_cache` on the instance; returns
    a function that removes it.

    Example:
        >>> undo = use_h2o(model, budget=256)                      # doctest: +SKIP
        >>> mlx_lm.batch_generate(model, tokenizer, prompts)       # doctest: +SKIP
        >>> undo()                                                 # doctest: +SKIP
    """
    policy = cache_policy(config, argmin, prompt, kv_bits, kv_group_size, budget=budget)
    kv, prompt = policy.kv, policy.prompt
    configs, every = plan_layers(model, policy.config, budgets, argmin, kv), layer_evict_every(model, evict_every)
    model.make_cache = lambda: _build(model, configs, argmin, every, prompt, kv)

    def undo():
        model.__dict__.pop("make_cache", None)

    return undo


def shares_kv(model: nn.Module, caches: Optional[List[Any]] = None) -> bool:
    """Whether some of the model's layers may attend to another layer's cache (afm7's KV-reuse
    layers, gemma3n's KV-shared ones read `keys_and_values()`): it has more layers than caches
    (`caches`: the model's own, when the caller built them already)."""
    return len(model.layers) > len(_model_caches(model) if caches is None else caches)


def keep_views(caches: List[Any], shared: bool) -> None:
    """Set `keeps_view` to `shared` (`shares_kv` of the model that reads them) on every H2O
    layer of `caches`: caches loaded from files, which do not record it."""
    for c in h2o_caches(caches):
        c.keeps_view = shared


def _model_caches(model: nn.Module) -> List[Any]:
    """The caches the model's own class builds (ignoring a `use_h2o` instance override)."""
    make = getattr(type(model), "make_cache", None)
    return make(model) if make is not None else [KVCache() for _ in model.layers]


def _budget_list(budgets, config: H2OConfig, n: int) -> Optional[List[int]]:
    """`budgets` as given to make_h2o_cache (None, one int per H2O layer, or a policy
    name) -> None or n ints."""
    if budgets is None or budgets == "uniform":
        return None
    if isinstance(budgets, str):
        if budgets == "calibrated":
            raise ValueError("budgets='calibrated' needs the tokenizer: pass "
                             "adapters.allocation.budgets_for(model, 'calibrated', config, tokenizer)")
        if budgets != "pyramid":
            raise ValueError(f"budgets={budgets!r} is invalid: expected one of {POLICIES}, "
                             "a sequence of ints or None")
        return pyramid(n, config.budget, config.n_sink + config.grace + 1)
    if not hasattr(budgets, "__len__") or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool)
                                                  for b in budgets):
        one = f" (one budget for every layer: budget={budgets!r})" if isinstance(budgets, numbers.Integral) else ""
        raise TypeError(f"budgets={budgets!r} is invalid: expected None, a sequence of ints (one per H2O layer) "
                        f"or a policy name ('uniform', 'pyramid'; 'calibrated' through allocation.budgets_for){one}")
    return [int(b) for b in budgets]


def plan_layers(model: nn.Module, config: Optional[H2OConfig] = None,
                budgets: Union[None, str, Sequence[int]] = None, argmin=protected_argmin,
                kv: Storage = Storage()) -> List[H2OConfig]:
    """Plan the H2O layers of `model`: the config of each, in layer order (see
    `make_h2o_cache`), per-layer budgets applied and key scoring where the hook cannot see
    the weights. Not a pure query: it installs the attention hook on the model's modules, and
    for query scoring it runs one probe token through throwaway caches to find the layers
    whose weights never reach the hook."""
    config = config_for(config)
    n = _leaders(_model_caches(model))
    if n == 0:
        kinds = sorted({type(c).__name__ for c in _model_caches(model)})
        raise ValueError(
            f"{type(model).__name__}'s caches are {kinds}: expected at least one "
            "full-attention KVCache layer for H2O to manage"
        )
    budgets = _budget_list(budgets, config, n)
    if budgets is not None and len(budgets) != n:
        raise ValueError(f"budgets has {len(budgets)} entries: expected one per H2O layer ({n})")
    configs = [config] * n if budgets is None else [_at_budget(config, b, i) for i, b in enumerate(budgets)]
    uniform = len({c.budget for c in configs}) == 1
    if install_query_hook(model) == 0 and not uniform:
        raise ValueError(
            f"per-layer budgets need the attention hook, and {type(model).__name__} does not "
            "call mlx_lm.models.base.scaled_dot_product_attention: use one budget"
        )
    if config.scoring == "query":
        deaf = _layers_without_weights(model, configs, argmin, kv) if is_hooked(model) else list(range(n))
        if deaf:
            warnings.warn(
                f"{type(model).__name__}: H2O layers {deaf} of {n} never hand their attention weights "
                "to the hook (their attention does not go through mlx_lm.models.base."
                "scaled_dot_product_attention on the heads they cache): they use scoring='key'",
                stacklevel=3,
            )
            configs = [c._replace(scoring="key") if i in deaf else c for i, c in enumerate(configs)]
    return configs


def layer_evict_every(model: nn.Module, evict_every: int = 1) -> List[int]:
    """evict_every per H2O layer of `model`, in layer order: `evict_every`, except 1 (with a
    warning naming them) for layers whose several KV caches move in lockstep: followers
    re-lay their rows out after chunks, not after staged flushes."""
    kv = _kv_per_layer(_model_caches(model))
    followed = [i for i, n in enumerate(kv) if n > 1] if evict_every != 1 else []
    if followed:
        warnings.warn(
            f"{type(model).__name__}: H2O layers {followed} hold several KV caches in lockstep, "
            "which take decode tokens one at a time: they use evict_every=1", stacklevel=3)
    return [1 if i in followed else evict_every for i in range(len(kv))]


def _at_budget(config: H2OConfig, budget: int, layer: int) -> H2OConfig:
    try:
        return config._replace(budget=int(budget))
    except ValueError as e:
        raise ValueError(f"H2O layer {layer}: budget {budget} does not fit the policy: {e}") from None


def _layers_without_weights(model, configs: List[H2OConfig], argmin, kv: Storage) -> List[int]:
    """H2O layers whose cache still waits for weights after one probe token."""
    probe = _build(model, configs, argmin, [1] * len(configs), Prompt(), kv)
    model(mx.array([[0]]), cache=probe)
    return [i for i, c in enumerate(h2o_caches(probe)) if c.wants_weights]
