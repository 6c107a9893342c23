"""check_invariants: the predicate the tests, the proofs and debug checks share.

Reads a state back to Python lists (one sync): use it in tests and debugging,
never in a decode loop.

Example:
    >>> from h2o_fn import H2OConfig, init, check_invariants
    >>> cfg = H2OConfig(budget=8, n_sink=2, grace=2)
    >>> check_invariants(init(cfg, 1, 1, 4), cfg)
    []
"""

import math
from typing import List

from .config import H2OConfig
from .state import FREE, RESERVED, H2OState


def check_invariants(state: H2OState, config: H2OConfig, selected=None) -> List[str]:
    """Violations of the H2O invariants in `state`, as messages ([] when it is sound).

    Per (b, h), with r reserved slots (position -2): |S| + r <= budget and
    |S| + r == length[b]; positions unique and in [0, seen[b]); every sink
    (p < n_sink) and every grace position (p > seen[b] - 1 - grace) kept, except grace
    positions below `selected[b]` (a selection keeps sinks only); scores
    finite and >= 0; free and reserved slots score 0; no other negative position; while
    length[b] < budget the occupied slots (tokens and reserved) are exactly [0, length[b]).

    `selected`: None, an int or `[B]` ints: each row's positions below it went through a
    selection (`h2o_fn.budgets.absorb_selected`).
    """
    lengths, seens = state.length.tolist(), state.seen.tolist()
    selected = [0] * len(seens) if selected is None else ([selected] * len(seens) if isinstance(selected, int)
                                                          else list(selected))
    problems = []
    positions, scores = state.positions.tolist(), state.scores.tolist()
    for b, (prow, srow, length, seen) in enumerate(zip(positions, scores, lengths, seens)):
        if length > config.budget:
            problems.append(f"(b={b}) length {length} > budget {config.budget}")
        must_keep = set(range(min(config.n_sink, seen))) | set(range(max(seen - config.grace, 0), seen))
        for h, (ps, ss) in enumerate(zip(prow, srow)):
            where = f"(b={b}, h={h})"
            kept = [p for p in ps if p >= 0]
            reserved = sum(p == RESERVED for p in ps)
            if len(kept) + reserved != length:
                problems.append(f"{where} holds {len(kept)} tokens and {reserved} reserved slots, "
                                f"length says {length}")
            if len(set(kept)) != len(kept):
                problems.append(f"{where} duplicate positions {sorted(kept)}")
            if any(p >= seen for p in kept):
                problems.append(f"{where} position >= seen={seen}: {sorted(kept)}")
            if any(p < 0 and p not in (FREE, RESERVED) for p in ps):
                problems.append(f"{where} negative position other than {FREE} (free) or {RESERVED} (reserved): {ps}")
            missing = {p for p in must_keep - set(kept) if p < config.n_sink or p >= selected[b]}
            if missing:
                problems.append(f"{where} protected positions evicted: {sorted(missing)}")
            for p, s in zip(ps, ss):
                if p >= 0 and not (math.isfinite(s) and s >= 0):
                    problems.append(f"{where} position {p} has score {s}, expected finite >= 0")
                if p < 0 and s != 0:
                    problems.append(f"{where} {'free' if p == FREE else 'reserved'} slot has score {s}, expected 0")
            if length < config.budget and any((p != FREE) != (i < length) for i, p in enumerate(ps)):
                problems.append(f"{where} occupied slots are not the prefix [0, {length}): {ps}")
    return problems


def assert_invariants(state: H2OState, config: H2OConfig, selected=None) -> None:
    """Raise `AssertionError` listing every violated invariant."""
    problems = check_invariants(state, config, selected)
    if problems:
        raise AssertionError("H2O invariants violated:\n  " + "\n  ".join(problems))
