"""lossscale.GradScaler against torch.amp.GradScaler itself: twin runs, host reads, misuse, checkpoints."""

import copy
import pickle

import pytest
import torch

import lossscale
from lossscale import DynamicScale, GradScaler, HostReadCounter

from _noting_policy import NotingScale

INJECT = {3: "inf", 4: "nan", 9: "inf", 10: "inf", 11: "inf", 17: "nan"}


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "fused_adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "fused_sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
}


def train(scaler, opt_name, steps=24, clip=True, micro_batches=1, seed=0):
    model = make_model(seed)
    opt = OPTIMIZERS[opt_name](model.parameters())
    gen = torch.Generator().manual_seed(1)
    scales, decisions = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for _ in range(micro_batches):
            x = torch.randn(32, 8, generator=gen)
            y = torch.randn(32, 4, generator=gen)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
        if step in INJECT:
            model[2].weight.grad[1, 3] = float(INJECT[step])
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        out = scaler.step(opt)
        decisions.append(out)
        scaler.update()
        scales.append(scaler.get_scale())
    return model, opt, scales, decisions


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("clip", [True, False])
def test_twin_run_equals_torch_exactly(opt_name, clip):
    kw = dict(init_scale=2.0**12, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ref_model, ref_opt, ref_scales, _ = train(torch.amp.GradScaler("cpu", **kw), opt_name, clip=clip)
    model, opt, scales, decisions = train(GradScaler("cpu", **kw), opt_name, clip=clip)
    assert scales == ref_scales
    assert len(set(scales)) > 3  # the run really grew and backed off
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(opt.state_dict()["state"].values(), ref_opt.state_dict()["state"].values()):
        for k in p:
            assert torch.equal(torch.as_tensor(p[k]), torch.as_tensor(q[k])), k
    stepped = [bool(d.stepped) for d in decisions]
    assert stepped == [i not in INJECT for i in range(len(stepped))]


def test_accumulation_over_backward_calls_equals_torch():
    kw = dict(init_scale=2.0**10, growth_interval=2)
    ref, _, ref_scales, _ = train(torch.amp.GradScaler("cpu", **kw), "adam", micro_batches=3)
    ours, _, scales, _ = train(GradScaler("cpu", **kw), "adam", micro_batches=3)
    assert scales == ref_scales
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters()))


def run_two_optimizers(scaler, inject_second_at):
    model = make_model()
    o1 = torch.optim.SGD(model[0].parameters(), lr=0.1)
    o2 = torch.optim.AdamW(model[2].parameters(), lr=0.01, fused=True)
    gen = torch.Generator().manual_seed(3)
    for step in range(8):
        o1.zero_grad(); o2.zero_grad()
        loss = model(torch.randn(4, 8, generator=gen)).square().mean()
        scaler.scale(loss).backward()
        if step == inject_second_at:
            model[2].bias.grad[0] = float("inf")
        scaler.unscale_(o1)
        scaler.step(o1)
        scaler.step(o2)
        scaler.update()
    return model, scaler.get_scale()


def test_multiple_optimizers_equal_torch():
    ref_model, ref_scale = run_two_optimizers(torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2), 5)
    model, scale = run_two_optimizers(GradScaler(init_scale=256.0, growth_interval=2), 5)
    assert scale == ref_scale
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


def one_iteration(scaler, opt, model, inf=False):
    opt.zero_grad()
    loss = model(torch.ones(2, 8)).sum()
    scaler.scale(loss).backward()
    if inf:
        model[0].weight.grad[0, 0] = float("inf")


def bare_step_reads(opt_name):
    """Host reads the optimizer makes by itself (CPU Adam reads its step counts): not the scaler's."""
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    with HostReadCounter() as reads:
        opt.step()
    return reads.count


@pytest.mark.parametrize("opt_name,scaler_reads", [("fused_adamw", 0), ("fused_sgd", 0), ("sgd", 1), ("adam", 1)])
def test_host_reads(opt_name, scaler_reads):
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    scaler = GradScaler()
    bare = bare_step_reads(opt_name)
    for inf in [False, True, False]:
        one_iteration(scaler, opt, model, inf)
        with HostReadCounter() as r_unscale:
            scaler.unscale_(opt)
        with HostReadCounter() as r_step:
            scaler.step(opt)
        with HostReadCounter() as r_update:
            scaler.update()
        own = 0 if (inf and scaler_reads) else bare  # a host-read skip never calls the optimizer
        assert (r_unscale.count, r_step.count - own, r_update.count) == (0, scaler_reads, 0)
    # without an explicit unscale_, the fused path checks read-only, still without a host read
    one_iteration(scaler, opt, model)
    with HostReadCounter() as reads:
        scaler.step(opt)
        scaler.update()
    assert reads.count - bare == scaler_reads


def test_skipped_fused_step_leaves_params_and_state_bit_identical():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = GradScaler()
    one_iteration(scaler, opt, model)
    scaler.step(opt); scaler.update()
    params = copy.deepcopy(list(model.parameters()))
    state = copy.deepcopy(opt.state_dict())
    one_iteration(scaler, opt, model, inf=True)
    out = scaler.step(opt)
    scaler.update()
    assert not bool(out.stepped) and bool(out.found_inf)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    for k, v in opt.state_dict()["state"].items():
        for name in v:
            assert torch.equal(v[name], state["state"][k][name])


def test_saturation_mode_skips_a_saturated_step():
    for mode, skipped in [("inf_nan", False), ("saturation", True)]:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = GradScaler(init_scale=1.0, overflow_mode=mode)
        one_iteration(scaler, opt, model)
        model[0].weight.grad[0, 0] = -65504.0
        out = scaler.step(opt)
        scaler.update()
        assert bool(out.found_inf) is skipped
        assert scaler.get_scale() == (0.5 if skipped else 1.0)


def test_overflowing_parameters_names_the_culprit():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler()
    one_iteration(scaler, opt, model, inf=True)
    assert scaler.overflowing_parameters(opt, model) == ["0.weight"]
    scaler.unscale_(opt)
    assert scaler.overflowing_parameters(opt) == ["param_groups[0][0]"]


def test_step_returns_the_optimizer_value():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(enabled=False)
    one_iteration(scaler, opt, model)
    assert scaler.step(opt).value is None and bool(scaler.step(opt).stepped)


class TestMisuse:
    def setup_method(self):
        self.model = make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.scaler = GradScaler()

    def test_step_before_scale(self):
        with pytest.raises(RuntimeError, match=r"step\(\) was called before scale\(\)"):
            self.scaler.step(self.opt)
        with pytest.raises(RuntimeError, match=r"unscale_\(\) was called before scale\(\)"):
            self.scaler.unscale_(self.opt)
        with pytest.raises(RuntimeError, match=r"update\(\) was called before scale\(\)"):
            self.scaler.update()

    def test_unscale_twice(self):
        one_iteration(self.scaler, self.opt, self.model)
        self.scaler.unscale_(self.opt)
        with pytest.raises(RuntimeError, match=r"unscale_\(\) was already called .* since the last update\(\)"):
            self.scaler.unscale_(self.opt)

    def test_unscale_after_step_and_step_twice(self):
        one_iteration(self.scaler, self.opt, self.model)
        self.scaler.step(self.opt)
        with pytest.raises(RuntimeError, match=r"unscale_\(\) was called after step\(\)"):
            self.scaler.unscale_(self.opt)
        with pytest.raises(RuntimeError, match=r"step\(\) was already called .* update\(\)"):
            self.scaler.step(self.opt)

    def test_update_without_step(self):
        one_iteration(self.scaler, self.opt, self.model)
        with pytest.raises(RuntimeError, match=r"update\(\) was called without unscale_\(\) or step\(\)"):
            self.scaler.update()

    def test_closure_and_fp16_grads(self):
        one_iteration(self.scaler, self.opt, self.model)
        with pytest.raises(RuntimeError, match="closure"):
            self.scaler.step(self.opt, closure=lambda: 0)
        half = torch.nn.Linear(2, 2).half()
        opt = torch.optim.SGD(half.parameters(), lr=0.1)
        self.scaler.scale(half(torch.ones(1, 2, dtype=torch.half)).float().sum()).backward()
        with pytest.raises(ValueError, match="float16 gradients"):
            self.scaler.unscale_(opt)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(growth_factor=0.9), "growth_factor must be a finite number > 1"),
    (dict(backoff_factor=1.5), "backoff_factor must be in"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(init_scale=-1.0), "init_scale"),
    (dict(init_scale=float("nan")), "init_scale"),
    (dict(overflow_mode="saturate"), "overflow_mode must be one of 'inf_nan', 'saturation'"),
    (dict(policy=DynamicScale(), init_scale=4.0), "pass either policy= or torch's scale arguments"),
    (dict(enabled="yes"), "enabled must be True or False"),
])
@pytest.mark.parametrize("enabled", [True, False])
def test_constructor_validation_even_when_disabled(kwargs, needle, enabled):
    kwargs = {"enabled": enabled, **kwargs}
    with pytest.raises(ValueError, match=needle):
        GradScaler(**kwargs)


def test_policy_must_be_a_policy():
    with pytest.raises(TypeError, match="policy must have init"):
        GradScaler(policy=object())


def test_update_new_scale_is_validated_and_applied():
    scaler = GradScaler()
    scaler.scale(torch.ones(()))
    scaler.update(1024.0)
    assert scaler.get_scale() == 1024.0
    scaler.update(torch.tensor(8.0))
    assert scaler.get_scale() == 8.0
    for bad in [0.0, float("inf"), -2.0]:
        with pytest.raises(ValueError, match="new_scale must be a finite number > 0"):
            scaler.update(bad)


def test_state_dict_round_trip_mid_run_and_torch_format():
    kw = dict(init_scale=2.0**10, growth_interval=3)
    scaler = GradScaler(**kw)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pattern = [False, True, False, False, False, False, True, False, False, False, False]
    trajectory = []
    saved = None
    for i, inf in enumerate(pattern):
        one_iteration(scaler, opt, model, inf)
        scaler.step(opt); scaler.update()
        trajectory.append(scaler.get_scale())
        if i == 3:
            saved = scaler.state_dict()
            pickled = pickle.dumps(scaler)
    assert saved["_growth_tracker"] == 2 and saved["scale"] == 512.0

    from_ours = GradScaler(**kw)
    from_ours.load_state_dict(saved)
    via_torch = GradScaler(**kw)
    ref = torch.amp.GradScaler("cpu", **kw)
    ref.load_state_dict({k: v for k, v in saved.items() if k != "policy_state"})  # torch loads ours
    assert ref.get_scale() == 512.0 and ref._get_growth_tracker() == 2
    via_torch.load_state_dict(ref.state_dict())  # and we load torch's
    for restored in [from_ours, pickle.loads(pickled), via_torch]:
        rest = []
        for inf in pattern[4:]:
            one_iteration(restored, opt, model, inf)
            restored.step(opt); restored.update()
            rest.append(restored.get_scale())
        assert rest == trajectory[4:]


def test_pickling_mid_iteration_is_refused():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler()
    one_iteration(scaler, opt, model)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="pickled only between iterations"):
        pickle.dumps(scaler)


def test_disabled_scaler_is_identity():
    scaler = GradScaler(enabled=False)
    x = torch.ones(3)
    assert scaler.scale(x) is x and scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    assert not scaler.is_enabled()


def test_public_surface():
    assert set(lossscale.__all__) >= {"GradScaler", "DynamicScale", "FixedScale"}


def test_step_flags_are_bool_tensors_formed_from_the_count_of_overflows():
    for count, overflowed in [(0.0, False), (1.0, True), (2.0, True)]:
        decision = lossscale.ScalerStep(overflow=torch.tensor(count))
        assert decision.found_inf.dtype == torch.bool and decision.stepped.dtype == torch.bool
        assert bool(decision.found_inf) is overflowed and bool(decision.stepped) is not overflowed
    flag = lossscale.ScalerStep(overflow=torch.tensor(True))
    assert bool(flag.found_inf) and not bool(flag.stepped)


@pytest.mark.parametrize("start", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("poison", [None, "inf", "nan"])
def test_private_unscale_grads_returns_what_torchs_returns(start, poison):
    results = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=4.0), GradScaler("cpu", init_scale=4.0)):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.scale(model(torch.ones(2, 8)).sum()).backward()
        if poison:
            model[2].bias.grad[1] = float(poison)
        found = scaler._unscale_grads_(opt, torch.tensor(0.25), torch.tensor(start), False)
        results.append(({str(d): float(f) for d, f in found.items()}, [p.grad.clone() for p in model.parameters()]))
    (torch_found, torch_grads), (our_found, our_grads) = results
    assert our_found == torch_found
    assert all(torch.equal(a, b) for a, b in zip(torch_grads, our_grads) if torch.isfinite(a).all())


def _noted_iteration(scaler, optimizers, poisoned=()):
    """One iteration over ``optimizers`` (each over a model of its own); ``poisoned``: indices whose gradients
    hold an inf. Returns the events of steps and policy updates."""
    NotingScale.EVENTS = []
    for i, (model, opt) in enumerate(optimizers):
        scaler.scale(model(torch.ones(2, 8)).sum()).backward()
        if i in poisoned:
            next(model.parameters()).grad[0, 0] = float("inf")
        opt.register_step_pre_hook(lambda *_: NotingScale.EVENTS.append("step"))
        scaler.step(opt)
        opt.zero_grad()
        opt._optimizer_step_pre_hooks.clear()
    NotingScale.EVENTS.append("update")
    scaler.update()
    return list(NotingScale.EVENTS)


@pytest.mark.parametrize("poisoned", [0, 1])
@pytest.mark.parametrize("opt_name", ["sgd", "fused_adamw"])
def test_with_two_optimizers_an_overflow_in_either_backs_off(opt_name, poisoned):
    pairs = [(m, OPTIMIZERS[opt_name](m.parameters())) for m in (make_model(0), make_model(1))]
    scaler = GradScaler("cpu", policy=NotingScale(init_scale=8.0, growth_interval=1))
    _noted_iteration(scaler, pairs, poisoned={poisoned})  # an overflow in one optimizer only
    assert scaler.get_scale() == 4.0  # backed off: update() saw both, not one optimizer's verdict
    _noted_iteration(scaler, pairs)
    assert scaler.get_scale() == 8.0


def _torch_keys(saved, **changes):
    return {**{k: v for k, v in saved.items() if k != "policy_state"}, **changes}


SETTERS_BETWEEN_STEP_AND_UPDATE = {  # each changes the rule or the state at every iteration i
    "set_growth_factor": lambda s, i: s.set_growth_factor(2.0 + i),
    "set_backoff_factor": lambda s, i: s.set_backoff_factor(1 / (2.0 + i)),
    "set_growth_interval": lambda s, i: s.set_growth_interval(2 - i % 2),
    "load_state_dict": lambda s, i: s.load_state_dict(_torch_keys(s.state_dict(), scale=64.0 * 2**i,
                                                                  _growth_tracker=i % 2)),
    "_scale": lambda s, i: setattr(s, "_scale", torch.tensor(32.0 * 2**i)),
    "_scale.fill_": lambda s, i: s._scale.fill_(256.0 * (i + 1)),  # real code's way to reset the scale
    "_growth_tracker.fill_": lambda s, i: s._growth_tracker.fill_(1 - i % 2),
}


@pytest.mark.parametrize("opt_name", ["sgd", "fused_adamw"])
@pytest.mark.parametrize("setter", sorted(SETTERS_BETWEEN_STEP_AND_UPDATE))
def test_a_setter_between_step_and_update_applies_to_that_update_as_in_torch(setter, opt_name):
    """update() uses the rule and the state as they are when it runs (torch's order), though step() already
    computed the next state before the optimizer ran: a stale one is never installed."""
    trajectories = []
    for scaler_type in (torch.amp.GradScaler, GradScaler):
        model = make_model()
        opt = OPTIMIZERS[opt_name](model.parameters())
        scaler = scaler_type("cpu", init_scale=1024.0, growth_interval=1)
        scales = []
        for i in range(5):
            scaler.scale(model(torch.ones(2, 8)).sum()).backward()
            if i in (1, 3):
                next(model.parameters()).grad[0, 0] = float("inf")
            scaler.step(opt)
            SETTERS_BETWEEN_STEP_AND_UPDATE[setter](scaler, i)
            scaler.update()
            opt.zero_grad()
            scales.append((scaler.get_scale(), scaler._growth_tracker.item()))
        trajectories.append((scales, [p.detach().clone() for p in model.parameters()]))
    (torch_scales, torch_params), (our_scales, our_params) = trajectories
    assert our_scales == torch_scales
    assert all(torch.equal(a, b) for a, b in zip(torch_params, our_params))


@pytest.mark.parametrize(("key", "field", "value"), [("scale", "scale", 64.0), ("_growth_tracker", "growth_tracker", 3)])
def test_a_state_dict_whose_two_copies_of_the_scale_disagree_is_refused_naming_both(key, field, value):
    """state_dict() writes the scale and the growth tracker twice (torch's keys, policy_state); an edit of one
    copy is never silently dropped for the other: torch's keys alone load, two that disagree raise."""
    scaler = GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))
    edited = {**scaler.state_dict(), key: value}
    with pytest.raises(ValueError, match=rf"state_dict\['{key}'\] = {value}.*\['policy_state'\]\['{field}'\].*disagree"):
        scaler.load_state_dict(edited)
    assert scaler.get_scale() == 1024.0 and int(scaler._growth_tracker) == 0  # nothing changed
    scaler.load_state_dict(_torch_keys(edited))  # torch's keys alone: the edit applies, as in torch
    twin = torch.amp.GradScaler("cpu", init_scale=1024.0)
    twin.scale(torch.ones(()))
    twin.load_state_dict(_torch_keys(edited))
    assert scaler.get_scale() == twin.get_scale() and int(scaler._growth_tracker) == int(twin._growth_tracker)
