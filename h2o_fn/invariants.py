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
from .state import H2OState


def check_invariants(state: H2OState, config: H2OConfig) -> List[str]:
    """Violations of the H2O invariants in `state`, as messages ([] when it is sound).

    Per (b, h): |S| <= budget and |S| == length[b]; positions unique and in
    [0, seen[b]); every sink (p < n_sink) and every grace position
    (p > seen[b] - 1 - grace) kept; scores finite and >= 0; free slots hold
    position -1 and score 0; while length[b] < budget the valid slots are exactly
    [0, length[b]).
    """
    lengths, seens = state.length.tolist(), state.seen.tolist()
    problems = []
    positions, scores = state.positions.tolist(), state.scores.tolist()
    for b, (prow, srow, length, seen) in enumerate(zip(positions, scores, lengths, seens)):
        if length > config.budget:
            problems.append(f"(b={b}) length {length} > budget {config.budget}")
        must_keep = set(range(min(config.n_sink, seen))) | set(range(max(seen - config.grace, 0), seen))
        for h, (ps, ss) in enumerate(zip(prow, srow)):
            where = f"(b={b}, h={h})"
            kept = [p for p in ps if p >= 0]
            if len(kept) != length:
                problems.append(f"{where} holds {len(kept)} tokens, length says {length}")
            if len(set(kept)) != len(kept):
                problems.append(f"{where} duplicate positions {sorted(kept)}")
            if any(p >= seen for p in kept):
                problems.append(f"{where} position >= seen={seen}: {sorted(kept)}")
            if any(p < -1 for p in ps):
                problems.append(f"{where} position < -1: {ps}")
            missing = must_keep - set(kept)
            if missing:
                problems.append(f"{where} protected positions evicted: {sorted(missing)}")
            for p, s in zip(ps, ss):
                if p >= 0 and not (math.isfinite(s) and s >= 0):
                    problems.append(f"{where} position {p} has score {s}, expected finite >= 0")
                if p < 0 and s != 0:
                    problems.append(f"{where} free slot has score {s}, expected 0")
            if length < config.budget and any((p >= 0) != (i < length) for i, p in enumerate(ps)):
                problems.append(f"{where} valid slots are not the prefix [0, {length}): {ps}")
    return problems


def assert_invariants(state: H2OState, config: H2OConfig) -> None:
    """Raise `AssertionError` listing every violated invariant."""
    problems = check_invariants(state, config)
    if problems:
        raise AssertionError("H2O invariants violated:\n  " + "\n  ".join(problems))
