"""An experiment for #34: a key-scored decode step's settle as one C++ mlx primitive on the CPU.

On a CPU, mlx dispatches each primitive for a few microseconds whatever it computes, and
H2O's decode step adds 35 (key) to 50 (query) of them per layer to the rotating cache's 14
(BENCHMARKS.md, "Decode at every budget"). `settle.cpp` does `h2o_fn.core._by_key`'s work
(decay-add, then the lowest unprotected token of each (b, h) freed in rows over budget) in
one primitive. Not wired into the library: this script builds it, checks it against the
core bit for bit, and measures what it would buy.

Usage (needs cmake and g++; nanobind 3.1.0, the one mlx 0.32 was built with, is in the bench extra):
    python bench/cpu_settle/check.py [--cases 300] [--chain 256 1024] [--rounds 7]

`--chain`: `bench profile`'s layer chain (30 layers of cache + attention, no model) at those
budgets with the core's settle, then with this one, twice each, printing each run's us per
layer and paired ratio to the rotating cache. The build goes to bench/cpu_settle/build.
"""

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

HERE = Path(__file__).resolve().parent


def build() -> None:
    out = HERE / "build"
    out.mkdir(exist_ok=True)
    subprocess.run(["cmake", "-S", str(HERE), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
                    f"-DPython_EXECUTABLE={sys.executable}"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(out), "-j", "2"], check=True, stdout=subprocess.DEVNULL)
    sys.path.insert(0, str(out))


def random_case(i: int):
    """An admitted state and proxy weights: ties, NaN scores, free slots, even rows one token
    over budget, B in 1..3, C from 9 to 1,025 (lazy arrays, as a decode step hands them over)."""
    from h2o_fn import H2OConfig
    from h2o_fn.state import H2OState

    k = iter(mx.random.split(mx.random.key(i), 8))
    B, H, C = 1 + i % 3, 3, (9, 65, 257, 1025)[i % 4]
    cfg = H2OConfig(budget=C - 1, n_sink=i % 5, grace=(0, 1, 4, 16)[i % 4], decay=(1.0, 0.98, 0.5)[i % 3],
                    scoring="key")
    seen = mx.array([C + (i % 7) * j for j in range(B)], dtype=mx.int32)
    order = mx.argsort(mx.random.uniform(shape=(B, H, C), key=next(k)), axis=-1).astype(mx.int32)
    odd = (mx.arange(B) % 2 == 1)[:, None, None]  # odd rows hold free slots and are within budget
    positions = mx.where(odd & (mx.random.uniform(shape=(B, H, C), key=next(k)) < 0.05), -1, order)
    scores = mx.random.uniform(shape=(B, H, C), key=next(k))
    scores = mx.where(mx.random.uniform(shape=(B, H, C), key=next(k)) < 0.2, 0.25, scores)  # ties
    if i % 5 == 0:
        scores = mx.where(mx.random.uniform(shape=(B, H, C), key=next(k)) < 0.02, mx.nan, scores)
    scores = mx.where(positions >= 0, scores, 0.0)
    w = mx.random.uniform(shape=(B, H, C), key=next(k)) * (positions >= 0)
    length = mx.where(mx.arange(B) % 2 == 0, C, C - 1).astype(mx.int32)  # even rows: one over budget
    z = mx.zeros((B, H, C, 4))
    return cfg, H2OState(z, z, scores, positions, length, seen), w


def check(cases: int) -> int:
    """How many of `cases` random states the primitive settles differently from the core."""
    import _h2o_settle
    from h2o_fn.core import _by_key
    from h2o_fn.rule import protected_argmin

    cfg, state, w = random_case(0)
    try:
        _h2o_settle.settle(state.scores, state.positions, state.length, state.seen, w, 1.0, 0, 0, 1)
    except TypeError as e:  # nanobind does not know mlx's array type: another ABI or domain
        sys.exit(f"the built module does not take mlx {mx.__version__}'s arrays ({e}): build it with the "
                 "nanobind version that mlx release was built with (CMakeLists.txt)")
    bad = 0
    for i in range(cases):
        cfg, state, w = random_case(i)
        want = _by_key(state, w, cfg, protected_argmin, None)
        scores, positions, length = _h2o_settle.settle(state.scores, state.positions, state.length, state.seen, w,
                                                       cfg.decay, cfg.n_sink, cfg.grace, cfg.budget)
        same = (mx.array_equal(want.scores, scores, equal_nan=True).item()
                and mx.array_equal(want.positions, positions).item() and mx.array_equal(want.length, length).item())
        if not same:
            bad += 1
            print(f"case {i}: differs (B, H, C = {tuple(state.scores.shape)}, {cfg})")
    return bad


def use_primitive(on: bool) -> None:
    """Route `Policy.settle_key` with attention's logits (the hooked decode step) through the
    primitive (`on`), or back to the core's compiled `settle_key`."""
    import _h2o_settle
    from h2o_fn.arrays import newest_slots
    from h2o_fn.scoring import proxy_softmax

    policy = importlib.import_module("h2o_fn.policy").Policy
    core_settle_key = getattr(policy, "_core_settle_key", policy.settle_key)
    policy._core_settle_key = core_settle_key
    if not on:
        policy.settle_key = core_settle_key
        return
    weights = mx.compile(lambda a, logits: proxy_softmax(
        logits, (a.positions >= 0) & ~newest_slots(a.positions, a.seen, None)))

    def settle_key(self, admitted, key, alive=None, logits=None):
        if alive is not None or logits is None:
            return core_settle_key(self, admitted, key, alive, logits)
        c = self.config
        scores, positions, length = _h2o_settle.settle(admitted.scores, admitted.positions, admitted.length,
                                                       admitted.seen, weights(admitted, logits),
                                                       c.decay, c.n_sink, c.grace, c.budget)
        return admitted._replace(scores=scores, positions=positions, length=length)

    policy.settle_key = settle_key


def chain(budgets, rounds: int) -> None:
    from h2o_fn.adapters.cli import bench, common

    args = bench.setup_arg_parser().parse_args(["profile"])
    configs = {b: common.policy_at(args, b, scoring="key") for b in budgets}
    for on in (False, True, False, True):
        use_primitive(on)
        print("settle:", "the primitive" if on else "the core's (compiled)", flush=True)
        bench.bench_layers(configs, rounds=rounds, steps=24)
    use_primitive(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=300, help="random states checked against the core")
    parser.add_argument("--chain", type=int, nargs="*", default=[], help="layer-chain budgets to time")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    build()
    bad = check(args.cases)
    print(f"{args.cases - bad} of {args.cases} random states settled bit for bit as h2o_fn.core._by_key")
    if args.chain:
        chain(args.chain, args.rounds)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
