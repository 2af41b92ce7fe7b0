"""Steps at the edges, through both front ends: sparse gradients holding inf, a step with no gradients, a scale
corrupted in memory behind every checked setter, and an optimizer that writes into the scale it is handed."""

from __future__ import annotations

import math

import pytest
import torch

from lossscale import DynamicScale, GradScaler, LossScaleOptimizer
from lossscale.stages import NoGradientsError


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("coalesce", [True, False], ids=["coalesced", "uncoalesced"])
def test_a_sparse_gradient_holding_inf_is_an_overflow(dtype, coalesce):
    p = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
    grad = torch.sparse_coo_tensor(
        torch.tensor([[0, 1]]), torch.tensor([1.0, math.inf], dtype=dtype), (4,), check_invariants=True
    )
    p.grad = grad.coalesce() if coalesce else grad
    found = GradScaler()._unscale_grads_(torch.optim.SGD([p], lr=1.0), torch.tensor(0.5), torch.zeros(()), True)
    assert float(sum(found.values())) == 1.0


def test_a_scaler_step_with_no_gradients_raises_and_never_counts_as_clean():
    """With growth_interval=1 a clean step would grow the scale: a step that saw no gradient must not.
    (LossScaleOptimizer's is tested with its other steps.)"""
    w = torch.nn.Parameter(torch.ones(2))
    scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    scaler.scale(torch.ones(()))
    with pytest.raises(NoGradientsError, match="No inf checks were recorded for this optimizer"):
        scaler.step(torch.optim.SGD([w], lr=0.1))
    assert scaler.get_scale() == 1024.0


def _step_with_a_scale_corrupted_in_memory(front_end: str, fused: bool, clip: bool, bad: float):
    """One AdamW step after the scale tensor itself was overwritten (no setter saw it); returns (weights before,
    weights after, the optimizer's floating state, the step's found_inf)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.randn(5, 4)).square().sum()
    if front_end == "GradScaler":
        scaler = GradScaler("cpu", init_scale=1024.0)
        scaler.scale(loss).backward()
        scaler.loss_scale.scale.fill_(bad)
        if clip:
            scaler.unscale_(adamw)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        found = scaler.step(adamw).found_inf
        scaler.update()
    else:
        opt = LossScaleOptimizer(adamw, policy=DynamicScale(init_scale=1024.0), clip_grad_norm=1.0 if clip else None)
        opt.backward(loss)
        opt.loss_scale.scale.fill_(bad)
        found = opt.step().found_inf
    state = [t for s in adamw.state.values() for t in s.values() if t.is_floating_point()]
    return before, [p.detach() for p in model.parameters()], state, found


@pytest.mark.parametrize("bad", [math.nan, -1.0], ids=["nan", "negative"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("front_end", ["GradScaler", "LossScaleOptimizer"])
def test_a_scale_corrupted_in_memory_skips_the_step(front_end, fused, clip, bad):
    """Behind the checked setters: whichever stage divides or multiplies by the scale (the fused kernel by the
    scale itself, an unscale pass by its inverse) treats a scale with no finite positive inverse as an overflow,
    so the weights do not move and no optimizer state turns non-finite. (Which values the guard refuses: the
    guard stage's own test, test_stages.py.)"""
    before, after, state, found = _step_with_a_scale_corrupted_in_memory(front_end, fused, clip, bad)
    assert bool(found)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.isfinite(t).all() for t in state)


class _GreedyFused(torch.optim.Optimizer):
    """A third-party SGD that unscales and skips in its step (``_step_supports_amp_scaling``) and then writes
    into the ``grad_scale`` it was handed, as code outside our control may."""

    _step_supports_amp_scaling = True

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        scale, found = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if found is not None and float(found) == 1.0:
            return None
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(p.grad / (1.0 if scale is None else scale), alpha=group["lr"])
        if scale is not None:
            scale.mul_(1024.0)
        return None


@pytest.mark.parametrize("front_end", ["GradScaler", "LossScaleOptimizer"])
def test_an_optimizer_never_holds_the_owners_scale(front_end):
    """The kernel's divisor is a tensor of its own: an optimizer that writes into it cannot move the scale."""
    w = torch.nn.Parameter(torch.ones(3))
    inner = _GreedyFused([w], lr=0.1)
    if front_end == "GradScaler":
        scaler = GradScaler("cpu", init_scale=256.0, growth_interval=1000)
        scaler.scale(w.sum()).backward()
        scaler.step(inner)
        scaler.update()
        assert scaler.get_scale() == 256.0
    else:
        opt = LossScaleOptimizer(inner, policy=DynamicScale(init_scale=256.0, growth_interval=1000))
        opt.backward(w.sum())
        opt.step()
        assert float(opt.scale) == 256.0
    assert torch.allclose(w.detach(), torch.full((3,), 0.9))
