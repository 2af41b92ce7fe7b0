"""The optional dependencies stay optional: importing lossscale imports no framework, no extra's package and not
the demo, and a missing framework is an ImportError that names the extra to install."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest


def test_importing_lossscale_imports_no_framework_no_demo_matplotlib_or_tqdm() -> None:
    # A fresh interpreter (one for both checks: each costs an import of torch). torch itself imports tqdm where it
    # is installed (torch.hub): the demo's packages are counted among what lossscale adds to torch's modules.
    code = (
        "import json, sys, torch; torch_modules = set(sys.modules); import lossscale, lossscale.integrations; "
        "print(json.dumps({'frameworks': sorted(m for m in ('lightning', 'accelerate', 'lightning_fabric', "
        "'transformers') if m in sys.modules), 'demo': sorted(m for m in set(sys.modules) - torch_modules "
        "if m.split('.')[0] in ('matplotlib', 'tqdm') or 'demo' in m)}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"frameworks": [], "demo": []}


@pytest.mark.parametrize(
    "module,framework,extra",
    [
        ("lightning", "lightning", "lightning"),
        ("fabric", "lightning", "lightning"),
        ("accelerate", "accelerate", "accelerate"),
        ("transformers", "transformers", "transformers"),
    ],
)
def test_a_missing_framework_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, module: str, framework: str, extra: str
) -> None:
    for name in [n for n in sys.modules if n == framework or n.startswith(framework + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, framework, None)  # makes `import <framework>` raise ImportError
    for name in [n for n in sys.modules if n.startswith("lossscale.integrations.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(
        ImportError,
        match=rf"lossscale.integrations.{module} needs the '{framework}[.\w]*' "
        rf"package.*pip install '\.\[{extra}\]'",
    ):
        importlib.import_module(f"lossscale.integrations.{module}")
