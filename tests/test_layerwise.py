"""lossscale.layerwise.LayerScales: per-layer scales, driven by hand around a plain torch optimizer, then
wired into LossScaleOptimizer(layerwise=...).

The deep network: 12 blocks of Linear, LayerNorm, Tanh under float16 autocast on CPU, each block's backward signal
attenuated by 2**-4 (2**-48 from the last block to the first, more than float16's whole range). With one global
scale the first blocks get no gradient at all; per-layer scales keep every module's gradients, from the first step.

The language models: a tiny GPT-2 (transformers, built from a config) and a Llama-style model written here, both with
tied input and output embeddings and residual streams, with per-layer scales on the whole model or on the blocks
only; checked against a float32 backward pass.
"""

import copy
import math
import warnings

import pytest
import torch

from _torch_versions import TORCH_VERSION
from lossscale import DynamicScale, LossScaleOptimizer, PrecisionSchedule, keep_float32
from lossscale.layerwise import LayerScales
from lossscale.testing import HostReadCounter

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
    groups = (
        [
            {
                "params": list(model[4 * b : 4 * b + 4].parameters()),  # block b's gradients are 2**(4 * (11 - b))
                "lr": lr * 2.0 ** (4 * (BLOCKS - 1 - b)),
            }
            for b in range(BLOCKS)
        ]
        if compensate
        else model.parameters()
    )
    opt = torch.optim.SGD(groups, lr=lr)
    skipped = 0
    for step in range(steps):
        opt.zero_grad()
        scale = state.scale if half else torch.ones(())
        loss = loss_of(model, step, half) * scale
        (loss if layers is None else layers.backward_from(loss)).backward()
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
    return [
        float(((g == 0) & (p.grad != 0)).float().sum() / (p.grad != 0).float().sum().clamp_min(1))
        for g, p in zip(grads, ref.parameters())
    ]


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

    return {
        "scale": scale,
        "skipped": skipped,
        "shares": shares,
        "exponent": layers.exponent.clone(),
        "rebuild": rebuild,
    }


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
        per_param = [
            float(((a - b).norm() / (b - s).norm()).detach())
            for a, b, s in zip(model.parameters(), ref.parameters(), start.parameters())
        ]
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
    found[: culprit + 1] = True
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
    inner = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"unit '1:Sequential' contains unit '0:Linear'.*pass either the outer"):
        LayerScales([inner, torch.nn.Sequential(inner)])
    with pytest.raises(ValueError, match="are the same module; list each unit once"):
        LayerScales([inner, inner])

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
    with pytest.raises(
        TypeError,
        match=r"LayerScales\(process_group='world'\): process_group must be None \(the "
        r"world\) or a torch.distributed.ProcessGroup.*got str",
    ):
        LayerScales(torch.nn.Linear(2, 2), process_group="world")

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
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        policy=policy or DynamicScale(),
        layerwise=model if layerwise else None,
    )
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
    assert "layer_scales" not in opt.last_result.fields


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


def test_an_optimizer_with_no_parameter_in_any_unit_is_refused():
    model, other = deep_net(), deep_net(seed=1)
    with pytest.raises(
        ValueError,
        match=r"layerwise=Sequential\): none of the inner optimizer's 48 parameters "
        r"belongs to a unit.*pass the model whose parameters the optimizer updates",
    ):
        LossScaleOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), layerwise=model)


@pytest.mark.parametrize("skip_mode", ["host", "masked"])
def test_an_overflow_skips_the_step_exactly_with_clipping_and_each_skip_mode(skip_mode):
    model = deep_net()
    opt = LossScaleOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-3), layerwise=model, clip_grad_norm=0.5, skip_mode=skip_mode
    )
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


# --- the first backward pass sets the factors --------------------------------------------------------


def test_every_unit_has_its_gradient_from_the_first_step():
    """The first backward sets each factor as the gradient reaches its unit, so no step is spent calibrating: from
    step 0 every parameter's unscaled gradient is nonzero and close to float32's (once each unit's factor rose
    from the global scale step by step, and the first three blocks had all-zero gradients for four steps)."""
    model = deep_net()
    for step, grads, skipped, layers, _ in train(model, 5, layerwise=True):  # noqa: B007  # the last step's count is read after the loop
        ref = model_before_step(model, grads, step)
        for p in ref.parameters():
            p.grad = None
        loss_of(ref, step, half=False).backward()
        for i, (g, p) in enumerate(zip(grads, ref.parameters())):
            assert bool((g != 0).any()), f"step {step}: parameter {i} has an all-zero gradient"
            error = float((g - p.grad).norm() / p.grad.norm())
            assert error < 0.02, f"step {step}: parameter {i} is {error:.3%} from float32's"
        if step == 0:
            assert float(layers.exponent[0]) >= 32  # the first block's factor, set in the first backward pass
        else:
            assert max(zero_shares(model_before_step(model, grads, step), grads, step)) < 1e-3
    assert skipped == 0


def test_factors_set_by_the_first_backward_stay_for_the_rest_of_the_window():
    """Micro-batches accumulate at one factor per unit: only the very first backward pass sets factors."""
    model = deep_net()
    layers = LayerScales(model)
    (loss_of(model, 0, half=True) * 2.0**16).backward()
    first = layers.exponent.clone()
    (loss_of(model, 1, half=True) * 2.0**16).backward()
    assert float(first.max()) >= 32 and torch.equal(layers.exponent, first)


def test_forward_backward_and_step_read_nothing_on_the_host_from_the_first_step():
    model = deep_net()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), layerwise=model, skip_mode="masked")
    for step in range(3):  # the first backward (sets the factors, reads the wiring), then steady steps
        with HostReadCounter() as reads:
            opt.zero_grad()
            opt.backward(loss_of(model, step, half=True))
            opt.step()
        assert reads.count == 0, f"step {step}"


def test_a_checkpoint_before_the_first_backward_still_sets_the_factors_there():
    model = deep_net()
    saved = LayerScales(deep_net()).state_dict()
    assert saved["calibrated"] is False
    layers = LayerScales(model)
    layers.load_state_dict(saved)
    (loss_of(model, 0, half=True) * 2.0**16).backward()
    assert float(layers.exponent.max()) >= 32
    older = {k: v for k, v in saved.items() if k != "calibrated"}  # a checkpoint from before the flag
    layers.load_state_dict({**older, "observed": [True] * len(older["observed"])})
    assert layers.state_dict()["calibrated"] is True
    with pytest.raises(ValueError, match="calibrated must be a bool"):
        layers.load_state_dict({**saved, "calibrated": 1})


def test_a_backward_whose_loss_is_not_scaled_passes_through_and_leaves_the_factors_for_the_first_scaled_one():
    model = deep_net()
    layers = LayerScales(model)
    layers.is_scaled = lambda: False
    loss_of(model, 0, half=True).backward()
    ref = plain_copy(model)
    for p in ref.parameters():
        p.grad = None
    loss_of(ref, 0, half=True).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    assert not bool(layers.exponent.any())
    model.zero_grad()
    layers.is_scaled = lambda: True
    (loss_of(model, 1, half=True) * 2.0**16).backward()
    assert float(layers.exponent.max()) >= 32


@pytest.mark.parametrize("mode", ["fast|step|0.5", "fast1|step|0.5"])
def test_steps_a_precision_schedule_does_not_scale_get_the_plain_backwards_gradients(mode):
    """In a schedule's bfloat16 phase and after its switch to float32, losses are not scaled: the per-layer hooks
    must not multiply the gradients either (they did, by up to 2**23 here, with nothing to divide it out)."""
    model = deep_net()
    schedule = PrecisionSchedule(mode, total_steps=8)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), schedule=schedule, layerwise=model)
    precisions = []
    for step in range(8):
        schedule.update(step)
        x, y = batch(step)

        def loss(m, x=x, y=y):
            with schedule.autocast("cpu"):
                out = m(x)
            return (out.float() - y).pow(2).mean()

        ref = plain_copy(model)
        opt.zero_grad()
        opt.backward(loss(model))
        result = opt.step()
        precisions.append(result.precision)
        if result.precision == "float16":
            continue
        loss(ref).backward()
        # the step ran with lr 0.05 on these gradients: compare them as they were
        for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
            assert torch.equal(p.grad, q.grad), f"step {step} ({result.precision}): parameter {i}"
    exponents = opt.state_dict()["layerwise"]["exponent"]
    if mode.startswith("fast|"):
        assert precisions == ["float16"] * 4 + ["float32"] * 4
        assert max(exponents) > 0  # the float16 steps set per-layer factors: the float32 ones had some to apply
    else:
        assert precisions == ["bfloat16"] * 4 + ["float32"] * 4
        assert max(exponents) == 0  # no scaled backward pass: nothing set a factor


class Checkpointed(torch.nn.Module):
    """deep_net() run through torch.utils.checkpoint in four segments (``reentrant`` None: not checkpointed)."""

    def __init__(self, reentrant):
        super().__init__()
        self.net, self.reentrant = deep_net(), reentrant

    def forward(self, x):
        if self.reentrant is None:
            return self.net(x)
        return torch.utils.checkpoint.checkpoint_sequential(self.net, 4, x, use_reentrant=self.reentrant)


def test_activation_checkpointing_without_reentrance_gives_the_same_gradients():
    """The recomputation in the backward pass runs the units' forwards again: their hooks leave it alone, and every
    step's unscaled gradients are those of the same run without checkpointing, bit for bit (before, the recomputed
    forward was recorded as a new one and the backward failed with a KeyError)."""
    runs = {}
    for reentrant in (None, False):
        model = Checkpointed(reentrant)
        opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), layerwise=model)
        runs[reentrant] = []
        for step in range(4):
            opt.zero_grad()
            opt.backward(loss_of(model, step, half=True))
            assert not bool(opt.step().skipped)
            runs[reentrant].append([p.grad.clone() for p in model.parameters()])
        assert float(opt.state_dict()["layerwise"]["exponent"][0]) >= 32
    for step, (plain, checkpointed) in enumerate(zip(runs[None], runs[False])):
        assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed)), f"step {step}"


def test_activation_checkpointing_with_reentrance_is_a_clear_error():
    model = Checkpointed(reentrant=True)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), layerwise=model)
    x, y = batch(0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (model(x.requires_grad_()).float() - y).pow(2).mean()
    with pytest.raises(
        RuntimeError,
        match=r"unit 'net.\d+' ran inside a backward pass without having run with "
        r"gradients enabled in the forward.*use_reentrant=True.*"
        r"Checkpoint with use_reentrant=False",
    ):
        opt.backward(loss)


def test_a_compiled_model_gets_the_eager_gradients_and_its_hooks_are_not_traced():
    """torch.compile (backend aot_eager: no C++ compiler needed) breaks the graph at the units' hooks and runs them
    eagerly: the same gradients bit for bit, and no recompilation storm (before, dynamo traced the hooks'
    bookkeeping, guarded on it, and hit its recompile limit within the first forward)."""
    import logging
    import warnings

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    records = Records()
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(records)
    torch._dynamo.reset()
    runs = {}
    with warnings.catch_warnings():
        # dynamo reads .grad of the module outputs it hands to a function it does not trace: torch's own warning,
        # which dynamo turns into an internal error where warnings are errors (as in this suite)
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        # and it instantiates the network's own autograd Function (Attenuate) while tracing it: torch's warning too
        warnings.filterwarnings("ignore", message=".*Function'> should not be instantiated")
        try:
            for compiled in (False, True):
                model = deep_net()
                opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), layerwise=model)
                forward = torch.compile(model, backend="aot_eager") if compiled else model
                runs[compiled] = []
                for step in range(3):
                    x, y = batch(step)
                    opt.zero_grad()
                    with torch.autocast("cpu", dtype=torch.float16):
                        out = forward(x)
                    opt.backward((out.float() - y).pow(2).mean())
                    opt.step()
                    runs[compiled].append([p.grad.clone() for p in model.parameters()])
        finally:
            dynamo_log.removeHandler(records)
            torch._dynamo.reset()
    for step, (eager, compiled) in enumerate(zip(runs[False], runs[True])):
        assert all(torch.equal(a, b) for a, b in zip(eager, compiled)), f"step {step}"
    if TORCH_VERSION >= (2, 9):  # on 2.6 to 2.8 dynamo guards on each unit's own ``disabled`` in the hooks' wrapper
        # and recompiles it per unit up to its limit, then runs it eagerly: the same gradients, more compile time
        assert not [m for m in records.messages if "recompile" in m], records.messages


# --- language models: tied embeddings, residual streams, parameters outside the units ------------------

VOCAB, CONTEXT, DIM = 64, 16, 32


def gpt2(n_layer=2):
    """A tiny GPT-2 (transformers, random init): the input and output embeddings are one parameter."""
    import transformers  # a dev dependency: a missing package fails here, loudly

    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=CONTEXT,
        n_embd=DIM,
        n_layer=n_layer,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def hf_llama(n_layer=2):
    """A tiny Llama (transformers, random init) with tied input and output embeddings."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=2 * DIM,
        num_hidden_layers=n_layer,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


class RMSNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaBlock(torch.nn.Module):
    """Pre-norm attention (rotary positions, causal) and a SwiGLU MLP, each on a residual stream."""

    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = torch.nn.Linear(dim, 2 * dim, bias=False), torch.nn.Linear(dim, 2 * dim, bias=False)
        self.down = torch.nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        q, k = (rotate(z, cos, sin) for z in (q, k))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores = scores.float().masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
        attn = (scores.softmax(-1).to(v.dtype) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(attn)
        h = self.mlp_norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + turned * sin).to(x.dtype)


class TinyLlama(torch.nn.Module):
    """A Llama-style language model whose output projection is the input embedding: an ``nn.Linear`` sharing its
    weight (``tie="module"``), or ``F.linear`` on the embedding's weight in this forward (``tie="functional"``)."""

    def __init__(self, tie="module", blocks=2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(LlamaBlock(DIM) for _ in range(blocks))
        self.norm = RMSNorm(DIM)
        self.tie = tie
        if tie == "module":
            self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)
            self.lm_head.weight = self.embed.weight
        half = DIM // 4  # half of a head's width (2 heads)
        angles = torch.outer(torch.arange(CONTEXT).float(), 10000.0 ** (-torch.arange(half).float() / half))
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, -1), persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, -1), persistent=False)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, self.cos[: ids.shape[1]], self.sin[: ids.shape[1]])
        h = self.norm(x)
        logits = self.lm_head(h) if self.tie == "module" else torch.nn.functional.linear(h, self.embed.weight)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1))


def gpt2_checkpointed():
    """gpt2() with transformers' activation checkpointing (the blocks recomputed in the backward pass)."""
    model = gpt2()
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.24 renamed gradient_checkpointing_enable
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    renamed = hasattr(type(model), "is_activation_checkpointing")
    assert getattr(model, "is_activation_checkpointing" if renamed else "is_gradient_checkpointing") and model.training
    return model


LANGUAGE_MODELS = {
    "gpt2": (gpt2, lambda m: m),
    "gpt2, checkpointed": (gpt2_checkpointed, lambda m: m),
    "gpt2, blocks only": (gpt2, lambda m: list(m.transformer.h)),
    "gpt2, embeddings and blocks": (gpt2, lambda m: [m.transformer.wte, *m.transformer.h, m.lm_head]),
    # docs/layerwise.md's lists for a GPU (the tied head outside the units)
    "gpt2, per block": (gpt2, lambda m: [m.transformer.wte, m.transformer.wpe, *m.transformer.h, m.transformer.ln_f]),
    "hf llama, per block": (hf_llama, lambda m: [m.model.embed_tokens, *m.model.layers, m.model.norm]),
    "llama": (TinyLlama, lambda m: m),
    "llama, blocks only": (TinyLlama, lambda m: list(m.blocks)),
    "llama, functional tie": (lambda: TinyLlama(tie="functional"), lambda m: m),
}


def lm_batch(step):
    return torch.randint(0, VOCAB, (4, CONTEXT), generator=torch.Generator().manual_seed(step))


def lm_loss(model, ids, half=False):
    with torch.autocast("cpu", dtype=torch.float16, enabled=half):
        out = model(ids, labels=ids)
    return out if isinstance(out, torch.Tensor) else out.loss


def lm_grads(model, ids):
    for p in model.parameters():
        p.grad = None
    lm_loss(model, ids).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", list(LANGUAGE_MODELS))
def test_language_models_unscale_exactly_whatever_the_factors(case):
    unscales_exactly(case)


def unscales_exactly(case):
    """Float32, factors far apart (2**1 .. 2**23 per unit) against factors 1, on the same wiring: the unscaled
    gradients are equal bit for bit, since every contribution to a gradient carries its unit's factor, a power of two,
    whatever the wiring: residual streams, tied embeddings (one factor for the units that share the parameter),
    parameters outside the units. Both are within float32's rounding of the plain backward (whose sums of three or
    more contributions may run in another order)."""
    build, units_of = LANGUAGE_MODELS[case]
    runs = {}
    for name, exponent in (("apart", lambda i: float(1 + (7 * i) % 23)), ("ones", lambda i: 0.0)):
        model = build()
        layers = LayerScales(units_of(model))
        layers.load_state_dict(
            {**layers.state_dict(), "calibrated": True, "exponent": [exponent(i) for i in range(len(layers.units))]}
        )
        grads = []
        for step in range(2):  # the first backward reads the wiring; the second runs on it
            for p in model.parameters():
                p.grad = None
            layers.backward_from(lm_loss(model, lm_batch(step)) * 8.0).backward()
            found, _ = layers.unscale_(torch.tensor(8.0), params=list(model.parameters()))
            assert not bool(found.any())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        runs[name] = layers, grads
    ref = build()
    for step in range(2):
        expected = lm_grads(ref, lm_batch(step))
        for name, want in expected.items():
            got = runs["apart"][1][step][name]
            assert torch.equal(got, runs["ones"][1][step][name]), f"step {step}: {name}"
            assert float((got - want).norm() / want.norm()) < 1e-5, f"step {step}: {name}"
    layers = runs["apart"][0]
    assert float(layers.exponent.max()) >= 8
    return layers


def test_units_that_share_a_parameter_carry_one_factor():
    model = gpt2()
    layers = LayerScales(model)
    names = [name for name, _ in layers.units]
    wte, head = names.index("transformer.wte"), names.index("lm_head")
    assert len(layers.parameters()) == len(list(model.parameters()))  # the shared weight once
    state = {**layers.state_dict(), "exponent": [float(i % 5 + 3) for i in range(len(names))], "calibrated": True}
    layers.load_state_dict(state)  # a group takes its smallest exponent
    assert float(layers.exponent[wte]) == float(layers.exponent[head]) == 3.0
    assert "1 shared" in repr(layers)
    ids = lm_batch(0)
    for step in range(3):
        (lm_loss(model, ids, half=True) * 2.0**12).backward()
        found, amax = layers.unscale_(torch.tensor(2.0**12))
        layers.update(found, amax, torch.tensor(2.0**12))
        assert float(layers.exponent[wte]) == float(layers.exponent[head]), f"step {step}"


def test_a_parameter_used_outside_its_unit_pins_the_unit_at_the_global_scale():
    """``F.linear(h, embed.weight)`` in the model's own forward: that use carries the global scale, so the embedding
    unit does too (its factor stays 1), and the weight's gradient is exact."""
    layers = unscales_exactly("llama, functional tie")
    names = [name for name, _ in layers.units]
    embed = names.index("embed")
    assert float(layers.exponent[embed]) == 0.0
    assert all(e >= 1 for i, e in enumerate(layers.exponent.tolist()) if i != embed)


def test_a_tied_head_left_out_of_the_units_pins_the_embedding_through_the_optimizer():
    """Units [wte, wpe, *h, ln_f]: the head, outside them, reads wte's weight after every unit. The optimizer gives
    its loss to the wiring walk, which finds that read and keeps wte at factor 1, so the weight's gradient (the
    embedding's share and the head's) is exact. Before, the walk started from the units' inputs only, missed the
    read, and divided the head's share by wte's factor too (2**5 here)."""
    model, ref = gpt2(), gpt2()
    body = model.transformer
    layers = LayerScales([body.wte, body.wpe, *body.h, body.ln_f])
    layers.load_state_dict({**layers.state_dict(), "calibrated": True, "exponent": [5.0] * len(layers.units)})
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), layerwise=layers)
    ids = lm_batch(0)
    opt.backward(lm_loss(model, ids))
    names = [name for name, _ in layers.units]
    assert float(layers.exponent[names.index("0:Embedding")]) == 0.0  # as the backward pass ran
    assert float(layers.exponent[names.index("2:GPT2Block")]) == 5.0
    assert bool(opt.step().stepped)
    expected = lm_grads(ref, ids)
    for name, p in model.named_parameters():
        error = float((p.grad - expected[name]).norm() / expected[name].norm())
        assert error < 1e-5, f"{name} is {error:.2%} from float32's"


def test_a_loss_term_on_a_units_weight_pins_that_unit_with_the_model_given_whole():
    """A penalty on one unit's weight, added to the loss after the model ran: the walk from the model's outputs does
    not meet it, the walk from the loss does. Before, that share of the weight's gradient was divided by the unit's
    factor too."""
    model, ref = gpt2(), gpt2()
    layers = LayerScales(model)
    layers.load_state_dict({**layers.state_dict(), "calibrated": True, "exponent": [5.0] * len(layers.units)})
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), layerwise=layers)

    def loss_of(m, ids):
        return lm_loss(m, ids) + 0.1 * m.transformer.h[0].mlp.c_fc.weight.square().sum()

    ids = lm_batch(0)
    opt.backward(loss_of(model, ids))
    names = [name for name, _ in layers.units]
    assert float(layers.exponent[names.index("transformer.h.0.mlp.c_fc")]) == 0.0
    assert float(layers.exponent[names.index("transformer.h.1.mlp.c_fc")]) == 5.0
    assert bool(opt.step().stepped)
    for p in ref.parameters():
        p.grad = None
    loss_of(ref, ids).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        error = float((p.grad - q.grad).norm() / q.grad.norm())
        assert error < 1e-5, f"{name} is {error:.2%} from float32's"


def test_a_list_of_units_warns_once_where_the_backward_pass_starts_from_a_loss_it_was_not_given():
    """Without the loss, a read of a unit's weight after the units cannot be found: say so, naming the fix."""
    model = gpt2()
    layers = LayerScales(list(model.transformer.h))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            lm_loss(model, lm_batch(step)).backward()
    ours = [str(w.message) for w in caught if "LayerScales" in str(w.message)]
    assert len(ours) == 1, ours
    assert (
        ours[0].startswith("LayerScales (a list of units): this backward pass started from a loss it was not given")
        and "layers.backward_from(loss)" in ours[0]
    )
    model = gpt2()
    layers = LayerScales(list(model.transformer.h))
    layers.backward_from(lm_loss(model, lm_batch(0))).backward()  # given: no warning (the suite's are errors)
    with pytest.raises(TypeError, match=r"LayerScales.backward_from\(loss\): loss must be a torch.Tensor; got float"):
        layers.backward_from(1.0)


@pytest.mark.parametrize(
    "case,flat",
    [
        ("gpt2", False),
        ("gpt2, blocks only", False),
        ("llama", False),
        ("gpt2", True),
        ("gpt2, checkpointed", False),
        ("gpt2, per block", False),
        ("hf llama, per block", False),
    ],
)
def test_language_models_through_the_optimizer_stay_within_a_percent_of_float32(case, flat):
    """Float16 autocast, AdamW, per-layer scales on the whole model (tied embeddings) or on the blocks only (the
    embeddings, final norm and head at the global scale): every parameter's unscaled gradient within 1% of the
    float32 backward's at the same weights, at every step; also with the gradients in one buffer (flat_grads)."""
    build, units_of = LANGUAGE_MODELS[case]
    model, ref = build(), build()
    opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), layerwise=units_of(model), flat_grads=flat)
    compared = 0
    for step in range(5):
        ids = lm_batch(step)
        ref.load_state_dict(model.state_dict())
        expected = lm_grads(ref, ids)
        opt.zero_grad()
        opt.backward(lm_loss(model, ids, half=True))
        result = opt.step()
        compared += bool(result.stepped)  # a skipped step's gradients hold the overflow
        for name, p in model.named_parameters():
            error = float((p.grad - expected[name]).norm() / expected[name].norm())
            assert not bool(result.stepped) or error < 0.01, f"step {step}: {name} is {error:.3%} from float32's"
    assert compared >= 4
    if case != "gpt2, blocks only":  # the per-module factors differ: the test exercises them
        totals = [float(s) for s in result.layer_scales.values()]
        assert max(totals) >= 8 * min(totals), result.layer_scales


def test_update_refuses_measurements_of_another_shape():
    layers = LayerScales(deep_net())
    with pytest.raises(
        ValueError,
        match=r"LayerScales.update\(found_inf, amax\): both must hold one entry per unit "
        r"\(24\), or 25 with the parameters outside the units last.*got shapes "
        r"\(3,\) and \(3,\)",
    ):
        layers.update(torch.zeros(3, dtype=torch.bool), torch.zeros(3))


def test_an_overflow_outside_the_units_skips_the_step_and_backs_off_the_global_scale():
    model = gpt2()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), layerwise=list(model.transformer.h))
    opt.backward(lm_loss(model, lm_batch(0), half=True))
    model.transformer.wpe.weight.grad[0, 0] = math.inf  # wpe belongs to no unit
    before = [p.detach().clone() for p in model.parameters()]
    result = opt.step()
    assert bool(result.found_inf) and not bool(result.stepped)
    assert float(result.next_scale) == float(result.scale) / 2
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_change_of_wiring_between_steps_is_read_again():
    """Layer drop: a block skipped on odd steps changes which units run; the wiring is read again each time and
    the gradients stay exact (float32, factors far apart)."""

    class Dropping(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.blocks = torch.nn.ModuleList(Residual() for _ in range(3))
            self.head = torch.nn.Linear(WIDTH, 1)
            self.skip = None

        def forward(self, x):
            for i, block in enumerate(self.blocks):
                if i != self.skip:
                    x = block(x)
            return self.head(x).square().mean()

    model, ref = Dropping(), Dropping()
    layers = LayerScales(model)
    state = {
        **layers.state_dict(),
        "calibrated": True,
        "exponent": [float(3 * i % 11 + 1) for i in range(len(layers.units))],
    }
    layers.load_state_dict(state)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0))
    for step in range(4):
        model.skip = ref.skip = 1 if step % 2 else None
        for m in (model, ref):
            for p in m.parameters():
                p.grad = None
        (model(x) * 4.0).backward()
        layers.unscale_(torch.tensor(4.0))
        ref(x).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            assert p.grad is None or torch.equal(p.grad, q.grad), f"step {step}: {name}"


def test_a_change_of_wiring_without_a_change_of_order_is_refused():
    """The units run in their usual order, but the loss now also reads the first unit's output: the second unit's
    input, scaled as its region's only reader, would reach the loss's share at another scale. (Read again because
    the second unit's inputs changed; a change of readers that changes no unit's inputs or outputs goes unseen.)"""

    class Adds(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.eye(4))

        def forward(self, y, extra=None):
            return y @ self.weight if extra is None else y @ self.weight + extra

    class Leaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = torch.nn.Linear(4, 4), Adds()

        def forward(self, x, leak):
            y = self.first(x)
            if not leak:
                return self.second(y).sum()
            return self.second(y, extra=torch.ones(4, requires_grad=True)).sum() + y.sum()

    model = Leaky()
    LayerScales(model)
    x = torch.ones(2, 4)
    for _ in range(2):
        model(x, leak=False).backward()
    with pytest.raises(
        RuntimeError,
        match=r"the wiring around unit 'second' changed while the units ran in "
        r"their usual order \(its input 0 is no longer read by it alone\)",
    ):
        model(x, leak=True).backward()


def test_independent_overflows_are_each_attributed_to_their_own_unit():
    """In a residual network a unit's float16 weight gradient can overflow on its own: every overflowing unit whose
    later readers did not overflow too is a culprit and backs off, in the same step; one that a later reader's
    overflow explains (an inf spreads into the units that feed it) keeps its factor."""
    model = gpt2()
    layers = LayerScales(model)
    names = [name for name, _ in layers.units]
    n = len(names)
    layers.load_state_dict({**layers.state_dict(), "calibrated": True, "exponent": [3.0] * n})
    (lm_loss(model, lm_batch(0), half=True) * 2.0**8).backward()  # reads the wiring
    first, second, reader = (
        names.index(f"transformer.h.{name}") for name in ("0.attn.c_attn", "1.mlp.c_fc", "0.attn.c_proj")
    )
    for overflowing, lowered in (([first, second], [first, second]), ([first, reader], [reader])):
        before = layers.exponent.clone()
        found = torch.zeros(n, dtype=torch.bool)
        found[overflowing] = True
        assert not bool(layers.update(found, torch.where(found, math.inf, 1.0), torch.tensor(2.0**8)))
        assert (layers.exponent != before).nonzero().flatten().tolist() == sorted(lowered)
        assert all(float(layers.exponent[i]) < float(before[i]) for i in lowered)


# --- in its front end (lossscale.optimizer.layerwise): the calls a front end makes --------------------------------


def test_the_front_ends_calls_run_the_same_steps_as_driving_it_by_hand():
    """bind, backward_from, unscale, layer_scales and update_observed over a front end's parameters (a head outside
    the units among them): the same gradients, exponents and global found_inf as unscale_ and update by hand, bit for
    bit; unscale's found_inf and amax are the per-unit ones' any and max, on the scale's device."""

    def same(a, b):  # bit for bit, NaN where NaN
        return (
            a.dtype == b.dtype
            and a.device == b.device
            and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
            and torch.equal(a.isnan(), b.isnan())
        )

    def build():
        torch.manual_seed(0)
        body, head = deep_net(), torch.nn.Linear(WIDTH, WIDTH)
        return body, head, LayerScales(body)

    (body_a, head_a, by_hand), (body_b, head_b, driven) = build(), build()
    params_a, params_b = [*body_a.parameters(), *head_a.parameters()], [*body_b.parameters(), *head_b.parameters()]
    driven.bind("Front", params_b, None, lambda: True)
    scale = torch.tensor(2.0**16)
    for step in range(4):
        for p in params_a + params_b:
            p.grad = None
        x, y = batch(step)
        poison = math.inf if step == 2 else 1.0  # one step overflows in the head, outside the units
        with torch.autocast("cpu", dtype=torch.float16):
            loss_a = (head_a(body_a(x)).float() * poison - y).pow(2).mean()
            loss_b = (head_b(body_b(x)).float() * poison - y).pow(2).mean()
        by_hand.backward_from(loss_a * scale).backward()
        driven.backward_from(loss_b * scale).backward()
        found_u, amax_u = by_hand.unscale_(scale, params=params_a)
        found, amax = driven.unscale(scale)
        assert same(found, found_u.any())
        assert same(amax, amax_u.max())
        totals = driven.layer_scales(scale)
        assert all(torch.equal(v, w) for v, w in zip(totals.values(), by_hand.layer_scales(scale).values()))
        want = by_hand.update(found_u, amax_u, scale)
        got = driven.update_observed(torch.zeros((), dtype=torch.bool), scale)
        assert torch.equal(got, want) and bool(got) == (step == 2)
        assert torch.equal(driven.exponent, by_hand.exponent)
        assert all(same(p.grad, q.grad) for p, q in zip(params_a, params_b))
    assert float(driven.exponent.max()) >= 32
    found = torch.ones((), dtype=torch.bool)
    assert driven.update_observed(found, scale) is found  # nothing kept since the last update: found_inf as it is


def test_bind_takes_the_front_ends_is_scaled_and_process_group_and_refuses_parameters_outside_every_unit():
    model, other = deep_net(), deep_net(seed=1)
    layers = LayerScales(model)
    with pytest.raises(
        ValueError,
        match=r"^Front\(layerwise=Sequential\): none of the inner optimizer's 48 "
        r"parameters belongs to a unit.*pass the model whose parameters",
    ):
        layers.bind("Front", list(other.parameters()), None, lambda: True)

    def is_scaled():
        return False

    layers.bind("Front", list(model.parameters()), None, is_scaled)
    layers.bind("Front", list(model.parameters()), None, is_scaled)  # again when the front end's options change
    assert layers.is_scaled is is_scaled and layers.process_group is None
    loss_of(model, 0, half=True).backward()  # not scaled: the hooks pass the gradients through
    ref = plain_copy(model)
    for p in ref.parameters():
        p.grad = None
    loss_of(ref, 0, half=True).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))


def test_layerwise_makes_a_front_end_of_its_own_that_only_a_plain_optimizer_class_takes():
    from lossscale.optimizer.layerwise import LayerwiseOptimizer

    model = deep_net()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), layerwise=model)
    assert type(opt) is LayerwiseOptimizer and isinstance(opt, LossScaleOptimizer)
    assert type(LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))) is LossScaleOptimizer

    class Mine(LossScaleOptimizer):
        pass

    with pytest.raises(
        TypeError, match=r"Mine\(layerwise=...\): per-layer scales are a LossScaleOptimizer of their own"
    ):
        Mine(torch.optim.SGD(deep_net().parameters(), lr=0.1), layerwise=deep_net())


def test_a_unit_kept_in_float32_takes_factor_one_and_gets_its_own_back_once_released():
    """keep_float32 on a module around two units (a heal keeping a block): both compute in float32 from the next
    forward on, so they carry the global scale only; released, their factors come back at the next step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), torch.nn.Linear(8, 1)
    )
    with torch.no_grad():
        model[2].weight.mul_(1e-3)  # the gradients before it are small: their units rise above the global scale
    policy = DynamicScale(init_scale=2.0**4, growth_interval=1000)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), layerwise=model, policy=policy)
    g = torch.Generator().manual_seed(0)

    def step():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8, generator=g)).float().sum()
        opt.backward(loss)
        result = opt.step()
        opt.zero_grad()
        return {name: float(total) for name, total in result.layer_scales.items()}

    before = [step() for _ in range(3)][-1]
    assert before["1.0"] > 2.0**4 and before["1.1"] > 2.0**4 and before["2"] == 2.0**4, before
    handle = keep_float32(model[1], outputs="float32")
    kept = step()
    assert kept == {**before, "1.0": 2.0**4, "1.1": 2.0**4}, kept
    handle.remove()
    released = [step() for _ in range(2)][-1]
    assert released == before, released


def test_validate_state_dict_raises_what_load_state_dict_would_and_changes_nothing():
    model = deep_net()
    layers = LayerScales(model)
    (loss_of(model, 0, half=True) * 2.0**16).backward()
    saved = layers.state_dict()
    before = layers.exponent.clone()
    assert layers.validate_state_dict(saved) is None
    with pytest.raises(ValueError, match="order must list distinct unit indices"):
        layers.validate_state_dict({**saved, "order": [0, 0]})
    assert torch.equal(layers.exponent, before) and layers.state_dict() == saved
