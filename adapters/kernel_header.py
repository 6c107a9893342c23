"""Precompile the header that every mlx CPU kernel includes, so that g++ reads it once.

On the CPU, mlx compiles each fused kernel (`mx.compile`d graphs, mlx-lm's compiled
activations) with `g++ -std=c++17 -O3 -Wall -fPIC -shared` on first use and keeps the
library in `$TMPDIR/mlx`. Every kernel's source starts with
`#include "mlx/backend/cpu/compiled_preamble.h"`, about 69,000 lines once preprocessed:
parsing them is most of the ~0.7 s each kernel costs. g++ uses `compiled_preamble.h.gch`
in place of the header when it sits beside it and was built with the same options, so the
kernels are the same machine code, built in ~0.15 s. A fresh machine (CI's, a user's)
compiles ~250 kernels on its first `make test`.

`make setup` runs `python -m h2o_fn.adapters.kernel_header` after installing mlx. Run it
again after upgrading mlx by hand: g++ does not check that the header is unchanged.

Example:
    >>> preamble().name
    'compiled_preamble.h'
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

import mlx.core as mx

# mlx's own command line for kernels (mlx/backend/cpu/jit_compiler.cpp), less -shared
FLAGS = ("-std=c++17", "-O3", "-Wall", "-fPIC")


def preamble() -> Path:
    """The header every mlx CPU kernel includes first."""
    return Path(mx.__file__).parent / "include" / "mlx" / "backend" / "cpu" / "compiled_preamble.h"


def precompile(compiler: str = "g++") -> Optional[Path]:
    """Build `compiled_preamble.h.gch` beside mlx's header (atomically: a failed build
    leaves no file). Returns its path, or None when there is no header or no compiler
    (mlx then runs its kernels uncompiled or compiles them the slow way)."""
    header = preamble()
    if not header.is_file() or shutil.which(compiler) is None:
        return None
    include = header.parents[3]  # the -I directory mlx passes
    # 0644: mkstemp's 0600 would hide it from other users of the same mlx
    return build_atomically([compiler, *FLAGS, "-x", "c++-header", str(header), "-I", str(include)],
                            header.with_name(header.name + ".gch"), 0o644)


def build_atomically(command: List[str], out: Path, mode: int, source: Optional[bytes] = None) -> Path:
    """Run a compiler's `command` with `-o` a temporary file beside `out` (`source` on its stdin),
    then move it to `out` in one step: a failed build (CalledProcessError, g++'s stderr in it)
    leaves no file behind and an earlier `out` as it was."""
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=out.suffix + ".tmp")
    os.close(fd)
    try:
        subprocess.run([*command, "-o", tmp], input=source, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)
        os.chmod(tmp, mode)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


if __name__ == "__main__":
    try:
        built = precompile()
    except subprocess.CalledProcessError as e:  # mlx still works: each kernel parses the header itself
        print(f"kernel_header: g++ could not precompile {preamble()}: {e.stderr.decode()[-500:]}", file=sys.stderr)
        sys.exit(0)
    print(f"kernel_header: {built}" if built else "kernel_header: no g++ or no mlx CPU header; nothing to do")
