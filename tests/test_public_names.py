"""Every public name the documentation mentions imports and is the kind of object it is documented as, and every
name in ``lossscale.__all__`` resolves.

The names are read from README.md and docs/*.md at collection: each ``lossscale.x.y`` written in the text and each
name of a ``from lossscale... import ...`` line. A newly documented name fails until its kind is recorded in KIND.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import types
from pathlib import Path

import pytest

import lossscale

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Each documented name and the kind of object the documentation says it is.
KIND = {
    "lossscale": "module",
    "lossscale.DynamicScale": "class",
    "lossscale.EMA": "class",
    "lossscale.GradScaler": "class",
    "lossscale.LossScale": "class",
    "lossscale.LossScaleOptimizer": "class",
    "lossscale.Policy": "class",
    "lossscale.PrecisionSchedule": "class",
    "lossscale.StepLogger": "class",
    "lossscale.presets": "module",
    "lossscale.layerwise.LayerScales": "class",
    "lossscale.ops.clip.norms": "function",
    "lossscale.state.ReplayedUpdate": "class",
    "lossscale.compat": "module",
    "lossscale.compat.ascend": "module",
    "lossscale.compat.ascend.ExperimentalConfig": "class",
    "lossscale.compat.ascend.TellMeStepOrLossHook": "class",
    "lossscale.compat.keras": "module",
    "lossscale.compat.mindspore": "module",
    "lossscale.compat.nnabla": "module",
    "lossscale.integrations": "module",
    "lossscale.integrations.accelerate": "module",
    "lossscale.integrations.accelerate.use_lossscale": "function",
    "lossscale.integrations.fabric": "module",
    "lossscale.integrations.fabric.MixedPrecision": "class",
    "lossscale.integrations.lightning": "module",
    "lossscale.integrations.lightning.LossScaleMonitor": "class",
    "lossscale.integrations.lightning.LossScalePrecision": "class",
    "lossscale.integrations.lightning.MixedPrecision": "class",
    "lossscale.integrations.transformers": "module",
    "lossscale.integrations.transformers.LossScaleCallback": "class",
    "lossscale.integrations.transformers.use_lossscale": "function",
    "lossscale.testing": "module",
    "lossscale.testing.init_from_env": "function",
    "lossscale.testing.is_main_process": "function",
    "lossscale.testing.shutdown": "function",
    "lossscale.reporting.step_record": "function",
    "lossscale.ops.amax_kernel": "module",
    "lossscale.ops.amax_kernel.amax": "function",
    "lossscale.diagnosis": "module",
    "lossscale.diagnosis.advance_trigger": "function",
    "lossscale.addons": "module",
    "lossscale.layerwise": "module",
    "lossscale.ops.distributed": "module",
    "lossscale.optimizer": "module",
    "lossscale.reporting": "module",
    "lossscale.testing.HostReadCounter": "class",
    # the modules docs/architecture.md walks a step through
    "lossscale.scaler": "module",
    "lossscale.stages": "module",
    "lossscale.state": "module",
    "lossscale.validation": "module",
    "lossscale.ops.clip": "module",
    "lossscale.ops.overflow": "module",
    "lossscale.optimizer.optimizer": "module",
    "lossscale.policies.dynamic": "module",
    "lossscale.OverflowDiagnosis": "class",
    "lossscale.OverflowWarning": "class",
    "lossscale.find_overflow": "function",
    "lossscale.keep_float32": "function",
    "lossscale.heal": "function",
    "lossscale.HealError": "class",
    "lossscale.HealWarning": "class",
}
#: The optional package a name needs (an integration's framework, an extra; triton, which torch's CUDA builds bring):
#: without it, its names are skipped, saying so.
FRAMEWORK = {
    "lossscale.integrations.lightning": "lightning",
    "lossscale.integrations.fabric": "lightning",
    "lossscale.integrations.accelerate": "accelerate",
    "lossscale.integrations.transformers": "transformers",
    "lossscale.ops.amax_kernel": "triton",
}
IS_KIND = {
    "module": lambda o: isinstance(o, types.ModuleType),
    "class": inspect.isclass,
    "function": inspect.isfunction,
}


def documented_names() -> list[str]:
    names = set()
    for path in DOCS:
        text = path.read_text()
        names.update(re.findall(r"(?<![\w.])lossscale(?:\.[A-Za-z_]\w*)*(?=[^\w.]|\.(?!\w))", text))
        for module, items in re.findall(r"from\s+(lossscale(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n]+)", text):
            for item in items.strip("()").split(","):
                item = item.split(" as ")[0].strip()
                if item:
                    names.add(f"{module}.{item}")
    return sorted(names)


NAMES = documented_names()


def resolve(name: str):
    """The object ``name`` names: its longest importable module, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as err:
            if err.name and not name.startswith(err.name):
                raise  # a dependency is missing, not the name's own module
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_the_documentation_names_what_kind_each_name_is():
    assert len(NAMES) > 20, NAMES  # the reading found the names
    assert set(NAMES) == set(KIND), (
        f"record the kind of {sorted(set(NAMES) - set(KIND))}; no longer documented: {sorted(set(KIND) - set(NAMES))}"
    )


@pytest.mark.parametrize("name", NAMES)
def test_a_documented_name_imports_as_its_kind(name):
    framework = next((f for prefix, f in FRAMEWORK.items() if name.startswith(prefix)), None)
    if framework:
        pytest.importorskip(framework, reason=f"{name} needs {framework}, which is not installed here")
    kind = KIND.get(name)
    assert kind, f"{name} is documented: record its kind in KIND"
    assert IS_KIND[kind](resolve(name)), f"{name} is documented as a {kind}"


@pytest.mark.parametrize("name", lossscale.__all__)
def test_every_name_in_all_resolves(name):
    obj = getattr(lossscale, name)
    assert isinstance(obj, types.ModuleType) or obj.__module__.startswith("lossscale."), name


#: The public modules (docs/architecture.md, "Public and internal"): exactly the ones that declare ``__all__``.
PUBLIC_MODULES = {
    "lossscale",
    "lossscale.addons",
    "lossscale.compat.ascend",
    "lossscale.compat.keras",
    "lossscale.compat.mindspore",
    "lossscale.compat.nnabla",
    "lossscale.diagnosis",
    "lossscale.integrations.accelerate",
    "lossscale.integrations.fabric",
    "lossscale.integrations.lightning",
    "lossscale.integrations.transformers",
    "lossscale.layerwise",
    "lossscale.optimizer",
    "lossscale.policies.presets",
    "lossscale.reporting",
    "lossscale.testing",
}


def _all_modules() -> list[str]:
    import pkgutil

    return ["lossscale", *(m.name for m in pkgutil.walk_packages(lossscale.__path__, "lossscale."))]


def test_exactly_the_public_modules_declare_all_and_each_name_in_it_resolves():
    declaring = set()
    for name in _all_modules():
        framework = next((f for prefix, f in FRAMEWORK.items() if name.startswith(prefix)), None)
        if framework and importlib.util.find_spec(framework) is None:
            continue  # an optional dependency absent here: the module cannot be imported to be read
        module = importlib.import_module(name)
        if "__all__" in vars(module):
            declaring.add(name)
            for member in module.__all__:
                assert hasattr(module, member), f"{name}.__all__ names {member!r}, which it does not have"
    assert declaring == PUBLIC_MODULES - {m for m in PUBLIC_MODULES if _absent(m)}, (
        f"declare __all__ only in public modules: extra {sorted(declaring - PUBLIC_MODULES)}, "
        f"missing {sorted(PUBLIC_MODULES - declaring)}"
    )


def _absent(name: str) -> bool:
    framework = next((f for prefix, f in FRAMEWORK.items() if name.startswith(prefix)), None)
    return framework is not None and importlib.util.find_spec(framework) is None


def test_the_architecture_page_lists_the_public_modules():
    text = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"`(lossscale(?:\.\w+)*)`", text.split("## Public and internal", 1)[1].split("\n## ")[0]))
    shown = {"lossscale.presets" if m == "lossscale.policies.presets" else m for m in PUBLIC_MODULES}
    grouped = {m for m in shown if m.startswith(("lossscale.compat.", "lossscale.integrations."))}
    assert shown - grouped <= listed, sorted(shown - grouped - listed)
    assert {"lossscale.compat", "lossscale.integrations"} <= listed
