"""Every example in the package's docstrings runs as written (doctest), one test per module that has examples.

Skipped: ``lossscale.demo`` (outside the library's import path), ``lossscale.integrations`` (their frameworks
are extras) and ``lossscale.ops.amax_kernel`` (needs triton, which comes with torch's CUDA builds); none holds an
example today.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import lossscale

SKIPPED = ("lossscale.demo", "lossscale.integrations", "lossscale.__main__", "lossscale.ops.amax_kernel")


def modules_with_examples() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(lossscale.__path__, "lossscale.") if not m.name.startswith(SKIPPED)]
    finder = doctest.DocTestFinder()
    return sorted(
        name
        for name in ["lossscale", *names]
        if any(test.examples for test in finder.find(importlib.import_module(name)))
    )


MODULES = modules_with_examples()


def test_the_documented_modules_have_examples():
    """A guard against a walk that finds nothing: the policies, the owner and the facades show examples."""
    assert {"lossscale.policies.dynamic", "lossscale.state", "lossscale.validation", "lossscale.compat.ascend"} <= set(
        MODULES
    )


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, report=True)
    assert result.attempted > 0 and result.failed == 0, f"{result.failed} of {result.attempted} examples failed"
