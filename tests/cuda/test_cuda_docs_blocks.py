"""The docs' blocks marked ``<!-- runnable-cuda -->`` run on a CUDA device as written, a page's blocks in order in
one namespace, and print what the page says (the marks: tests/_doc_blocks.py; the CPU blocks:
tests/test_docs_blocks.py)."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from _doc_blocks import ROOT, promises, python_blocks, same_output

PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
CUDA_PAGES = [page for page in PAGES if any(b.mark == "runnable-cuda" for b in python_blocks(page))]


def test_there_are_cuda_blocks():
    assert CUDA_PAGES, "no page has a <!-- runnable-cuda --> block"


@pytest.mark.parametrize("page", CUDA_PAGES)
def test_cuda_blocks_run_and_print_what_the_page_says(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for block in python_blocks(page):
        if block.mark != "runnable-cuda":
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block.code, block.where, "exec"), namespace)
        torch.cuda.synchronize()
        printed = out.getvalue()
        if block.output is not None:
            assert same_output(printed, block.output), f"{block.where}: printed\n{printed}\npage:\n{block.output}"
        promised = promises(block.code)
        if promised:
            lines = printed.splitlines()
            assert len(lines) == len(promised), (block.where, lines, promised)
            for text, got in zip(promised, lines):
                assert got.startswith(text), f"{block.where}: printed {got!r}, the comment says {text!r}"
