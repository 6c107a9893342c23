"""The docstring examples of the core and of the adapter's modules run (what `pytest
--doctest-modules` checks), inside `make test`; the commands' examples run in tests/test_cli.py."""

import doctest
import importlib
import inspect
import pkgutil

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
