"""Every install line a user meets works from a clone: lossscale is on no package index, so a line must install
from the clone (``pip install .``, ``pip install '.[demo]'``), never ``lossscale`` or ``lossscale[demo]`` as a
requirement, which pip looks for on PyPI and cannot find. Each extra such a line names is one that pyproject.toml
declares. Read: the README and the other top-level guides, the Makefile, the pages and scripts in docs/, examples/,
the package's own sources (its docstrings and error messages) and .ci/.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _doc_blocks import ROOT

SCANNED = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md", "Makefile", "docs/**/*", "examples/*", "src/**/*", ".ci/*"]
SKIPPED = ("docs/_build/", "docs/api/compat/", "docs/api/integrations/", "docs/api/modules/")  # built or generated

#: ``lossscale`` as the requirement of an install: ``lossscale[demo]`` anywhere, or ``pip install lossscale``.
AS_REQUIREMENT = re.compile(r"(?<![\w.])lossscale\[|pip install\s+(?:-\S+\s+)*['\"]?lossscale\b(?![\w./-])")
#: The extras of an install from the clone: ``.[demo]``, ``'.[transformers,demo]'``, ``-e ".[dev]"``.
FROM_CLONE = re.compile(r"(?<![\w/])\.\[([a-z][\w-]*(?:, ?[a-z][\w-]*)*)\]")


def scanned_files() -> list[Path]:
    files = {p for pattern in SCANNED for p in ROOT.glob(pattern) if p.is_file()}
    texts = []
    for path in sorted(files):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(SKIPPED) or "__pycache__" in rel or path.suffix in (".png", ".pyc"):
            continue
        texts.append(path)
    return texts


def lines() -> list[tuple[str, str]]:
    """``(file:line, text)`` of every line of the scanned files."""
    return [
        (f"{path.relative_to(ROOT)}:{number}", line)
        for path in scanned_files()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
    ]


def declared_extras() -> set[str]:
    """The extras of pyproject.toml's ``[project.optional-dependencies]`` (read without tomllib, for Python 3.10)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    table = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", table, re.M))


def test_the_scan_reads_the_places_install_lines_live_in():
    # the scan has to reach the README, a docs page, an example, the package's messages and .ci
    names = {p.relative_to(ROOT).as_posix() for p in scanned_files()}
    for expected in (
        "README.md",
        "docs/integrations.md",
        "examples/transformers_trainer.py",
        "src/lossscale/integrations/__init__.py",
        "src/lossscale/demo/cli.py",
        ".ci/wheel_check.py",
    ):
        assert expected in names, expected
    assert len([line for _, line in lines() if FROM_CLONE.search(line)]) >= 10


def test_no_line_asks_pip_for_lossscale_from_an_index():
    wrong = [f"{where}: {line.strip()}" for where, line in lines() if AS_REQUIREMENT.search(line)]
    assert not wrong, (
        "lossscale is on no package index, so pip cannot resolve it as a requirement; install from a clone "
        "instead (pip install '.[extra]' in the clone's folder):\n" + "\n".join(wrong)
    )


def test_each_extra_an_install_line_names_is_declared_in_pyproject():
    declared = declared_extras()
    assert {"demo", "lightning", "accelerate", "transformers"} <= declared
    unknown = [
        f"{where}: .[{extras}] ({name!r} is not an extra of pyproject.toml: {', '.join(sorted(declared))})"
        for where, line in lines()
        for extras in FROM_CLONE.findall(line)
        for name in (e.strip() for e in extras.split(","))
        if name not in declared
    ]
    assert not unknown, "\n".join(unknown)


@pytest.mark.parametrize("module", ["lightning", "fabric", "accelerate", "transformers"])
def test_each_integration_requires_its_framework_under_a_declared_extra(module):
    # the ImportError's install line is f"pip install '.[{extra}]'": the extra comes from the module's require()
    source = (ROOT / "src" / "lossscale" / "integrations" / f"{module}.py").read_text(encoding="utf-8")
    extras = re.findall(r"^require\(\s*\"[\w.]+\",\s*\"([\w-]+)\"", source, re.M)
    assert extras, f"lossscale.integrations.{module} calls no require(framework, extra, ...) at its top"
    assert set(extras) <= declared_extras(), extras
