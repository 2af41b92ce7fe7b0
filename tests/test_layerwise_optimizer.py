"""LossScaleOptimizer(layerwise=...): the per-layer scales wired into the one pipeline.

The deep network of issue 18 (tests/test_layerwise.py): 12 blocks whose backward signal falls by 2**-4
each. Through the optimizer, one global scale leaves the first blocks without gradient; per-layer scales
keep every module under 0.1% with no more skipped steps; uniform layers give the global trajectory bit
for bit; a checkpoint continues the same trajectory.
"""

from __future__ import annotations

import pytest
import torch
from test_layerwise import deep_net, loss_of, model_before_step, zero_shares

from lossscale import DynamicScale, LossScaleOptimizer


def _train(model, steps, layerwise, policy=None):
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), policy=policy or DynamicScale(),
                             layerwise=model if layerwise else None)
    skipped, scales = 0, []
    for step in range(steps):
        opt.zero_grad()
        opt.backward(loss_of(model, step, half=True))
        result = opt.step()
        skipped += int(result.skipped)
        scales.append(float(result.scale))
    grads = [p.grad.clone() for p in model.parameters()]
    return opt, grads, skipped, scales, steps - 1


@pytest.mark.parametrize("layerwise", [False, True])
def test_per_layer_scales_reach_the_first_blocks_through_the_optimizer(layerwise):
    model = deep_net()
    opt, grads, skipped, _, step = _train(model, 20, layerwise)
    shares = zero_shares(model_before_step(model, grads, step), grads, step)
    assert skipped == 0
    if layerwise:
        assert max(shares) < 1e-3, shares
        result = opt.last_result
        assert set(result.layer_scales) == {name for name, _ in opt._run.layers.units}
        assert float(max(result.layer_scales.values())) > float(result.scale)
    else:
        assert all(s == 1.0 for s in shares[:8])  # the first two blocks: no gradient at all
        assert opt.last_result.layer_scales is None


def test_uniform_layers_follow_the_global_trajectory_bit_for_bit():
    runs = {}
    for layerwise in (False, True):
        model = deep_net(factor=1.0)
        _, _, _, scales, _ = _train(model, 8, layerwise, DynamicScale(growth_interval=3))
        runs[layerwise] = (scales, [p.detach().clone() for p in model.parameters()])
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))


def test_checkpoint_mid_run_continues_the_same_trajectory():
    a, b = deep_net(), deep_net()
    opt_a = LossScaleOptimizer(torch.optim.SGD(a.parameters(), lr=0.05), layerwise=a)
    opt_b = LossScaleOptimizer(torch.optim.SGD(b.parameters(), lr=0.05), layerwise=b)
    for step in range(6):
        opt_a.zero_grad()
        opt_a.backward(loss_of(a, step, half=True))
        opt_a.step()
    b.load_state_dict(a.state_dict())
    opt_b.load_state_dict(opt_a.state_dict())
    for step in range(6, 10):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            opt.backward(loss_of(model, step, half=True))
            opt.step()
    assert torch.equal(opt_a._run.layers.exponent, opt_b._run.layers.exponent)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_a_parameter_outside_every_unit_is_refused():
    model = deep_net()
    extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\[48\] of the inner optimizer belongs to no unit"):
        LossScaleOptimizer(torch.optim.SGD([*model.parameters(), extra], lr=0.1), layerwise=model)


@pytest.mark.parametrize("skip_mode", ["host", "masked"])
def test_an_overflow_skips_the_step_exactly_with_clipping_and_each_skip_mode(skip_mode):
    model = deep_net()
    opt = LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), layerwise=model, clip_grad_norm=0.5,
                             skip_mode=skip_mode)
    for step in range(3):
        opt.zero_grad()
        opt.backward(loss_of(model, step, half=True))
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[next(model.parameters())].items() if torch.is_tensor(v)}
    opt.zero_grad()
    opt.backward(loss_of(model, 3, half=True) * torch.tensor(float("inf")))
    result = opt.step()
    assert bool(result.found_inf) and not bool(result.stepped)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    after = opt.state[next(model.parameters())]
    assert all(torch.equal(v, after[k]) for k, v in state.items())
