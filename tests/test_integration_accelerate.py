"""lossscale.integrations.accelerate.use_lossscale with a real Accelerator on CPU, side by side with
Accelerate's own path driving torch.amp.GradScaler."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import GradScalerKwargs
from torch import nn

import lossscale
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


def prepared(kind: str) -> tuple[Accelerator, Any, Any, Any]:
    acc = accelerator(mixed_precision="fp16", gradient_accumulation_steps=2)
    if kind == "torch":  # Accelerate's own scaler path, switched on by hand on CPU
        acc.scaler = torch.amp.GradScaler("cpu", **TORCH_ARGS)
        acc.native_amp = True
    else:
        assert isinstance(use_lossscale(acc, fp16_on_cpu=True, **TORCH_ARGS), lossscale.GradScaler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(4 * BATCHES, 4, generator=g),
                                          10 * torch.randn(4 * BATCHES, 1, generator=g))
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4))
    return acc, model, opt, loader


def train(acc: Accelerator, model: Any, opt: Any, loader: Any, start: int = 0,
          stop: int = BATCHES) -> tuple[list[float], list[bool]]:
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
