"""Run by .ci/wheel_check.sh with the python of a fresh environment that has only the wheel and its declared
dependencies installed, from a folder outside the checkout:

    python wheel_check.py DIST_DIR README.md

Checks: the wheel's metadata (version, license, extras, py.typed); every public module of the installed package
imports, except the optional parts, which must fail with their documented error (an integration without its
framework: an ImportError naming its extra as a clone installs it, ``pip install '.[<extra>]'``, an extra the wheel
declares; the demo without matplotlib and tqdm: a message naming ``pip install '.[demo]'``); the ``lossscale``
console script; the README's first python code block runs and prints what its comment says. Ends with one line,
``wheel_check: N passed, N failed``; exits 1 on a failure.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as metadata
import io
import pkgutil
import re
import subprocess
import sys
import zipfile
from pathlib import Path

results: list[tuple[str, str | None]] = []  # (what, None if it passed else why not)
DEMO_EXTRA = "pip install '.[demo]'"  # how the demo's and the plot's messages name the extra (from a clone)


def check(what: str, ok: bool, why: str = "") -> None:
    results.append((what, None if ok else why or "failed"))
    print(f"   {'ok ' if ok else 'FAIL'} {what}" + ("" if ok else f": {why}"))


def wheel_contents(dist: Path) -> None:
    wheels = sorted(dist.glob("lossscale-*.whl"))
    sdists = sorted(dist.glob("lossscale-*.tar.gz"))
    check("one wheel and one sdist were built", len(wheels) == 1 and len(sdists) == 1, f"{wheels} {sdists}")
    if not wheels:
        return
    names = zipfile.ZipFile(wheels[0]).namelist()
    check("the wheel ships lossscale/py.typed", "lossscale/py.typed" in names)
    check("the wheel ships the license file", any(n.endswith(".dist-info/licenses/LICENSE") for n in names))
    check(
        "the wheel ships no tests, docs or benchmarks",
        not any(n.startswith(("tests/", "docs/", "benchmarks/")) for n in names),
    )


def installed_metadata() -> None:
    import lossscale

    meta = metadata.metadata("lossscale")
    site = Path(lossscale.__file__).resolve()
    check("lossscale is imported from the installed wheel, not a checkout", "site-packages" in site.parts, str(site))
    check(
        "lossscale.__version__ is the package's version",
        lossscale.__version__ == meta["Version"],
        f"{lossscale.__version__} != {meta['Version']}",
    )
    check(
        "License-Expression: Apache-2.0",
        meta.get("License-Expression") == "Apache-2.0",
        str(meta.get("License-Expression")),
    )
    extras = declared_extras()
    wanted = {"demo", "dev", "lightning", "accelerate", "transformers", "docs"}
    check("every extra is declared", wanted <= extras, f"missing {sorted(wanted - extras)}")
    requires = metadata.requires("lossscale") or []
    plain = [r for r in requires if "extra ==" not in r]
    check(
        "the only unconditional dependency is torch",
        [re.split(r"[<>=!~ ;\[]", r)[0] for r in plain] == ["torch"],
        str(plain),
    )


def declared_extras() -> set[str]:
    return set(metadata.metadata("lossscale").get_all("Provides-Extra") or [])


def every_module() -> None:
    import lossscale

    for name in ("lossscale.presets",):  # an attribute of the package (the module is lossscale.policies.presets)
        check(f"{name} is there", hasattr(lossscale, "presets") and bool(lossscale.presets.__all__))
    for info in sorted(pkgutil.walk_packages(lossscale.__path__, "lossscale."), key=lambda i: i.name):
        name = info.name
        if any(part.startswith("_") for part in name.split(".")):
            continue  # private modules: imported by the public ones
        try:
            module = importlib.import_module(name)
        except (ImportError, SystemExit) as err:
            message = str(err)
            if name.startswith("lossscale.integrations."):
                extra = re.search(r"pip install '\.\[(\w+)\]'", message)
                check(
                    f"{name} without its framework: ImportError naming its extra (a declared one)",
                    isinstance(err, ImportError) and extra is not None and extra.group(1) in declared_extras(),
                    message,
                )
            elif name.startswith("lossscale.demo."):
                check(
                    f"{name} without matplotlib and tqdm: the demo's message or an ImportError of them",
                    DEMO_EXTRA in message or getattr(err, "name", None) in ("matplotlib", "tqdm"),
                    message,
                )
            elif name == "lossscale.ops.amax_kernel":  # the Triton kernel: used only where triton imports
                check(f"{name} without triton: ImportError of triton", getattr(err, "name", None) == "triton", message)
            else:
                check(f"import {name}", False, f"{type(err).__name__}: {message}")
            continue
        public = getattr(module, "__all__", [])
        missing = [n for n in public if not hasattr(module, n)]
        check(f"import {name} ({len(public)} names in __all__)", not missing, f"__all__ names missing: {missing}")


def console_script() -> None:
    run = subprocess.run(["lossscale", "demo", "--quick"], capture_output=True, text=True, timeout=300)
    check(
        f"`lossscale demo` without the demo extra: exits non-zero, naming {DEMO_EXTRA}",
        run.returncode != 0 and DEMO_EXTRA in run.stderr + run.stdout,
        f"{run.returncode}: {run.stderr}",
    )


def readme_first_block(readme: Path) -> None:
    text = readme.read_text(encoding="utf-8")
    block = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    check("README.md has a python code block", block is not None)
    if block is None:
        return
    code = block.group(1)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md (first python block)", "exec"), {"__name__": "readme"})
    except Exception as err:
        check("the README's first python block runs", False, f"{type(err).__name__}: {err}")
        return
    check("the README's first python block runs", True)
    promised = [m.group(1).rstrip(", ") for m in re.finditer(r"^print\(.*\)\s+# (.*?)(?:\.\.\.|$)", code, re.M)]
    printed = out.getvalue().splitlines()
    check(
        "it prints what its comments say",
        len(printed) == len(promised) and all(p.startswith(t) for t, p in zip(promised, printed)),
        f"printed {printed}, promised {promised}",
    )


def main() -> int:
    dist, readme = Path(sys.argv[1]), Path(sys.argv[2])
    wheel_contents(dist)
    installed_metadata()
    every_module()
    console_script()
    readme_first_block(readme)
    failed = [what for what, why in results if why is not None]
    print(f"wheel_check: {len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
