"""lossscale.addons.layerwise.LayerScales: per-layer scales, driven by hand around a plain torch optimizer, then
wired into LossScaleOptimizer(layerwise=...).

The deep network: 12 blocks of Linear, LayerNorm, Tanh under float16 autocast on CPU, each block's backward signal
attenuated by 2**-4 (2**-48 from the last block to the first, more than float16's whole range). With one global
scale the first blocks get no gradient at all; per-layer scales keep every module's gradients.
"""

import copy
import math

import pytest
import torch

from lossscale import DynamicScale, HostReadCounter, LossScaleOptimizer
from lossscale.addons.layerwise import LayerScales

BLOCKS, WIDTH = 12, 32


class _Attenuate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class Attenuate(torch.nn.Module):
    """Identity forward; multiplies the backward signal by ``factor`` (a gate with a small gain)."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return _Attenuate.apply(x, self.factor)


def deep_net(factor=2.0**-4, seed=0):
    torch.manual_seed(seed)
    mods = []
    for _ in range(BLOCKS):
        mods += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.Tanh(), Attenuate(factor)]
    return torch.nn.Sequential(*mods)


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(64, WIDTH, generator=g), torch.randn(64, WIDTH, generator=g)


def loss_of(model, step, half):
    x, y = batch(step)
    with torch.autocast("cpu", dtype=torch.float16, enabled=half):
        out = model(x)
    return (out.float() - y).pow(2).mean()


def train(model, steps, *, half=True, layerwise=False, lr=0.05, policy=None, layers=None, compensate=False):
    """The scaler's loop, by hand. Yields (step, grads after unscale, skipped so far, layers, scale)."""
    policy = policy or DynamicScale()
    state = policy.init()
    if layerwise and layers is None:
        layers = LayerScales(model)
    groups = [{"params": list(model[4 * b: 4 * b + 4].parameters()),  # block b's gradients are 2**(4 * (11 - b))
               "lr": lr * 2.0 ** (4 * (BLOCKS - 1 - b))} for b in range(BLOCKS)] if compensate else model.parameters()
    opt = torch.optim.SGD(groups, lr=lr)
    skipped = 0
    for step in range(steps):
        opt.zero_grad()
        scale = state.scale if half else torch.ones(())
        (loss_of(model, step, half) * scale).backward()
        if layers is not None:
            found, amax = layers.unscale_(scale)
            global_found = layers.update(found, amax, scale)
            skip = bool(found.any())
        else:
            grads = [p.grad for p in model.parameters()]
            skip = not all(bool(torch.isfinite(g).all()) for g in grads)
            global_found = torch.tensor(skip)
            torch._foreach_div_(grads, scale)
        grads = [p.grad.clone() for p in model.parameters()]
        skipped += skip
        if not skip:
            opt.step()
        if half:
            state = policy.update(state, global_found)
        yield step, grads, skipped, layers, state.scale


def plain_copy(model):
    """A copy of ``model`` without the LayerScales hooks (a deepcopy would keep them)."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
    return ref


def zero_shares(model, grads, step):
    """Per parameter: share of gradient values that are zero where the float32 backward has them nonzero."""
    ref = plain_copy(model)
    for p in ref.parameters():
        p.grad = None
    loss_of(ref, step, half=False).backward()
    return [float(((g == 0) & (p.grad != 0)).float().sum() / (p.grad != 0).float().sum().clamp_min(1))
            for g, p in zip(grads, ref.parameters())]


def model_before_step(model, grads, step):
    """The parameters the last gradients were taken at (undo the last SGD step: p + lr * g)."""
    before = plain_copy(model)
    with torch.no_grad():
        for p, g in zip(before.parameters(), grads):
            p.add_(g, alpha=0.05)
    return before


def run(layerwise, steps=20):
    """``steps`` steps by hand; returns (model, layers, the last scale, skipped steps, the last step's zero shares)."""
    model = deep_net()
    *_, (step, grads, skipped, layers, scale) = train(model, steps, layerwise=layerwise)
    return model, layers, scale, skipped, zero_shares(model_before_step(model, grads, step), grads, step)


@pytest.fixture(scope="module")
def calibrated():
    """20 steps with per-layer scales by hand (the first ~11 calibrate them): what the run left, and a function
    that rebuilds a live (model, LayerScales) from it, for tests that go on from there."""
    model, layers, scale, skipped, shares = run(layerwise=True)
    model_state, layers_state = copy.deepcopy(model.state_dict()), layers.state_dict()

    def rebuild():
        fresh = deep_net()
        fresh.load_state_dict(model_state)
        fresh_layers = LayerScales(fresh)
        fresh_layers.load_state_dict(layers_state)
        return fresh, fresh_layers

    return {"scale": scale, "skipped": skipped, "shares": shares, "exponent": layers.exponent.clone(),
            "rebuild": rebuild}


def test_one_global_scale_leaves_the_first_blocks_without_gradient():
    *_, skipped, shares = run(layerwise=False)
    weights = shares[0::2]  # Linear weight, Linear bias, LayerNorm weight, LayerNorm bias per block
    assert all(s == 1.0 for s in shares[:8])  # the first two blocks' gradients are entirely zero
    assert skipped == 0 and max(weights[-4:]) < 1e-3


def test_per_layer_scales_keep_every_module_under_a_tenth_of_a_percent(calibrated):
    assert calibrated["skipped"] == 0  # no more skipped steps than the global scale (which skips none here)
    assert max(calibrated["shares"]) < 1e-3, calibrated["shares"]
    exponents = calibrated["exponent"].tolist()  # the first block's units carry the largest factors
    assert exponents[0] >= 32 and exponents[-1] == 0 and exponents[-2] == 0


def test_parameters_track_the_float32_run_more_closely():
    """SGD whose learning rate undoes each block's attenuation, so every block moves: with one global scale
    the first blocks' gradients are zero and they do not move at all; per-layer scales move them as float32 does."""
    steps = 40  # the first ~11 are calibration, in which the first blocks do not move yet
    ref, start = deep_net(), deep_net()
    for _ in train(ref, steps, half=False, compensate=True):
        pass
    distances = {}
    for layerwise in (False, True):
        model = deep_net()
        for _ in train(model, steps, layerwise=layerwise, compensate=True):
            pass
        per_param = [float(((a - b).norm() / (b - s).norm()).detach()) for a, b, s in
                     zip(model.parameters(), ref.parameters(), start.parameters())]
        distances[layerwise] = per_param  # 1.0: did not move at all; 0: on the float32 trajectory
    assert max(distances[False][:8]) == 1.0 and max(distances[True][:8]) < 0.5, distances
    assert sum(distances[True]) < 0.5 * sum(distances[False]), distances


def test_uniform_layers_give_the_global_scale_trajectory_exactly():
    """Without attenuation every unit's gradient sits within the margin of the largest: all factors
    stay 1 and the parameters equal the global-scale run bit for bit."""
    runs = {}
    for layerwise in (False, True):
        model = deep_net(factor=1.0)
        scales = [float(s) for *_, s in train(model, 8, layerwise=layerwise, policy=DynamicScale(growth_interval=3))]
        runs[layerwise] = (scales, [p.detach().clone() for p in model.parameters()])
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))


def test_an_overflow_is_attributed_to_the_unit_nearest_the_loss_and_backs_off_only_it(calibrated):
    _, layers = calibrated["rebuild"]()
    scale = calibrated["scale"]
    before = layers.exponent.clone()
    culprit = 10  # an inf spreads upstream in backward: units 0..10 overflow, 10 is where it began
    found = torch.zeros(len(layers.units), dtype=torch.bool)
    found[:culprit + 1] = True
    amax = torch.full((len(layers.units),), float("inf"))
    global_found = layers.update(found, amax, scale)
    assert not bool(global_found)  # unit 10 carries a factor: the global scale is not to blame
    changed = (layers.exponent != before).nonzero().flatten().tolist()
    assert changed == [culprit] and layers.exponent[culprit] == before[culprit] - 1
    found = torch.ones(len(layers.units), dtype=torch.bool)  # the last unit has no factor: the global scale's
    assert bool(layers.update(found, amax, scale))


def test_state_dict_round_trip_continues_the_same_trajectory(calibrated):
    model, layers = calibrated["rebuild"]()
    for _ in train(model, 2, layers=layers):  # live, not only loaded
        pass
    saved, params = layers.state_dict(), copy.deepcopy(model.state_dict())
    assert saved["units"][:2] == ["0", "1"] and len(saved["exponent"]) == 2 * BLOCKS

    def continue_run(m, ls):
        m.load_state_dict(params)
        return [grads for _, grads, *_ in train(m, 3, layers=ls)]

    a = continue_run(model, layers)
    other = deep_net(seed=1)
    other_layers = LayerScales(other)
    other_layers.load_state_dict(saved)
    b = continue_run(other, other_layers)
    assert all(torch.equal(x, y) for ga, gb in zip(a, b) for x, y in zip(ga, gb))
    assert torch.equal(layers.exponent, other_layers.exponent)
    with pytest.raises(ValueError, match="units"):
        LayerScales(torch.nn.Linear(2, 2)).load_state_dict(saved)


def test_unscale_and_update_read_nothing_on_the_host():
    model = deep_net()
    layers = LayerScales(model)
    (loss_of(model, 0, half=True) * 2.0**16).backward()
    with HostReadCounter() as reads:
        found, amax = layers.unscale_(torch.tensor(2.0**16))
        layers.update(found, amax, torch.tensor(2.0**16))
        layers.layer_scales(torch.tensor(2.0**16))
    assert reads.count == 0


def test_accumulated_micro_batches_carry_one_scale(calibrated):
    """Two backward passes before one unscale: each unit's gradients add at the same factor."""
    model, layers = calibrated["rebuild"]()
    scale = calibrated["scale"]
    parts = []
    for step in (100, 101):
        for p in model.parameters():
            p.grad = None
        (loss_of(model, step, half=True) * scale).backward()
        parts.append([p.grad.clone() for p in model.parameters()])
    for p in model.parameters():
        p.grad = None
    for step in (100, 101):
        (loss_of(model, step, half=True) * scale).backward()
    assert all(torch.equal(p.grad, a + b) for p, a, b in zip(model.parameters(), *parts))
    found, _ = layers.unscale_(scale)
    assert not bool(found.any())


def test_layer_scales_name_every_unit_and_give_total_scales(calibrated):
    _, layers = calibrated["rebuild"]()
    scale = calibrated["scale"]
    totals = layers.layer_scales(scale)
    assert list(totals) == [str(i) for b in range(BLOCKS) for i in (4 * b, 4 * b + 1)]
    assert all(math.log2(float(t)).is_integer() and float(t) >= float(scale) for t in totals.values())


def test_wrong_wiring_is_a_clear_error():
    shared = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="shared by units"):
        LayerScales([shared, torch.nn.Sequential(shared)])

    class OwnsAndContains(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(4))
            self.inner = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="owns parameters directly and also contains"):
        LayerScales(OwnsAndContains())
    with pytest.raises(TypeError, match="non-empty sequence"):
        LayerScales([])
    with pytest.raises(ValueError, match="search_step must be an integer >= 1"):
        LayerScales(torch.nn.Linear(2, 2), search_step=0)

    first, twice = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    LayerScales([first, twice])
    with pytest.raises(RuntimeError, match="ran twice in one forward"):
        twice(twice(first(torch.ones(1, 4))))


def test_remove_restores_plain_backward(calibrated):
    model, layers = calibrated["rebuild"]()
    layers.remove()
    for p in model.parameters():
        p.grad = None
    loss_of(model, 0, half=False).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    ref = plain_copy(model)
    for p in ref.parameters():
        p.grad = None
    loss_of(ref, 0, half=False).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, ref.parameters()))


class Residual(torch.nn.Module):
    """x + tanh(LayerNorm(Linear(x))), with the block's backward signal attenuated by 2**-4."""

    def __init__(self):
        super().__init__()
        self.linear, self.norm, self.gate = torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), Attenuate(2.0**-4)

    def forward(self, x):
        return self.gate(x + torch.tanh(self.norm(self.linear(x))))


def test_residual_blocks_as_units():
    """A skip connection joins two paths: with the blocks themselves as units both carry one factor."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Residual() for _ in range(BLOCKS)])
    layers = LayerScales(list(model))
    assert len(layers.units) == BLOCKS and len(layers.parameters()) == 4 * BLOCKS
    *_, (step, grads, skipped, _, _) = train(model, 20, layers=layers)
    shares = zero_shares(model_before_step(model, grads, step), grads, step)
    assert skipped == 0 and max(shares) < 1e-3, shares
    ref = model_before_step(model, grads, step)
    for p in ref.parameters():
        p.grad = None
    loss_of(ref, step, half=False).backward()
    for g, p in zip(grads, ref.parameters()):  # the unscaled float16 gradients are the float32 ones, roughly
        a, b = g.double().flatten(), p.grad.double().flatten()
        assert float(a @ b / (a.norm() * b.norm())) > 0.99


# --- through LossScaleOptimizer(layerwise=...) ------------------------------------------------------

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


def test_per_layer_scales_reach_the_first_blocks_through_the_optimizer():
    model = deep_net()
    opt, grads, skipped, _, step = _train(model, 20, True)
    shares = zero_shares(model_before_step(model, grads, step), grads, step)
    assert skipped == 0 and max(shares) < 1e-3, shares
    result = opt.last_result
    assert list(result.layer_scales) == [str(i) for b in range(BLOCKS) for i in (4 * b, 4 * b + 1)]
    assert float(max(result.layer_scales.values())) > float(result.scale)
    opt, *_ = _train(deep_net(), 1, False)
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
    assert opt_a.state_dict()["layerwise"] == opt_b.state_dict()["layerwise"]
    assert max(opt_a.state_dict()["layerwise"]["exponent"]) > 0
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
