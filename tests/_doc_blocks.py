"""The ```python blocks of README.md and docs/*.md, with the mark each carries, and how a marked block is run.

A ```python block's opening fence follows a mark on the line before it:

- ``<!-- runnable -->`` (or ``<!-- runnable: note -->``): runs on CPU as written. A page's runnable blocks run in
  order in one namespace, so a later block uses an earlier one's names (the page's set-up is its first runnable
  block). Run by tests/test_docs_blocks.py.
- ``<!-- runnable-cuda -->``: the same, on a CUDA device; run by tests/cuda/test_cuda_docs_blocks.py.
- ``<!-- excerpt -->`` (or ``<!-- excerpt: what it needs -->``): lines from a larger program, not run; it must
  still parse as Python (no ``...`` in an argument list, no stray indentation).
- ``<!-- example: NAME.py -->``: a whole script that a named test runs as a file (docs/distributed.md's
  ``train_ddp.py`` runs under torchrun in tests/test_distributed.py).

What a runnable block promises about its output:

- a line ``print(...)  # text`` promises that the line it prints starts with ``text`` (a trailing ``...``, a
  trailing ``, ...`` or ``: ...`` ends the promise: what follows it is not checked);
- a ```text block right after the runnable block, marked ``<!-- output -->``, is what the block prints: the same
  lines, numbers equal within 1e-3 relative (the last digits of a float16 loss may differ by CPU).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"^<!-- (runnable-cuda|runnable|excerpt|example|output)(?::\s*([^>]*?))? -->$")
KINDS = ("runnable", "runnable-cuda", "excerpt", "example")


@dataclass(frozen=True)
class Block:
    """One fenced block: its page (relative to the repository), the line of its opening fence, its mark (None
    without one) and the mark's note (after the colon), its language and its code; ``output`` is the
    ``<!-- output -->`` block after it, if any."""

    page: str
    line: int
    mark: str | None
    note: str
    lang: str
    code: str
    output: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """Every fenced block of ``page`` (a path relative to the repository) in order; an ``<!-- output -->``
    block is attached to the python block before it instead of being listed."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        lang = lines[i][3:].strip()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```")
        before = lines[i - 1].strip() if i else ""
        m = MARK.match(before)
        mark, note = (m.group(1), m.group(2) or "") if m else (None, "")
        code = "\n".join(lines[i + 1 : end])
        if mark == "output":
            assert found and found[-1].lang == "python" and found[-1].output is None, (
                f"{page}:{i + 1}: an <!-- output --> block must follow a python block"
            )
            found[-1] = dataclasses.replace(found[-1], output=code)
        else:
            found.append(Block(page, i + 1, mark, note, lang, code))
        i = end + 1
    return found


def python_blocks(page: str) -> list[Block]:
    return [b for b in blocks(page) if b.lang == "python"]


_PROMISE = re.compile(r"^\s*print\(.*\)\s+# (.*)$", re.M)


def promises(code: str) -> list[str]:
    """The printed prefix each ``print(...)  # text`` line of ``code`` promises, in order."""
    out = []
    for m in _PROMISE.finditer(code):
        text = m.group(1).rstrip()
        text = re.sub(r"(?:[,:]\s*)?\.\.\.[^.]*$", "", text)  # "{'a': 1, ...}: one read" -> "{'a': 1"
        out.append(text.rstrip())
    return out


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def same_output(printed: str, promised: str) -> bool:
    """Line for line the same text, numbers equal within 1e-3 relative."""
    got, want = printed.rstrip("\n").splitlines(), promised.rstrip("\n").splitlines()
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if _NUMBER.sub("#", g).split() != _NUMBER.sub("#", w).split():
            return False
        for a, b in zip(_NUMBER.findall(g), _NUMBER.findall(w)):
            if not math.isclose(float(a), float(b), rel_tol=1e-3, abs_tol=1e-4):
                return False
    return True
