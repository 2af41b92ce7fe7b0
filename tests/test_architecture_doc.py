"""docs/architecture.md names things that exist, where it says they are, and walks the steps the code runs.

- Every function the page names as ``module:Qualified.name`` (in backticks) exists, is defined in that module (not
  re-exported), and sits in the file named after it (`` (`stages.py`) ``).
- Every file and folder of the tree exists, and every module and package of src/lossscale is in the tree.
- Each walk names exactly the functions a traced step of its front end enters (lossscale's own, comprehensions
  left out), and its "opens N files and M functions" sentence counts them.
- The table of shared stages names stages and methods that exist, and each method named calls a stage of its row.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import types
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

import torch

import lossscale
from lossscale import GradScaler, LossScaleOptimizer

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = Path(lossscale.__file__).resolve().parent

#: `lossscale.module:Qualified.name`, optionally followed by its file: (`path.py` or , `path.py`
NAME = re.compile(r"`(lossscale(?:\.\w+)*):([\w.<>]+)`(?:[\s(,]*`([\w/]+\.py)`)?")
WALKS = {"## One LossScaleOptimizer step": "optimizer", "## One GradScaler step": "scaler"}
COUNTS = re.compile(r"This walk opens (\d+) files and (\d+) functions \((\d+) of them properties\)")
SKIPPED = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>")


def section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next second-level heading."""
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def resolve(module: str, qualname: str) -> object:
    """The object ``module:qualname`` names (a property as the property; ``f.<locals>.g``: g's code object).

    Raises:
        LookupError: naming the part that does not exist.
    """
    obj: object = importlib.import_module(module)
    parts = qualname.split(".")
    i = 0
    while i < len(parts):
        if parts[i] == "<locals>" and i + 1 < len(parts):
            code = _code(obj)
            nested = [c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == parts[i + 1]]
            if not nested:
                raise LookupError(f"{module}:{qualname}: no function {parts[i + 1]!r} inside {parts[i - 1]!r}")
            obj, i = nested[0], i + 2
            continue
        try:
            obj = inspect.getattr_static(obj, parts[i])
        except AttributeError:
            raise LookupError(f"{module}:{qualname}: {parts[i]!r} does not exist") from None
        i += 1
    return obj


def _function(obj: object) -> Callable[..., object] | None:
    """The function behind a function, method, property (its getter) or cached property."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    if isinstance(obj, cached_property):
        obj = obj.func
    if isinstance(obj, types.FunctionType):
        return inspect.unwrap(obj)  # torch wraps an optimizer class's step() (its step hooks) once one is built
    return None


def _code(obj: object) -> types.CodeType:
    if isinstance(obj, types.CodeType):
        return obj
    function = _function(obj)
    if function is None:
        raise LookupError(f"{obj!r} is not a function")
    return function.__code__


def module_file(module: str) -> str:
    """The module's file relative to src/lossscale (``optimizer/optimizer.py``)."""
    path = Path(importlib.import_module(module).__file__ or "").resolve()
    return str(path.relative_to(PACKAGE))


def name_problems(text: str) -> list[str]:
    """What is wrong with the functions ``text`` names: each must exist, be a function defined in its module, and
    sit in the file named after it."""
    problems = []
    for m in NAME.finditer(text):
        module, qualname, path = m.groups()
        full = f"{module}:{qualname}"
        try:
            obj = resolve(module, qualname)
            code = _code(obj)
        except (LookupError, ImportError) as err:
            problems.append(str(err) if str(err).startswith(full) else f"{full}: {err}")
            continue
        if Path(code.co_filename).resolve() != Path(importlib.import_module(module).__file__ or "").resolve():
            problems.append(f"{full}: defined in {code.co_filename}, not in {module} (name where it is defined)")
        if path is not None and path != module_file(module):
            problems.append(f"{full}: the page says {path}, it is in {module_file(module)}")
    return problems


def names_in(text: str) -> set[str]:
    return {f"{m.group(1)}:{m.group(2)}" for m in NAME.finditer(text)}


def tree_entries(text: str) -> dict[Path, set[str]]:
    """The folder tree (the first ```text block of "## The folders"): each entry's path under src/lossscale, with
    the .py files its description names where it is a folder."""
    block = section(text, "## The folders").split("```text\n", 1)[1].split("\n```", 1)[0]
    lines = block.splitlines()
    assert lines[0] == "src/lossscale/", f"the tree starts at src/lossscale/; got {lines[0]!r}"
    entries: dict[Path, set[str]] = {}
    parents: list[Path] = [Path()]
    last: Path | None = None
    for line in lines[1:]:
        indent = len(line) - len(line.lstrip(" "))
        first = line.split()[0]
        if indent in (2, 4, 6) and re.fullmatch(r"\w+(\.py|/)", first):
            depth = indent // 2
            del parents[depth:]
            last = parents[-1] / first.rstrip("/")
            entries[last] = set()
            if first.endswith("/"):
                parents.append(last)
            rest = line[indent + len(first) :]
        else:
            rest = line
        if last is not None and last.suffix != ".py":
            entries[last] |= set(re.findall(r"\b(\w+\.py)\b", rest))
    return entries


def tree_problems(text: str) -> list[str]:
    """Entries or named files that do not exist; modules and packages the tree leaves out."""
    entries = tree_entries(text)
    problems = [f"src/lossscale/{p}: in the tree, not in the package" for p in entries if not (PACKAGE / p).exists()]
    for folder, files in entries.items():
        problems += [
            f"src/lossscale/{folder / f}: named in the tree, not in the package"
            for f in sorted(files)
            if not (PACKAGE / folder / f).exists()
        ]
    for folder in [Path(), *(p for p in entries if (PACKAGE / p).is_dir())]:
        listed = {p.name for p in entries if p.parent == folder} | entries.get(folder, set())
        for child in sorted((PACKAGE / folder).iterdir()):
            is_module = child.suffix == ".py" and (child.name != "__init__.py" or folder == Path())
            is_package = child.is_dir() and (child / "__init__.py").exists()
            if (is_module or is_package) and child.name not in listed:
                problems.append(f"src/lossscale/{folder / child.name}: in the package, not in the tree")
    return problems


def _in_package(code: types.CodeType) -> bool:
    try:
        return PACKAGE in Path(code.co_filename).resolve().parents
    except OSError:
        return False


def _qualnames(module: types.ModuleType) -> dict[types.CodeType, str]:
    """Every code object of ``module``'s functions, methods and properties (and functions nested in them), with
    its qualified name (``co_qualname`` exists only from Python 3.11)."""
    found: dict[types.CodeType, str] = {}

    def add(code: types.CodeType, qualname: str) -> None:
        found[code] = qualname
        for const in code.co_consts:
            if isinstance(const, types.CodeType) and not const.co_name.startswith("<"):
                add(const, f"{qualname}.<locals>.{const.co_name}")

    def visit(namespace: dict[str, object], prefix: str) -> None:
        for name, value in namespace.items():
            if isinstance(value, type) and value.__module__ == module.__name__ and not prefix:
                visit(dict(vars(value)), f"{name}.")
                continue
            values = [value.fset, value.fget] if isinstance(value, property) else [value]
            for v in values:
                function = _function(v)
                if function is not None and function.__module__ == module.__name__:
                    add(function.__code__, prefix + name)

    visit(dict(vars(module)), "")
    return found


def traced(run: Callable[[], object]) -> set[str]:
    """``module:qualname`` of every lossscale function ``run`` enters (comprehensions and lambdas left out)."""
    seen: set[str] = set()
    codes: dict[types.CodeType, str] = {}

    def tracer(frame: types.FrameType, event: str, arg: object) -> None:
        code = frame.f_code
        if event != "call" or code.co_name in SKIPPED or not _in_package(code):
            return None
        if code not in codes:
            module = sys.modules[frame.f_globals["__name__"]]
            codes.update(_qualnames(module))
            codes.setdefault(code, f"?{code.co_name}")  # not found: shows as a name the page cannot match
        seen.add(f"{frame.f_globals['__name__']}:{codes[code]}")
        return None

    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        run()
    finally:
        sys.settrace(before)
    return seen


def _model_and_data() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.randn(8, 16), torch.randn(8, 4)


def optimizer_step() -> set[str]:
    """The page's LossScaleOptimizer walk, traced after three warm-up steps: backward, then step."""
    model, x, y = _model_and_data()
    opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), fused=True), clip_grad_norm=1.0)
    for _ in range(3):
        opt.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    results = []
    seen = traced(lambda: (opt.backward(loss), results.append(opt.step())))
    assert opt.skip_mode == "fused" and bool(results[0].stepped)
    return seen


def scaler_step() -> set[str]:
    """The page's GradScaler walk, traced after three warm-up iterations: scale and backward, step, update."""
    model, x, y = _model_and_data()
    inner = torch.optim.AdamW(model.parameters(), fused=True)
    scaler = GradScaler("cpu")
    for _ in range(3):
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(inner)
        scaler.update()
        inner.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    return traced(lambda: (scaler.scale(loss).backward(), scaler.step(inner), scaler.update()))


STEPS = {"optimizer": optimizer_step, "scaler": scaler_step}


def walk_problems(text: str, heading: str, entered: set[str]) -> list[str]:
    """How the walk under ``heading`` differs from the functions a traced step ``entered``, and from its count."""
    walk = section(text, heading)
    named = names_in(walk)
    problems = [f"{heading}: names {n}, which the step does not enter" for n in sorted(named - entered)]
    problems += [f"{heading}: the step enters {n}, which the walk does not name" for n in sorted(entered - named)]
    counts = COUNTS.search(walk)
    if counts is None:
        return [*problems, f"{heading}: no sentence 'This walk opens N files and M functions (P of them properties)'"]
    said = tuple(int(c) for c in counts.groups())
    if said != walk_counts(walk):
        problems.append(f"{heading}: says {said} (files, functions, properties); the walk names {walk_counts(walk)}")
    return problems


def walk_counts(walk: str) -> tuple[int, int, int]:
    """(files, functions, properties) a walk names."""
    named = names_in(walk)
    files = {module_file(n.split(":")[0]) for n in named}
    properties = sum(isinstance(resolve(*n.split(":")), property) for n in named if not name_problems(f"`{n}`"))
    return len(files), len(named), properties


#: A row of the counts table: its front end, and its last cell ("now").
NOW = re.compile(r"^\| `(\w+)`.*\| (\d+) files, (\d+) functions \((\d+) properties\) \|$", re.M)


def count_table_problems(text: str) -> list[str]:
    """The counts table's "now" column against what each walk names."""
    rows = {
        m.group(1): tuple(int(c) for c in m.groups()[1:])
        for m in NOW.finditer(section(text, "## How many places one step opens"))
    }
    problems = []
    for heading in WALKS:
        front_end = heading.split()[2]
        counted = walk_counts(section(text, heading))
        if rows.get(front_end) != counted:
            problems.append(f"counts table, {front_end}: now {rows.get(front_end)}; the walk names {counted}")
    return problems


def shared_table_problems(text: str) -> list[str]:
    """Each row of the shared-stages table: its stages exist (stages.py, or state.py for ``LossScale.update``), its
    methods exist on LossScaleOptimizer (or in optimizer/options.py) and GradScaler, and each method calls a stage
    of its row."""
    rows = [ln for ln in section(text, "## What both front ends share").splitlines() if ln.startswith("| ")][1:]
    assert rows, "no table under '## What both front ends share'"
    options = importlib.import_module("lossscale.optimizer.options")
    problems = []
    for row in rows:
        part, stage_cell, optimizer_cell, scaler_cell = (c.strip() for c in row.strip("|").split("|"))
        names = [re.findall(r"`([A-Za-z_][\w.]*)`", c) for c in (stage_cell, optimizer_cell, scaler_cell)]
        stages = [n for n in names[0] if not n.endswith(".py")]
        for stage in stages:
            module = "lossscale.state" if "." in stage else "lossscale.stages"
            try:
                resolve(module, stage)
            except LookupError as err:
                problems.append(f"shared table, {part!r}: {err}")
        callers = [(LossScaleOptimizer, n) for n in names[1]] + [(GradScaler, n) for n in names[2]]
        for owner, method in callers:
            try:
                obj = resolve(owner.__module__, f"{owner.__name__}.{method}")
            except LookupError:
                try:
                    obj = resolve(options.__name__, method)
                except LookupError:
                    problems.append(f"shared table, {part!r}: {owner.__name__}.{method} does not exist")
                    continue
            source = inspect.getsource(_code(obj))
            if not any(re.search(rf"\b{re.escape(s.split('.')[-1])}\(", source) for s in stages):
                problems.append(f"shared table, {part!r}: {method} calls none of {stages}")
    return problems


def test_every_named_function_exists_where_the_page_says():
    text = PAGE.read_text(encoding="utf-8")
    assert len(names_in(text)) > 30, "the page's walks name their functions as `module:Qualified.name`"
    assert name_problems(text) == []


def test_the_tree_lists_the_package():
    assert tree_problems(PAGE.read_text(encoding="utf-8")) == []


def test_each_walk_is_what_a_traced_step_enters():
    text = PAGE.read_text(encoding="utf-8")
    for heading, step in WALKS.items():
        assert walk_problems(text, heading, STEPS[step]()) == []


def test_the_counts_table_says_what_the_walks_name():
    assert count_table_problems(PAGE.read_text(encoding="utf-8")) == []


def test_the_shared_table_names_stages_and_their_callers():
    assert shared_table_problems(PAGE.read_text(encoding="utf-8")) == []


def test_the_checks_fail_on_a_page_that_is_wrong():
    text = PAGE.read_text(encoding="utf-8")
    renamed = text.replace("LossScaleOptimizer._unscale`", "LossScaleOptimizer._unscale_and_clip`")
    assert any("_unscale_and_clip" in p for p in name_problems(renamed))
    walk = "## One LossScaleOptimizer step"
    assert any("_unscale_and_clip" in p for p in walk_problems(renamed, walk, optimizer_step()))
    moved = text.replace(
        "`lossscale.stages:guarded_found` (`stages.py`", "`lossscale.stages:guarded_found` (`state.py`"
    )
    assert any("guarded_found" in p and "state.py" in p for p in name_problems(moved))
    reexported = "`lossscale.stages:grouped_norm_squared`"  # stages imports it from ops/clip.py
    assert any("not in lossscale.stages" in p for p in name_problems(reexported))
    assert any("states.py" in p for p in tree_problems(text.replace("  state.py ", "  states.py")))
    assert any(
        "validation.py: in the package" in p for p in tree_problems(text.replace("  validation.py", "  checks.py"))
    )
    wrong_count = text.replace("opens 7 files and 25 functions (2", "opens 7 files and 24 functions (2")
    assert any("says (7, 24, 2)" in p for p in walk_problems(wrong_count, "## One GradScaler step", scaler_step()))
    stale = text.replace("| 7 files, 25 functions (1 properties) |", "| 7 files, 24 functions (1 properties) |")
    assert any("LossScaleOptimizer: now (7, 24, 1)" in p for p in count_table_problems(stale))
    swapped = text.replace("| `clip_norm` | `_unscale` | |", "| `clip_norm` | `_apply` | |")
    assert any("_apply calls none" in p for p in shared_table_problems(swapped))


def test_the_walks_keep_to_the_step_budget():
    """The step every user runs is small: at most 7 files and 25 functions per front end, by the tracer."""
    for step in STEPS.values():
        entered = step()
        files = {module_file(n.split(":")[0]) for n in entered}
        assert len(files) <= 7 and len(entered) <= 25, (len(files), len(entered), sorted(entered))
