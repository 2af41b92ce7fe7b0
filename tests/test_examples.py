"""The examples in examples/ run as a user runs them, at their own (small) sizes, and show what they claim.

(examples/transformers_trainer.py is run by tests/test_integration_transformers.py, beside the integration it shows.)
"""

from __future__ import annotations

import atexit
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_float16_overflow_names_the_t5_feed_forward_and_keep_float32_fixes_it(tmp_path, capsys):
    pytest.importorskip("transformers", reason="examples/float16_overflow.py builds a T5 with transformers")
    example = runpy.run_path(str(EXAMPLES / "float16_overflow.py"))
    plot = tmp_path / "magnitudes.png"
    args = ["--plot", str(plot)] if _has_matplotlib() else []
    report, fixed = example["main"](args)
    assert (report.kind, report.module) == ("forward", "encoder.block.1.layer.1.DenseReluDense")
    assert fixed.kind == "none"
    out = capsys.readouterr().out
    assert "T5DenseGatedActDense" in out and "keep_float32(model.get_submodule(" in out
    assert not args or plot.stat().st_size > 1000


def _start_heal_example() -> tuple[subprocess.Popen, Path]:
    """examples/heal.py run as a user runs it (with --plot where matplotlib is there), in a process of its own with one
    torch thread, started as pytest collects this module: its half minute takes the second core meanwhile."""
    folder = Path(tempfile.mkdtemp(prefix="lossscale-heal-example-"))
    args = ["--plot", str(folder / "heal.png")] if _has_matplotlib() else []
    with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLES / "heal.py"), *args],
            stdout=out,
            stderr=err,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    return proc, folder


def test_heal_keeps_the_grown_feed_forward_in_float32_and_trains_on_where_torch_breaks():
    pytest.importorskip("transformers", reason="examples/heal.py builds a GPT-2 with transformers")
    proc, folder = HEAL_EXAMPLE
    try:
        code = proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("examples/heal.py gave no answer in 300 s")
    out = (folder / "stdout").read_text()
    assert code == 0, (folder / "stderr").read_text()[-3000:]
    line = (
        r"^(?P<run>\w+)\s+held-out loss (?P<loss>\S+)\s+skipped\s+(?P<skipped>\d+) of \d+\s+final scale (?P<scale>\S+)$"
    )
    runs = {m["run"]: m for m in re.finditer(line, out, re.M)}
    assert set(runs) == {"torch", "heal", "float32"}, out
    assert "HealWarning: healed at step" in out and "'transformer.h.3.mlp.c_proj' now runs in float32" in out
    assert "kept by healing: {'transformer.h.3.mlp.c_proj': 'torch.float32'}" in out
    assert runs["torch"]["loss"] == "nan"  # torch's run broke and stayed broken
    assert float(runs["torch"]["scale"]) < 1e-6 and int(runs["torch"]["skipped"]) > 40  # its scale driven to the floor
    assert abs(float(runs["heal"]["loss"]) / float(runs["float32"]["loss"]) - 1) < 0.03
    assert int(runs["heal"]["skipped"]) <= 6 and float(runs["heal"]["scale"]) >= 2.0**15
    assert not _has_matplotlib() or (folder / "heal.png").stat().st_size > 1000


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _stop(proc: subprocess.Popen, folder: Path) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


HEAL_EXAMPLE = _start_heal_example()
atexit.register(_stop, *HEAL_EXAMPLE)
