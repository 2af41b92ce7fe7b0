"""LossScaleOptimizer against an fp32 control that skips by hand, torch's clipping, and its own invariants."""

import copy
import random

import pytest
import torch

from lossscale import (EMA, DynamicScale, FixedScale, FloorError, HostReadCounter, LossScaleOptimizer, PredictiveScale,
                       StepResult)

INJECT = {2, 5, 6, 11, 17}


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    gen = torch.Generator().manual_seed(seed + 1)
    data = [(torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)) for _ in range(24)]
    return model, data


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def state_tensors(opt):
    return {(k, n): v.clone() for k, s in opt.state_dict()["state"].items() for n, v in s.items()
            if isinstance(v, torch.Tensor)}


SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
FUSED_SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True)  # noqa: E731
ADAM = lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True)  # noqa: E731
FUSED_ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)  # noqa: E731


@pytest.mark.parametrize("make_opt,skip_mode", [(SGD, "host"), (SGD, "masked"), (FUSED_SGD, "fused"),
                                                (ADAM, "masked"), (FUSED_ADAMW, "fused")])
def test_twin_run_equals_fp32_control_that_skips_by_hand(make_opt, skip_mode):
    control, data = model_and_data()
    model = copy.deepcopy(control)
    ref_opt = make_opt(control.parameters())
    opt = LossScaleOptimizer(make_opt(model.parameters()), policy=DynamicScale(init_scale=2.0**8, growth_interval=3),
                             skip_mode=skip_mode)
    stepped, scales = [], []
    for i, (x, y) in enumerate(data):
        ref_opt.zero_grad()
        loss_fn(control, x, y).backward()
        if i not in INJECT:
            ref_opt.step()
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        if i in INJECT:
            model[2].weight.grad[0, 0] = float("nan") if i % 2 else float("inf")
        result = opt.step()
        stepped.append(bool(result.stepped))
        scales.append((float(result.scale), float(result.next_scale)))
    assert stepped == [i not in INJECT for i in range(len(data))]
    assert len({s for s, _ in scales}) > 2
    for p, q in zip(model.parameters(), control.parameters()):
        assert torch.equal(p, q)
    ours, ref = state_tensors(opt.inner), state_tensors(ref_opt)
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)


@pytest.mark.parametrize("make_opt,fused", [(SGD, False), (FUSED_ADAMW, True)])
def test_clipping_equals_clip_grad_norm_on_the_control(make_opt, fused):
    control, data = model_and_data(3)
    model = copy.deepcopy(control)
    ref_opt = make_opt(control.parameters())
    opt = LossScaleOptimizer(make_opt(model.parameters()), policy=FixedScale(2.0**10), clip_grad_norm=0.05)
    assert opt.skip_mode == ("fused" if fused else "host")
    for x, y in data[:10]:
        ref_opt.zero_grad()
        loss_fn(control, x, y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(control.parameters(), 0.05)
        ref_opt.step()
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        result = opt.step()
        assert float(ref_norm) > 0.05  # clipping really happened
        torch.testing.assert_close(result.grad_norm, ref_norm, rtol=1e-6, atol=0)
        for p, q in zip(model.parameters(), control.parameters()):
            torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("make_opt", [SGD, FUSED_ADAMW, ADAM])
def test_accumulation_of_four_micro_batches_equals_one_batch_of_the_mean(make_opt):
    control, data = model_and_data(5)
    model = copy.deepcopy(control)
    ref_opt = make_opt(control.parameters())
    opt = LossScaleOptimizer(make_opt(model.parameters()), policy=FixedScale(2.0**12), accumulation_steps=4)
    for k in range(3):
        batch = data[4 * k:4 * k + 4]
        ref_opt.zero_grad()
        loss_fn(control, torch.cat([x for x, _ in batch]), torch.cat([y for _, y in batch])).backward()
        ref_opt.step()
        results = []
        for x, y in batch:
            opt.zero_grad()  # a no-op inside the window
            opt.backward(loss_fn(model, x, y))
            results.append(opt.step())
        assert [r.accumulating for r in results] == [True, True, True, False]
        assert [bool(r.stepped) for r in results] == [False, False, False, True]
        for p, q in zip(model.parameters(), control.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def own_reads(make_opt):
    model, data = model_and_data()
    opt = make_opt(model.parameters())
    for _ in range(2):
        loss_fn(model, *data[0]).backward()
        with HostReadCounter() as reads:
            opt.step()
    return reads.count


@pytest.mark.parametrize("make_opt,skip_mode,clip", [(FUSED_ADAMW, "fused", None), (FUSED_ADAMW, "fused", 1.0),
                                                     (ADAM, "masked", None), (ADAM, "masked", 1.0),
                                                     (SGD, "masked", 1.0)])
def test_no_host_reads_added_by_the_wrapper(make_opt, skip_mode, clip):
    model, data = model_and_data()
    opt = LossScaleOptimizer(make_opt(model.parameters()), skip_mode=skip_mode, clip_grad_norm=clip)
    bare = own_reads(make_opt)
    for i, (x, y) in enumerate(data[:6]):
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        if i in (3, 4):
            model[0].bias.grad[0] = float("inf")
        if i == 0:
            opt.step()  # masked: the first step creates the optimizer state and is decided on the host
            continue
        with HostReadCounter() as reads:
            opt.step()
        assert reads.count - bare == 0, i


def test_host_mode_reads_once():
    model, data = model_and_data()
    opt = LossScaleOptimizer(SGD(model.parameters()), skip_mode="host")
    for x, y in data[:3]:
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        with HostReadCounter() as reads:
            opt.step()
        assert reads.count == 1


@pytest.mark.parametrize("make_opt,skip_mode", [(ADAM, "masked"), (ADAM, "host"), (FUSED_ADAMW, "fused"),
                                                (SGD, "masked"), (FUSED_ADAMW, "masked")])
def test_random_overflows_never_corrupt_and_every_skip_is_exact(make_opt, skip_mode):
    rng = random.Random(7)
    model, _ = model_and_data(11)
    ema = EMA(0.9)
    opt = LossScaleOptimizer(make_opt(model.parameters()), policy=DynamicScale(init_scale=2.0**20, growth_interval=5,
                             hysteresis=2), skip_mode=skip_mode, clip_grad_norm=1.0, ema=ema, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    skipped = 0
    for step in range(200):
        x = torch.randn(8, 6, generator=gen)
        if rng.random() < 0.25:
            x[rng.randrange(8), rng.randrange(6)] = rng.choice([float("inf"), float("-inf"), float("nan")])
        before_p = [p.detach().clone() for p in model.parameters()]
        before_s = state_tensors(opt.inner)
        before_ema = [s.clone() for s in ema.shadow]
        opt.zero_grad()
        opt.backward(model(x).square().mean())
        result = opt.step()
        if not bool(result.stepped):
            skipped += 1
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before_p))
            after_s = state_tensors(opt.inner)
            assert after_s.keys() == before_s.keys() and all(torch.equal(after_s[k], before_s[k]) for k in after_s)
            assert all(torch.equal(a, b) for a, b in zip(ema.shadow, before_ema))
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert all(torch.isfinite(v).all() for v in state_tensors(opt.inner).values())
        assert all(torch.isfinite(s).all() for s in ema.shadow)
    assert 20 < skipped < 120


def run_steps(opt, model, data, inject=(), start=0):
    out = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        if i + start in inject:
            model[0].weight.grad[1, 1] = float("inf")
        r = opt.step()
        out.append((r.accumulating, bool(r.stepped), float(r.next_scale)))
    return out


def test_state_dict_round_trip_mid_run_with_hysteresis_and_accumulation_in_flight():
    inject = {4, 12, 16}

    def make():
        model, data = model_and_data(2)
        opt = LossScaleOptimizer(ADAM(model.parameters()), policy=DynamicScale(init_scale=2.0**9, growth_interval=2,
                                 hysteresis=2, hysteresis_mode="cumulative"), accumulation_steps=3, ema=EMA(0.5))
        return model, data, opt

    model, data, opt = make()
    full = run_steps(opt, model, data[:20], inject)
    final = [p.clone() for p in model.parameters()]

    model, data, opt = make()
    first = run_steps(opt, model, data[:10], inject)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    assert saved["opt"]["micro_step"] == 1 and saved["opt"]["policy_state"]["hysteresis_left"] == 1
    model2, _, opt2 = make()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    rest = run_steps(opt2, model2, data[10:20], inject, start=10)
    assert first + rest == full
    assert all(torch.equal(p, q) for p, q in zip(model2.parameters(), final))


def test_ema_and_weight_decay_only_on_applied_steps():
    model, data = model_and_data()
    p0 = [p.detach().clone() for p in model.parameters()]
    ema = EMA(momentum=0.5)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=FixedScale(1.0), ema=ema, weight_decay=0.5,
                             skip_mode="masked")
    opt.zero_grad()
    opt.backward(loss_fn(model, *data[0]))
    for p in model.parameters():
        p.grad.zero_()  # a zero-gradient step: only weight decay moves the parameters
    opt.step()
    for p, q, s in zip(model.parameters(), p0, ema.shadow):
        torch.testing.assert_close(p, q * (1 - 0.1 * 0.5))
        torch.testing.assert_close(s, 0.5 * q + 0.5 * p)
    snapshot = [p.detach().clone() for p in model.parameters()] + [s.clone() for s in ema.shadow]
    opt.zero_grad()
    opt.backward(loss_fn(model, *data[1]))
    model[0].bias.grad[0] = float("nan")
    assert not bool(opt.step().stepped)
    assert all(torch.equal(a, b) for a, b in zip(list(model.parameters()) + ema.shadow, snapshot))


def test_ema_overwrite_every():
    model, data = model_and_data()
    ema = EMA(momentum=0.9, overwrite_every=2)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), ema=ema)
    run_steps(opt, model, data[:2])
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), ema.shadow))


def test_floor_error_names_scale_steps_and_cause():
    model, data = model_and_data()
    opt = LossScaleOptimizer(SGD(model.parameters()), policy=DynamicScale(init_scale=4.0, min_scale=1.0, at_floor="raise"))
    x = data[0][0].clone()
    x[0, 0] = float("nan")
    with pytest.raises(FloorError, match=r"step 3: .*min_scale=1.0.*NaN or inf in the data"):
        for _ in range(5):
            opt.zero_grad()
            opt.backward(model(x).sum())
            opt.step()


def test_attribution_by_name_after_an_overflow():
    for mode in ["fused", "host"]:
        model, data = model_and_data()
        opt = LossScaleOptimizer(FUSED_ADAMW(model.parameters()), module=model, skip_mode=mode)
        opt.zero_grad()
        opt.backward(loss_fn(model, *data[0]))
        model[2].bias.grad[1] = float("inf")
        assert not bool(opt.step().stepped)
        assert opt.overflowing_parameters() == ["2.bias"]


def test_saturation_mode_skips_saturated_scaled_gradients():
    for mode, skipped in [("inf_nan", False), ("saturation", True)]:
        model, data = model_and_data()
        opt = LossScaleOptimizer(FUSED_ADAMW(model.parameters()), policy=FixedScale(2.0**4), overflow_mode=mode)
        opt.zero_grad()
        opt.backward(loss_fn(model, *data[0]))
        model[2].bias.grad[1] = 65504.0
        assert bool(opt.step().found_inf) is skipped


@pytest.mark.parametrize("observes_amax", [False, True])
def test_every_check_of_a_step_that_overflows_twice_hands_the_fused_kernel_exactly_one(observes_amax):
    # saturation (aminmax), the clip norm and an amax-observing policy each check the same step; were any of
    # them to add to found_inf instead of setting it, the kernel would get 2.0 and apply the step (it skips
    # only where found_inf == 1.0), writing NaN into the weights and Adam's moments
    model, data = model_and_data()
    policy = PredictiveScale() if observes_amax else FixedScale(2.0**4)
    opt = LossScaleOptimizer(FUSED_ADAMW(model.parameters()), policy=policy, overflow_mode="saturation",
                             clip_grad_norm=1.0)
    for batch, bad in [(0, None), (1, float("nan")), (2, float("inf"))]:
        opt.zero_grad()
        opt.backward(loss_fn(model, *data[batch]))
        before = [p.detach().clone() for p in model.parameters()]
        if bad is not None:
            model[2].bias.grad[0] = bad
            model[0].weight.grad[0, 0] = bad
        handed = []
        kernel_step = opt.inner.step
        opt.inner.step = lambda *a, **k: (handed.append(float(opt.inner.found_inf)), kernel_step(*a, **k))[1]
        r = opt.step()
        opt.inner.step = kernel_step
        assert handed == [0.0 if bad is None else 1.0]
        assert bool(r.found_inf) is (bad is not None)
        if bad is not None:
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        states = [t for st in opt.inner.state.values() for t in st.values() if torch.is_tensor(t)]
        assert all(torch.isfinite(t).all() for t in states) and all(torch.isfinite(p).all()
                                                                     for p in model.parameters())


def test_step_result_is_frozen_and_readable():
    model, data = model_and_data()
    opt = LossScaleOptimizer(SGD(model.parameters()), clip_grad_norm=10.0)
    opt.zero_grad()
    opt.backward(loss_fn(model, *data[0]))
    r = opt.step()
    assert isinstance(r, StepResult) and opt.last_result is r
    with pytest.raises(Exception):
        r.stepped = None
    d = r.as_dict()
    assert d["stepped"] is True and d["found_inf"] is False and d["scale"] == 65536.0 and d["grad_norm"] > 0
    assert d["step"] == 0 and d["accumulating"] is False


def test_lr_scheduler_accepts_the_wrapper():
    model, data = model_and_data()
    opt = LossScaleOptimizer(SGD(model.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    run_steps(opt, model, data[:2])
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(0.025)


@pytest.mark.parametrize("kwargs,err,needle", [
    (dict(overflow_mode="x"), ValueError, "overflow_mode must be one of"),
    (dict(clip_grad_norm=0.0), ValueError, "clip_grad_norm must be None or a finite number > 0; got 0.0"),
    (dict(clip_grad_value=-1), ValueError, "clip_grad_value"),
    (dict(clip_grad_norm=1.0, clip_grad_value=1.0), ValueError, "at most one way of clipping"),
    (dict(accumulation_steps=0), ValueError, "accumulation_steps must be an integer >= 1; got 0"),
    (dict(skip_mode="never"), ValueError, "skip_mode must be one of 'auto', 'fused', 'host', 'masked'"),
    (dict(skip_mode="fused"), ValueError, "does not take grad_scale/found_inf"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay must be None or a finite number >= 0"),
    (dict(ema=0.99), TypeError, "ema must be a lossscale.EMA"),
    (dict(policy="dynamic"), TypeError, "policy must have init"),
])
def test_validation(kwargs, err, needle):
    model, _ = model_and_data()
    with pytest.raises(err, match=needle):
        LossScaleOptimizer(SGD(model.parameters()), **kwargs)


def test_ema_validation():
    with pytest.raises(ValueError, match=r"EMA\(momentum=1.0\): momentum must be in \[0, 1\)"):
        EMA(1.0)
    with pytest.raises(ValueError, match="overwrite_every must be an integer >= 1"):
        EMA(0.9, overwrite_every=0)


def test_set_scale_keeps_the_counters_and_validates():
    model, data = model_and_data()
    opt = LossScaleOptimizer(SGD(model.parameters()), policy=DynamicScale(init_scale=2.0**8, growth_interval=3))
    run_steps(opt, model, data[:2])
    tracker = int(opt.scale_state.growth_tracker)
    with HostReadCounter() as reads:
        opt.set_scale(torch.tensor(32.0))
    assert reads.count == 0 and float(opt.scale) == 32.0 and int(opt.scale_state.growth_tracker) == tracker == 2
    opt.set_scale(1024.0)
    assert run_steps(opt, model, data[2:3]) == [(False, True, 2048.0)]  # the third clean step grows from it
    for bad in [0.0, -1.0, float("inf"), float("nan")]:
        with pytest.raises(ValueError, match=r"LossScaleOptimizer.set_scale\(new_scale=.*finite number > 0"):
            opt.set_scale(bad)
    with pytest.raises(ValueError, match="1-element tensor"):
        opt.set_scale(torch.ones(2))
