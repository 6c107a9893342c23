"""The methods `eval ruler` compares: a registry of ways to read a context into a cache that
holds at most a budget of tokens per layer and KV head.

A method is a class registered under the name `--ruler-methods` takes. `eval ruler` makes
one per run (`Method(run)`: `run.model`, `run.tokenizer`, `run.policy(budget)` (the H2O
config the flags give at that budget), `run.options` (`make_h2o_cache`'s other
arguments) and `run.args`), calls `prepare(model)` once, then for every context asks for
one cache per budget with `compress_many(model, ids, budgets)`. The question is then fed
through each cache and the answer decoded greedily.

- `Method.compress(model, ids, budget) -> cache` is all a method must define; the default
  `compress_many` calls it once per budget.
- A method that scores a context once and selects per budget subclasses `Scored`
  instead: `scores(model, ids) -> handle` once, `select(model, handle, budget) -> cache`
  per budget (one scoring pass serves every ratio).
- `budgeted = False` marks the reference (the full cache): it is read once per context,
  with `budget=None`, and serves every ratio and both protocols.

Example (a new method in five lines):
    >>> from h2o_fn.adapters.mlx_lm import make_h2o_cache                        # doctest: +SKIP
    >>> @register("h2o-greedy")                                                 # doctest: +SKIP
    ... class GreedyPrefill(Method):
    ...     label = "H2O, prompt scored token by token"
    ...     def compress(self, model, ids, budget):
    ...         cache = make_h2o_cache(model, self.run.policy(budget, prefill="greedy"), **self.run.options)
    ...         prefill(model, ids, cache)
    ...         return cache
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Type

from ...mlx_lm import make_h2o_cache
from ...cache import H2OKVCache
from ...retention import cache_prompt, keep_chunk, reading_for, repeat_prefix, score_chunk
from ..baselines import Baseline, build
from ..retrieval import prefill


class Method:
    """A way to read a context into a cache of at most `budget` tokens per layer and KV head."""

    label = "method"  # the name tables and plots print
    budgeted = True  # False: the reference, read once without a budget

    def __init__(self, run):
        self.run = run

    def prepare(self, model) -> None:
        """Once per run, before any context (e.g. calibrate per-head scores on the model)."""

    def compress(self, model, ids: Sequence[int], budget: Optional[int]) -> List[Any]:
        """The cache list (`prompt_cache=`) after reading `ids` at `budget`."""
        raise NotImplementedError(f"{type(self).__name__} defines no compress(model, ids, budget)")

    def compress_many(self, model, ids: Sequence[int], budgets: Sequence[Optional[int]]) -> List[List[Any]]:
        """One cache list per budget, in order (default: `compress` once per budget)."""
        return [self.compress(model, ids, b) for b in budgets]


class Scored(Method):
    """A method that scores a context once (`scores`) and keeps any budget of it (`select`):
    `compress_many` then costs one scoring pass for every budget."""

    def scores(self, model, ids: Sequence[int]) -> Any:
        """Whatever `select` needs (e.g. the full keys and values and a score per token)."""
        raise NotImplementedError(f"{type(self).__name__} defines no scores(model, ids)")

    def select(self, model, handle: Any, budget: Optional[int]) -> List[Any]:
        """The cache list keeping `budget` tokens per layer and KV head of the scored context."""
        raise NotImplementedError(f"{type(self).__name__} defines no select(model, handle, budget)")

    def compress(self, model, ids, budget):
        return self.select(model, self.scores(model, ids), budget)

    def compress_many(self, model, ids, budgets):
        handle = self.scores(model, ids)
        return [self.select(model, handle, b) for b in budgets]


METHODS: Dict[str, Type[Method]] = {}  # --ruler-methods name -> class, in registration order


def register(name: str) -> Callable[[Type[Method]], Type[Method]]:
    """Class decorator: `--ruler-methods NAME` runs this method. A name is registered once."""
    def add(cls: Type[Method]) -> Type[Method]:
        if name in METHODS:
            raise ValueError(f"method name {name!r} is taken by {METHODS[name].__name__}: expected a new name")
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            raise TypeError(f"register({name!r}) got {cls!r}: expected a subclass of Method")
        METHODS[name] = cls
        return cls
    return add


@register("full")
class Full(Method):
    """mlx-lm's KVCache: nothing evicted, the ceiling."""

    label = "full KVCache"
    budgeted = False

    def compress(self, model, ids, budget):
        cache = build(model, Baseline("full"))
        prefill(model, ids, cache)
        return cache


class _CachePrompt(Scored):
    """The adapter's policy at the budget, read by `cache_prompt` (two passes per chunk: the
    chunk, then REPEAT_PROMPT and the chunk again, scored by KVzip's rule) with `budgets`
    spread as `cache_prompt` takes them. A context that fits one chunk is scored once for
    every budget (`score_chunk`, then `ScoringPass.onto` a fresh cache per budget)."""

    budgets = "auto"

    def _cache(self, model, budget):
        return make_h2o_cache(model, self.run.policy(budget), **self.run.options)

    def scores(self, model, ids):
        cache = self._cache(model, 2)  # any budget: the passes evict nothing
        one = len(ids) <= self.run.args.repeat_chunk and all(isinstance(c, H2OKVCache) for c in cache)
        prefix = repeat_prefix(self.run.tokenizer)
        return ids, score_chunk(model, ids, cache, prefix, self.run.args.repeat_pool,
                                 self.run.args.repeat_surprisal) if one else None

    def select(self, model, handle, budget):
        ids, scored = handle  # scored: the ScoringPass of each layer, or None (cache_prompt per budget)
        cache = self._cache(model, budget)
        args = self.run.args
        share = None if self.budgets == "uniform" else args.repeat_share
        if scored is None:
            return cache_prompt(model, ids, cache, repeat_prefix=repeat_prefix(self.run.tokenizer),
                                chunk_size=args.repeat_chunk, budgets=self.budgets, pool=args.repeat_pool,
                                surprisal=args.repeat_surprisal, share=share, width=args.repeat_share_width,
                                windows=args.repeat_share_windows)
        passes = [p.onto(c) for p, c in zip(scored, cache)]
        keep_chunk(passes, *reading_for(cache, len(ids), self.budgets, share), args.repeat_share_width,
                   windows=args.repeat_share_windows)
        return cache


@register("cache_prompt")
class CachePrompt(_CachePrompt):
    """cache_prompt's default ("auto"): one selection per layer when the budget is at least
    `LAYER_FROM` (45%) of the context, else one over every layer and KV head (`h2o_fn.budgets`)."""

    label = "H2O + cache_prompt (repeat pass)"


@register("cache_prompt-global")
class CachePromptGlobal(_CachePrompt):
    """cache_prompt with `budgets="global"`: one selection over every layer and KV head."""

    label = "H2O + cache_prompt, global"
    budgets = "global"


@register("cache_prompt-uniform")
class CachePromptUniform(_CachePrompt):
    """cache_prompt with `budgets="uniform"`: every KV head keeps the budget."""

    label = "H2O + cache_prompt, uniform per head"
    budgets = "uniform"


@register("cache_prompt-layer")
class CachePromptLayer(_CachePrompt):
    """cache_prompt with `budgets="layer"`: each layer keeps its budget times its heads,
    spread over its own heads (kvpress's KVzip `layerwise=True`)."""

    label = "H2O + cache_prompt, per layer"
    budgets = "layer"


@register("h2o")
class Prefill(Method):
    """The adapter's policy at the budget fed the context as a prompt (its own oneshot
    prefill: SnapKV's window of the chunk's last queries)."""

    label = "H2O defaults, plain prefill"

    def compress(self, model, ids, budget):
        cache = make_h2o_cache(model, self.run.policy(budget), **self.run.options)
        prefill(model, ids, cache)
        return cache


@register("rotating")
class Rotating(Method):
    """mlx-lm's RotatingKVCache: the first n_sink tokens (H2O's) and the most recent ones."""

    label = "RotatingKVCache"

    def compress(self, model, ids, budget):
        cache = build(model, Baseline("rotating", budget=budget, keep=self.run.policy(budget).n_sink))
        prefill(model, ids, cache)
        return cache
