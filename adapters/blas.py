"""OpenBLAS for mlx's CPU matmuls on Linux, from PyPI, without root.

mlx's Linux wheel links netlib's reference BLAS (bundled in `mlx_cpu.libs`): its
`cblas_sgemm`, which every float32 matmul calls, is plain scalar loops. The wheel
`scipy-openblas32` ships OpenBLAS built for every x86-64 and arm64 core (it picks one at
run time) but with its symbols renamed `scipy_cblas_*`, so it cannot stand in directly.
`build()` compiles a library of three forwarding functions that exports the names mlx calls
(`cblas_sgemm`, `cblas_dgemm`, `cblas_cgemm`; `nm -D libmlx.so` lists no other BLAS
symbol). Preloaded (`LD_PRELOAD`), it takes the reference BLAS's place in that process and
its children: `make test` runs the suite so, one OpenBLAS thread per pytest worker, and
eval and bench re-run themselves with it when Debian's OpenBLAS is not installed
(`cli.common.openblas_path`). Results differ from the reference BLAS's in the last bits
(OpenBLAS sums in another order, by block).

`make setup` runs `python -m h2o_fn.adapters.blas`. Without g++, without the wheel, or off
Linux (macOS: mlx uses Accelerate), nothing is built and everything runs as before.

Example:
    >>> library().name
    'libh2o_openblas.so'
"""

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from .kernel_header import build_atomically

# C ABI: CBLAS enums are ints; scipy-openblas32's integers are 32-bit (blasint = int)
SHIM = """
extern "C" {
typedef float S; typedef double D;
void scipy_cblas_sgemm(int, int, int, int, int, int, S, const S*, int, const S*, int, S, S*, int);
void scipy_cblas_dgemm(int, int, int, int, int, int, D, const D*, int, const D*, int, D, D*, int);
void scipy_cblas_cgemm(int, int, int, int, int, int, const void*, const void*, int, const void*, int,
                       const void*, void*, int);
void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, S al, const S* a, int lda, const S* b, int ldb,
                 S be, S* c, int ldc) { scipy_cblas_sgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc); }
void cblas_dgemm(int o, int ta, int tb, int m, int n, int k, D al, const D* a, int lda, const D* b, int ldb,
                 D be, D* c, int ldc) { scipy_cblas_dgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc); }
void cblas_cgemm(int o, int ta, int tb, int m, int n, int k, const void* al, const void* a, int lda,
                 const void* b, int ldb, const void* be, void* c, int ldc) {
  scipy_cblas_cgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
}
}
"""


def library() -> Path:
    """Where `build` puts the preloadable library: this environment's `lib/h2o_fn/`."""
    return Path(sys.prefix) / "lib" / "h2o_fn" / "libh2o_openblas.so"


def built() -> Optional[str]:
    """The library's path when it has been built (Linux only), else None."""
    return str(library()) if sys.platform == "linux" and library().is_file() else None


def build(compiler: str = "g++") -> Optional[Path]:
    """Compile the forwarding library against scipy-openblas32 (atomically: a failed build
    leaves no file). Returns its path, or None off Linux, without the wheel or without a compiler."""
    try:
        import scipy_openblas32 as wheel
    except ImportError:
        return None
    if sys.platform != "linux" or shutil.which(compiler) is None:
        return None
    lib_dir = Path(wheel.get_lib_dir()).resolve()
    out = library()
    out.parent.mkdir(parents=True, exist_ok=True)
    return build_atomically([compiler, "-O2", "-shared", "-fPIC", "-x", "c++", "-", f"-L{lib_dir}",
                             f"-l{wheel.get_library()}", f"-Wl,-rpath,{lib_dir}"], out, 0o755, SHIM.encode())


if __name__ == "__main__":
    try:
        made = build()
    except subprocess.CalledProcessError as e:  # mlx keeps its reference BLAS
        print(f"blas: g++ could not build {library()}: {e.stderr.decode()[-500:]}", file=sys.stderr)
        sys.exit(0)
    print(f"blas: {made} (OpenBLAS for mlx when preloaded)" if made else
          "blas: not Linux, no scipy-openblas32 or no g++; mlx keeps its reference BLAS")
