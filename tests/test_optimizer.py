"""LossScaleOptimizer: every skip mode against an fp32 control that skips by hand, clipping against torch's
clip_grad_norm_, accumulation, host reads, EMA and weight decay, attribution, and the torch optimizer it is
(hooks, LR schedulers, closures, setters during the step).

Its checkpoints: test_optimizer_checkpoint.py. Bad arguments: test_entry_point_checks.py.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from lossscale import (
    EMA,
    DynamicScale,
    FixedScale,
    FloorError,
    LossScale,
    LossScaleOptimizer,
    PredictiveScale,
    StepResult,
)
from lossscale.compat.keras import _KerasStep
from lossscale.stages import NoGradientsError
from lossscale.testing import HostReadCounter

INF, NAN = math.inf, math.nan
INJECT = {2, 5, 6, 11, 17}

SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
FUSED_SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True)  # noqa: E731
ADAM = lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True)  # noqa: E731
FUSED_ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)  # noqa: E731


def model_and_data(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    gen = torch.Generator().manual_seed(seed + 1)
    data = [(torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)) for _ in range(24)]
    return model, data


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def state_tensors(opt) -> dict:
    return {
        (k, n): v.clone()
        for k, s in opt.state_dict()["state"].items()
        for n, v in s.items()
        if isinstance(v, torch.Tensor)
    }


def run_steps(opt, model, data, inject=(), start=0) -> list[tuple]:
    out = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        if i + start in inject:
            model[0].weight.grad[1, 1] = INF
        r = opt.step()
        out.append((r.accumulating, bool(r.stepped), float(r.next_scale)))
    return out


# --- against an fp32 control and torch's clipping -------------------------------------------------------


@pytest.mark.parametrize(
    "make_opt,skip_mode",
    [(SGD, "host"), (SGD, "masked"), (FUSED_SGD, "fused"), (ADAM, "masked"), (FUSED_ADAMW, "fused")],
)
@pytest.mark.parametrize("flat", [False, True])
def test_twin_run_equals_an_fp32_control_that_skips_by_hand(make_opt, skip_mode, flat):
    control, data = model_and_data()
    model = copy.deepcopy(control)
    ref_opt = make_opt(control.parameters())
    opt = LossScaleOptimizer(
        make_opt(model.parameters()),
        policy=DynamicScale(init_scale=2.0**8, growth_interval=3),
        skip_mode=skip_mode,
        flat_grads=flat,
    )
    assert opt.skip_mode == skip_mode
    stepped, scales = [], []
    for i, (x, y) in enumerate(data):
        ref_opt.zero_grad()
        loss_fn(control, x, y).backward()
        if i not in INJECT:
            ref_opt.step()
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        if i in INJECT:
            model[2].weight.grad[0, 0] = NAN if i % 2 else INF
        result = opt.step()
        stepped.append(bool(result.stepped))
        scales.append(float(result.scale))
    assert stepped == [i not in INJECT for i in range(len(data))]
    assert len(set(scales)) > 2
    for p, q in zip(model.parameters(), control.parameters()):
        assert torch.equal(p, q)
    ours, ref = state_tensors(opt.inner), state_tensors(ref_opt)
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)


@pytest.mark.parametrize("make_opt,skip_mode", [(SGD, "host"), (FUSED_ADAMW, "fused")])
@pytest.mark.parametrize("flat", [False, True])
def test_clipping_equals_clip_grad_norm_on_the_control(make_opt, skip_mode, flat):
    control, data = model_and_data(3)
    model = copy.deepcopy(control)
    ref_opt = make_opt(control.parameters())
    opt = LossScaleOptimizer(
        make_opt(model.parameters()), policy=FixedScale(2.0**10), clip_grad_norm=0.05, flat_grads=flat
    )
    assert opt.skip_mode == skip_mode
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
@pytest.mark.parametrize("flat", [False, True])
def test_accumulation_of_four_micro_batches_equals_one_batch_of_the_mean(make_opt, flat):
    control, data = model_and_data(5)
    model = copy.deepcopy(control)
    ref_opt = make_opt(control.parameters())
    opt = LossScaleOptimizer(
        make_opt(model.parameters()), policy=FixedScale(2.0**12), accumulation_steps=4, flat_grads=flat
    )
    for k in range(3):
        batch = data[4 * k : 4 * k + 4]
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
        assert [r.step for r in results] == [k] * 4
        for p, q in zip(model.parameters(), control.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make_opt,skip_mode",
    [(ADAM, "masked"), (ADAM, "host"), (FUSED_ADAMW, "fused"), (SGD, "masked"), (FUSED_ADAMW, "masked")],
)
@pytest.mark.parametrize("flat", [False, True])
def test_random_overflows_skip_exactly_the_poisoned_steps_and_never_corrupt(make_opt, skip_mode, flat):
    """With clipping, hysteresis, EMA and weight decay: an inf or NaN at a random place of a quarter of the inputs."""
    rng = random.Random(7)
    model, _ = model_and_data(11)
    ema = EMA(0.9)
    inner = make_opt(model.parameters())
    opt = LossScaleOptimizer(
        _KerasStep(inner, clipnorm=None, weight_decay=0.01),
        policy=DynamicScale(init_scale=2.0**20, growth_interval=5, hysteresis=2),
        skip_mode=skip_mode,
        clip_grad_norm=1.0,
        ema=ema,
        flat_grads=flat,
    )
    gen = torch.Generator().manual_seed(0)
    poisoned, skipped = [], []
    for _ in range(80):
        x = torch.randn(8, 6, generator=gen)
        poisoned.append(rng.random() < 0.25)
        if poisoned[-1]:
            x[rng.randrange(8), rng.randrange(6)] = rng.choice([INF, -INF, NAN])
        before_p = [p.detach().clone() for p in model.parameters()]
        before_s = state_tensors(opt.inner)
        before_ema = [s.clone() for s in ema.shadow]
        opt.zero_grad()
        opt.backward(model(x).square().mean())
        skipped.append(not bool(opt.step().stepped))
        if skipped[-1]:
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before_p))
            after_s = state_tensors(opt.inner)
            assert after_s.keys() == before_s.keys() and all(torch.equal(after_s[k], before_s[k]) for k in after_s)
            assert all(torch.equal(a, b) for a, b in zip(ema.shadow, before_ema))
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert all(torch.isfinite(v).all() for v in state_tensors(opt.inner).values())
        assert all(torch.isfinite(s).all() for s in ema.shadow)
    assert skipped == poisoned and sum(skipped) > 10


@pytest.mark.parametrize("observes_amax", [False, True])
def test_a_step_that_several_checks_find_overflowing_is_skipped_by_the_fused_kernel(observes_amax):
    """Saturation (aminmax), the clip norm and an amax-observing policy each check the same step; the fused kernel
    skips only where found_inf == 1.0, so were a check to add to it instead of setting it, the step would apply and
    write NaN into the weights and Adam's moments."""
    model, data = model_and_data()
    policy = PredictiveScale() if observes_amax else FixedScale(2.0**4)
    opt = LossScaleOptimizer(
        FUSED_ADAMW(model.parameters()), policy=policy, overflow_mode="saturation", clip_grad_norm=1.0
    )
    assert opt.skip_mode == "fused"
    for batch, bad in [(0, None), (1, NAN), (2, INF), (3, 1e5)]:  # 1e5: saturated, finite
        opt.zero_grad()
        opt.backward(loss_fn(model, *data[batch]))
        before = [p.detach().clone() for p in model.parameters()]
        if bad is not None:
            model[2].bias.grad[0] = bad
            model[0].weight.grad[0, 0] = bad
        r = opt.step()
        assert bool(r.found_inf) is (bad is not None)
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) is (bad is not None)
        states = [t for st in opt.inner.state.values() for t in st.values() if torch.is_tensor(t)]
        assert all(torch.isfinite(t).all() for t in states)
        assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("coalesce", [False, True])
def test_a_sparse_embedding_steps_as_with_torchs_scaler(coalesce):
    def run(front_end):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(6, 3, sparse=True)
        sgd = torch.optim.SGD(emb.parameters(), lr=0.1)
        loss = emb(torch.tensor([1, 2, 1, 4])).square().sum()
        if front_end == "torch":
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            scaler.scale(loss).backward()
        else:
            opt = LossScaleOptimizer(sgd, policy=DynamicScale(init_scale=1024.0))
            opt.backward(loss)
        if coalesce:
            emb.weight.grad = emb.weight.grad.coalesce()
        if front_end == "torch":
            scaler.step(sgd)
        else:
            assert bool(opt.step().stepped)
        return emb.weight.detach()

    ours = run("ours")
    assert torch.equal(ours, run("torch"))
    torch.manual_seed(0)
    start = torch.nn.Embedding(6, 3).weight.detach()
    assert [not torch.equal(a, b) for a, b in zip(ours, start)] == [False, True, True, False, True, False]


# --- host reads ----------------------------------------------------------------------------------------


def own_reads(make_opt) -> int:
    """Host reads of the bare optimizer's step (CPU Adam reads its step counts)."""
    model, data = model_and_data()
    opt = make_opt(model.parameters())
    for _ in range(2):
        loss_fn(model, *data[0]).backward()
        with HostReadCounter() as reads:
            opt.step()
    return reads.count


@pytest.mark.parametrize(
    "make_opt,skip_mode,clip,added",
    [
        (FUSED_ADAMW, "fused", None, 0),
        (FUSED_ADAMW, "fused", 1.0, 0),
        (ADAM, "masked", None, 0),
        (ADAM, "masked", 1.0, 0),
        (SGD, "masked", 1.0, 0),
        (SGD, "host", None, 1),
    ],
)
def test_host_reads_added_by_the_wrapper(make_opt, skip_mode, clip, added):
    model, data = model_and_data()
    opt = LossScaleOptimizer(make_opt(model.parameters()), skip_mode=skip_mode, clip_grad_norm=clip)
    bare = own_reads(make_opt)
    for i, (x, y) in enumerate(data[:6]):
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        if i in (3, 4):
            model[0].bias.grad[0] = INF
        if i == 0:
            opt.step()  # masked: the first step creates the optimizer state and is decided on the host
            continue
        with HostReadCounter() as reads:
            result = opt.step()
        stepped = bool(result.stepped)
        assert stepped is (i not in (3, 4))
        own = 0 if (added and not stepped) else bare  # a step skipped on the host never calls the optimizer
        assert reads.count - own == added, i


# --- what rides on the step: EMA, weight decay, the policy, attribution ---------------------------------


def test_ema_and_weight_decay_only_on_applied_steps():
    model, data = model_and_data()
    p0 = [p.detach().clone() for p in model.parameters()]
    ema = EMA(momentum=0.5)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = LossScaleOptimizer(
        _KerasStep(inner, clipnorm=None, weight_decay=0.5),
        policy=FixedScale(1.0),
        ema=ema,
        skip_mode="masked",
    )
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
    model[0].bias.grad[0] = NAN
    assert not bool(opt.step().stepped)
    assert all(torch.equal(a, b) for a, b in zip(list(model.parameters()) + ema.shadow, snapshot))


def test_ema_overwrite_every_copies_the_average_into_the_parameters():
    model, data = model_and_data()
    ema = EMA(momentum=0.9, overwrite_every=2)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), ema=ema)
    run_steps(opt, model, data[:1])
    assert not all(torch.equal(p, s) for p, s in zip(model.parameters(), ema.shadow))
    run_steps(opt, model, data[1:2])
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), ema.shadow))


def test_a_floor_error_names_the_step_the_floor_and_the_cause():
    model, data = model_and_data()
    opt = LossScaleOptimizer(
        SGD(model.parameters()), policy=DynamicScale(init_scale=4.0, min_scale=1.0, at_floor="raise")
    )
    x = data[0][0].clone()
    x[0, 0] = NAN
    with pytest.raises(FloorError, match=r"step 3: .*min_scale=1.0.*NaN or inf in the data"):
        for _ in range(5):
            opt.zero_grad()
            opt.backward(model(x).sum())
            opt.step()


def test_a_non_finite_loss_reaches_a_policy_that_observes_it():
    """PredictiveScale treats an overflow with a NaN loss as a fault of the data, not of the scale: it holds."""
    w = torch.nn.Parameter(torch.ones(4))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.1), policy=PredictiveScale(init_scale=2.0**10))

    def one_step(factor: float) -> float:
        opt.backward((w * factor).sum())
        opt.step()
        opt.zero_grad()
        return float(opt.scale)

    before = [one_step(2.0) for _ in range(3)][-1]
    assert one_step(NAN) == before
    assert torch.allclose(w.detach(), torch.full((4,), 0.4))  # three applied steps, the NaN one skipped


@pytest.mark.parametrize("skip_mode", ["fused", "host"])
def test_overflowing_parameters_names_the_culprit(skip_mode):
    model, data = model_and_data()
    opt = LossScaleOptimizer(FUSED_ADAMW(model.parameters()), module=model, skip_mode=skip_mode)
    opt.zero_grad()
    opt.backward(loss_fn(model, *data[0]))
    model[2].bias.grad[1] = INF
    assert not bool(opt.step().stepped)
    assert opt.overflowing_parameters() == ["2.bias"]


def test_saturation_mode_skips_saturated_scaled_gradients_that_inf_nan_mode_applies():
    for mode, skipped in [("inf_nan", False), ("saturation", True)]:
        model, data = model_and_data()
        opt = LossScaleOptimizer(FUSED_ADAMW(model.parameters()), policy=FixedScale(2.0**4), overflow_mode=mode)
        opt.zero_grad()
        opt.backward(loss_fn(model, *data[0]))
        model[2].bias.grad[1] = 65504.0
        assert bool(opt.step().found_inf) is skipped


# --- the scale and its owner ---------------------------------------------------------------------------


def test_set_scale_keeps_the_counters_without_a_host_read():
    model, data = model_and_data()
    opt = LossScaleOptimizer(SGD(model.parameters()), policy=DynamicScale(init_scale=2.0**8, growth_interval=3))
    run_steps(opt, model, data[:2])
    with HostReadCounter() as reads:
        opt.set_scale(torch.tensor(32.0))
    assert reads.count == 0 and float(opt.scale) == 32.0 and int(opt.scale_state.growth_tracker) == 2
    opt.set_scale(1024.0)
    assert run_steps(opt, model, data[2:3]) == [(False, True, 2048.0)]  # the third clean step grows from it


def test_a_loss_scale_can_be_shared_by_two_optimizers():
    model, _ = model_and_data()
    owner = LossScale(DynamicScale(init_scale=512.0))
    a = LossScaleOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), policy=owner)
    b = LossScaleOptimizer(torch.optim.SGD(model[2].parameters(), lr=0.1), policy=owner)
    a.set_scale(8.0)
    assert float(b.scale) == 8.0 and a.loss_scale is b.loss_scale is owner


def _inner_and_wrapper(skip_mode: str):
    model, data = model_and_data()
    inner = FUSED_ADAMW(model.parameters()) if skip_mode == "fused" else SGD(model.parameters())
    opt = LossScaleOptimizer(inner, policy=DynamicScale(init_scale=8.0, growth_interval=1), skip_mode=skip_mode)
    opt.backward(loss_fn(model, *data[0]))
    return inner, opt


@pytest.mark.parametrize("skip_mode", ["fused", "host"])
def test_an_inner_step_that_raises_leaves_the_scale_as_it_was(skip_mode):
    inner, opt = _inner_and_wrapper(skip_mode)

    def fail(*_):
        raise RuntimeError("inner step failed")

    inner.register_step_pre_hook(fail)
    before = opt.loss_scale.state_dict()
    with pytest.raises(RuntimeError, match="inner step failed"):
        opt.step()
    assert opt.loss_scale.state_dict() == before  # the clean step would have grown it to 16


SET_DURING_THE_INNER_STEP = {  # what a hook on the inner optimizer does, and the scale after the step
    "set_scale": (lambda ls: ls.set_scale(2.0), 4.0),
    "set_policy": (lambda ls: ls.set_policy(DynamicScale(init_scale=8.0, growth_factor=4.0, growth_interval=1)), 32.0),
    "scale.fill_": (lambda ls: ls.scale.fill_(2.0), 4.0),
}


@pytest.mark.parametrize("skip_mode", ["fused", "host"])
@pytest.mark.parametrize("setter", sorted(SET_DURING_THE_INNER_STEP))
def test_a_scale_or_rule_set_during_the_inner_step_is_what_the_policy_advances(setter, skip_mode):
    """Set, then advanced (growth_interval=1): 2 -> 4, or 8 -> 32 by the new rule; never the old 8 -> 16."""
    change, expected = SET_DURING_THE_INNER_STEP[setter]
    inner, opt = _inner_and_wrapper(skip_mode)

    def hook(*_):
        change(opt.loss_scale)

    inner.register_step_pre_hook(hook)
    assert bool(opt.step().stepped)
    assert float(opt.loss_scale.scale) == expected


# --- a torch optimizer: hooks, schedulers, closures, proxies ------------------------------------------


def test_param_groups_state_and_defaults_are_the_inner_optimizers_and_lr_schedulers_drive_them():
    model, data = model_and_data()
    inner = SGD(model.parameters())
    opt = LossScaleOptimizer(inner)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    run_steps(opt, model, data[:2])
    sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.025)


def test_the_step_returns_a_step_result_and_keeps_it():
    model, data = model_and_data()
    opt = LossScaleOptimizer(SGD(model.parameters()), clip_grad_norm=10.0)
    opt.backward(loss_fn(model, *data[0]))
    r = opt.step()
    assert isinstance(r, StepResult) and opt.last_result is r
    assert (bool(r.stepped), bool(r.found_inf), float(r.scale), r.step, r.accumulating) == (
        True,
        False,
        65536.0,
        0,
        False,
    )
    assert float(r.next_scale) == 65536.0 and float(r.grad_norm) > 0


def test_step_hooks_run_in_torchs_order_with_torchs_arguments():
    """Global and own pre hooks, the step (the inner optimizer's own hooks inside), own and global post hooks;
    a pre hook's (args, kwargs) replace the call's, args starting with the optimizer (torch's wrapper)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    model, data = model_and_data()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=FixedScale(8.0))
    seen = []

    def closure():
        opt.backward(loss_fn(model, *data[0]))
        return "replaced"

    opt.register_step_pre_hook(
        lambda o, args, kwargs: (seen.append(("pre", args[0] is o, len(args))), ((o, closure), {}))[1]
    )
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", args[1] is closure)))
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: seen.append(("global pre", type(o).__name__))),
        register_optimizer_step_post_hook(lambda o, a, k: seen.append(("global post", type(o).__name__))),
    ]
    try:
        result = opt.step()
    finally:
        for handle in handles:
            handle.remove()
    assert result.loss == "replaced" and bool(result.stepped)
    assert seen == [
        ("global pre", "LossScaleOptimizer"),
        ("pre", True, 1),
        ("global pre", "SGD"),
        ("global post", "SGD"),
        ("post", True),
        ("global post", "LossScaleOptimizer"),
    ]


def test_a_step_pre_hook_that_returns_something_else_is_refused_as_torch_refuses_it():
    model, data = model_and_data()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=FixedScale(8.0))
    opt.register_step_pre_hook(lambda o, args, kwargs: "not a pair")
    opt.backward(loss_fn(model, *data[0]))
    with pytest.raises(RuntimeError, match=r"must return None or a tuple of \(new_args, new_kwargs\)"):
        opt.step()


def test_state_dict_hooks_run_and_may_rewrite():
    model, _ = model_and_data()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": 7})
    loaded = []
    opt.register_load_state_dict_post_hook(lambda o: loaded.append(True))
    saved = opt.state_dict()
    assert saved["tag"] == 7
    opt.load_state_dict(saved)
    assert loaded == [True]


def test_a_step_with_a_closure_runs_it_first_with_grad_and_reports_its_loss():
    model, data = model_and_data()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=FixedScale(8.0))
    calls = []

    def closure() -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = loss_fn(model, *data[0])
        opt.backward(loss)
        return loss

    with torch.no_grad():
        result = opt.step(closure)
    assert calls == [True] and bool(result.stepped) and result.loss is not None and result.loss.requires_grad


def test_a_step_without_gradients_raises_and_never_counts_as_clean():
    """With growth_interval=1 a clean step would grow the scale: a step that saw no gradient must not."""
    model, _ = model_and_data()
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), policy=DynamicScale(init_scale=1024.0, growth_interval=1)
    )
    with pytest.raises(NoGradientsError, match=r"LossScaleOptimizer\.step\(\): No inf checks were recorded"):
        opt.step()
    assert float(opt.scale) == 1024.0 and opt.state_dict()["boundaries"] == 0


def test_options_after_the_optimizer_are_keyword_only():
    model, _ = model_and_data()
    with pytest.raises(TypeError):
        LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), FixedScale(4.0))


def test_float16_parameters_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match=r"param_groups\[0\]\[0\] is a float16 parameter.*autocast"):
        LossScaleOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))], lr=0.1))


def _proxy(opt: LossScaleOptimizer):
    """A proxy built as Lightning's LightningOptimizer is: a generated subclass, ``__dict__`` copied."""

    class Wrapper:
        pass

    cls = type("Lightning" + type(opt).__name__, (Wrapper, type(opt)), {})
    proxy = Wrapper.__new__(cls)
    proxy.__dict__ = {k: v for k, v in opt.__dict__.items() if k not in ("step", "__del__")}
    return proxy


def test_a_proxy_that_copies_the_dict_shares_the_scale_and_the_accumulation_position():
    model, data = model_and_data()
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), policy=DynamicScale(init_scale=1024.0), accumulation_steps=2
    )
    proxy = _proxy(opt)
    proxy.set_scale(64.0)
    assert float(opt.scale) == 64.0
    proxy.backward(loss_fn(model, *data[0]))
    assert proxy.step().accumulating  # the first micro-batch, counted where opt sees it
    assert opt.state_dict()["micro_step"] == 1
    opt.backward(loss_fn(model, *data[1]) * torch.tensor(INF))
    result = opt.step()
    assert bool(result.found_inf) and proxy.last_result is result and float(proxy.scale) == 32.0


# --- flat gradients (the buffer itself: test_ops_flat.py) -------------------------------------------------------


def _flat_run(zero, steps=6):
    model, data = model_and_data(9)
    opt = LossScaleOptimizer(
        FUSED_ADAMW(model.parameters()),
        policy=DynamicScale(init_scale=2.0**10, growth_interval=2),
        clip_grad_norm=0.5,
        flat_grads=True,
    )
    for i, (x, y) in enumerate(data[:steps]):
        zero(model, opt)
        opt.backward(loss_fn(model, x, y))
        if i == 3:
            model[0].weight.grad[0, 0] = INF
        opt.step()
    return model, opt


def test_flat_gradients_set_to_none_elsewhere_go_back_into_the_buffer_before_the_backward():
    kept, _ = _flat_run(lambda model, opt: opt.zero_grad())
    released, opt = _flat_run(lambda model, opt: model.zero_grad())  # Lightning does it before validating
    assert opt._flat.attached(list(released.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(released.parameters(), kept.parameters()))


def test_flat_gradients_made_outside_the_buffer_are_copied_back_with_one_warning():
    def replace(model, opt):
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # a new tensor: the backward goes into it, not into the buffer

    kept, _ = _flat_run(lambda model, opt: opt.zero_grad())
    with pytest.warns(
        UserWarning,
        match=r"flat_grads=True\): some gradients were not views .* opt.zero_grad\(\)"
        r".* opt.backward\(loss\)",
    ) as record:
        replaced, opt = _flat_run(replace)
    assert len(record) == 1 and record[0].filename == __file__  # once per optimizer, though every step copied
    assert opt._flat.attached(list(replaced.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(replaced.parameters(), kept.parameters()))


def test_flat_gradients_follow_a_new_parameter_group_and_can_be_turned_off():
    model, opt = _flat_run(lambda model, opt: opt.zero_grad(), steps=2)
    extra = torch.nn.Parameter(torch.ones(5))
    opt.add_param_group({"params": [extra]})
    assert extra.grad is not None and opt._flat.attached(opt._params())
    opt.zero_grad()
    (model(torch.ones(1, 6)).sum() + (extra * 3).sum()).backward()
    assert torch.equal(extra.grad, torch.full((5,), 3.0))
    assert bool(opt.step().stepped) and not torch.equal(extra, torch.ones(5))
    opt.configure(flat_grads=False)
    opt.zero_grad()
    assert opt._flat is None and all(p.grad is None for p in opt._params())
