"""Decode tokens as C++ mlx primitives on the CPU: `key_step`; `admit`, `attention`, `settle`.

On a CPU mlx dispatches each primitive for a few microseconds whatever it computes, and a
key-scored decode token costs `h2o_fn.core`'s admit and settle_key 35 more of them per layer
than the rotating cache's update (BENCHMARKS.md, "Decode at every budget"). `cpu_step.cpp`
does the same work in three: the keys' row write, then the key proxy's weights, the decay-add
and the eviction, then the values' row write, which waits for them so that whatever attends
to the new rows evaluates the settle too (a settle left for later would still hold the keys).
Each write is in place when nothing else holds the store (one output: mlx donates no input to
a primitive with sibling outputs). Its spec is the core: `key_step(state, key, value, config)` is
`settle_key(admit(state, key, value), key, config)` (dense rows, every batch row taking the
token), bit for bit: the weights come from the same `cblas_sgemm` call mlx's matmul makes and
mlx's own softmax (`exact` states; tests/test_cpu_step.py).

A query-scored decode token (50 more primitives a layer than rotating's, as mlx ops) takes three
ops, each bit for bit its spec: `admit` (`core.admit`: the two row writes and one for the
positions and counts), `attention` (the attention hook's explicit attention of one query per
head and its weights averaged per KV head: the same `cblas_sgemm` calls, `h2o_fn.softmax`'s exp
replayed operation for operation; dense rows, or 8-bit ones with one group per row) and `settle`
(`core.settle`: the weights decay-added, one eviction). `native(policy)` says whether a cache
takes them (the bench's mx-ops rows do not). A key-scored token that `key_step` does not take
(8-bit rows, or more than `UP_TO` slots) has the hook's attention hand over its proxy's logits:
`attention` with the proxy's rows gives them from its own product, `settle_key` settles by them;
8-bit rows' proxy query is read back from the slot `admit` wrote (`newest_row`).

`make setup` runs `python -m h2o_fn.metal_ops.cpu_step`, which builds it with cmake, g++ and
nanobind (the version and domain mlx's own module was built with) into this environment's
`lib/h2o_fn/`. Where it is not built (no compiler, another mlx ABI, a GPU), `available()` is
False and callers keep the core's path.

Example:
    >>> import mlx.core as mx
    >>> from h2o_fn import H2OConfig, admit, init, settle_key
    >>> cfg = H2OConfig(budget=4, n_sink=1, grace=1, scoring="key")
    >>> s = init(cfg, 1, 2, 8)
    >>> for _ in range(6):
    ...     kv = mx.random.normal((1, 2, 1, 8))
    ...     fused = key_step(s, kv, kv, cfg) if available() else settle_key(admit(s, kv, kv), kv, cfg)
    ...     s = settle_key(admit(s, kv, kv), kv, cfg)
    ...     assert mx.array_equal(fused.positions, s.positions).item()
    >>> s.length.tolist()
    [4]
"""

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import mlx.core as mx

from h2o_fn import H2OConfig, Policy, arrays, rule, storage
from h2o_fn.softmax import MLX_UP_TO
from h2o_fn.state import H2OState

from . import evict

NAME = "_h2o_cpu_step"
SOURCE = Path(__file__).resolve().parent  # cpu_step.cpp and its CMakeLists.txt
# slots of the view up to which `fused` takes a decode token: the hook's attention.FUSED_UP_TO, where
# mlx-lm's attention gives the output; above, the hook's one C++ attention also gives the proxy's
# logits, faster (1.02x rotating against 0.93x at budget 1024) and the core's output bit for bit
# (BENCHMARKS.md, "Decode at every budget")
UP_TO = 512


def library_dir() -> Path:
    """Where `build` puts the module: this environment's `lib/h2o_fn/` (beside adapters.blas's)."""
    return Path(sys.prefix) / "lib" / "h2o_fn"


def build() -> Optional[Path]:
    """Build the module (cmake, g++, nanobind) into `library_dir()`, atomically. Returns its
    path, or None without cmake, a compiler or nanobind."""
    beside = Path(sys.executable).with_name("cmake")  # the bench extra's, in this environment
    cmake = str(beside) if beside.is_file() else shutil.which("cmake")
    if cmake is None or shutil.which("g++") is None or importlib.util.find_spec("nanobind") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        run = functools.partial(subprocess.run, check=True, capture_output=True)
        run([cmake, "-S", str(SOURCE), "-B", tmp, "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"])
        run([cmake, "--build", tmp, "-j", "2"])
        made = next(Path(tmp).glob(f"{NAME}*.so"), None)
        if made is None:
            return None
        out = library_dir() / made.name
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(made, out.with_suffix(".tmp"))
        os.replace(out.with_suffix(".tmp"), out)  # a reader sees the old module or the new one
        return out


@functools.lru_cache(maxsize=None)
def module():
    """The built module when it loads and takes this mlx's arrays, else None."""
    found = sorted(library_dir().glob(f"{NAME}*.so"))
    if not found:
        return None
    spec = importlib.util.spec_from_file_location(NAME, found[0])
    try:
        m = importlib.util.module_from_spec(spec)  # an extension module loads here
        spec.loader.exec_module(m)
        z, n = mx.zeros((1, 1, 2, 1)), mx.zeros((1,), dtype=mx.int32)
        mx.eval(m.key_step(z, z, mx.zeros((1, 1, 2)), mx.full((1, 1, 2), -1, mx.int32), n, n, z[:, :, :1],
                           z[:, :, :1], 1.0, 1.0, 0, 0, 1, 2))
    except (ImportError, TypeError) as e:  # another mlx: its nanobind ABI or array type differs
        print(f"h2o_fn.metal_ops.cpu_step: {found[0]} does not load with mlx {mx.__version__} ({e}); "
              "the core's key step is used (make setup rebuilds it)", file=sys.stderr)
        return None
    return m


def available() -> bool:
    """Whether `key_step` can run: the module is built and the default device is the CPU."""
    return mx.default_device() == mx.cpu and module() is not None


def fused(policy: Policy, state: H2OState, span: int) -> bool:
    """Whether a plain key-scored decode token into `state`, over a view of `span` slots, goes
    through `key_step`: built, on the CPU, dense rows, the rule's own eviction (not a custom
    `argmin`), an `exact` state, and at most `UP_TO` slots in the view (above, the attention
    hook's `attention` takes the proxy's logits from its own product of the keys and
    `settle_key` settles by them)."""
    return (policy.config.scoring == "key" and policy.kv.bits is None and span <= UP_TO and exact(state)
            and policy.argmin in (rule.protected_argmin, evict.protected_argmin) and available())


def exact(state: H2OState) -> bool:
    """Whether the core's proxy softmax over this state is mlx's own (`ranking_softmax`: at
    most `MLX_UP_TO` elements), the one `key_step` reproduces bit for bit."""
    return state.scores.size <= MLX_UP_TO


def native(policy: Policy) -> bool:
    """Whether a cache of this policy takes the C++ ops (`admit`, `attention`, `settle`): built,
    on the CPU, and the rule's own eviction (not a custom `argmin`, such as the bench's mx-ops
    rows); any scoring and row storage."""
    return policy.argmin in (rule.protected_argmin, evict.protected_argmin) and available()


def settle(admitted: H2OState, weights: mx.array, config: H2OConfig) -> H2OState:
    """`core.settle(admitted, weights, config)` with every batch row taking the token, as one
    primitive, bit for bit: weights `[B, H, C]` over the admitted state's slots decay-added
    (NaN, +-inf and negative ones as 0), then one eviction in each row over budget."""
    scores, positions, length = module().weight_settle(
        admitted.scores, admitted.positions, admitted.length, admitted.seen, weights.astype(mx.float32),
        config.decay, config.n_sink, config.grace, config.budget)
    return admitted._replace(scores=scores, positions=positions, length=length)


def admit(state: H2OState, key: mx.array, value: mx.array, kv: storage.Storage = storage.DENSE) -> H2OState:
    """`core.admit(state, key, value, kv)` (every batch row taking the token) as three
    primitives (dense rows) or nine (quantized: the rows' two mx.quantize, six writes), bit for
    bit: the key and value rows `[B, H, 1, D]` (as the stores hold them) written into each (b,
    h)'s first free slot (in place when nothing else holds the store), its position, the counts."""
    if storage.is_quantized(state.keys) != (kv.bits is not None):
        raise ValueError(f"admit got {'quantized' if storage.is_quantized(state.keys) else 'dense'} rows with "
                         f"kv.bits={kv.bits}: expected quantized rows exactly when kv.bits is set")
    if kv.bits is None:  # the C++ write casts them, as the core's astype does
        rows = [key, value]
    else:
        rows = [r for x, like in ((key, state.keys), (value, state.values))
                for r in storage.parts(arrays.stored_rows(x, like, kv))]
    out = module().admit_rows([*storage.parts(state.keys), *storage.parts(state.values)], state.positions,
                              state.length, state.seen, rows)
    n = len(storage.parts(state.keys))
    keys, values = (tuple(out[i:i + n]) if n > 1 else out[i] for i in (0, n))
    return state._replace(keys=keys, values=values, positions=out[-3], length=out[-2], seen=out[-1])


def reads_back(state: H2OState, kv: storage.Storage) -> bool:
    """Whether `newest_row` takes this admitted state: built, on the CPU, 8-bit rows with one group
    per row and float32 scales (what `storage.dense` computes in float32)."""
    if kv.bits != 8 or not storage.is_quantized(state.keys):
        return False
    packed, scales, _ = state.keys
    return scales.shape[-1] == 1 and scales.dtype == mx.float32 and kv.group_size == packed.shape[-1] * 4 \
        and available()


def newest_row(admitted: H2OState) -> mx.array:
    """`view.proxy_query(admitted, key, kv)` for the token `admit` just wrote, read back from its
    slot as one primitive instead of a second quantize and a dequantize (~10): the key proxy's
    query `[B, H, 1, D]` float32, bit for bit (`storage.dense`'s float(code) * s + b, times
    1/sqrt(D)). 8-bit rows as `reads_back` says; every batch row took the token."""
    packed, scales, biases = admitted.keys
    D = packed.shape[-1] * 4
    return module().newest_row(packed, scales, biases, admitted.positions, admitted.seen, D ** -0.5)


def attends(queries: mx.array, keys, values, bits: Optional[int] = None) -> bool:
    """Whether `attention` takes this attention: built, on the CPU, one query per head, dense
    keys and values (any number: it is the faster at 256-4096 keys, BENCHMARKS.md), or 8-bit
    rows (`bits`) in mx.quantize's triples with one group per row."""
    dense = bits is None and isinstance(keys, mx.array) and isinstance(values, mx.array)
    q8 = bits == 8 and all(isinstance(x, tuple) and len(x) == 3 and x[1].shape[-1] == 1 for x in (keys, values))
    return queries.shape[2] == 1 and (dense or q8) and available()


def attention(queries: mx.array, keys, values, scale: float, rows: Optional[mx.array] = None) -> tuple:
    """One query per head, no mask: `attention_with_weights(queries, keys, values, scale)`'s
    output `[B, Hq, 1, Dv]` (the queries' dtype) and its weights averaged over the query heads
    sharing each KV head, `per_kv_head(weights, H)` `[B, H, 1, L]` float32, as one primitive, bit
    for bit (h2o_fn.adapters.attention: the same products, h2o_fn.softmax's exp; 8-bit rows as
    h2o_fn.storage multiplies them). Queries `[B, Hq, 1, D]`, keys `[B, H, L, D]`, values
    `[B, H, L, Dv]` (or 8-bit triples, `attends`), Hq a multiple of H.

    With the key proxy's `rows` `[B, H, P, D]` (float32, scaled), a third array: their logits
    `[B, H, P, L]` from the same product, so (output, logits) are `attention_with_proxy`'s."""
    extra = [] if rows is None else [rows]
    if isinstance(keys, tuple):
        return tuple(module().attention_q8(queries, *keys, *values, scale, extra))
    return tuple(module().attention(queries, keys, values, scale, extra))


def settle_key(admitted: H2OState, logits: mx.array, config: H2OConfig) -> H2OState:
    """`core.settle_key(admitted, key, config, logits=view.decode_weights(logits, admitted))`
    with every batch row taking the token, as one primitive, bit for bit: the key proxy's
    logits `[B, H, 1, span]` over the admitted state's first span slots (0 beyond), their
    softmax over the slots holding a token other than the new one (mlx's own for `exact`
    states, else h2o_fn.softmax's, as `ranking_softmax` picks), decay-added, one eviction in
    each row over budget."""
    scores, positions, length = module().key_settle(
        admitted.scores, admitted.positions, admitted.length, admitted.seen, logits.astype(mx.float32),
        config.decay, config.n_sink, config.grace, config.budget, exact(admitted))
    return admitted._replace(scores=scores, positions=positions, length=length)


def key_step(state: H2OState, key: mx.array, value: mx.array, config: H2OConfig,
             span: Optional[int] = None) -> H2OState:
    """`core.settle_key(core.admit(state, key, value), key, config)` as one primitive: one token
    `[B, H, 1, D]` written into the first free slot of dense stores `[B, H, C, D]`, scored by its
    key, settled. Every batch row takes it. With `span` (the decode view's slots, default C) the
    proxy's logits are the product over those slots only, 0 beyond, as the attention hook hands
    them over (`cache_state.receive_proxy`: the same products, which a BLAS may round differently
    for another N). Needs `available()`."""
    if storage.is_quantized(state.keys) or config.scoring != "key" or not exact(state):
        raise ValueError(f"key_step takes dense rows, scoring='key' and at most {MLX_UP_TO} slots: got "
                         f"{config.scoring!r}, {'quantized' if storage.is_quantized(state.keys) else 'dense'} "
                         f"rows, {state.scores.size} slots")
    C = state.scores.shape[-1]
    out = module().key_step(*state, key, value, config.decay, key.shape[-1] ** -0.5, config.n_sink,
                            config.grace, config.budget, C if span is None else span)
    return H2OState(*out)


if __name__ == "__main__":
    try:
        made = build()
    except subprocess.CalledProcessError as e:  # the core's key step stays
        print(f"cpu_step: could not build {NAME}: {(e.stderr or b'').decode()[-800:]}", file=sys.stderr)
        sys.exit(0)
    print(f"cpu_step: {made} (a key-scored decode token as three CPU primitives)" if made else
          "cpu_step: no cmake, g++ or nanobind; the core's key step stays")
