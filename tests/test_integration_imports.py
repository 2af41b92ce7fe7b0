"""The integrations are optional: importing lossscale imports no framework, and a missing framework is an
ImportError that names the extra to install."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


def test_importing_lossscale_imports_no_framework() -> None:
    code = ("import sys, lossscale, lossscale.integrations; "
            "print(sorted(m for m in ('lightning', 'accelerate', 'lightning_fabric', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("module,framework,extra", [
    ("lightning", "lightning", "lightning"),
    ("fabric", "lightning", "lightning"),
    ("accelerate", "accelerate", "accelerate"),
    ("transformers", "transformers", "transformers"),
])
def test_a_missing_framework_names_the_extra(monkeypatch: pytest.MonkeyPatch, module: str, framework: str,
                                             extra: str) -> None:
    for name in [n for n in sys.modules if n == framework or n.startswith(framework + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, framework, None)  # makes `import <framework>` raise ImportError
    for name in [n for n in sys.modules if n.startswith("lossscale.integrations.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=rf"lossscale.integrations.{module} needs the '{framework}[.\w]*' "
                                          rf"package.*pip install 'lossscale\[{extra}\]'"):
        importlib.import_module(f"lossscale.integrations.{module}")
