"""LossScalePrecision + LossScaleOptimizer in a real Lightning Trainer on CPU: against Lightning's own plugin
with torch's scaler (same skips, same scales) and against the wrapper in a plain loop (same weights)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lossscale
from _lightning_models import (
    INF_AT,
    LIGHTNING_WARNINGS,
    TORCH_ARGS,
    Planted,
    Tiny,
    assert_same_weights,
    data,
    fit,
    torch_plugin,
)
from lossscale import OverflowDiagnosis, OverflowWarning
from lossscale.integrations.lightning import LossScalePrecision

pytestmark = [pytest.mark.filterwarnings(w) for w in LIGHTNING_WARNINGS]  # the reasons are in _lightning_models


def plain_loop(epochs: int = 2, accumulate: int = 2, schedule: Any = None, **wrap: Any) -> tuple[nn.Module, list]:
    """The same model, data and injected infs, trained with the wrapper by hand, as Lightning would drive it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    if wrap.get("layerwise") is True:
        wrap = {**wrap, "layerwise": net}
    opt = lossscale.LossScaleOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
        policy=lossscale.DynamicScale(**TORCH_ARGS),
        schedule=schedule,
        **wrap,
    )
    results, steps = [], 0
    for epoch in range(epochs):
        for i, (x, y) in enumerate(data()):
            if schedule is not None:
                schedule.update(step=steps)
            with schedule.autocast("cpu") if schedule is not None else torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(net(x).float(), y)
                loss = loss * float("inf") if (epoch, i) in INF_AT else loss
            opt.backward(loss / accumulate)
            if i % accumulate == accumulate - 1:
                results.append(opt.step())
                steps += 1
                opt.zero_grad()
    return net, results


class StepHooks(pl.Callback):
    def __init__(self) -> None:
        self.calls = 0

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.calls += 1


def plugin() -> LossScalePrecision:
    return LossScalePrecision(torch.float16, "cpu")


@pytest.mark.parametrize("wrap", [{}, {"flat_grads": True}, {"layerwise": True}])
def test_automatic_optimization_skips_like_torch_and_updates_like_the_plain_loop(wrap: dict) -> None:
    _, ref_rec, _ = fit(torch_plugin())
    hooks = StepHooks()
    ours, rec, trainer = fit(plugin(), Tiny(wrap=wrap), callbacks=[hooks])  # gradient_clip_val=1.0 is mapped
    assert trainer.optimizers[0].clip_grad_norm == 1.0
    assert rec.scales == ref_rec.scales  # the same skips at the same steps give the same scale trajectory
    assert [r.step for r in rec.results if bool(r.found_inf)] == [0, 3, 5]
    assert trainer.global_step == 8 and hooks.calls == 8  # optimizer steps only, skipped ones included
    if "layerwise" in wrap:  # per-layer scales ran through Lightning's closure: one total scale per unit
        assert all(sorted(r.layer_scales) == ["0", "2"] for r in rec.results)
    if "flat_grads" in wrap:  # Lightning zeroes the gradients through the wrapper: they stay in the buffer
        assert trainer.optimizers[0]._flat.attached(list(ours.net.parameters()))
    net, results = plain_loop(clip_grad_norm=1.0, **wrap)
    assert_same_weights(ours.net, net)
    norms, plain_norms = (torch.stack([r.grad_norm for r in rs]) for rs in (rec.results, results))
    torch.testing.assert_close(norms, plain_norms, rtol=0, atol=0, equal_nan=True)


def test_clip_by_value_runs_inside_the_wrapper_when_the_wrapper_has_the_same_value() -> None:
    ours, rec, _ = fit(
        plugin(), Tiny(wrap=dict(clip_grad_value=0.5)), epochs=1, gradient_clip_val=0.5, gradient_clip_algorithm="value"
    )
    net, results = plain_loop(epochs=1, clip_grad_value=0.5)
    skips = [bool(r.found_inf) for r in rec.results]
    assert skips == [bool(r.found_inf) for r in results] == [True, False, False, True]
    assert_same_weights(ours.net, net)


def test_resume_from_a_mid_run_checkpoint_continues_identically(tmp_path: Any) -> None:
    ref, ref_rec, _ = fit(plugin(), Tiny(wrap={}))
    _, rec1, trainer = fit(plugin(), Tiny(wrap={}), epochs=1)
    path = str(tmp_path / "mid.ckpt")
    trainer.save_checkpoint(path)
    resumed, rec2, trainer = fit(plugin(), Tiny(wrap={}), ckpt=path)
    assert rec1.scales + rec2.scales == ref_rec.scales
    assert trainer.global_step == 8
    assert_same_weights(resumed, ref)


def test_manual_optimization_with_a_schedule_switch_matches_the_plain_loop() -> None:
    schedule = lossscale.PrecisionSchedule("fast|step|0.5", total_steps=8)
    module = Tiny(manual=True, wrap=dict(clip_grad_norm=1.0, schedule=schedule))
    ours, rec, _ = fit(plugin(), module, manual=True, epochs=1)
    net, results = plain_loop(
        epochs=1, accumulate=1, schedule=lossscale.PrecisionSchedule("fast|step|0.5", total_steps=8), clip_grad_norm=1.0
    )
    assert [r.precision for r in rec.results] == ["float16"] * 4 + ["float32"] * 4
    assert [bool(r.found_inf) for r in rec.results] == [bool(r.found_inf) for r in results]
    assert ours.step_returns == rec.results  # opt.step() returns the StepResult, as in a plain loop
    assert_same_weights(ours.net, net)


def test_manual_optimization_through_the_proxy_does_not_diverge_after_a_switch() -> None:
    schedule = lossscale.PrecisionSchedule("fast|step|0.5", total_steps=8)
    module = Tiny(manual=True, own_backward=True, wrap=dict(clip_grad_norm=1.0, schedule=schedule))
    ours, _rec, _ = fit(plugin(), module, manual=True, epochs=1)
    net, _ = plain_loop(
        epochs=1, accumulate=1, schedule=lossscale.PrecisionSchedule("fast|step|0.5", total_steps=8), clip_grad_norm=1.0
    )
    assert_same_weights(ours.net, net)


def test_wiring_that_would_scale_clip_or_count_wrongly_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"LossScaleOptimizer\(accumulation_steps=2\) with "
        r"Trainer\(accumulate_grad_batches=2\).*accumulate_grad_batches=n",
    ):
        fit(plugin(), Tiny(wrap=dict(accumulation_steps=2)), epochs=1)
    with pytest.raises(
        ValueError,
        match=r"gradient_clip_val=1.0, gradient_clip_algorithm='norm'.*"
        r"has clip_grad_norm=0.5",
    ):
        fit(plugin(), Tiny(wrap=dict(clip_grad_norm=0.5)), epochs=1)
    with pytest.raises(ValueError, match=r"gradient_clip_algorithm='value'.*no clipping.*clip_grad_value=1.0"):
        fit(plugin(), Tiny(wrap={}), epochs=1, gradient_clip_algorithm="value")
    with pytest.raises(TypeError, match=r"configure_optimizers returned SGD. Wrap it"):
        fit(plugin(), Tiny(), epochs=1)
    with pytest.raises(ValueError, match=r"LossScalePrecision\(dtype=torch.float32\): dtype must be"):
        LossScalePrecision(torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"pass LossScalePrecision\(dtype=torch.bfloat16\)"):
        fit(plugin(), Tiny(wrap=dict(schedule=lossscale.PrecisionSchedule("fast1|step", total_steps=8))), epochs=1)


def test_set_scale_through_lightnings_optimizer_proxy_reaches_the_wrapper() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    wrapper = lossscale.LossScaleOptimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    proxy = LightningOptimizer(wrapper)  # what self.optimizers() returns
    assert isinstance(proxy, lossscale.LossScaleOptimizer)
    proxy.set_scale(8.0)
    assert float(wrapper.scale) == 8.0 == float(proxy.scale)


def test_the_lightning_module_is_found_inside_a_strategy_wrapper() -> None:
    from lossscale.integrations.lightning import _lightning_module

    module = Tiny()
    wrapped = nn.Module()
    wrapped.module = module  # what DistributedDataParallel(module) looks like
    assert _lightning_module(wrapped) is module and _lightning_module(module) is module
    with pytest.raises(TypeError, match=r"found no LightningModule in the strategy's model Linear"):
        _lightning_module(nn.Linear(2, 2))


def test_diagnose_true_names_the_module_whose_forward_overflows() -> None:
    plugin = LossScalePrecision(device="cpu", diagnose=True)
    with pytest.warns(OverflowWarning, match=r"forward overflow: 'net.amplify' \(Amplify\) produced inf") as caught:
        module, _, _ = fit(plugin, Planted(factor=1e6, wrap={}), epochs=3, accumulate_grad_batches=1)
    [warning] = [w.message for w in caught if isinstance(w.message, OverflowWarning)]
    assert (warning.report.kind, warning.report.module) == ("forward", "net.amplify")
    # the loss is non-finite from step 0: the trigger fires at the second (1), is acted on at 2, traces step 3
    assert "the loss was non-finite 2 steps in a row; the traced step 3" in str(warning)
    assert plugin.diagnosis is not None and plugin.diagnosis.model is module


def test_diagnose_never_warns_on_isolated_overflows_and_changes_no_step() -> None:
    _, ref_rec, _ = fit(plugin(), Tiny(wrap={}))
    module = Tiny(wrap={})
    diagnosing = LossScalePrecision(device="cpu", diagnose=OverflowDiagnosis(module, patience=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, rec, _ = fit(diagnosing, module)  # overflows at steps 0, 3 and 5: none two in a row
    assert not [w for w in caught if issubclass(w.category, OverflowWarning)]
    assert diagnosing.diagnosis is not None and diagnosing.diagnosis.last_report is None
    assert rec.scales == ref_rec.scales


def test_diagnose_refuses_what_it_cannot_trace() -> None:
    with pytest.raises(TypeError, match=r"LossScalePrecision\(diagnose=1\): diagnose must be True \(the Lightning"):
        LossScalePrecision(device="cpu", diagnose=1)  # type: ignore[arg-type]
    own = OverflowDiagnosis(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"LossScalePrecision\(diagnose=...\) and a LossScaleOptimizer built with"):
        fit(LossScalePrecision(device="cpu", diagnose=True), Tiny(wrap=dict(add_ons=[own])), epochs=1)
    plugin = LossScalePrecision(device="cpu")  # without diagnose=, the wrapper's own diagnosis, for loggers
    fit(plugin, Tiny(wrap=dict(add_ons=[own])), epochs=1)
    assert plugin.diagnosis is own
