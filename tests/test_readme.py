"""README.md's first screen shows the install line and working code for both front ends. (That the README's marked
blocks run and print what they say is tests/test_docs_blocks.py's, for every page.)"""

from __future__ import annotations

from _doc_blocks import ROOT, python_blocks

FIRST_SCREEN = 40


def test_the_first_screen_has_the_install_line_and_runnable_code_for_both_front_ends():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert any(line.startswith("pip install") for line in lines[:FIRST_SCREEN])
    first = [
        b.code
        for b in python_blocks("README.md")
        if b.mark == "runnable" and b.line + b.code.count("\n") + 2 <= FIRST_SCREEN
    ]
    assert first, f"no runnable block ends within README.md's first {FIRST_SCREEN} lines"
    code = "\n".join(first)
    assert "GradScaler()" in code and "LossScaleOptimizer(" in code
