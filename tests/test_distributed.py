"""Tensor parallel H2O on mx.distributed (ring backend over loopback, via mlx.launch):
every rank evicts its own KV heads exactly as one process does, with no communication."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("scripts") / "distributed_run.py"
LAUNCH = Path(sys.executable).with_name("mlx.launch")


def runs(which, scoring, budget, max_tokens, ranks=1, timeout=240):
    """{rank: result} of the script, alone or under mlx.launch with `ranks` processes."""
    cmd = [sys.executable, str(SCRIPT), which, scoring, str(budget), str(max_tokens)]
    if ranks > 1:
        cmd = [str(LAUNCH), "--backend", "ring", "-n", str(ranks), *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent.parent)})
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {r["rank"]: r for r in results}


def assert_sharded_equals_single(single, sharded, ranks):
    assert sorted(sharded) == list(range(ranks))
    heads = len(single["kept"][0])
    for rank, r in sharded.items():
        assert r["size"] == ranks and r["ids"] == single["ids"], rank  # the same greedy text
        local = heads // ranks
        for layer, kept in enumerate(r["kept"]):  # each rank holds heads [rank * local, ...)
            assert kept == single["kept"][layer][rank * local : (rank + 1) * local], (rank, layer)


pytestmark = pytest.mark.skipif(not LAUNCH.exists() or shutil.which("bash") is None,
                                reason="mlx.launch is not installed beside this python")


def test_tiny_llama_4_kv_heads_over_2_ranks():
    single = runs("tiny", "query", 12, 10)[0]
    assert single["seen"] > 12  # it evicted
    assert_sharded_equals_single(single, runs("tiny", "query", 12, 10, ranks=2), 2)


def test_smollm2_3_kv_heads_over_3_ranks():
    """The bundled model: 3 KV heads, one per rank; a 35-token prompt into 16 slots, then two
    decode steps (each forward costs ~2 s: 60 all_sums over loopback, 3 ranks on 2 cores)."""
    gguf = pytest.importorskip("h2o_fn.adapters.gguf")
    try:
        gguf.default_gguf_path()
    except FileNotFoundError:  # pragma: no cover
        pytest.skip(f"default model missing: {gguf.INSTALL_HINT}")
    single = runs("smollm", "query", 16, 3)[0]
    assert_sharded_equals_single(single, runs("smollm", "query", 16, 3, ranks=3), 3)


def test_heads_that_do_not_divide_are_refused():
    from h2o_fn.adapters.distributed import shard

    class Group:
        def size(self):
            return 2

    class Model:
        class args:
            num_key_value_heads = 3

    with pytest.raises(ValueError, match="3 KV heads, which do not divide over 2 ranks"):
        shard(Model(), Group())
