"""lossscale.integrations.lightning.MixedPrecision in a real Lightning Trainer on CPU, side by side with
Lightning's own MixedPrecision plugin driving torch.amp.GradScaler."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _lightning_models import TORCH_ARGS, LIGHTNING_WARNINGS, assert_same_weights, fit, torch_plugin
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision

import lossscale
from lossscale.integrations.lightning import MixedPrecision

pytestmark = [pytest.mark.filterwarnings(w) for w in LIGHTNING_WARNINGS]  # the reasons are in _lightning_models

def test_automatic_optimization_matches_lightning_with_torch_scaler_bit_for_bit() -> None:
    ref, ref_rec, ref_trainer = fit(torch_plugin())
    ours, rec, trainer = fit(MixedPrecision("16-mixed", "cpu", **TORCH_ARGS))
    assert rec.scales == ref_rec.scales
    assert len(set(rec.scales)) > 2  # the scale both backed off and grew
    assert_same_weights(ours, ref)
    assert trainer.global_step == ref_trainer.global_step == 8  # attempted steps, skipped ones included
    skipped = [r.step for r in rec.results if bool(r.found_inf)]
    assert skipped == [0, 3, 5]
    assert [r.step for r in rec.results] == list(range(8))
    for r in rec.results:  # clipping by norm records the unscaled norm (inf where the step overflowed)
        assert r.grad_norm is not None and bool(torch.isfinite(r.grad_norm)) != bool(r.found_inf)
        if bool(r.found_inf):
            assert float(r.next_scale) == float(r.scale) / 2


def test_manual_optimization_matches_lightning_with_torch_scaler() -> None:
    ref, ref_rec, _ = fit(torch_plugin(), manual=True, epochs=1)
    ours, rec, _ = fit(MixedPrecision("16-mixed", "cpu", **TORCH_ARGS), manual=True, epochs=1)
    assert rec.scales == ref_rec.scales
    assert_same_weights(ours, ref)
    assert ours.step_returns == ref.step_returns  # what opt.step() returns: the inner step's value, as torch's
    assert [bool(r.found_inf) for r in rec.results] == [b in (1, 6) for b in range(8)]


@pytest.mark.parametrize("first,second", [("torch", "ours"), ("ours", "torch")])
def test_checkpoint_resumes_across_torch_and_lossscale_plugins(tmp_path: Any, first: str, second: str) -> None:
    make = {"torch": torch_plugin, "ours": lambda: MixedPrecision("16-mixed", "cpu", **TORCH_ARGS)}
    ref, ref_rec, _ = fit(make[first](), epochs=2)
    _, rec1, trainer = fit(make[first](), epochs=1)
    path = str(tmp_path / "mid.ckpt")
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert saved["MixedPrecision"]["scale"] == rec1.scales[-1]  # Lightning's key: the plugin's class name
    resumed, rec2, _ = fit(make[second](), ckpt=path, epochs=2)
    assert rec1.scales + rec2.scales == ref_rec.scales
    assert_same_weights(resumed, ref)


def test_constructor_refuses_what_it_cannot_honour() -> None:
    with pytest.raises(ValueError, match=r"MixedPrecision\(precision='bf16-mixed'\): precision must be '16-mixed'"):
        MixedPrecision("bf16-mixed", "cpu")
    with pytest.raises(TypeError, match=r"scaler must be a lossscale.GradScaler; got torch.amp.grad_scaler"):
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"MixedPrecision\(scaler=..., init_scale=...\): pass either"):
        MixedPrecision("16-mixed", "cpu", scaler=lossscale.GradScaler("cpu"), init_scale=8.0)
    with pytest.raises(TypeError, match=r"device must be a device type string"):
        MixedPrecision("16-mixed", torch.device("cpu"))  # type: ignore[arg-type]
    plugin = MixedPrecision("16-mixed", "cpu", policy=lossscale.DynamicScale(init_scale=8.0))
    assert isinstance(plugin, LightningMixedPrecision) and plugin.scaler.get_scale() == 8.0
