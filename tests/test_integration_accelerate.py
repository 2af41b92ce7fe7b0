"""lossscale.integrations.accelerate.use_lossscale with a real Accelerator on CPU, side by side with
Accelerate's own path driving torch.amp.GradScaler."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import GradScalerKwargs
from torch import nn

import lossscale
from lossscale import OverflowDiagnosis, OverflowWarning
from lossscale.integrations.accelerate import use_lossscale

TORCH_ARGS = dict(init_scale=2.0**10, growth_interval=2)
INF_AT = {1, 6, 11}  # micro-batches whose loss is inf: optimizer steps 0, 3 and 5 overflow
BATCHES = 16


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide state (a singleton), so that the next Accelerator is built afresh."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_state() -> Iterator[None]:
    """Each test builds its own accelerators."""
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def accelerator(**kwargs: Any) -> Accelerator:
    reset_accelerate_state()
    return Accelerator(cpu=True, **kwargs)


def prepared(kind: str, patience: int | None = None) -> tuple[Accelerator, Any, Any, Any]:
    """``patience``: lossscale's scaler with ``diagnose=OverflowDiagnosis(model, patience=patience)``."""
    acc = accelerator(mixed_precision="fp16", gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "torch":  # Accelerate's own scaler path, switched on by hand on CPU
        acc.scaler = torch.amp.GradScaler("cpu", **TORCH_ARGS)
        acc.native_amp = True
    else:
        diagnose = None if patience is None else OverflowDiagnosis(model, patience=patience)
        assert isinstance(use_lossscale(acc, fp16_on_cpu=True, diagnose=diagnose, **TORCH_ARGS), lossscale.GradScaler)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(4 * BATCHES, 4, generator=g), 10 * torch.randn(4 * BATCHES, 1, generator=g)
    )
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4))
    return acc, model, opt, loader


def train(
    acc: Accelerator, model: Any, opt: Any, loader: Any, start: int = 0, stop: int = BATCHES
) -> tuple[list[float], list[bool]]:
    """accumulate / backward / clip_grad_norm_ / step; the scale after each micro-batch and the skips."""
    scales, skipped = [], []
    for i, (x, y) in enumerate(loader):
        if not start <= i < stop:
            continue
        with acc.accumulate(model):
            loss = F.mse_loss(model(x).float(), y)
            acc.backward(loss * float("inf") if i in INF_AT else loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if acc.sync_gradients:
                skipped.append(acc.optimizer_step_was_skipped)
        scales.append(acc.scaler.get_scale())
    return scales, skipped


def test_training_matches_accelerate_with_torch_scaler_bit_for_bit() -> None:
    ref = prepared("torch")
    ref_scales, ref_skipped = train(*ref)
    run = prepared("ours")
    scales, skipped = train(*run)
    assert scales == ref_scales and len(set(scales)) > 2
    assert skipped == ref_skipped == [s in (0, 3, 5) for s in range(BATCHES // 2)]
    for p, q in zip(run[1].parameters(), ref[1].parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("first,second", [("torch", "ours"), ("ours", "torch")])
def test_save_state_and_load_state_both_ways(tmp_path: Any, first: str, second: str) -> None:
    ref = prepared(first)
    ref_scales, _ = train(*ref)
    acc, model, opt, loader = prepared(first)
    head, _ = train(acc, model, opt, loader, 0, BATCHES // 2)
    acc.save_state(str(tmp_path / "state"))
    acc, model, opt, loader = prepared(second)
    acc.load_state(str(tmp_path / "state"))
    assert acc.scaler.get_scale() == head[-1]
    tail, _ = train(acc, model, opt, loader, BATCHES // 2, BATCHES)
    assert head + tail == ref_scales
    ref_weights = list(ref[1].parameters())
    for p, q in zip(model.parameters(), ref_weights):
        assert torch.equal(p, q)


def test_refusals_name_the_problem_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"mixed_precision='no'; loss scaling needs mixed_precision='fp16'"):
        use_lossscale(accelerator(mixed_precision="no"))
    with pytest.raises(ValueError, match=r"mixed_precision='bf16'"):
        use_lossscale(accelerator(mixed_precision="bf16"))
    with pytest.raises(ValueError, match=r"Accelerate drops fp16 on CPU .* fp16_on_cpu=True"):
        use_lossscale(accelerator(mixed_precision="fp16"))
    with pytest.raises(TypeError, match=r"accelerator must be an accelerate.Accelerator; got dict"):
        use_lossscale({})  # type: ignore[arg-type]
    acc = accelerator(mixed_precision="fp16")
    acc.prepare(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"called after accelerator.prepare\(\).* before prepare\(\)"):
        use_lossscale(acc, fp16_on_cpu=True)
    acc = accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=8.0)])
    with pytest.raises(ValueError, match=r"use_lossscale\(accelerator, growth_interval=...\): the accelerator already"):
        use_lossscale(acc, fp16_on_cpu=True, growth_interval=3)
    assert use_lossscale(acc, fp16_on_cpu=True).get_scale() == 8.0  # the handler's arguments are used
    assert acc.native_amp and isinstance(acc.scaler, lossscale.GradScaler)


class Amplify(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor  # 1e6: the float16 output of the Tanh before it passes 65504


def test_diagnose_names_the_module_whose_forward_overflows() -> None:
    torch.manual_seed(0)
    layers = [("inp", nn.Linear(4, 8)), ("act", nn.Tanh()), ("amplify", Amplify(1e6)), ("out", nn.Linear(8, 1))]
    model = nn.Sequential(OrderedDict(layers))
    acc = accelerator(mixed_precision="fp16")
    scaler = use_lossscale(acc, fp16_on_cpu=True, diagnose=model, **TORCH_ARGS)
    prepared_model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    g = torch.Generator().manual_seed(1)
    with pytest.warns(OverflowWarning, match=r"forward overflow: 'amplify' \(Amplify\) produced inf") as caught:
        for _ in range(20):
            x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
            acc.backward(F.mse_loss(prepared_model(x).float(), y))
            opt.step()
            opt.zero_grad()
    [warning] = [w.message for w in caught if isinstance(w.message, OverflowWarning)]
    assert (warning.report.kind, warning.report.module) == ("forward", "amplify")
    # the loss is non-finite from step 0: the trigger fires at the second (1), is acted on at 2, traces step 3
    assert "the loss was non-finite 2 steps in a row; the traced step 3" in str(warning)
    [diagnosis] = scaler.add_ons
    assert isinstance(diagnosis, OverflowDiagnosis) and diagnosis.model is model


def test_diagnose_never_warns_on_isolated_overflows_and_changes_no_step() -> None:
    ref_scales, _ = train(*prepared("ours"))
    run = prepared("ours", patience=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scales, _ = train(*run)  # overflows at steps 0, 3 and 5: none two in a row
    assert not [w for w in caught if issubclass(w.category, OverflowWarning)]
    [diagnosis] = run[0].scaler.add_ons
    assert isinstance(diagnosis, OverflowDiagnosis) and diagnosis.last_report is None
    assert scales == ref_scales


def test_diagnose_refuses_what_it_cannot_trace() -> None:
    acc = accelerator(mixed_precision="fp16")
    with pytest.raises(
        TypeError,
        match=r"use_lossscale\(diagnose=True\): diagnose must be a torch.nn.Module \(the model to trace when the "
        r"loss scale collapses\), a lossscale.OverflowDiagnosis, or None/False \(no diagnosis\); got bool. Pass the "
        r"model itself: diagnose=model.",
    ):
        use_lossscale(acc, fp16_on_cpu=True, diagnose=True)  # type: ignore[arg-type]
    assert use_lossscale(acc, fp16_on_cpu=True, diagnose=False).add_ons == ()


def test_heal_names_and_heals_the_planted_module_and_keeps_the_scale() -> None:
    torch.manual_seed(0)
    layers = [("inp", nn.Linear(4, 8)), ("big", nn.Linear(8, 8)), ("norm", nn.LayerNorm(8)), ("out", nn.Linear(8, 1))]
    model = nn.Sequential(OrderedDict(layers))
    with torch.no_grad():
        model.big.weight.mul_(3e5)  # its float16 output passes 65504 at every step
    acc = accelerator(mixed_precision="fp16")
    scaler = use_lossscale(acc, fp16_on_cpu=True, diagnose=model, heal=True, init_scale=2.0**10, growth_interval=1000)
    prepared_model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    g = torch.Generator().manual_seed(1)
    with pytest.warns(lossscale.HealWarning, match=r"healed at step 3: 'big' now runs in float32") as caught:
        for _ in range(12):
            x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
            acc.backward(F.mse_loss(prepared_model(x).float(), y))
            opt.step()
            opt.zero_grad()
    assert len([w for w in caught if isinstance(w.message, lossscale.HealWarning)]) == 1
    [diagnosis] = scaler.add_ons
    assert isinstance(diagnosis, OverflowDiagnosis) and diagnosis.healed == {"big": torch.float32}
    assert scaler.get_scale() == 2.0**10 and not opt.step_was_skipped  # the last step applied
