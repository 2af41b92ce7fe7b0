"""Every picture in docs/ is drawn by a command of this repository, which the page that shows it names, and records
that command and the settings it ran with; those are today's (a preset that changes makes the old picture fail
here until ``python docs/images/make_images.py`` draws it again). Nothing is drawn here: the recorded settings are
compared with the ones the command would use, read from the code."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from dataclasses import replace

import pytest

from _doc_blocks import ROOT
from _png_text import png_text

DOCS = ROOT / "docs"
PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp")
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\((?:\./)?images/([^)\s]+)\)|^```\{(?:image|figure)\} (?:\./)?images/(\S+)", re.M)


def load_make_images():
    spec = importlib.util.spec_from_file_location("make_images", DOCS / "images" / "make_images.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_images"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


make_images = load_make_images()


def pictures_in_docs() -> list[str]:
    return sorted(
        str(p.relative_to(DOCS / "images"))
        for p in DOCS.rglob("*")
        if p.suffix.lower() in PICTURE_SUFFIXES and "_build" not in p.relative_to(DOCS).parts
    )


def test_every_picture_in_docs_is_one_that_make_images_draws():
    assert all(p.parent == DOCS / "images" for p in DOCS.rglob("*.png") if "_build" not in p.parts)
    assert pictures_in_docs() == sorted(make_images.PICTURES), (
        "each picture in docs/images/ needs a command that draws it, in docs/images/make_images.py's PICTURES"
    )


@pytest.mark.parametrize("name", sorted(make_images.PICTURES))
def test_a_picture_records_its_command_and_todays_settings(name):
    picture = make_images.PICTURES[name]
    recorded = png_text((DOCS / "images" / name).read_bytes())
    again = f"draw it again: python docs/images/make_images.py {name}"
    assert recorded.get("Command") == picture.command_line, (
        f"docs/images/{name} records the command {recorded.get('Command')!r}, not {picture.command_line!r}; {again}"
    )
    assert "Settings" in recorded, f"docs/images/{name} records no settings; {again}"
    assert json.loads(recorded["Settings"]) == picture.settings(), (
        f"docs/images/{name} was drawn with other settings than `{picture.command_line}` uses today; {again}"
    )


def test_a_changed_quick_preset_makes_the_demo_picture_stale(monkeypatch):
    # the comparison above reads the preset from the code: a smaller --quick is a different picture
    from lossscale.demo import cli

    recorded = json.loads(png_text((DOCS / "images" / "demo-quick.png").read_bytes())["Settings"])
    assert make_images.PICTURES["demo-quick.png"].settings() == recorded
    monkeypatch.setattr(cli, "QUICK", replace(cli.QUICK, sequences=cli.QUICK.sequences * 2))
    assert make_images.PICTURES["demo-quick.png"].settings() != recorded


def test_the_page_that_shows_a_picture_names_the_command_beside_it():
    shown = []
    for page in sorted(DOCS.glob("*.md")):
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            for match in IMAGE_LINK.finditer(line):
                name = match.group(1) or match.group(2)
                shown.append(name)
                assert name in make_images.PICTURES, f"docs/{page.name}:{number + 1}: no picture {name}"
                beside = " ".join(" ".join(lines[max(0, number - 4) : number + 5]).split())
                command = make_images.PICTURES[name].command_line
                assert command in beside and f"docs/images/make_images.py {name}" in beside, (
                    f"docs/{page.name}:{number + 1}: name `{command}` and "
                    f"`python docs/images/make_images.py {name}` next to the picture"
                )
    assert sorted(set(shown)) == sorted(make_images.PICTURES)
