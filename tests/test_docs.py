"""The docstring examples of the core run (what `pytest --doctest-modules h2o_fn` checks),
inside `make test`; the adapter's offline examples run in tests/test_cli.py."""

import doctest
import importlib
import inspect
import pkgutil

import pytest

import h2o_fn

WITH_EXAMPLES = [
    m.name for m in pkgutil.iter_modules(h2o_fn.__path__, "h2o_fn.")
    if not m.ispkg and m.name != "h2o_fn.__main__"
    and ">>>" in inspect.getsource(importlib.import_module(m.name))
]


def test_the_core_modules_have_examples():
    assert {"h2o_fn.core", "h2o_fn.config", "h2o_fn.view", "h2o_fn.rope"} <= set(WITH_EXAMPLES)


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
