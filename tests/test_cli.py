"""Every command runs end to end on a tiny budget/length, so none of them can rot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def h2o_fn(*args, timeout=240):
    done = subprocess.run([sys.executable, "-m", "h2o_fn", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_demo_shows_the_freeze_and_the_advancing_window():
    out = h2o_fn("demo", "--budget", "16", "--tokens", "120")
    published, defaults = out.split("h2o-fn defaults")
    assert published.count("kept  16: 0-15") == 5  # frozen on the first budget tokens
    last = [line for line in defaults.splitlines() if "after  120 tokens" in line][0]
    assert "kept  16: 0-3 " in last and last.endswith("112-119")  # sinks + the grace window
    assert all(int(p.split("-")[0]) > 60 for p in last.split(": ")[-1].split()[1:])  # the rest is recent


def test_generate_with_compare():
    out = h2o_fn("generate", "--prompt", "Name a colour.", "--max-tokens", "12", "--budget", "24",
                 "--n-sink", "2", "--grace", "4", "--compare")
    assert "KV cache: " in out and "compression" in out
    assert "full KVCache" in out and "RotatingKVCache(24, keep=2)" in out and "diverges at" in out


def test_eval_tiny(tmp_path):
    h2o_fn("eval", "--tokens", "40", "--budgets", "24", "--gen-budgets", "24", "--gen-tokens", "6",
           "--prompts", "1", "--passkey-context", "40", "--passkey-budgets", "24", "--depths", "0.5",
           "--trials", "1", "--map-steps", "4", "--sweep-budget", "24", "--no-openblas", "--quantized",
           "--out", str(tmp_path))
    results = json.loads((tmp_path / "eval.json").read_text())
    assert {"ppl", "agree", "retrieval", "kept_map", "sweep", "mass"} <= results.keys()
    assert {r["gqa"] for r in results["sweep"]["rows"]} == {"mean", "max"}
    names = {r["name"] for r in results["ppl"]["rows"]}
    assert {"full KVCache", "RotatingKVCache keep=4", "H2O key oneshot", "H2O query greedy"} <= names
    assert all(r["ppl"] > 1 for r in results["ppl"]["rows"])
    assert (tmp_path / "ppl_vs_budget.png").stat().st_size > 1000
    assert (tmp_path / "kept_positions.png").stat().st_size > 1000
    assert "Streaming perplexity" in (tmp_path / "eval.md").read_text()


def test_bench_tiny(tmp_path):
    h2o_fn("bench", "--budgets", "16", "--repeats", "3", "--contexts", "32", "--budget", "24", "--steps", "4",
           "--chunk", "16", "--prefill-tokens", "48", "--prefill-chunk", "16", "--no-openblas", "--quantized",
           "--out", str(tmp_path))
    results = json.loads((tmp_path / "bench.json").read_text())
    assert {r["cache"] for r in results["update"]} >= {"KVCache", "H2O step (compiled)"}
    assert len(results["decode"]["rows"]) == 4 and all(r["tok_s"] > 0 for r in results["decode"]["rows"])
    assert results["prefill"][0]["vs_full"] == pytest.approx(1.0)
