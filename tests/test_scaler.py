"""lossscale.GradScaler against torch.amp.GradScaler itself: twin runs (fixed and random call sequences), setters
between step and update, state dicts both ways, pickling, host reads, misuse of the call order.

torch's private names: test_scaler_torch_private.py. Bad arguments: test_entry_point_checks.py.
"""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale import DynamicScale, GradScaler, PredictiveScale
from lossscale.testing import HostReadCounter

INF, NAN = math.inf, math.nan
INJECT = {3: INF, 4: NAN, 9: INF, 10: INF, 11: INF, 17: NAN}


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "fused_adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "fused_sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
}


def train(scaler, opt_name: str, steps: int = 24, clip: bool = True, micro_batches: int = 1):
    """torch's AMP recipe under float16 autocast, with the overflows of INJECT written into a gradient."""
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    gen = torch.Generator().manual_seed(1)
    scales, stepped = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for _ in range(micro_batches):
            x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
        if step in INJECT:
            model[2].weight.grad[1, 3] = INJECT[step]
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        out = scaler.step(opt)
        stepped.append(None if isinstance(scaler, torch.amp.GradScaler) else bool(out.stepped))
        scaler.update()
        scales.append(scaler.get_scale())
    return model, opt, scales, stepped


def assert_same_training(ours: tuple, theirs: tuple) -> None:
    """Parameters and optimizer state bit for bit."""
    (model, opt), (ref_model, ref_opt) = ours, theirs
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(opt.state_dict()["state"].values(), ref_opt.state_dict()["state"].values()):
        assert p.keys() == q.keys()
        for k in p:
            assert torch.equal(torch.as_tensor(p[k]), torch.as_tensor(q[k])), k


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("clip", [True, False])
def test_twin_run_equals_torch_exactly(opt_name, clip):
    kw = dict(init_scale=2.0**12, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ref_model, ref_opt, ref_scales, _ = train(torch.amp.GradScaler("cpu", **kw), opt_name, clip=clip)
    model, opt, scales, stepped = train(GradScaler("cpu", **kw), opt_name, clip=clip)
    assert scales == ref_scales
    assert len(set(scales)) > 3  # the run really grew and backed off
    assert stepped == [i not in INJECT for i in range(len(stepped))]
    assert_same_training((model, opt), (ref_model, ref_opt))


def test_accumulation_over_backward_calls_equals_torch():
    kw = dict(init_scale=2.0**10, growth_interval=2)
    ref_model, ref_opt, ref_scales, _ = train(torch.amp.GradScaler("cpu", **kw), "adam", steps=12, micro_batches=3)
    model, opt, scales, _ = train(GradScaler("cpu", **kw), "adam", steps=12, micro_batches=3)
    assert scales == ref_scales and len(set(scales)) > 2
    assert_same_training((model, opt), (ref_model, ref_opt))


def run_two_optimizers(scaler, poisoned: str):
    """SGD (unscaled explicitly) over the first layer and fused AdamW over the second, one scaler; an inf in the
    gradients of one optimizer at steps 2 and 5."""
    model = make_model()
    o1 = torch.optim.SGD(model[0].parameters(), lr=0.1)
    o2 = torch.optim.AdamW(model[2].parameters(), lr=0.01, fused=True)
    gen = torch.Generator().manual_seed(3)
    scales = []
    for step in range(8):
        o1.zero_grad()
        o2.zero_grad()
        scaler.scale(model(torch.randn(4, 8, generator=gen)).square().mean()).backward()
        if step in (2, 5):
            (model[0].weight if poisoned == "first" else model[2].bias).grad.view(-1)[0] = INF
        scaler.unscale_(o1)
        scaler.step(o1)
        scaler.step(o2)
        scaler.update()
        scales.append(scaler.get_scale())
    return model, (o1, o2), scales


@pytest.mark.parametrize("poisoned", ["first", "second"])
def test_two_optimizers_back_off_on_an_overflow_in_either_as_torch(poisoned):
    ref_model, ref_opts, ref_scales = run_two_optimizers(
        torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2), poisoned
    )
    model, opts, scales = run_two_optimizers(GradScaler("cpu", init_scale=256.0, growth_interval=2), poisoned)
    assert scales == ref_scales and scales[2] == scales[1] / 2 and scales[5] < scales[4]
    for opt, ref_opt in zip(opts, ref_opts):
        assert_same_training((model, opt), (ref_model, ref_opt))


def test_a_fused_step_where_every_dtype_group_overflows_is_skipped():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    fused = torch.optim.AdamW([a, b], fused=True)
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    a.grad = torch.full((3,), INF)
    b.grad = torch.full((3,), NAN, dtype=torch.float16)
    result = scaler.step(fused)
    assert bool(result.found_inf) and not bool(result.stepped)
    assert torch.equal(a.detach(), torch.ones(3)) and torch.equal(b.detach(), torch.ones(3, dtype=torch.float16))


@pytest.mark.parametrize("coalesce", [False, True])
def test_a_sparse_embedding_steps_as_with_torch(coalesce):
    def run(scaler):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(6, 3, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        scaler.scale(emb(torch.tensor([1, 2, 1, 4])).square().sum()).backward()
        if coalesce:
            emb.weight.grad = emb.weight.grad.coalesce()
        scaler.step(opt)
        return emb.weight.detach()

    ours, theirs = run(GradScaler("cpu", init_scale=1024.0)), run(torch.amp.GradScaler("cpu", init_scale=1024.0))
    torch.manual_seed(0)
    start = torch.nn.Embedding(6, 3).weight.detach()
    assert torch.equal(ours, theirs)
    assert [not torch.equal(a, b) for a, b in zip(ours, start)] == [False, True, True, False, True, False]


# --- random call sequences ------------------------------------------------------------------------------

SCALES = st.one_of(
    st.sampled_from([2.0**k for k in range(-8, 40)]),
    st.floats(min_value=2.0**-8, max_value=2.0**40, allow_nan=False, allow_infinity=False),
)
ITERATION = st.fixed_dictionaries(
    {
        "inject": st.one_of(st.none(), st.tuples(st.sampled_from([INF, -INF, NAN]), st.integers(0, 7))),
        "unscale_first": st.booleans(),
        "new_scale": st.one_of(st.none(), st.none(), SCALES, SCALES.map(torch.tensor)),
        "round_trip": st.sampled_from([None, None, "own", "torch_into_lossscale", "lossscale_into_torch"]),
    }
)
CONFIG = st.fixed_dictionaries(
    {
        "init_scale": SCALES,
        "growth_factor": st.sampled_from([2.0, 1.5, 3.0, 1.25]),
        "backoff_factor": st.sampled_from([0.5, 0.25, 0.8, 0.125]),
        "growth_interval": st.integers(1, 4),
    }
)


class Run:
    """One model, its SGD-with-momentum optimizer and a scaler; every run starts from the same weights."""

    def __init__(self, scaler_cls: type, config: dict) -> None:
        gen = torch.Generator().manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=2.0**-6, momentum=0.5)
        self.scaler_cls, self.config = scaler_cls, config
        self.scaler = scaler_cls("cpu", **config)

    def backward(self, x: torch.Tensor, inject: tuple[float, int] | None) -> None:
        self.opt.zero_grad()
        self.scaler.scale(self.model(x).square().mean()).backward()
        if inject is not None:
            value, index = inject
            grads = [p.grad for p in self.model.parameters()]
            grad = grads[index % len(grads)]
            grad.view(-1)[index % grad.numel()] = value

    def step(self, unscale_first: bool) -> bool:
        """Whether the optimizer's step was applied (torch's: its found_inf, read before update())."""
        if unscale_first:
            self.scaler.unscale_(self.opt)
        result = self.scaler.step(self.opt)
        if isinstance(self.scaler, GradScaler):
            return bool(result.stepped)
        return sum(float(v) for v in self.scaler._found_inf_per_device(self.opt).values()) == 0.0

    def reload(self, state: dict) -> None:
        self.scaler = self.scaler_cls("cpu", **self.config)
        self.scaler.load_state_dict(state)


def check_twins(ours: Run, theirs: Run, where: str) -> None:
    assert ours.scaler.get_scale() == theirs.scaler.get_scale(), where
    for p, q in zip(ours.model.parameters(), theirs.model.parameters()):
        assert torch.equal(p, q), where
        a, b = ours.opt.state[p], theirs.opt.state[q]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), where


@settings(max_examples=60, deadline=None)
@given(config=CONFIG, iterations=st.lists(ITERATION, min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_random_call_sequences_agree_with_torch_after_every_call(config, iterations, seed):
    """Random iterations of zero_grad / scale(loss).backward() / an inf or NaN in a gradient / unscale_ (optional) /
    step / update() or update(new_scale), with state-dict round trips (own format, or the other scaler's) between
    them. The runs stay above the 2**-126 floor, where lossscale stops and torch goes on into subnormals (an
    intended difference)."""
    ours, theirs = Run(GradScaler, config), Run(torch.amp.GradScaler, config)
    gen = torch.Generator().manual_seed(seed)
    for i, it in enumerate(iterations):
        x = torch.randn(5, 3, generator=gen)
        for run in (ours, theirs):
            run.backward(x, it["inject"])
        applied = [run.step(it["unscale_first"]) for run in (ours, theirs)]
        assert applied[0] == applied[1] == (it["inject"] is None), f"iteration {i}: skip decision"
        for run in (ours, theirs):
            new_scale = it["new_scale"]
            run.scaler.update(new_scale=new_scale.clone() if isinstance(new_scale, torch.Tensor) else new_scale)
        check_twins(ours, theirs, f"iteration {i}: after update")
        assert ours.scaler.get_scale() >= 2.0**-126
        if it["round_trip"] == "own":
            ours.reload(ours.scaler.state_dict())
            theirs.reload(theirs.scaler.state_dict())
        elif it["round_trip"] == "torch_into_lossscale":
            ours.reload(theirs.scaler.state_dict())
        elif it["round_trip"] == "lossscale_into_torch":
            theirs.reload(torch_keys(ours.scaler.state_dict()))
        check_twins(ours, theirs, f"iteration {i}: after the round trip {it['round_trip']}")


# --- setters and state dicts -----------------------------------------------------------------------------


def torch_keys(saved: dict, **changes) -> dict:
    """A state dict of ours as torch's: without policy_state."""
    return {**{k: v for k, v in saved.items() if k != "policy_state"}, **changes}


SETTERS_BETWEEN_STEP_AND_UPDATE = {  # each changes the rule or the state at every iteration i
    "set_growth_factor": lambda s, i: s.set_growth_factor(2.0 + i),
    "set_backoff_factor": lambda s, i: s.set_backoff_factor(1 / (2.0 + i)),
    "set_growth_interval": lambda s, i: s.set_growth_interval(2 - i % 2),
    "load_state_dict": lambda s, i: s.load_state_dict(
        torch_keys(s.state_dict(), scale=64.0 * 2**i, _growth_tracker=i % 2)
    ),
    "_scale": lambda s, i: setattr(s, "_scale", torch.tensor(32.0 * 2**i)),
    "_scale.fill_": lambda s, i: s._scale.fill_(256.0 * (i + 1)),  # real code's way to reset the scale
    "_growth_tracker.fill_": lambda s, i: s._growth_tracker.fill_(1 - i % 2),
}


@pytest.mark.parametrize("opt_name", ["sgd", "fused_adamw"])
@pytest.mark.parametrize("setter", sorted(SETTERS_BETWEEN_STEP_AND_UPDATE))
def test_a_setter_between_step_and_update_applies_to_that_update_as_in_torch(setter, opt_name):
    """update() uses the rule and the state as they are when it runs, as torch's does."""
    trajectories = []
    for scaler_type in (torch.amp.GradScaler, GradScaler):
        model = make_model()
        opt = OPTIMIZERS[opt_name](model.parameters())
        scaler = scaler_type("cpu", init_scale=1024.0, growth_interval=1)
        scales = []
        for i in range(5):
            scaler.scale(model(torch.ones(2, 8)).sum()).backward()
            if i in (1, 3):
                next(model.parameters()).grad[0, 0] = INF
            scaler.step(opt)
            SETTERS_BETWEEN_STEP_AND_UPDATE[setter](scaler, i)
            scaler.update()
            opt.zero_grad()
            scales.append((scaler.get_scale(), scaler._growth_tracker.item()))
        trajectories.append((scales, [p.detach().clone() for p in model.parameters()]))
    (torch_scales, torch_params), (our_scales, our_params) = trajectories
    assert our_scales == torch_scales
    assert all(torch.equal(a, b) for a, b in zip(torch_params, our_params))


def one_iteration(scaler, opt, model, inf: bool = False) -> None:
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    if inf:
        model[0].weight.grad[0, 0] = INF


def test_state_dict_round_trips_mid_run_in_our_format_torchs_and_by_pickle():
    kw = dict(init_scale=2.0**10, growth_interval=3)
    scaler = GradScaler(**kw)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pattern = [False, True, False, False, False, False, True, False, False, False, False]
    trajectory = []
    for i, inf in enumerate(pattern):
        one_iteration(scaler, opt, model, inf)
        scaler.step(opt)
        scaler.update()
        trajectory.append(scaler.get_scale())
        if i == 3:
            saved = scaler.state_dict()
            pickled = pickle.dumps(scaler)
            start = copy.deepcopy((model.state_dict(), opt.state_dict()))
    assert saved["_growth_tracker"] == 2 and saved["scale"] == 512.0

    from_ours = GradScaler(**kw)
    from_ours.load_state_dict(saved)
    ref = torch.amp.GradScaler("cpu", **kw)
    ref.load_state_dict(torch_keys(saved))  # torch loads ours
    assert ref.get_scale() == 512.0 and ref._get_growth_tracker() == 2
    via_torch = GradScaler(**kw)
    via_torch.load_state_dict(ref.state_dict())  # and we load torch's
    for restored in [from_ours, pickle.loads(pickled), via_torch]:
        model.load_state_dict(start[0])
        opt.load_state_dict(start[1])
        rest = []
        for inf in pattern[4:]:
            one_iteration(restored, opt, model, inf)
            restored.step(opt)
            restored.update()
            rest.append(restored.get_scale())
        assert rest == trajectory[4:]


@pytest.mark.parametrize(
    ("key", "field", "value"), [("scale", "scale", 64.0), ("_growth_tracker", "growth_tracker", 3)]
)
def test_a_state_dict_whose_two_copies_of_the_scale_disagree_is_refused_naming_both(key, field, value):
    """state_dict() writes the scale and the growth tracker twice (torch's keys, policy_state); an edit of one
    copy is never silently dropped for the other: torch's keys alone load, two that disagree raise."""
    scaler = GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))
    edited = {**scaler.state_dict(), key: value}
    message = rf"state_dict\['{key}'\] = {value}.*\['policy_state'\]\['{field}'\].*disagree"
    with pytest.raises(ValueError, match=message):
        scaler.load_state_dict(edited)
    assert scaler.get_scale() == 1024.0 and int(scaler._growth_tracker) == 0  # nothing changed
    scaler.load_state_dict(torch_keys(edited))  # torch's keys alone: the edit applies, as in torch
    twin = torch.amp.GradScaler("cpu", init_scale=1024.0)
    twin.scale(torch.ones(()))
    twin.load_state_dict(torch_keys(edited))
    assert scaler.get_scale() == twin.get_scale() and int(scaler._growth_tracker) == int(twin._growth_tracker)


def test_pickling_mid_iteration_is_refused():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler()
    one_iteration(scaler, opt, model)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="pickled only between iterations"):
        pickle.dumps(scaler)


# --- beyond torch: host reads, saturation, attribution, policies that observe the loss ---------------------


def bare_step_reads(opt_name: str) -> int:
    """Host reads the optimizer makes by itself (CPU Adam reads its step counts): not the scaler's."""
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    with HostReadCounter() as reads:
        opt.step()
    return reads.count


@pytest.mark.parametrize("opt_name,scaler_reads", [("fused_adamw", 0), ("fused_sgd", 0), ("sgd", 1), ("adam", 1)])
def test_host_reads_are_torchs_one_for_a_step_skipped_on_the_host_and_none_for_fused_kernels(opt_name, scaler_reads):
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
    one_iteration(scaler, opt, model)  # without unscale_: a fused kernel unscales, still without a host read
    with HostReadCounter() as reads:
        scaler.step(opt)
        scaler.update()
    assert reads.count - bare == scaler_reads


@pytest.mark.parametrize("opt_name", ["fused_adamw", "fused_sgd"])
@pytest.mark.parametrize("clip", [True, False])
def test_skip_mode_host_never_calls_a_fused_step_that_overflows_and_otherwise_trains_as_torch(opt_name, clip):
    kw = dict(init_scale=2.0**12, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ref_model, ref_opt, ref_scales, _ = train(torch.amp.GradScaler("cpu", **kw), opt_name, clip=clip)
    calls = []
    real = OPTIMIZERS[opt_name]

    def counted(ps):
        opt = real(ps)
        opt.register_step_pre_hook(lambda *_: calls.append(1))
        return opt

    OPTIMIZERS[opt_name] = counted
    try:
        model, opt, scales, stepped = train(GradScaler("cpu", skip_mode="host", **kw), opt_name, clip=clip)
    finally:
        OPTIMIZERS[opt_name] = real
    assert len(calls) == len(stepped) - len(INJECT)  # the kernel never ran on an overflowing step
    assert scales == ref_scales and stepped == [i not in INJECT for i in range(len(stepped))]
    assert_same_training((model, opt), (ref_model, ref_opt))


def test_saturation_mode_skips_a_saturated_step_that_inf_nan_mode_applies():
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


def test_overflowing_parameters_names_the_culprit_before_and_after_unscale():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler()
    one_iteration(scaler, opt, model, inf=True)
    assert scaler.overflowing_parameters(opt, model) == ["0.weight"]
    scaler.unscale_(opt)
    assert scaler.overflowing_parameters(opt) == ["param_groups[0][0]"]  # no module: positions


def test_a_non_finite_loss_reaches_a_policy_that_observes_it():
    """PredictiveScale treats an overflow with a NaN loss as a fault of the data, not of the scale: it holds."""
    w = torch.nn.Parameter(torch.ones(4))
    sgd = torch.optim.SGD([w], lr=0.1)
    scaler = GradScaler(policy=PredictiveScale(init_scale=2.0**10))

    def one_step(factor: float) -> float:
        scaler.scale((w * factor).sum()).backward()
        scaler.step(sgd)
        scaler.update()
        sgd.zero_grad()
        return scaler.get_scale()

    before = [one_step(2.0) for _ in range(3)][-1]
    assert one_step(NAN) == before
    assert torch.allclose(w.detach(), torch.full((4,), 0.4))  # three applied steps, the NaN one skipped


# --- disabled, construction, call order ------------------------------------------------------------------


def test_a_disabled_scaler_is_the_identity_and_steps():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(enabled=False)
    x = torch.ones(3)
    assert scaler.scale(x) is x and scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    assert not scaler.is_enabled()
    before = [p.detach().clone() for p in model.parameters()]
    one_iteration(scaler, opt, model)
    result = scaler.step(opt)
    assert result.value is None and bool(result.stepped)
    assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(growth_factor=0.9), "growth_factor must be a finite number > 1"),
        (dict(overflow_mode="saturate"), "overflow_mode must be one of 'inf_nan', 'saturation'"),
        (dict(policy=DynamicScale(), init_scale=4.0), "pass either policy= or torch's scale arguments"),
    ],
)
def test_construction_is_checked_even_when_disabled(kwargs, needle, enabled):
    with pytest.raises(ValueError, match=needle):
        GradScaler(enabled=enabled, **kwargs)


MISUSE = {  # (calls after scale(loss).backward() or, with None, on a fresh scaler; the message)
    "step before scale": (None, lambda s, o: s.step(o), r"step\(\) was called before scale\(\)"),
    "unscale_ before scale": (None, lambda s, o: s.unscale_(o), r"unscale_\(\) was called before scale\(\)"),
    "update before scale": (None, lambda s, o: s.update(), r"update\(\) was called before scale\(\)"),
    "unscale_ twice": (
        lambda s, o: s.unscale_(o),
        lambda s, o: s.unscale_(o),
        r"unscale_\(\) was already called .* since the last update\(\)",
    ),
    "unscale_ after step": (
        lambda s, o: s.step(o),
        lambda s, o: s.unscale_(o),
        r"unscale_\(\) was called after step\(\)",
    ),
    "step twice": (lambda s, o: s.step(o), lambda s, o: s.step(o), r"step\(\) was already called .* update\(\)"),
    "update without step": (
        lambda s, o: None,
        lambda s, o: s.update(),
        r"update\(\) was called without unscale_\(\) "
        r"or step\(\)",
    ),
    "step with a closure": (lambda s, o: None, lambda s, o: s.step(o, closure=lambda: 0), "closure"),
}


@pytest.mark.parametrize("case", sorted(MISUSE))
def test_misuse_of_the_call_order_names_both_calls(case):
    before_call, call, message = MISUSE[case]
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler()
    if before_call is not None:
        one_iteration(scaler, opt, model)
        before_call(scaler, opt)
    with pytest.raises(RuntimeError, match=message):
        call(scaler, opt)


def test_unscale_refuses_float16_gradients():
    half = torch.nn.Linear(2, 2).half()
    opt = torch.optim.SGD(half.parameters(), lr=0.1)
    scaler = GradScaler()
    scaler.scale(half(torch.ones(1, 2, dtype=torch.half)).float().sum()).backward()
    with pytest.raises(ValueError, match=r"GradScaler\.unscale_\(optimizer\): the optimizer holds float16 gradients"):
        scaler.unscale_(opt)
