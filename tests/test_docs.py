"""The docstring examples of the core and of the adapter's modules run (what `pytest
--doctest-modules` checks), inside `make test`; the commands' examples run in tests/test_cli.py.
The README's quick start runs and holds the commands' policy, its policy table is the code's,
and the links between the pages land."""

import doctest
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import h2o_fn
import h2o_fn.adapters


def with_examples(package) -> list:
    """The modules of `package` (not its subpackages) whose docstrings hold examples."""
    return [
        m.name for m in pkgutil.iter_modules(package.__path__, package.__name__ + ".")
        if not m.ispkg and not m.name.endswith("__main__")
        and ">>>" in inspect.getsource(importlib.import_module(m.name))
    ]


WITH_EXAMPLES = with_examples(h2o_fn)
ADAPTER_EXAMPLES = with_examples(h2o_fn.adapters)


def test_the_core_modules_have_examples():
    assert {"h2o_fn.core", "h2o_fn.config", "h2o_fn.view", "h2o_fn.rope"} <= set(WITH_EXAMPLES)


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0


def test_the_adapters_modules_have_examples():
    assert {"h2o_fn.adapters.cache", "h2o_fn.adapters.cache_state", "h2o_fn.adapters.staging",
            "h2o_fn.adapters.lockstep"} <= set(ADAPTER_EXAMPLES)


@pytest.mark.parametrize("name", ADAPTER_EXAMPLES)
def test_adapter_docstring_examples_run(name):
    """Examples that need the bundled model are marked `+SKIP` (tests/test_real_model.py runs it)."""
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0


# ---------------------------------------------------------------- the README and docs/

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", "BENCHMARKS.md", "docs/usage.md", "docs/serve.md", "docs/policy.md", "docs/ARCHITECTURE.md"]


def readme_quick_start() -> str:
    """The first python block of the README (its quick start)."""
    text = (ROOT / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def commands_policy(budget: int):
    """The policy and evict_every every H2O cache of `h2o-fn generate --budget <budget>` holds,
    built as generate builds them from its parsed default flags."""
    from h2o_fn.adapters.cli import common, generate

    parser = generate.setup_arg_parser()
    args = parser.parse_args(["--budget", str(budget)])
    options = common.cache_options(parser, args)
    return common.policy_of(common.policy_or_error(parser, args, args.budget), options), options["evict_every"]


def test_the_readme_quick_start_runs_the_commands_policy(capsys):
    """The README's Python example runs (with 8 new tokens instead of its 300: the same calls)
    and every H2O cache it builds holds the policy `h2o-fn generate --budget 256` uses."""
    gguf = pytest.importorskip("h2o_fn.adapters.gguf")
    try:
        gguf.default_gguf_path()
    except FileNotFoundError:
        pytest.skip(f"default model missing: install it with `{gguf.INSTALL_HINT}`")
    from h2o_fn.adapters.attention import remove_query_hook
    from h2o_fn.adapters.mlx_lm import h2o_caches

    code = readme_quick_start()
    assert "make_h2o_cache(model, budget=256)" in code and "max_tokens=300" in code
    assert len(code.strip().splitlines()) <= 12
    namespace = {}
    exec(compile(code.replace("max_tokens=300", "max_tokens=8"), "README.md", "exec"), namespace)
    try:
        policy, every = commands_policy(256)
        caches = h2o_caches(namespace["cache"])
        assert len(caches) == 30 and all(c.policy == policy and c.evict_every == every for c in caches)
        kept, seen, nbytes = map(int, capsys.readouterr().out.split()[-3:])
        assert kept == seen == caches[0].tokens_seen > 8 and nbytes > 0  # within budget: nothing evicted yet
    finally:
        remove_query_hook(namespace["model"])


def test_the_readme_policy_table_is_the_code():
    """One table of defaults (the README's), equal to the code's one source, which the
    commands' flags and make_h2o_cache's signature read."""
    from h2o_fn import Storage
    from h2o_fn.adapters.cli import generate
    from h2o_fn.adapters.mlx_lm import DEFAULT_CONFIG, DEFAULT_PROMPT, make_h2o_cache

    text = (ROOT / "README.md").read_text()
    table = text[text.index("| knob | default |"):].split("\n\n")[0].splitlines()[2:]
    readme = {row.split("|")[1].strip(" `"): row.split("|")[2].strip(" `\"") for row in table}
    code = {**DEFAULT_CONFIG._asdict(), **DEFAULT_PROMPT._asdict(), "kv_bits": Storage().bits,
            "kv_group_size": Storage().group_size,
            "evict_every": inspect.signature(make_h2o_cache).parameters["evict_every"].default}
    assert readme == {k: str(v) for k, v in code.items()}
    flags = {a.dest: a.default for a in generate.setup_arg_parser()._actions}
    for knob, value in code.items():
        if knob not in ("budget", "n_sink", "grace"):  # generate: None, then the budget's (recommended)
            assert flags[knob] == value, knob
    assert len(text.splitlines()) <= 220


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES)
def test_every_link_between_the_pages_lands(page):
    """Relative links name a file that exists and, with #anchor, a heading in it."""
    text = (ROOT / page).read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"https?://", target):
            continue
        path, _, frag = target.partition("#")
        file = (ROOT / page).parent / path if path else ROOT / page
        assert file.exists(), f"{page} links to {target}: no such file"
        if frag and file.suffix == ".md":
            anchors = {anchor(h) for h in re.findall(r"^#+ (.*)$", file.read_text(), re.M)}
            assert frag in anchors, f"{page} links to {target}: no such heading in {file.name}"
