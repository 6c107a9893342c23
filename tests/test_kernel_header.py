"""`make setup` precompiles the header every mlx CPU kernel includes (adapters/kernel_header.py)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from h2o_fn.adapters import kernel_header


def test_make_setup_leaves_a_precompiled_kernel_header_that_g_plus_plus_uses(tmp_path):
    if not (Path(sys.prefix) / ".h2o-fn-installed").is_file() or shutil.which("g++") is None:
        pytest.skip("only the Makefile's virtualenv (with g++) precompiles mlx's kernel header")
    header = kernel_header.preamble()
    gch = header.with_name(header.name + ".gch")
    assert gch.is_file(), f"{gch} is missing: `make setup` runs python -m h2o_fn.adapters.kernel_header"
    assert gch.stat().st_mtime >= header.stat().st_mtime, f"{gch} is older than the header it replaces"
    source = tmp_path / "kernel.cpp"  # what mlx writes for a kernel: the preamble first, then C code
    source.write_text('#include "mlx/backend/cpu/compiled_preamble.h"\n'
                      'extern "C" float twice(float x) { return x * 2; }\n')
    run = subprocess.run(["g++", *kernel_header.FLAGS, "-shared", "-H", "-I", str(header.parents[3]), str(source),
                          "-o", str(tmp_path / "kernel.so")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"! {gch}" in run.stderr, "g++ parsed the header instead of its precompiled copy"
