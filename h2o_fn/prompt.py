"""Prompt: how `absorb` scores a prompt, a prefill policy beside the eviction rule.

SnapKV's two knobs, as kvpress hands a press to a model's prefill: a oneshot chunk of
more than `window` tokens (a prompt; every chunk when window is 0) sums only its last
`window` queries' weights (the question at the end of a prompt), and with `pool` > 1
its eviction ranking (not the stored score) takes the best score within +-pool//2
positions, so spans survive together (`prefill.pooled`). Greedy prefill has no
chunk-level decision and ignores both; decode steps never read them.

Example:
    >>> from h2o_fn import Prompt
    >>> Prompt(window=48, pool=15).window, Prompt().pool
    (48, 1)
    >>> Prompt(pool=4)
    Traceback (most recent call last):
    ...
    ValueError: Prompt.pool=4 is invalid: expected an odd pool >= 1 (1: no pooling)
"""

from typing import NamedTuple


class _Fields(NamedTuple):
    window: int  # a oneshot chunk longer than this (a prompt) scores by its last `window` queries
    pool: int  # ... and ranks tokens by the best score within +-pool//2 positions (1: off)


class Prompt(_Fields):
    """SnapKV's prompt scoring, validated at construction (`ValueError` names the field).

    `Prompt()` (window 0, pool 1) is plain oneshot prefill: every query of a chunk
    scores and tokens rank by their own score.
    """

    __slots__ = ()

    def __new__(cls, window: int = 0, pool: int = 1):
        for field, value in (("window", window), ("pool", pool)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Prompt.{field}={value!r} is invalid: expected an int")
        if window < 0:
            raise ValueError(f"Prompt.window={window} is invalid: expected window >= 0 (0: every query of "
                             "a chunk scores)")
        if pool < 1 or pool % 2 == 0:
            raise ValueError(f"Prompt.pool={pool} is invalid: expected an odd pool >= 1 (1: no pooling)")
        return super().__new__(cls, window, pool)

    def _replace(self, **changes) -> "Prompt":
        return Prompt(**{**self._asdict(), **changes})
