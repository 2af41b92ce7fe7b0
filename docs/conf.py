"""Sphinx configuration of lossscale's documentation site (`make docs`).

The guide pages are the Markdown files in docs/ (MyST); the API reference in docs/api/ is generated from the
package's docstrings by autodoc, module by module, following each module's ``__all__``. Nothing here fetches
anything over the network: torch's and the frameworks' names render as code, without links (see
``nitpick_ignore_regex``).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import sys
from importlib.metadata import version as _version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))  # a checkout without `pip install -e .` builds too

import lossscale  # noqa: E402

# ``lossscale.presets`` is an attribute of the package (the module is lossscale.policies.presets): registered under
# that name, autodoc finds the module's source and so the ``#:`` comments of its constants.
sys.modules.setdefault("lossscale.presets", lossscale.presets)

project = "lossscale"
author = "the lossscale authors"
copyright = "the lossscale authors; Apache-2.0"
try:
    release = _version("lossscale")
except Exception:
    release = ""
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: the Markdown pages as they read on the repository page.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc + napoleon: Google-style Args/Returns/Raises; members follow each module's __all__.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # an "Attributes:" section is a field list, so fields autodoc documents are not doubled
napoleon_attr_annotations = False  # its types are in the class's signature already
autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
    "member-order": "bysource",
}
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autoclass_content = "both"  # the class docstring and __init__'s (where the arguments are described)
autodoc_mock_imports = ["triton"]  # lossscale.ops.amax_kernel needs it on a CUDA machine only

# -n (nitpicky): every cross-reference must resolve, except to the names below, which belong to other
# projects. Without network access there are no intersphinx inventories, so they render as plain code.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|lightning|pytorch_lightning|lightning_fabric|accelerate|transformers|triton|numpy)(\..*)?"),
    (r"py:.*", r"(typing|collections|collections\.abc|types|enum|dataclasses|contextlib|os|pathlib|fractions)\..*"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Sequence|Mapping|Literal|Optional|Union|Self|TypeVar)"),
    (r"py:.*", r"(lossscale(\.\w+)*\.)?_\w+.*"),  # private modules and classes (bases): plain code, no page
    # a signature with a default Python cannot parse (a dataclass field's ``<factory>``) is split on commas by
    # Sphinx, which cuts "tuple[~torch.Tensor, ...]" into targets no name can have
    (r"py:class", r".*\[.*"),
    (r"py:class", r"ProcessGroup"),  # torch.distributed's, as annotations name it
    (
        r"py:class",
        r"(int|float|bool|str|bytes|dict|list|tuple|set|object|type|None|Exception|ValueError|"
        r"TypeError|RuntimeError|ImportError|KeyError|NotImplementedError|UserWarning)",
    ),
]

# furo: a clean theme, light and dark; _static/lossscale.css fits it to a laptop's 1280-px-wide window (code and
# output wrap, dotted names break at dots, "On this page" stays on the page).
html_theme = "furo"
html_title = f"lossscale {release}".strip()
html_static_path = ["_static"]
html_css_files = ["lossscale.css"]
html_show_sourcelink = False


# The API pages of the modules are generated at each build from the package itself, so that a module added, moved
# or removed changes the reference without an edit here: one page per public module, a module that declares
# ``__all__`` (docs/architecture.md, "Public and internal"), in docs/api/compat/, docs/api/integrations/ and
# docs/api/modules/ (not tracked by git), each following its ``__all__``. A name that the package exports at the top
# (``lossscale.__all__``) or that ``lossscale.presets`` holds is described once, on those pages; a module's page links
# to it. The internal modules have no page: a docstring's reference to one of their names renders as code.
API = Path(__file__).resolve().parent / "api"
SKIPPED = ("lossscale.demo", "lossscale.__main__")
GROUPS = {"lossscale.compat": "compat", "lossscale.integrations": "integrations"}


def _modules() -> list[str]:
    """Every module of the package but the private ones (a part starting with "_") and the demo."""
    import lossscale

    names = []
    for info in pkgutil.walk_packages(lossscale.__path__, "lossscale."):
        if any(part.startswith("_") for part in info.name.split(".")) or info.name.startswith(SKIPPED):
            continue
        names.append(info.name)
    return sorted(names)


def _declares_all(name: str) -> bool:
    try:
        return "__all__" in vars(importlib.import_module(name))
    except ImportError:  # an optional dependency (triton): an internal module
        return False


def _public_modules() -> list[str]:
    """The modules that declare ``__all__``, but the two with hand-written pages (``lossscale``, its presets)."""
    import lossscale

    return [n for n in _modules() if _declares_all(n) and n != lossscale.presets.__name__]


# a reference to an internal module or one of its names renders as code (the module has no page)
nitpick_ignore_regex.extend(
    (r"py:.*", re.escape(name) + r"(\..*)?") for name in _modules() if name != "lossscale" and not _declares_all(name)
)


def _exported() -> dict[int, str]:
    """id(object) -> its documented public name, for the names documented on the hand-written pages."""
    import lossscale

    out = {id(getattr(lossscale, n)): f"lossscale.{n}" for n in lossscale.__all__ if n != "presets"}
    out.update({id(getattr(lossscale.presets, n)): f"lossscale.presets.{n}" for n in lossscale.presets.__all__})
    return out


def _module_page(name: str, group: str, exported: dict[int, str]) -> str:
    try:
        module = importlib.import_module(name)
    except ImportError:  # an optional dependency (triton): autodoc mocks it, nothing here is exported at the top
        module = None
    elsewhere = []
    for member, obj in sorted(vars(module).items() if module else ()):
        if id(obj) in exported and name != "lossscale" and member in getattr(module, "__all__", ()):
            elsewhere.append((member, exported[id(obj)]))
    lines = [f"# `{name}`", "", "```{eval-rst}", f".. automodule:: {name}"]
    if elsewhere:
        lines.append("   :exclude-members: " + ", ".join(m for m, _ in elsewhere))
    lines += ["```", ""]
    if elsewhere:
        links = ", ".join(f"{{py:obj}}`{public}`" for _, public in elsewhere)
        lines += [f"Also defined here, described under their public names: {links}.", ""]
    return "\n".join(lines)


def _generate_api_pages() -> None:
    exported = _exported()
    wanted: dict[Path, str] = {}
    for name in _public_modules():
        group = next((g for prefix, g in GROUPS.items() if name == prefix or name.startswith(prefix + ".")), "modules")
        wanted[API / group / f"{name}.md"] = _module_page(name, group, exported)
    for group in (*GROUPS.values(), "modules"):
        folder = API / group
        folder.mkdir(exist_ok=True)
        for old in folder.glob("*.md"):
            if old not in wanted:
                old.unlink()
    for path, text in wanted.items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:  # unchanged pages keep their mtime
            path.write_text(text, encoding="utf-8")


_generate_api_pages()


# Annotations name torch.distributed's ProcessGroup under ``if TYPE_CHECKING:`` (a torch build without distributed
# support still imports lossscale). autodoc evaluates a signature's annotations in its module: one unresolved name
# leaves the whole signature as strings, and its aliases (OverflowMode, SkipMode) as targets no page has. The name
# is given to the modules that annotate with it, for the build only.
def _resolvable_type_checking_names() -> None:
    import torch.distributed

    for name in _modules():
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional dependency (triton)
            continue
        source = getattr(module, "__file__", None)
        if source and "ProcessGroup" not in vars(module) and "ProcessGroup" in Path(source).read_text("utf-8"):
            module.ProcessGroup = torch.distributed.ProcessGroup


_resolvable_type_checking_names()


# napoleon reads the first line of a property's or a module constant's docstring as "type: description" (Google
# style); this project writes them as sentences ("Whether losses are scaled now: ...", "2**-126, the smallest normal
# float32: ..."), so a first line whose part before the colon has two words in a row gets an empty type, not a type
# named after those words. A type ("dict[str, int]: ...") has none.
_WORDS = re.compile(r"[\w*)] +[\w(]")


def _sentences_not_types(app, what, name, obj, options, lines):
    if what in ("property", "attribute", "data") and lines and ": " in lines[0]:
        head = lines[0].split(": ", 1)[0]
        if "`" not in head and _WORDS.search(head):
            lines[0] = ": " + lines[0]


# A docstring names a sibling by its short name (:class:`LossScaleOptimizer`, :func:`advance`) where Python's scope
# makes it plain; Sphinx looks for it only beside the object as documented (``lossscale.PrecisionSchedule`` is
# documented at the top of the package, its helper ``advance`` in lossscale.addons.schedule). Resolve such a name
# to the package's public name ``lossscale.<name>`` if there is one, else to the one documented object whose name
# ends in it; none or several: the reference stays unresolved, and -n reports it. A full name that a package
# re-exports (``lossscale.diagnosis.find_overflow``) resolves to where the object is defined and documented.
def _resolve_short_name(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~")
    domain = env.get_domain("py")
    if "." in target:
        full = _defined_name(target)
        if full is None or full not in domain.objects:
            return None
    elif f"lossscale.{target}" in domain.objects:
        full = f"lossscale.{target}"
    else:
        found = [name for name in domain.objects if name.endswith("." + target) and name.startswith("lossscale.")]
        if len(found) > 1:  # prefer a sibling of the object whose docstring it is (its module or class)
            where = (node.source or "").rpartition("docstring of ")[2]
            found = [name for name in found if where.startswith(name.rpartition(".")[0] + ".")]
        if len(found) != 1:
            return None
        full = found[0]
    node["reftarget"] = full
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], full, node, contnode)


def _defined_name(target: str) -> str | None:
    """``module.attr`` of a lossscale object named through a package that imports it; None if there is none."""
    owner, _, attr = target.rpartition(".")
    if not owner.startswith("lossscale"):
        return None
    try:
        obj = getattr(importlib.import_module(owner), attr)
    except (ImportError, AttributeError):
        return None
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not name or f"{module}.{name}" == target:
        return None
    return f"{module}.{name}"


# The root's Markdown files (README, CHANGELOG, CONTRIBUTING, benchmarks/RESULTS.md) are included into pages of
# docs/: their links to each other and into docs/ are rewritten to the site's pages.
_ROOT_LINKS = {
    "](docs/": "](",
    "](benchmarks/RESULTS.md": "](benchmarks.md",
    "](../benchmarks/RESULTS.md": "](benchmarks.md",
    "](CHANGELOG.md": "](changelog.md",
    "](CONTRIBUTING.md": "](contributing.md",
    "](README.md": "](index.md",
}


def _rewrite_root_links(app, relative_path, parent_docname, content):
    if (Path(app.srcdir) / relative_path).resolve().parent in (ROOT, ROOT / "benchmarks"):
        text = content[0]
        for old, new in _ROOT_LINKS.items():
            text = text.replace(old, new)
        content[0] = _escape_powers(text)


# The Markdown writes powers as 2**-126 and 2**12 outside code; two of them in one paragraph or table row would pair
# up as bold (as they do on a repository page). On the site each such ``**`` between digits is escaped, outside
# code spans and fenced blocks.
_POWER = re.compile(r"(?<=[\w)])\*\*(?=-?[\w(])")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def _escape_powers(text: str) -> str:
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            parts, last = [], 0
            for code in _CODE_SPAN.finditer(line):
                parts += [_POWER.sub(r"\\*\\*", line[last : code.start()]), code.group(0)]
                last = code.end()
            line = "".join(parts) + _POWER.sub(r"\\*\\*", line[last:])
        out.append(line)
    return "\n".join(out)


def _escape_powers_in_page(app, docname, source):
    if app.env.doc2path(docname).suffix == ".md":
        source[0] = _escape_powers(source[0])


# A method without a docstring of its own inherits its base's; one inherited from torch (``Function.forward``) is
# written for torch's site, with its labels and roles, so it is left out; one from a lossscale base is kept.
def _no_foreign_docstrings(app, what, name, obj, options, lines):
    if what != "method" or getattr(obj, "__doc__", None) or not lines:
        return
    owner_name, _, attr = name.rpartition(".")
    module_name, _, class_name = owner_name.rpartition(".")
    try:
        owner = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        return
    for base in getattr(owner, "__mro__", ())[1:]:
        found = base.__dict__.get(attr)
        if found is not None and getattr(found, "__doc__", None):
            if not base.__module__.startswith("lossscale"):
                lines.clear()
            return


# The page of the package's public names (api/lossscale.md) opens with the names most programs use, in the sections
# written on it (the two front ends, what a step returns, the rule for the scale, the diagnosis); where the page has
# the marker, the other names of ``lossscale.__all__`` follow in its order, so that a name added there gets its
# entry without an edit.
_OTHER_NAMES = "<!-- the other names of lossscale.__all__: added here by docs/conf.py -->"
_AUTODOC_NAME = re.compile(r"^\.\. auto\w+:: lossscale\.(\w+)\s*$", re.M)


def _other_public_names(app, docname, source):
    if docname != "api/lossscale" or _OTHER_NAMES not in source[0]:
        return
    shown = set(_AUTODOC_NAME.findall(source[0]))
    lines = ["```{eval-rst}"]
    for name in lossscale.__all__:
        obj = getattr(lossscale, name)
        if name in shown or inspect.ismodule(obj):  # a module (presets) has its own page
            continue
        if inspect.isclass(obj):
            kind = "exception" if issubclass(obj, BaseException) else "class"
        else:
            kind = "function" if callable(obj) else "data"
        lines.append(f".. auto{kind}:: lossscale.{name}")
    source[0] = source[0].replace(_OTHER_NAMES, "\n".join(lines + ["```"]))


# A picture wider than the text column is shown at the column's width (furo's img max-width), and Sphinx links a
# picture given a width to its full-size file: the reader clicks a plot to read its small labels. A narrower
# picture keeps its own size and no link.
_COLUMN_PX = 736  # furo's text column, 46em of 16 px


def _link_wide_pictures(app, doctree):
    from docutils import nodes
    from sphinx.util.images import get_image_size

    for image in doctree.findall(nodes.image):
        path = image.get("candidates", {}).get("*")
        size = get_image_size(str(Path(app.srcdir) / path)) if path else None
        if size and size[0] > _COLUMN_PX and not {"width", "height", "scale"} & set(image.attributes):
            image["width"] = "100%"
            image["classes"].append("wide-picture")  # the CSS's zoom-in cursor


# furo's navigation and "On this page" break a long dotted name anywhere ("acce / lerate"): a <wbr> after each dot
# of a code name there lets it break after the dot instead (the CSS turns the break-anywhere off).
_CODE_NAME = re.compile(r'(<span class="pre">)([\w.]+\.[\w.()]+)(</span>)')


def _breakable_dotted_names(app, pagename, templatename, context, doctree):
    for key in ("furo_navigation_tree", "toc"):
        if isinstance(context.get(key), str):
            context[key] = _CODE_NAME.sub(lambda m: m[1] + m[2].replace(".", ".<wbr>") + m[3], context[key])


def setup(app):
    app.connect("source-read", _other_public_names)
    app.connect("doctree-read", _link_wide_pictures, priority=600)  # after Sphinx's image collector (500)
    app.connect("html-page-context", _breakable_dotted_names, priority=600)  # after furo's, which makes the tree
    app.connect("autodoc-process-docstring", _no_foreign_docstrings, priority=50)
    app.connect("autodoc-process-docstring", _sentences_not_types, priority=100)  # before napoleon's (500)
    app.connect("missing-reference", _resolve_short_name)
    app.connect("include-read", _rewrite_root_links)
    app.connect("source-read", _escape_powers_in_page)
