"""The API page of the package's public names (docs/api/lossscale.md) opens with the two front ends and names only
public names; docs/conf.py adds the names the page does not list, in the order of ``lossscale.__all__``, where the
page has its marker (docs_site_check.py checks after a build that every public name has its entry)."""

from __future__ import annotations

import re

import lossscale
from _doc_blocks import ROOT

PAGE = ROOT / "docs" / "api" / "lossscale.md"
MARKER = "<!-- the other names of lossscale.__all__: added here by docs/conf.py -->"


def named_on_the_page() -> list[str]:
    return re.findall(r"^\.\. auto\w+:: lossscale\.(\w+)\s*$", PAGE.read_text(encoding="utf-8"), re.M)


def test_the_page_opens_with_the_two_front_ends():
    assert named_on_the_page()[:2] == ["GradScaler", "LossScaleOptimizer"]


def test_the_page_names_public_names_once_each_and_leaves_the_rest_to_the_build():
    names = named_on_the_page()
    assert len(names) == len(set(names)), names
    private = sorted(set(names) - set(lossscale.__all__))
    assert not private, f"docs/api/lossscale.md documents names that lossscale.__all__ does not export: {private}"
    text = PAGE.read_text(encoding="utf-8")
    assert text.count(MARKER) == 1 and MARKER in (ROOT / "docs" / "conf.py").read_text(encoding="utf-8")
