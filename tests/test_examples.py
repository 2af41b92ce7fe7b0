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


def test_heal_keeps_the_grown_feed_forward_in_float32_and_trains_on_where_torch_breaks(tmp_path, capsys):
    pytest.importorskip("transformers", reason="examples/heal.py builds a GPT-2 with transformers")
    example = runpy.run_path(str(EXAMPLES / "heal.py"))
    plot = tmp_path / "heal.png"
    args = ["--plot", str(plot)] if _has_matplotlib() else []
    runs = example["main"](args)
    assert runs["heal"]["healed"] == {"transformer.h.3.mlp.c_proj": "torch.float32"}
    assert runs["torch"]["held_out"] != runs["torch"]["held_out"]  # NaN: torch's run broke and stayed broken
    assert runs["torch"]["scales"][-1] < 1e-6 and runs["torch"]["skipped"] > 40  # its scale driven to the floor
    assert abs(runs["heal"]["held_out"] / runs["float32"]["held_out"] - 1) < 0.03
    assert runs["heal"]["skipped"] <= 6 and runs["heal"]["scales"][-1] >= 2.0**15
    out = capsys.readouterr().out
    assert "HealWarning: healed at step" in out and "kept by healing:" in out
    assert not args or plot.stat().st_size > 1000


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
