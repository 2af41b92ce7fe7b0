"""Checks the built documentation site (`make docs` runs it after sphinx-build; not a pytest file).

    python tests/docs_site_check.py [docs/_build/html]

1. Every page of docs/ (each .md and .rst file Sphinx reads) has its HTML page.
2. Every internal link of every HTML page points to a file that exists, and its #fragment, if any, to an id on
   that page.
3. Every public name has its entry in the API reference: the names in ``lossscale.__all__``, in
   ``lossscale.presets.__all__``, and in the ``__all__`` of each module under ``lossscale.compat`` and
   ``lossscale.integrations`` (each of those modules has its page).

Prints each problem, then one closing line; exits 1 if there was a problem.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SKIPPED_DIRS = {"_build", "_static", "_templates"}


class Page(HTMLParser):
    """The ids and the link targets (href, src) of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            elif name in ("href", "src") and value and tag in ("a", "img", "link", "script"):
                self.links.append(value)


def parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def source_pages() -> list[Path]:
    """docs/'s pages, relative to docs/, without their suffix."""
    pages = []
    for path in DOCS.rglob("*"):
        rel = path.relative_to(DOCS)
        if path.suffix in (".md", ".rst") and not SKIPPED_DIRS & set(rel.parts):
            pages.append(rel.parent / rel.stem)  # not with_suffix: a module's page is named lossscale.ops.clip.md
    return sorted(pages)


def public_names() -> list[str]:
    """The full name of each public object, and ``module-<name>`` for each module page."""
    import lossscale

    names = [f"lossscale.{n}" for n in lossscale.__all__ if n != "presets"]
    names += [f"lossscale.presets.{n}" for n in lossscale.presets.__all__]
    for package in ("lossscale.compat", "lossscale.integrations"):
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__, package + "."):
            if info.name.rpartition(".")[2].startswith("_"):
                continue
            module = importlib.import_module(info.name)
            names.append(f"module-{info.name}")
            names += [f"{info.name}.{n}" for n in getattr(module, "__all__", [])]
    return names


def check(html_root: Path) -> tuple[int, list[str]]:
    problems: list[str] = []
    checked = 0
    for page in source_pages():
        checked += 1
        if not (html_root / page.parent / f"{page.name}.html").is_file():
            problems.append(f"docs/{page}: no page {page}.html in {html_root}")

    pages = {path: parse(path) for path in html_root.rglob("*.html")}
    all_ids: set[str] = set()
    for path, page in pages.items():
        all_ids |= page.ids
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:", "data:")):
                continue
            checked += 1
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            where = path.relative_to(html_root)
            if html_root.resolve() not in target.resolve().parents and target.resolve() != html_root.resolve():
                problems.append(f"{where}: link {link!r} leaves the site")
            elif not target.is_file():
                problems.append(f"{where}: link {link!r} points to a missing file")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else parse(target).ids
                if unquote(parts.fragment) not in ids:
                    problems.append(f"{where}: link {link!r}: no id {parts.fragment!r} on that page")

    for name in public_names():
        checked += 1
        if name not in all_ids:
            problems.append(f"API reference: no entry for {name.removeprefix('module-')}")
    return checked, problems


def main() -> int:
    html_root = Path(sys.argv[1]) if len(sys.argv) > 1 else DOCS / "_build" / "html"
    if not (html_root / "index.html").is_file():
        print(f"docs_site_check: no built site in {html_root} (run `make docs`)")
        return 1
    checked, problems = check(html_root)
    for problem in problems:
        print(problem)
    print(f"docs_site_check: {checked - len(problems)} passed, {len(problems)} failed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
