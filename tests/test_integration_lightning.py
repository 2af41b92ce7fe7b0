"""lossscale.integrations.lightning.MixedPrecision in a real Lightning Trainer on CPU, side by side with
Lightning's own MixedPrecision plugin driving torch.amp.GradScaler."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision

import lossscale
from _lightning_models import LIGHTNING_WARNINGS, TORCH_ARGS, Planted, Tiny, assert_same_weights, fit, torch_plugin
from lossscale import OverflowDiagnosis, OverflowWarning
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
    with pytest.raises(
        ValueError,  # Lightning's own text, then what each value means
        match=re.escape("Passed `MixedPrecision(precision='16')`. Precision must be '16-mixed' or 'bf16-mixed' (")
        + r"float16 autocast with lossscale's GradScaler, or bfloat16 autocast without a scaler\)\.",
    ):
        MixedPrecision("16", "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"scaler must be a lossscale.GradScaler; got torch.amp.grad_scaler"):
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"MixedPrecision\(scaler=..., init_scale=...\): pass either"):
        MixedPrecision("16-mixed", "cpu", scaler=lossscale.GradScaler("cpu"), init_scale=8.0)
    with pytest.raises(TypeError, match=r"device must be a device type string"):
        MixedPrecision("16-mixed", torch.device("cpu"))  # type: ignore[arg-type]
    plugin = MixedPrecision("16-mixed", "cpu", policy=lossscale.DynamicScale(init_scale=8.0))
    assert isinstance(plugin, LightningMixedPrecision) and plugin.scaler.get_scale() == 8.0


def test_diagnose_true_names_the_module_whose_forward_overflows() -> None:
    plugin = MixedPrecision("16-mixed", "cpu", diagnose=True, **TORCH_ARGS)
    with pytest.warns(OverflowWarning, match=r"forward overflow: 'net.amplify' \(Amplify\) produced inf") as caught:
        module, _, _ = fit(plugin, Planted(factor=1e6), epochs=3, accumulate_grad_batches=1)  # 24 steps
    [warning] = [w.message for w in caught if isinstance(w.message, OverflowWarning)]
    assert (warning.report.kind, warning.report.module) == ("forward", "net.amplify")
    # the loss is non-finite from step 0: the trigger fires at the second (1), is acted on at 2, traces step 3
    assert "the loss was non-finite 2 steps in a row; the traced step 3" in str(warning)
    assert plugin.diagnosis is not None and plugin.diagnosis.model is module  # True: the LightningModule trained


def test_diagnose_never_warns_on_isolated_overflows_and_changes_no_step() -> None:
    ref, ref_rec, _ = fit(MixedPrecision("16-mixed", "cpu", **TORCH_ARGS))
    module = Tiny()
    plugin = MixedPrecision("16-mixed", "cpu", diagnose=OverflowDiagnosis(module, patience=2), **TORCH_ARGS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, rec, _ = fit(plugin, module)  # overflows at steps 0, 3 and 5: none two in a row
    assert not [w for w in caught if issubclass(w.category, OverflowWarning)]
    assert plugin.diagnosis is not None and plugin.diagnosis.last_report is None and not plugin.diagnosis.tracing
    assert rec.scales == ref_rec.scales
    assert_same_weights(ours, ref)


def test_diagnose_refuses_what_it_cannot_trace() -> None:
    with pytest.raises(
        TypeError,
        match=r"MixedPrecision\(diagnose='model'\): diagnose must be True \(the LightningModule being trained\), "
        r"a torch.nn.Module .*, a lossscale.OverflowDiagnosis, or None/False \(no diagnosis\); got str",
    ):
        MixedPrecision("16-mixed", "cpu", diagnose="model")  # type: ignore[arg-type]
    own = lossscale.GradScaler("cpu", diagnose=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"MixedPrecision\(diagnose=...\) and a GradScaler built with diagnose="):
        MixedPrecision("16-mixed", "cpu", scaler=own, diagnose=True)
    assert MixedPrecision("16-mixed", "cpu", scaler=own).diagnosis is own.add_ons[0]  # the scaler's, for loggers
    assert MixedPrecision("16-mixed", "cpu", diagnose=False).diagnosis is None


@pytest.mark.parametrize("manual", [False, True])
def test_bf16_mixed_trains_as_lightnings_own_plugin_bit_for_bit(manual: bool) -> None:
    dtypes: list[torch.dtype] = []
    runs = []
    for plugin in (LightningMixedPrecision("bf16-mixed", "cpu"), MixedPrecision("bf16-mixed", "cpu")):
        module = Tiny(inf_at=set(), manual=manual)  # no loss scale: an inf loss would make both runs NaN
        module.net.register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
        runs.append(fit(plugin, module, manual=manual))
    (ref, _, ref_trainer), (ours, rec, trainer) = runs
    assert set(dtypes) == {torch.bfloat16}  # both forwards ran under bfloat16 autocast
    assert_same_weights(ours, ref)
    assert any(not torch.equal(p, q) for p, q in zip(ours.parameters(), Tiny().parameters()))  # it trained
    assert ours.step_returns == ref.step_returns  # manual: what opt.step() returned
    assert trainer.global_step == ref_trainer.global_step == (16 if manual else 8)  # every step taken
    plugin = trainer.precision_plugin
    assert plugin.scaler is None and plugin.last_result is None and plugin.diagnosis is None and not rec.scales
    assert plugin.state_dict() == ref_trainer.precision_plugin.state_dict() == {}


def test_bf16_mixed_refuses_what_needs_a_loss_scale() -> None:
    with pytest.raises(
        ValueError,  # Lightning's own text after the call (Lightning raises it for torch's scaler)
        match=r"MixedPrecision\(precision='bf16-mixed', scaler=...\): `precision='bf16-mixed'` does not use a "
        r"scaler, found <lossscale.scaler.GradScaler.*leave scaler out, or use precision='16-mixed'",
    ):
        MixedPrecision("bf16-mixed", "cpu", scaler=lossscale.GradScaler("cpu"))
    with pytest.raises(
        ValueError, match=r"MixedPrecision\(precision='bf16-mixed', init_scale=...\): GradScaler's arguments need"
    ):
        MixedPrecision("bf16-mixed", "cpu", init_scale=8.0)
    for diagnose, got in [(True, "True"), (Tiny(), "Tiny(...)"), (OverflowDiagnosis(Tiny()), "OverflowDiagnosis(...)")]:
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"MixedPrecision(precision='bf16-mixed', diagnose={got}): diagnose must be None or False with "
                f"'bf16-mixed' (bfloat16 has float32's range: there is no loss scale to collapse, and the diagnosis "
                f"is triggered by the scale's collapse); got {got}. Leave diagnose out, or use precision='16-mixed'."
            ),
        ):
            MixedPrecision("bf16-mixed", "cpu", diagnose=diagnose)
    assert MixedPrecision("bf16-mixed", "cpu", diagnose=False).scaler is None
