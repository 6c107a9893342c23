"""What the adapter keeps, dumped per commit and compared: is a refactor exact?

Usage:
    python bench/kept_sets.py dump OUT.npz [--tokens 300] [--prompt 40] [--budget 64] [--window 0 --pool 1]
        [--kv-bits 8]
    python bench/kept_sets.py compare A.npz B.npz

`dump` feeds `--tokens` tokens of pydoc_data.topics through the bundled model (weights
dequantized) with H2O caches, `--prompt` of them as one chunk (scored with SnapKV's
`--window` and `--pool` when it is longer than the window) and the rest one decode token at a time,
with rows stored in `--kv-bits` (groups of 64) when given, for key and query scoring with evict_every 1 and 8, then saves every layer's kept
positions and scores (sorted by position) and each step's logits. Run it with two
checkouts' interpreters (e.g. `git worktree add /tmp/old <commit>`), then `compare`
prints per configuration whether the kept positions are identical and the largest score
and logit differences.
"""

import argparse
import sys

import numpy as np

CONFIGS = [(scoring, k) for scoring in ("key", "query") for k in (1, 8)]


def h2o_cache(model, budget: int, scoring: str, k: int, window: int, pool: int, kv_bits=None) -> list:
    """The H2O cache list of one configuration, with whichever API the checkout has:
    evict_every, the prompt scoring (window, pool) and the row storage (kv_bits) were
    H2OConfig fields before 94b7e27, d30f813 and the Storage split."""
    from h2o_fn import H2OConfig
    from h2o_fn.adapters.mlx_lm import make_h2o_cache

    fields, options = dict(budget=budget, n_sink=4, grace=16, scoring=scoring), {}
    if "evict_every" in H2OConfig._fields:
        fields["evict_every"] = k
    else:
        options["evict_every"] = k
    if "window" in H2OConfig._fields:
        fields.update(window=window, pool=pool)
    else:
        from h2o_fn import Prompt

        options["prompt"] = Prompt(window, pool)
    if kv_bits is not None:
        (fields if "kv_bits" in H2OConfig._fields else options)["kv_bits"] = kv_bits
    return make_h2o_cache(model, H2OConfig(**fields), **options)


def dump(out: str, tokens: int, budget: int, prompt: int = 40, window: int = 0, pool: int = 1,
         kv_bits=None) -> None:
    import mlx.core as mx

    from h2o_fn.adapters.gguf import load_gguf
    from h2o_fn.adapters.metrics import corpus_tokens
    from h2o_fn.adapters.mlx_lm import h2o_caches

    model, tokenizer = load_gguf(dequantize=True)
    ids, saved = corpus_tokens(tokenizer, tokens, None), {}
    for scoring, k in CONFIGS:
        cache = h2o_cache(model, budget, scoring, k, window, pool, kv_bits)
        model(mx.array([ids[:prompt]]), cache=cache)
        logits = []
        for t in ids[prompt:]:
            step = model(mx.array([[t]]), cache=cache)
            mx.eval(step)
            logits.append(np.array(step[0, -1]))
        name = f"{scoring}{k}"
        saved[f"{name}_logits"] = np.stack(logits)
        for i, c in enumerate(h2o_caches(cache)):
            c.flush() if hasattr(c, "flush") else c._flush()  # older commits: a private method
            p, s = np.array(c.core_state.positions), np.array(c.core_state.scores)
            order = np.argsort(np.where(p < 0, 1 << 30, p), axis=-1)
            saved[f"{name}_pos{i}"] = np.take_along_axis(p, order, -1)
            saved[f"{name}_sc{i}"] = np.take_along_axis(s, order, -1)
        print(f"dumped {name}", flush=True)
    np.savez(out, **saved)


def compare(a_path: str, b_path: str) -> None:
    a, b = np.load(a_path), np.load(b_path)
    for scoring, k in CONFIGS:
        name = f"{scoring}{k}"
        keys = [f for f in a.files if f.startswith(name + "_")]
        same = all(np.array_equal(a[f], b[f]) for f in keys if "_pos" in f)
        scores = max(float(np.max(np.abs(a[f] - b[f]))) for f in keys if "_sc" in f)
        logits = float(np.max(np.abs(a[f"{name}_logits"] - b[f"{name}_logits"])))
        print(f"{scoring} scoring, evict_every {k}: kept positions identical: {same}; "
              f"largest score difference {scores:.3g}, logit difference {logits:.3g}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    d = sub.add_parser("dump", help="run the model and save what every layer keeps")
    d.add_argument("out", help="the .npz to write")
    d.add_argument("--tokens", type=int, default=300, help="tokens fed (default 300)")
    d.add_argument("--prompt", type=int, default=40, help="of those, the first fed as one chunk (default 40)")
    d.add_argument("--budget", type=int, default=64, help="H2O budget (default 64)")
    d.add_argument("--window", type=int, default=0,
                   help="prompt scoring: a chunk longer than this scores by its last WINDOW queries (default 0)")
    d.add_argument("--pool", type=int, default=1, help="prompt scoring: spans kept together (default 1)")
    d.add_argument("--kv-bits", type=int, default=None, help="store the kept rows in this many bits (default: dense)")
    c = sub.add_parser("compare", help="compare two dumps")
    c.add_argument("a")
    c.add_argument("b")
    args = parser.parse_args(argv)
    if args.what == "dump":
        dump(args.out, args.tokens, args.budget, args.prompt, args.window, args.pool, args.kv_bits)
    else:
        compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
