"""The package's shape against docs/architecture.md: imports run only down the page's layers (imports inside functions
included), no package imports itself in a cycle, the add-on contract stays small and each hook is used, and neither
front end names an add-on. Each check is shown to fail on a doctored import or contract."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lossscale
from lossscale.addons.base import AddOn

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = Path(lossscale.__file__).resolve().parent

#: The checkpoint entry of an add-on: plumbing beside the contract, not a hook.
PLUMBING = {"key", "label", "state_dict", "validate_state_dict", "load_state_dict"}


def layers(text: str) -> dict[str, int]:
    """The page's layer table: ``{entry: layer}``, an entry a module or package below ``lossscale`` (``__init__``: the
    package itself)."""
    block = text.split("## Layers", 1)[1].split("```text\n", 1)[1].split("\n```", 1)[0]
    out: dict[str, int] = {}
    for line in block.splitlines():
        number, *entries = line.split()
        for entry in entries:
            out[entry] = int(number)
    return out


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("lossscale", *parts)).removesuffix(".__init__")


def imports() -> dict[str, set[str]]:
    """Every module of the package and the lossscale modules it imports, anywhere in its code."""
    out: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lossscale":
                for alias in node.names:  # `from lossscale.ops import clip` imports the module lossscale.ops.clip
                    target = f"{node.module}.{alias.name}"
                    found.add(target if _is_module(target) else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == "lossscale")
        out[name] = found - {name}
    return out


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").exists() or (PACKAGE / relative / "__init__.py").exists()


def layer_of(module: str, table: dict[str, int]) -> tuple[str, int]:
    """The most specific entry of ``table`` that holds ``module``, and its layer."""
    relative = module.removeprefix("lossscale").lstrip(".") or "__init__"
    parts = relative.split(".")
    for i in range(len(parts), 0, -1):
        entry = ".".join(parts[:i])
        if entry in table:
            return entry, table[entry]
    raise LookupError(f"{module}: no entry of the layer table holds it; add it to docs/architecture.md's table")


def package_of(module: str) -> str:
    """The first package below lossscale that holds ``module`` (``lossscale.ops.clip`` -> ``ops``), or the module."""
    relative = module.removeprefix("lossscale").lstrip(".") or "__init__"
    return relative.split(".")[0]


def layer_problems(graph: dict[str, set[str]], table: dict[str, int]) -> list[str]:
    """Each import that runs up or sideways, and each cycle inside a package."""
    problems = []
    for module, targets in graph.items():
        entry, layer = layer_of(module, table)
        for target in sorted(targets):
            if package_of(target) == package_of(module) and package_of(module) != "__init__":
                continue  # inside one package: checked for cycles below
            target_entry, target_layer = layer_of(target, table)
            if target_layer >= layer:
                problems.append(
                    f"{module} (layer {layer}, {entry}) imports {target} (layer {target_layer}, {target_entry}): "
                    f"an import runs only down"
                )
    for package in {package_of(m) for m in graph}:
        inside = {m: {t for t in graph[m] if package_of(t) == package} for m in graph if package_of(m) == package}
        cycle = _cycle(inside)
        if cycle:
            problems.append(f"package {package}: an import cycle {' -> '.join(cycle)}")
    return problems


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_every_module_has_a_layer_and_imports_run_only_down():
    table = layers(PAGE.read_text(encoding="utf-8"))
    graph = imports()
    assert len(graph) > 40 and len(table) >= 13
    assert layer_problems(graph, table) == []


def test_an_upward_or_sideways_import_or_a_cycle_fails():
    table = layers(PAGE.read_text(encoding="utf-8"))
    graph = imports()
    upward = {**graph, "lossscale.stages": graph["lossscale.stages"] | {"lossscale.scaler"}}
    assert any("lossscale.stages (layer 5" in p and "lossscale.scaler" in p for p in layer_problems(upward, table))
    sideways = {**graph, "lossscale.scaler": graph["lossscale.scaler"] | {"lossscale.optimizer.optimizer"}}
    assert any("imports lossscale.optimizer.optimizer (layer 10" in p for p in layer_problems(sideways, table))
    cyclic = {**graph, "lossscale.ops.clip": graph["lossscale.ops.clip"] | {"lossscale.ops.overflow"}}
    assert any("package ops: an import cycle" in p for p in layer_problems(cyclic, table))
    doctored = PAGE.read_text(encoding="utf-8").replace("5   stages", "11  stages")
    assert any("imports lossscale.stages (layer 11" in p for p in layer_problems(graph, layers(doctored)))


def hooks(base: type) -> list[str]:
    """The members of the add-on base class a front end calls or reads, checkpoint plumbing aside."""
    return sorted(n for n in vars(base) if not n.startswith("__") and n not in PLUMBING)


def add_on_classes() -> list[type]:
    """The library's add-ons."""
    from lossscale import EMA, OverflowDiagnosis, PrecisionSchedule

    return [EMA, PrecisionSchedule, OverflowDiagnosis]


FRONT_ENDS = [PACKAGE / "scaler.py", PACKAGE / "optimizer" / "optimizer.py"]


def contract_problems(base: type, add_ons: list[type], front_ends: list[str]) -> list[str]:
    """At most six hooks, each overridden by two add-ons or called (read) by both front ends."""
    found = hooks(base)
    problems = [f"the add-on contract has {len(found)} hooks ({found}); at most 6"] if len(found) > 6 else []
    for hook in found:
        implementers = [c.__name__ for c in add_ons if hook in vars(c)]
        callers = [i for i, source in enumerate(front_ends) if re.search(rf"\.{hook}\b", source)]
        if len(implementers) < 2 and len(callers) < 2:
            problems.append(f"hook {hook}: used by {implementers} and {len(callers)} front end(s)")
    return problems


def test_the_add_on_contract_is_small_and_each_hook_is_used():
    sources = [p.read_text(encoding="utf-8") for p in FRONT_ENDS]
    assert hooks(AddOn) == ["after_step", "attach", "finds_forward_faults", "on_loss"]
    assert contract_problems(AddOn, add_on_classes(), sources) == []

    class Wider(AddOn):
        def before_apply(self) -> None:  # a hook only one add-on would want
            pass

    assert any("hook before_apply" in p for p in contract_problems(Wider, add_on_classes(), sources))


def test_neither_front_end_names_an_add_on():
    graph = imports()
    for path in FRONT_ENDS:
        module = module_name(path)
        named = {
            t
            for t in graph[module]
            if t.startswith(("lossscale.addons.", "lossscale.diagnosis", "lossscale.layerwise"))
        }
        assert named <= {"lossscale.addons.base"}, (module, named)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not used & {"EMA", "PrecisionSchedule", "OverflowDiagnosis", "LayerScales"}, module
