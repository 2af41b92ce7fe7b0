"""README.md's code that is marked runnable runs, and prints what its comments say; its first screen shows the
install line and working code for both front ends.

A block is runnable when the line before its opening fence starts with ``<!-- runnable``. The marked blocks run
in order in one namespace (a later block may use an earlier one's names). A ``print(...)  # text ...`` line
promises that the printed text starts with ``text``.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
FIRST_SCREEN = 40


def runnable_blocks() -> list[tuple[int, str]]:
    """(line number of the opening fence, code) of each block marked runnable."""
    lines = README.read_text(encoding="utf-8").splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.startswith("<!-- runnable"):
            assert lines[i + 1] == "```python", f"README.md:{i + 2}: a runnable mark must precede a ```python fence"
            end = lines.index("```", i + 2)
            blocks.append((i + 2, "\n".join(lines[i + 2:end])))
    return blocks


def test_the_first_screen_has_the_install_line_and_runnable_code_for_both_front_ends():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert any(line.startswith("pip install") for line in lines[:FIRST_SCREEN])
    first = [code for start, code in runnable_blocks() if start + code.count("\n") + 2 <= FIRST_SCREEN]
    assert first, f"no runnable block ends within README.md's first {FIRST_SCREEN} lines"
    code = "\n".join(first)
    assert "GradScaler()" in code and "LossScaleOptimizer(" in code


def test_runnable_blocks_run_and_print_what_their_comments_promise():
    blocks = runnable_blocks()
    assert blocks
    namespace: dict = {"__name__": "readme"}
    for start, code in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"README.md:{start}", "exec"), namespace)  # noqa: S102 - the README is ours
        promised = [m.group(1).rstrip() for m in re.finditer(r"^print\(.*\)\s+# (.*?)(?:\.\.\.|$)", code, re.M)]
        printed = out.getvalue().splitlines()
        assert len(printed) == len(promised), (start, printed)
        for text, got in zip(promised, printed):
            assert got.startswith(text.rstrip(", ")), f"README.md:{start}: printed {got!r}, the comment says {text!r}"
