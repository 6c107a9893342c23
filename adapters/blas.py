"""Optional OpenBLAS for eval and bench: mlx's Linux wheel links a reference BLAS.

Debian's OpenBLAS, preloaded, makes float matmuls 10-30x faster on this kind
of CPU. A process cannot preload into itself, so `reexec_with_openblas`
re-executes the command once with LD_PRELOAD set. Tests never use this.
"""

import glob
import os
import sys
from typing import List, Optional

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
    env = dict(os.environ, LD_PRELOAD=path, OPENBLAS_CORETYPE=os.environ.get("OPENBLAS_CORETYPE", _coretype()))
    env[FLAG] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "h2o_fn", *argv], env)


def blas_report() -> str:
    """One line saying which BLAS this process runs with."""
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        return (f"BLAS: OpenBLAS preloaded ({os.environ['LD_PRELOAD']}, "
                f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'auto')})")
    return "BLAS: mlx's bundled reference BLAS (OpenBLAS not preloaded)"
