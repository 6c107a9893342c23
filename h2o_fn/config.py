"""H2OConfig: the eviction policy as a NamedTuple of Python scalars.

A config is hashable and immutable, so `mx.compile` specialises on it once.
It is validated at construction; `_replace` validates too.

Example:
    >>> from h2o_fn import H2OConfig
    >>> H2OConfig().at_budget(32).grace        # the defaults, scaled to a small budget
    8
    >>> H2OConfig(grace=600)
    Traceback (most recent call last):
    ...
    ValueError: H2OConfig n_sink + grace = 4 + 600 = 604 is invalid: expected n_sink + grace < budget = 512 (at least one evictable slot)

How rows are stored is not the rule's business: `h2o_fn.Storage`.
"""

from typing import NamedTuple

SCORINGS = ("key", "query")
PREFILLS = ("greedy", "oneshot")


class _Fields(NamedTuple):
    budget: int  # max tokens kept per (batch row, KV head)
    n_sink: int  # positions < n_sink are never evicted
    grace: int  # the newest `grace` positions are never evicted
    decay: float  # scores are multiplied by this before each new token's weights are added
    scoring: str  # "key" (key-as-query proxy) or "query" (the model's own attention weights)
    prefill: str  # "greedy" (token by token) or "oneshot" (one weight pass per chunk)


def _validate(budget, n_sink, grace, decay, scoring, prefill):
    def bad(field, value, expected):
        raise ValueError(f"H2OConfig.{field}={value!r} is invalid: expected {expected}")

    for field, value in (("budget", budget), ("n_sink", n_sink), ("grace", grace)):
        if isinstance(value, bool) or not isinstance(value, int):
            bad(field, value, "an int")
    if budget < 1:
        bad("budget", budget, "budget >= 1")
    if n_sink < 0:
        bad("n_sink", n_sink, "n_sink >= 0")
    if grace < 0:
        bad("grace", grace, "grace >= 0")
    if n_sink + grace >= budget:
        raise ValueError(
            f"H2OConfig n_sink + grace = {n_sink} + {grace} = {n_sink + grace} is invalid: "
            f"expected n_sink + grace < budget = {budget} (at least one evictable slot)"
        )
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
        bad("decay", decay, "a float in (0, 1]")
    if scoring not in SCORINGS:
        bad("scoring", scoring, f"one of {SCORINGS}")
    if prefill not in PREFILLS:
        bad("prefill", prefill, f"one of {PREFILLS}")


class H2OConfig(_Fields):
    """Eviction policy, validated at construction (`ValueError` names the field).

    Valid iff budget >= 1, n_sink >= 0, grace >= 0, n_sink + grace < budget,
    0 < decay <= 1, scoring in SCORINGS, prefill in PREFILLS.
    `grace=0, decay=1.0` is H2O's Algorithm 1 as published.
    """

    __slots__ = ()

    def __new__(
        cls,
        budget: int = 512,
        n_sink: int = 4,
        grace: int = 16,
        decay: float = 0.98,
        scoring: str = "key",
        prefill: str = "oneshot",
    ):
        _validate(budget, n_sink, grace, decay, scoring, prefill)
        return super().__new__(cls, budget, n_sink, grace, float(decay), scoring, prefill)

    def _replace(self, **changes) -> "H2OConfig":
        return H2OConfig(**{**self._asdict(), **changes})

    def at_budget(self, budget: int) -> "H2OConfig":
        """This policy at another budget: grace shrinks to budget // 4 and n_sink to what
        still leaves one evictable slot, so small budgets stay valid. The budget is never changed."""
        grace = min(self.grace, budget // 4)
        n_sink = min(self.n_sink, max(budget - 1 - grace, 0))
        return self._replace(budget=budget, n_sink=n_sink, grace=grace)
