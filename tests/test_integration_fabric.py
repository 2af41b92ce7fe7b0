"""lossscale.integrations.fabric.MixedPrecision in a real Fabric loop on CPU, side by side with Fabric's own
MixedPrecision plugin driving torch.amp.GradScaler."""

from __future__ import annotations

import re
import warnings
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from torch import nn

import lossscale
from lossscale import OverflowDiagnosis, OverflowWarning
from lossscale.integrations.fabric import MixedPrecision

TORCH_ARGS = dict(init_scale=2.0**10, growth_interval=2)
INF_AT = {1, 6, 11}  # micro-batches whose loss is inf: optimizer steps 0, 3 and 5 overflow
BATCHES = 16


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=g), 10 * torch.randn(4, 1, generator=g)) for _ in range(BATCHES)]


def setup(plugin: Any) -> tuple[Fabric, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = fabric.setup(model, opt)
    return fabric, model, opt


def train(fabric: Fabric, model: Any, opt: Any, start: int, stop: int) -> tuple[list[float], list[Any]]:
    """Accumulation 2 with ``no_backward_sync``, clip 1.0; the scale after each micro-batch and step results."""
    plugin, scales, results = fabric.strategy.precision, [], []
    for i, (x, y) in enumerate(batches()[start:stop], start):
        boundary = i % 2 == 1
        with fabric.no_backward_sync(model, enabled=not boundary):
            loss = F.mse_loss(model(x).float(), y)
            fabric.backward((loss * float("inf") if i in INF_AT else loss) / 2)
        if boundary:
            fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
            opt.step()
            opt.zero_grad()
            results.append(getattr(plugin, "last_result", None))
        scales.append(plugin.scaler.get_scale())
    return scales, results


def torch_plugin() -> FabricMixedPrecision:
    return FabricMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **TORCH_ARGS))


def ours() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", **TORCH_ARGS)


def test_fabric_loop_matches_fabric_with_torch_scaler_bit_for_bit() -> None:
    ref_scales, _ = train(*(ref := setup(torch_plugin())), 0, BATCHES)
    scales, results = train(*(run := setup(ours())), 0, BATCHES)
    assert scales == ref_scales and len(set(scales)) > 2
    for p, q in zip(run[1].parameters(), ref[1].parameters()):
        assert torch.equal(p, q)
    assert [r.step for r in results] == list(range(BATCHES // 2))
    assert [r.step for r in results if bool(r.found_inf)] == [0, 3, 5]
    assert all(float(r.next_scale) == float(r.scale) / 2 for r in results if bool(r.found_inf))


@pytest.mark.parametrize("first,second", [(torch_plugin, ours), (ours, torch_plugin)])
def test_save_and_load_with_the_scaler_in_the_state_both_ways(tmp_path: Any, first: Any, second: Any) -> None:
    ref = setup(first())
    ref_scales, _ = train(*ref, 0, BATCHES)
    fabric, model, opt = setup(first())
    head, _ = train(fabric, model, opt, 0, BATCHES // 2)
    path = tmp_path / "state.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "scaler": fabric.strategy.precision.scaler})
    fabric, model, opt = setup(second())
    fabric.load(path, {"model": model, "optimizer": opt, "scaler": fabric.strategy.precision.scaler})
    tail, _ = train(fabric, model, opt, BATCHES // 2, BATCHES)
    assert head + tail == ref_scales
    for p, q in zip(model.parameters(), ref[1].parameters()):
        assert torch.equal(p, q)


def test_the_plugin_itself_is_checkpointable(tmp_path: Any) -> None:
    fabric, model, opt = setup(ours())
    train(fabric, model, opt, 0, 4)
    fabric.save(tmp_path / "p.ckpt", {"precision": fabric.strategy.precision})
    plugin = ours()
    fabric.load(tmp_path / "p.ckpt", {"precision": plugin})
    assert plugin.scaler.get_scale() == fabric.strategy.precision.scaler.get_scale() == 2.0**10 / 2


def test_constructor_refuses_what_it_cannot_honour() -> None:
    with pytest.raises(
        ValueError, match=re.escape("Passed `MixedPrecision(precision='bf16')`. Precision must be '16-mixed' or")
    ):
        MixedPrecision("bf16", "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`precision='bf16-mixed'` does not use a scaler, found <lossscale"):
        MixedPrecision("bf16-mixed", "cpu", scaler=lossscale.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"\(precision='bf16-mixed', diagnose=True\): diagnose must be None or False"):
        MixedPrecision("bf16-mixed", "cpu", diagnose=True)
    with pytest.raises(TypeError, match=r"scaler must be a lossscale.GradScaler"):
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    plugin = MixedPrecision("16-mixed", "cpu", scaler=lossscale.GradScaler("cpu", init_scale=4.0))
    assert isinstance(plugin, FabricMixedPrecision) and plugin.scaler.get_scale() == 4.0


def test_bf16_mixed_trains_as_fabrics_own_plugin_bit_for_bit() -> None:
    dtypes: list[torch.dtype] = []
    runs = []
    for plugin in (FabricMixedPrecision("bf16-mixed", "cpu"), MixedPrecision("bf16-mixed", "cpu")):
        fabric, model, opt = setup(plugin)
        model.module[0].register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
        returns = []
        for x, y in batches():  # no inf injected: with no loss scale, both runs would turn NaN
            fabric.backward(F.mse_loss(model(x).float(), y))
            fabric.clip_gradients(model, opt, max_norm=1.0)
            returns.append(opt.step())
            opt.zero_grad()
        runs.append((model, returns, fabric.strategy.precision))
    (ref, ref_returns, _), (trained, returns, plugin) = runs
    assert set(dtypes) == {torch.bfloat16}  # both forwards ran under bfloat16 autocast
    for p, q in zip(trained.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert any(not torch.equal(p, q) for p, q in zip(trained.parameters(), setup(ours())[1].parameters()))  # it trained
    assert returns == ref_returns
    assert plugin.scaler is None and plugin.last_result is None and plugin.diagnosis is None
    assert plugin.state_dict() == {}


class Amplify(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor  # 1e6: the float16 output of the Tanh before it passes 65504


def planted(factor: float) -> nn.Module:
    torch.manual_seed(0)
    layers = [("inp", nn.Linear(4, 8)), ("act", nn.Tanh()), ("amplify", Amplify(factor)), ("out", nn.Linear(8, 1))]
    return nn.Sequential(OrderedDict(layers))


def test_diagnose_true_names_the_module_whose_forward_overflows() -> None:
    plugin = MixedPrecision("16-mixed", "cpu", diagnose=True, **TORCH_ARGS)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    raw = planted(1e6)
    model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.05))
    with pytest.warns(OverflowWarning, match=r"forward overflow: 'amplify' \(Amplify\) produced inf") as caught:
        for x, y in batches() + batches()[:4]:  # 20 steps
            fabric.backward(F.mse_loss(model(x).float(), y))
            opt.step()
            opt.zero_grad()
    [warning] = [w.message for w in caught if isinstance(w.message, OverflowWarning)]
    assert (warning.report.kind, warning.report.module) == ("forward", "amplify")
    # the loss is non-finite from step 0: the trigger fires at the second (1), is acted on at 2, traces step 3
    assert "the loss was non-finite 2 steps in a row; the traced step 3" in str(warning)
    assert plugin.diagnosis is not None and plugin.diagnosis.model is raw  # True: the module given to setup


def test_diagnose_never_warns_on_isolated_overflows_and_changes_no_step() -> None:
    ref_scales, _ = train(*setup(ours()), 0, BATCHES)
    run = setup(MixedPrecision("16-mixed", "cpu", diagnose=True, **TORCH_ARGS))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scales, _ = train(*run, 0, BATCHES)  # overflows at steps 0, 3 and 5
    assert not [w for w in caught if issubclass(w.category, OverflowWarning)]
    assert scales == ref_scales


def test_diagnose_refuses_what_it_cannot_trace() -> None:
    with pytest.raises(TypeError, match=r"diagnose must be True \(the module given to fabric.setup\), .*; got str"):
        MixedPrecision("16-mixed", "cpu", diagnose="amplify")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"and a GradScaler built with diagnose= of its own"):
        MixedPrecision("16-mixed", "cpu", scaler=lossscale.GradScaler("cpu", diagnose=planted(1.0)), diagnose=True)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", diagnose=True)])
    fabric.setup(planted(1.0))
    with pytest.raises(ValueError, match=r"another one \(Linear\) came after Sequential; pass the module"):
        fabric.setup(nn.Linear(2, 2))
    given = OverflowDiagnosis(planted(1.0))
    assert MixedPrecision("16-mixed", "cpu", diagnose=given).diagnosis is given


def healable() -> nn.Module:
    """``big`` overflows float16 in the forward at every step (weights x3e5), a LayerNorm after it."""
    torch.manual_seed(0)
    layers = [("inp", nn.Linear(4, 8)), ("big", nn.Linear(8, 8)), ("norm", nn.LayerNorm(8)), ("out", nn.Linear(8, 1))]
    model = nn.Sequential(OrderedDict(layers))
    with torch.no_grad():
        model.big.weight.mul_(3e5)
    return model


def test_heal_true_heals_the_module_given_to_setup_and_keeps_the_scale() -> None:
    plugin = MixedPrecision("16-mixed", "cpu", diagnose=True, heal=True, init_scale=2.0**10, growth_interval=1000)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    raw = healable()
    model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.05))
    stepped = []
    with pytest.warns(lossscale.HealWarning, match=r"healed at step 3: 'big' now runs in float32") as caught:
        for x, y in batches():
            fabric.backward(F.mse_loss(model(x).float(), y))
            opt.step()
            opt.zero_grad()
            stepped.append(bool(plugin.last_result.stepped))
    assert len([w for w in caught if isinstance(w.message, lossscale.HealWarning)]) == 1
    assert plugin.diagnosis is not None and plugin.diagnosis.healed == {"big": torch.float32}
    assert stepped == [i > 3 for i in range(len(stepped))] and plugin.scaler.get_scale() == 2.0**10
