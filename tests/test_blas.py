"""The OpenBLAS stand-in (adapters/blas.py): preloaded, mlx's float matmuls run through
OpenBLAS and agree with float64 products; built again, it replaces itself atomically."""

import os
import subprocess
import sys

import pytest

from h2o_fn.adapters import blas

CHECK = """
import ctypes, os
import mlx.core as mx, numpy as np
rng = np.random.default_rng(0)
for m, k, n in [(1, 64, 3), (7, 33, 5), (130, 576, 200)]:
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    for x, y in [(a, b), (a, np.ascontiguousarray(b.T).T)]:
        got = np.array(mx.array(x) @ mx.array(y))
        assert np.allclose(got, x.astype(np.float64) @ y, rtol=1e-4, atol=1e-4), (m, k, n)
class Info(ctypes.Structure):  # dladdr's Dl_info
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                ("saddr", ctypes.c_void_p)]
process = ctypes.CDLL(None)  # the global scope, where a preloaded library's symbols come first
try:
    where, info = ctypes.cast(process.cblas_sgemm, ctypes.c_void_p), Info()
    process.dladdr(where, ctypes.byref(info))
    print(os.path.basename(info.fname.decode()))
except AttributeError:  # mlx's own reference BLAS is loaded locally, for libmlx alone
    print("none")
"""


def run_check(preload: str) -> str:
    env = dict(os.environ, LD_PRELOAD=preload, OPENBLAS_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.skipif(blas.built() is None, reason="no stand-in built here (not Linux, or no g++ or scipy-openblas32)")
def test_preloaded_the_products_run_through_openblas_and_agree():
    assert run_check(blas.built()) == "libh2o_openblas.so"  # what libmlx's cblas_sgemm binds to
    assert run_check("") == "none"  # without it mlx keeps its reference BLAS, with the same products


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in is for mlx's Linux wheel")
def test_a_build_replaces_the_library_in_one_step(tmp_path, monkeypatch):
    pytest.importorskip("scipy_openblas32")
    monkeypatch.setattr(blas, "library", lambda: tmp_path / "lib" / "libh2o_openblas.so")
    if blas.build() is None:
        pytest.skip("no g++ here")
    assert [p.name for p in (tmp_path / "lib").iterdir()] == ["libh2o_openblas.so"]  # no temporary left
    assert run_check(str(tmp_path / "lib" / "libh2o_openblas.so")) == "libh2o_openblas.so"
    monkeypatch.setattr(blas, "SHIM", "not C++")
    with pytest.raises(subprocess.CalledProcessError):
        blas.build()
    assert [p.name for p in (tmp_path / "lib").iterdir()] == ["libh2o_openblas.so"]  # the old one kept
