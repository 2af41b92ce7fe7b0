"""The public API's docstrings list every parameter of its signatures and name no private function of lossscale.

The objects: each class and function named in the ``__all__`` of a public module (``PUBLIC_MODULES`` in
test_public_names.py), each object once, under the first public module that names it. A module whose optional
framework is not installed is skipped, saying so.

First rule, the parameters. A function's signature is its own; a class's is its constructor's: the parameters of
the ``__init__`` that lossscale defines for it, its own or inherited (a dataclass's generated one: its fields), or
where there is none its ``__new__`` (a NamedTuple's: its fields). A ``__new__`` beside an ``__init__`` is left out:
it receives the same arguments, and the ``__init__`` is what takes and checks them. A class whose constructor is
not lossscale's (an exception's, ``object``'s) has none to list. ``self``, ``cls`` and parameters whose name starts
with ``_`` are left out. Each remaining parameter must have a Google-style entry in an ``Args:`` or ``Attributes:``
section: a line ``name:`` or ``name (type):``, ``*name:`` for ``*args`` and ``**name:`` for ``**kwargs``, at the
section's entry indentation. For a class the class docstring and its own ``__init__`` docstring are read together.
Methods' signatures are out of scope: their docstrings say what they do in prose and are not checked here.

Second rule, no private names. No docstring of these objects, of a class's own ``__init__`` or of its public
methods and properties (those lossscale defines, inherited ones included) names a private function, method or
variable of lossscale: a backticked identifier starting with ``_`` (not a dunder) that lossscale's source defines
(``def _name`` or ``_name =`` anywhere under src/lossscale). Private names of other libraries (torch's
``aten._local_scalar_dense``) are not lossscale's and pass.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from test_public_names import FRAMEWORK, PUBLIC_MODULES, _absent

SRC = Path(__file__).resolve().parent.parent / "src" / "lossscale"
SECTIONS = ("Args", "Attributes")
ENTRY = re.compile(r"(\*{0,2})([A-Za-z_]\w*)(?: \([^)]*\))?:(?:\s|$)")
HEADER = re.compile(rf"(\s*)({'|'.join(SECTIONS)}):\s*$")
BACKTICKED = re.compile(r"(``?)([^`\n]+?)\1")
PRIVATE = re.compile(r"(?<!\w)_\w+")
DEFINED = re.compile(r"^\s*(?:async\s+)?def\s+(_\w+)|^\s*(_\w+)\s*(?::[^=\n]*)?=(?!=)", re.M)


def public_objects() -> list[Any]:
    """One pytest parameter per class or function in a public ``__all__``: (qualified name, object)."""
    params, seen = [], set()
    for module_name in sorted(PUBLIC_MODULES):  # "lossscale" first: an object re-exported there is named there
        if _absent(module_name):
            framework = next(f for prefix, f in FRAMEWORK.items() if module_name.startswith(prefix))
            reason = f"{module_name} needs {framework}, which is not installed here"
            params.append(pytest.param(module_name, None, id=module_name, marks=pytest.mark.skip(reason=reason)))
            continue
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) or id(obj) in seen:
                continue
            seen.add(id(obj))
            params.append(pytest.param(f"{module_name}.{name}", obj, id=f"{module_name}.{name}"))
    return params


OBJECTS = public_objects()


def _lossscale_method(cls: type, name: str) -> Any:
    """The ``__init__`` or ``__new__`` the class gets, where a lossscale class defines it (else None)."""
    owner = next((c for c in cls.__mro__ if name in vars(c)), object)
    method = vars(owner)[name] if owner.__module__.startswith("lossscale") else None
    return method.__func__ if isinstance(method, staticmethod) else method


def parameters(obj: Any) -> list[str]:
    """The parameters the docstring must list, with ``*``/``**`` before var-positional and var-keyword ones."""
    function = obj
    if inspect.isclass(obj):  # the __init__ checks the arguments; a __new__ beside it only sees them first
        function = _lossscale_method(obj, "__init__") or _lossscale_method(obj, "__new__")
        if function is None:
            return []  # the constructor is not lossscale's (an exception's, object's)
    names = []
    for p in inspect.signature(function).parameters.values():
        if p.name not in ("self", "cls") and not p.name.startswith("_"):
            names.append({p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name)
    return names


def entries(doc: str | None) -> set[str]:
    """The names a docstring's ``Args:`` and ``Attributes:`` sections have entries for (``*``/``**`` kept)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    found: set[str] = set()
    section_indent: int | None = None  # the header's indentation, inside a section
    entry_indent: int | None = None  # the indentation of the section's entries (its first line's)
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        header = HEADER.fullmatch(line)
        if header:
            section_indent, entry_indent = indent, None
            continue
        if section_indent is None:
            continue
        if indent <= section_indent:  # the section ended
            section_indent = None
            continue
        if entry_indent is None:
            entry_indent = indent
        if indent == entry_indent:
            entry = ENTRY.match(line.strip())
            if entry:
                found.add(entry.group(1) + entry.group(2))
    return found


def docstrings(obj: Any) -> dict[str, str]:
    """The docstrings the second rule reads, by what they document: the object's, and for a class its own
    ``__init__``'s and those of the public methods and properties lossscale defines for it."""
    docs = {"": obj.__doc__ or ""}
    if not inspect.isclass(obj):
        return docs
    if "__init__" in vars(obj):
        docs[".__init__"] = obj.__init__.__doc__ or ""
    for cls in obj.__mro__:
        if not cls.__module__.startswith("lossscale"):
            continue
        for name, member in vars(cls).items():
            if name.startswith("_") or f".{name}" in docs:
                continue
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if inspect.isfunction(member) or isinstance(member, property):
                docs[f".{name}"] = member.__doc__ or ""
    return docs


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def private_definitions() -> dict[str, str]:
    """Each private name lossscale's source defines (``def _name``, ``_name =``), with a file that defines it."""
    defined: dict[str, str] = {}
    for path in sorted(SRC.rglob("*.py")):
        for match in DEFINED.finditer(path.read_text()):
            name = match.group(1) or match.group(2)
            if not _dunder(name):
                defined.setdefault(name, str(path.relative_to(SRC.parent.parent)))
    return defined


DEFINED_PRIVATE = private_definitions()


def private_names(doc: str) -> list[str]:
    """The backticked identifiers in ``doc`` that start with ``_`` and that lossscale defines."""
    hits = []
    for _, span in BACKTICKED.findall(doc):
        hits += [name for name in PRIVATE.findall(span) if name in DEFINED_PRIVATE]
    return list(dict.fromkeys(hits))


@pytest.mark.parametrize(("qualname", "obj"), OBJECTS)
def test_the_docstring_lists_every_parameter(qualname, obj):
    listed = entries(obj.__doc__)
    if inspect.isclass(obj) and "__init__" in vars(obj):
        listed |= entries(obj.__init__.__doc__)
    wanted = parameters(obj)
    missing = [name for name in wanted if name not in listed]
    where = "the class docstring (or its own __init__'s)" if inspect.isclass(obj) else "its docstring"
    assert not missing, (
        f"{qualname}: {where} lists no entry for the parameter(s) {missing} of its signature {wanted}. Add a "
        f"Google-style entry for each under 'Args:' ('Attributes:' for a dataclass's or NamedTuple's fields): a "
        f"line 'name: what it is, its unit and default', with '*name'/'**name' for *args/**kwargs."
    )


CLASSES = [  # the classes whose constructor is lossscale's
    p
    for p in OBJECTS
    if inspect.isclass(cls := p.values[1]) and (_lossscale_method(cls, "__init__") or _lossscale_method(cls, "__new__"))
]


@pytest.mark.parametrize(("qualname", "obj"), CLASSES)
def test_help_shows_the_constructor_the_docstring_lists(qualname, obj):
    """``help(cls)`` and ``inspect.signature(cls)`` show the parameters the docstring lists (a ``__new__`` that only
    routes its arguments, as LossScaleOptimizer's, must not hide them behind ``*args, **kwargs``)."""
    shown = [
        {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        for p in inspect.signature(obj).parameters.values()
        if not p.name.startswith("_")
    ]
    assert shown == parameters(obj), f"{qualname}: help() shows {shown}, the constructor takes {parameters(obj)}"


def test_a_subclass_annotated_with_a_name_it_cannot_resolve_still_shows_its_constructor():
    from lossscale import LossScaleOptimizer

    class Mine(LossScaleOptimizer):
        def __init__(self, inner, *, group: NotImportedHere = None, **kwargs):  # noqa: F821  # a TYPE_CHECKING name
            super().__init__(inner, **kwargs)

    shown = inspect.signature(Mine)
    assert list(shown.parameters) == ["inner", "group", "kwargs"]
    assert shown.parameters["group"].annotation == "NotImportedHere"  # as written: it cannot be evaluated


@pytest.mark.parametrize(("qualname", "obj"), OBJECTS)
def test_the_docstrings_name_no_private_function(qualname, obj):
    found = {f"{qualname}{member}": names for member, doc in docstrings(obj).items() if (names := private_names(doc))}
    assert not found, (
        f"{qualname}: docstrings name private functions, methods or variables of lossscale: "
        + "; ".join(
            f"{where} names {', '.join(f'{n} ({DEFINED_PRIVATE[n]})' for n in names)}" for where, names in found.items()
        )
        + ". A private name can change or go at any release: say what it does in words, or name the public API "
        "that does it."
    )


# --- the rules themselves: each can fail -------------------------------------------------------------------------


def _documented(a: int, b: int = 0, *rest: int, c: int, **more: int) -> None:
    """A function for the rules' own tests.

    Args:
        a: Listed.
        b (int): Listed with its type.
            c: A continuation line, not an entry.
        *rest: Listed with its star.

    Returns:
        more: Not an Args section.
    """


def test_the_parameter_rule_finds_what_is_missing():
    assert parameters(_documented) == ["a", "b", "*rest", "c", "**more"]
    assert entries(_documented.__doc__) == {"a", "b", "*rest"}


def test_a_constructor_is_what_takes_the_arguments():
    from lossscale import FloorError, LossScaleOptimizer, StepResult
    from lossscale.diagnosis import TriggerState

    assert parameters(LossScaleOptimizer)[:2] == ["inner", "policy"]  # its __init__, not __new__'s *args, **kwargs
    assert parameters(LossScaleOptimizer)[-1] == "**options"
    assert parameters(TriggerState)[:2] == ["streak", "seen_clean"]  # a NamedTuple's __new__: its fields
    assert "stepped" in parameters(StepResult)  # a dataclass: its fields, inherited ones too
    assert parameters(FloorError) == []  # RuntimeError's constructor


def test_the_private_name_rule_tells_lossscale_names_from_others():
    assert "_refuse_float16_parameters" in DEFINED_PRIVATE  # the source was read
    doc = "Calls ``_refuse_float16_parameters`` and :func:`~lossscale.x._refuse_float16_parameters`, torch's "
    doc += "``aten._local_scalar_dense`` and ``_amp_update_scale_``, and ``__init__``."
    assert private_names(doc) == ["_refuse_float16_parameters"]
