"""The examples in moe_upcycle's docstrings run and print what they say, module by module.

They are run here rather than with pytest's ``--doctest-modules``, which would also read the test files'
own docstrings as examples. An example that needs a model or the embedder is marked ``# doctest: +SKIP``.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import moe_upcycle

MODULES = sorted(m.name for m in pkgutil.walk_packages(moe_upcycle.__path__, "moe_upcycle."))


def test_every_module_is_found():
    assert {"moe_upcycle.build", "moe_upcycle.in_memory", "moe_upcycle.recipe.schema",
            "moe_upcycle.inputs.records", "moe_upcycle.cli.mergekit_flags"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report: list[str] = []
    for test in doctest.DocTestFinder().find(module, name):
        runner.run(test, out=report.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(report)
