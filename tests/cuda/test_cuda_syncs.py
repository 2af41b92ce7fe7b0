"""Host synchronisations per steady training step on a GPU, counted with torch.cuda.set_sync_debug_mode("warn"): for
each front end x skip mode x clip, 0 where the README says none (lossscale.GradScaler with a fused optimizer,
LossScaleOptimizer in fused and masked modes) and torch's own count where a step is skipped on the host. Counted over
steady steps (after warm-up), one of them overflowing. And masked mode's refusal of a step counter in host memory."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch

from lossscale import DynamicScale, GradScaler, LossScaleOptimizer

WARM, COUNTED, OVERFLOW_AT = 3, 6, 2
SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's warning per sync (not its "prototype" notice)
OPTIMIZERS = {
    "fused AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "foreach AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "capturable foreach AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True, capturable=True),
    "foreach SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(x)
    return torch.nn.functional.mse_loss(out.float(), y)


def _scaler_step(scaler_type: type, opt_name: str, clip: bool) -> Callable[[bool], None]:
    model = _model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    scaler = scaler_type("cuda", growth_interval=10**6)
    x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")

    def step(overflow: bool) -> None:
        scaler.scale(_loss(model, x, y)).backward()
        if overflow:
            model[2].weight.grad[0, 0].fill_(math.inf)  # a kernel: no host copy, no sync
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)

    return step


def _optimizer_step(opt_name: str, skip_mode: str, clip: bool, flat: bool = False) -> Callable[[bool], None]:
    model = _model()
    opt = LossScaleOptimizer(
        OPTIMIZERS[opt_name](model.parameters()),
        policy=DynamicScale(growth_interval=10**6),
        clip_grad_norm=1.0 if clip else None,
        skip_mode=skip_mode,
        flat_grads=flat,
    )
    x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")

    def step(overflow: bool) -> None:
        opt.backward(_loss(model, x, y))
        if overflow:
            model[2].weight.grad[0, 0].fill_(math.inf)  # a kernel: no host copy, no sync
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step


def syncs_per_step(step: Callable[[bool], None], warm: int = WARM) -> float:
    """Synchronising CUDA calls per step over COUNTED steps (one overflowing), after ``warm`` steps."""
    for _ in range(warm):
        step(False)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for i in range(COUNTED):
                step(i == OVERFLOW_AT)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(SYNC_WARNING in str(w.message) for w in caught) / COUNTED


@pytest.mark.parametrize("clip", [False, True])
def test_grad_scaler_with_a_fused_optimizer_makes_no_host_sync(clip):
    assert syncs_per_step(_scaler_step(GradScaler, "fused AdamW", clip)) == 0


@pytest.mark.parametrize("clip", [False, True])
def test_grad_scaler_syncs_no_more_than_torch_from_the_first_step(clip):
    """The first scale() moves the policy's state to the GPU without waiting for it (torch creates its own there)."""
    ours = syncs_per_step(_scaler_step(GradScaler, "fused AdamW", clip), warm=0)
    assert ours == syncs_per_step(_scaler_step(torch.amp.GradScaler, "fused AdamW", clip), warm=0) == 0


@pytest.mark.parametrize("clip", [False, True])
def test_grad_scaler_with_a_non_fused_optimizer_syncs_as_torch_does(clip):
    ours = syncs_per_step(_scaler_step(GradScaler, "foreach AdamW", clip))
    assert ours == syncs_per_step(_scaler_step(torch.amp.GradScaler, "foreach AdamW", clip)) == 1


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize(
    "opt_name,skip_mode",
    [
        ("fused AdamW", "fused"),
        ("fused AdamW", "masked"),
        ("capturable foreach AdamW", "masked"),
        ("foreach SGD momentum", "masked"),
    ],
)
@pytest.mark.parametrize("flat", [False, True])
def test_loss_scale_optimizer_in_fused_and_masked_modes_makes_no_host_sync(opt_name, skip_mode, clip, flat):
    assert syncs_per_step(_optimizer_step(opt_name, skip_mode, clip, flat)) == 0


@pytest.mark.parametrize("clip", [False, True])
def test_loss_scale_optimizer_in_host_mode_syncs_as_torch_does(clip):
    ours = syncs_per_step(_optimizer_step("foreach AdamW", "host", clip))
    assert ours == syncs_per_step(_scaler_step(torch.amp.GradScaler, "foreach AdamW", clip)) == 1


def test_masked_mode_refuses_step_counters_in_host_memory_at_its_first_masked_step():
    step = _optimizer_step("foreach AdamW", "masked", False)  # capturable=False: state["step"] on the CPU
    step(False)  # the first step creates the state and is decided on the host
    with pytest.raises(ValueError) as err:
        step(False)
    message = str(err.value)
    for needle in (
        "LossScaleOptimizer(skip_mode='masked'): AdamW keeps state 'step' of param_groups[0][0] in host "
        "memory (cpu) while found_inf is on cuda",
        "capturable=True",
        "skip_mode='host'",
    ):
        assert needle in message, needle
