"""Every ```python block of README.md and docs/*.md is marked, and the runnable ones run on CPU and print what the
page says they print. The marks and the promises are described in tests/_doc_blocks.py; the CUDA blocks run in
tests/cuda/test_cuda_docs_blocks.py.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from _doc_blocks import KINDS, ROOT, promises, python_blocks, same_output

#: Pages being written or rewritten elsewhere; each comes off this list once its blocks are marked.
NOT_YET: dict[str, str] = {}
PAGES = ["README.md"] + sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md") if str(p.relative_to(ROOT)) not in NOT_YET
)
RUNNABLE_PAGES = [page for page in PAGES if any(b.mark == "runnable" for b in python_blocks(page))]


@pytest.mark.parametrize("page", PAGES)
def test_every_python_block_is_marked_and_an_excerpt_still_parses(page):
    for block in python_blocks(page):
        assert block.mark in KINDS, (
            f"{block.where}: a ```python block needs a mark on the line before its fence, one of "
            + ", ".join(f"<!-- {k} -->" for k in KINDS)
            + f" (tests/_doc_blocks.py); got {block.mark!r}"
        )
        if block.mark == "excerpt":
            compile(block.code, block.where, "exec")  # pasted, it is at least Python
        if block.mark == "example":
            runners = [p for p in (ROOT / "tests").rglob("test_*.py") if block.note in p.read_text()]
            assert block.note and runners, f"{block.where}: no test in tests/ runs the example {block.note!r}"


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_runnable_blocks_run_on_cpu_and_print_what_the_page_says(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a block may write files (StepLogger's CSV)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the README's blocks pick CUDA where there is one
    namespace: dict = {"__name__": "__docs__"}
    for block in python_blocks(page):
        if block.mark != "runnable":
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block.code, block.where, "exec"), namespace)
        printed = out.getvalue()
        if block.output is not None:
            assert same_output(printed, block.output), (
                f"{block.where}: printed\n{printed}\nthe page shows\n{block.output}"
            )
        promised = promises(block.code)
        if promised:
            lines = printed.splitlines()
            assert len(lines) == len(promised), (block.where, lines, promised)
            for text, got in zip(promised, lines):
                assert got.startswith(text), f"{block.where}: printed {got!r}, the comment says {text!r}"
