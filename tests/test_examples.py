"""The examples in examples/ run as a user runs them, at their own (small) sizes, and show what they claim.

(examples/transformers_trainer.py is run by tests/test_integration_transformers.py, beside the integration it shows.)
"""

from __future__ import annotations

import runpy
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


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
