"""PredictiveScale: a pure-Python oracle of its rule, synthetic gradient streams, bounds, state, host reads."""

import math
import pickle
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale import HostReadCounter
from lossscale.policy import state_from_dict, state_to_dict
from lossscale.predictive import PredictiveScale
from lossscale.underflow import underflow_share

LIMIT = 65504.0


class PredictiveOracle:
    """The documented rule in plain Python floats (float32 rounding of the stored history)."""

    def __init__(self, init_scale, margin, history, backoff_factor=0.5, learn_margin=True, forget_interval=1000,
                 min_scale=2.0**-126, max_scale=3.4028234663852886e38):
        self.lo = 2.0 ** math.ceil(math.log2(min_scale))
        self.hi = 2.0 ** math.floor(math.log2(max_scale))
        self.scale = min(max(2.0 ** math.floor(math.log2(init_scale)), self.lo), self.hi)
        self.margin, self.n, self.backoff = margin, history, backoff_factor
        self.learn, self.forget = learn_margin, forget_interval
        self.hist = [0.0] * history
        self.pos = self.extra = self.run = 0

    def step(self, overflow, amax):
        import struct
        obs = LIMIT / self.scale if overflow else (amax / self.scale if math.isfinite(amax) else 0.0)
        self.hist[self.pos] = struct.unpack("f", struct.pack("f", min(obs, 3.4028234663852886e38)))[0]
        self.pos = (self.pos + 1) % self.n
        window = max(self.hist)
        surprise = overflow and self.run > 0
        self.run = 0 if overflow else self.run + 1
        if self.learn:
            if surprise:
                self.extra += 1
            elif self.run >= self.forget:
                self.extra = max(self.extra - 1, 0)
                self.run = 0
        if window > 0:
            e = math.floor(math.log2(LIMIT / window)) - self.margin - self.extra
            pred = 2.0 ** min(max(e, -126), 127)
        else:
            pred = self.scale
        if overflow:
            pred = min(pred, self.scale * self.backoff)
        pred = 2.0 ** math.floor(math.log2(pred))
        self.scale = min(max(pred, self.lo), self.hi)
        return self.scale


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.floats(1e-12, 1e4)), min_size=1, max_size=150),
       st.integers(0, 3), st.integers(1, 20), st.booleans(), st.integers(1, 30), st.sampled_from([0.5, 0.25, 0.3]))
def test_matches_oracle(steps, margin, history, learn, forget, backoff):
    policy = PredictiveScale(init_scale=2.0**15, margin=margin, history=history, learn_margin=learn,
                             forget_interval=forget, backoff_factor=backoff)
    oracle = PredictiveOracle(2.0**15, margin, history, backoff, learn, forget)
    state = policy.init()
    for overflow, unscaled_amax in steps:
        amax = float("inf") if overflow else unscaled_amax * float(state.scale)
        state = policy.update(state, torch.tensor(overflow), amax=torch.tensor(amax))
        assert float(state.scale) == oracle.step(overflow, amax)


def simulate(policy, amaxes, limit=LIMIT):
    """A synthetic stream: a step overflows when its unscaled max times the scale reaches the limit."""
    state = policy.init()
    scales, overflows = [], []
    for a in amaxes:
        scale = float(state.scale)
        over = a * scale >= limit
        scales.append(scale)
        overflows.append(over)
        state = policy.update(state, torch.tensor(over), amax=torch.tensor(float("inf") if over else a * scale))
    return scales, overflows


def test_slow_drift_never_overflows():
    rng = random.Random(0)
    amaxes = [1e-3 * math.exp(4 * t / 3000) * rng.uniform(0.8, 1.0) for t in range(3000)]
    scales, overflows = simulate(PredictiveScale(margin=1, history=16), amaxes)
    assert not any(overflows)
    assert all(math.log2(s).is_integer() for s in scales)
    # and the scale follows the drift down (no underflow from a stale small scale: within 2**3 of ideal)
    ideal = [LIMIT / a for a in amaxes]
    assert all(ideal[t] / 2**3 <= scales[t] <= ideal[t] for t in range(20, 3000))


@pytest.mark.parametrize("learn_margin", [False, True])
def test_spikes_overflow_alone_and_recover_within_history(learn_margin):
    history = 10
    base = [2e-3] * 400
    spikes = {100, 250}
    amaxes = [a * (2**8 if t in spikes else 1) for t, a in enumerate(base)]
    scales, overflows = simulate(PredictiveScale(margin=1, history=history, learn_margin=learn_margin,
                                                 forget_interval=50), amaxes)
    assert {t for t, o in enumerate(overflows) if o} == spikes  # only the spike steps themselves
    settled = scales[99]
    for s in spikes:
        assert scales[s + 1] < settled
        # back to the settled scale within `history` steps (plus the learned margin's forgetting)
        recover = history + 1 if not learn_margin else 50 + 1
        assert scales[s + recover] == settled


def test_long_quiet_stretch_never_overflows_where_blind_growth_does():
    from lossscale import DynamicScale
    amaxes = [0.6] * 6000
    scales, overflows = simulate(PredictiveScale(), amaxes)
    assert not any(overflows) and len(set(scales[1:])) == 1
    dyn, state, dyn_over = DynamicScale(), DynamicScale().init(), 0
    for a in amaxes:  # torch's rule grows blindly every 2000 clean steps and pays an overflow for it
        over = a * float(state.scale) >= LIMIT
        dyn_over += over
        state = dyn.update(state, torch.tensor(over))
    assert dyn_over >= 2


def test_zero_gradients_and_bounds_keep_a_power_of_two():
    amaxes = [1e-3] * 50 + [0.0] * 300 + [1e-30] * 200 + [1e-3] * 50
    scales, overflows = simulate(PredictiveScale(max_scale=2.0**40, min_scale=1.0), amaxes)
    assert all(1.0 <= s <= 2.0**40 and math.log2(s).is_integer() for s in scales)
    assert scales[349] == scales[49]  # all-zero gradients carry no information: the scale holds
    assert max(scales) == 2.0**40
    # the return from a 1e27-fold quiet stretch is a spike: it backs off several powers of two per step
    assert 1 <= sum(overflows) <= 8 and not any(overflows[-30:])


def test_beats_trial_and_error_on_skipped_steps():
    """On a stream where torch's rule (grow every 100, halve on overflow) keeps probing, far fewer skips."""
    from lossscale import DynamicScale
    rng = random.Random(1)
    amaxes = [1e-2 * rng.uniform(0.5, 1.0) for _ in range(3000)]
    _, pred_over = simulate(PredictiveScale(), amaxes)
    dyn = DynamicScale(growth_interval=100)
    state = dyn.init()
    dyn_over = 0
    for a in amaxes:
        over = a * float(state.scale) >= LIMIT
        dyn_over += over
        state = dyn.update(state, torch.tensor(over))
    assert dyn_over >= 20 and sum(pred_over) * 5 <= dyn_over


def test_update_has_no_host_read_and_state_round_trips():
    policy = PredictiveScale(history=5)
    state = policy.init()
    with HostReadCounter() as reads:
        for i in range(7):
            state = policy.update(state, torch.tensor(i == 3), amax=torch.tensor(float(i + 1)))
    assert reads.count == 0
    restored = state_from_dict(policy.init(), pickle.loads(pickle.dumps(state_to_dict(state))))
    a = policy.update(state, torch.tensor(False), amax=torch.tensor(3.0))
    b = policy.update(restored, torch.tensor(False), amax=torch.tensor(3.0))
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(margin=-1), "margin must be an integer >= 0"),
    (dict(history=0), "history must be an integer >= 1"),
    (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
    (dict(dtype=torch.int8), "dtype must be a floating-point"),
    (dict(init_scale=0.0), "init_scale"),
    (dict(min_scale=3.0, max_scale=3.5, init_scale=3.0), "no power of two"),
    (dict(learn_margin="yes"), "learn_margin must be one of True, False"),
])
def test_validation(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        PredictiveScale(**kwargs)


def test_underflow_share_counts_values_float16_rounds_to_zero():
    g = torch.tensor([0.0, 1e-9, -1e-9, 1e-3, 2.0**-25, 2.0**-24, 1.0])
    # nonzero: 6; at or below 2**-25: 1e-9, -1e-9, 2**-25
    assert float(underflow_share([g], stride=1)) == pytest.approx(3 / 6)
    assert float(underflow_share([g], stride=1, carried_scale=2.0**20)) == pytest.approx(0.0)
    half = torch.tensor([2.0**-24, 1.0, 0.0], dtype=torch.float16)  # a float16 subnormal is not zero
    assert float(underflow_share([half], stride=1)) == 0.0
    assert float(underflow_share([half], stride=1, carried_scale=2.0**-2)) == 0.5
    with pytest.raises(ValueError, match="stride must be an integer >= 1"):
        underflow_share([g], stride=0)


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
                                      lambda ps: torch.optim.SGD(ps, lr=1e-2)])
def test_works_in_both_scalers_and_predicts_from_the_observed_maximum(make_opt):
    from lossscale import GradScaler, LossScaleOptimizer
    x = torch.randn(16, 4)
    for shell in ["scaler", "optimizer"]:
        model = tiny_model()
        policy = PredictiveScale(init_scale=2.0**4, margin=2, history=3)
        if shell == "scaler":
            opt, scaler = make_opt(model.parameters()), GradScaler(policy=policy)
        else:
            opt = LossScaleOptimizer(make_opt(model.parameters()), policy=policy, underflow_stride=1)
        results = []
        for step in range(6):
            opt.zero_grad()
            loss = model(x).square().mean()
            if shell == "scaler":
                scaler.scale(loss).backward()
                used = scaler.get_scale()
                amax = max(float(p.grad.abs().max()) for p in model.parameters())
                if step == 2:
                    model[0].bias.grad[0] = float("inf")
                with HostReadCounter() as reads:
                    scaler.step(opt)
                    scaler.update()
                new = scaler.get_scale()
            else:
                opt.backward(loss)
                used = float(opt.scale)
                amax = max(float(p.grad.abs().max()) for p in model.parameters())
                if step == 2:
                    model[0].bias.grad[0] = float("inf")
                with HostReadCounter() as reads:
                    r = opt.step()
                new = float(r.next_scale)
                assert r.underflow is not None and 0.0 <= float(r.underflow) <= 1.0
                results.append(r)
            if getattr(opt, "_step_supports_amp_scaling", False) or shell == "optimizer" and opt.skip_mode == "fused":
                assert reads.count == 0
            if step == 2:
                assert new == used / 2**3  # at once: the overflow bound, less margin 2 and one learned power
            elif step < 2:
                # largest power of two keeping the window's max (unscaled) 2**margin below 65504
                assert new == 2.0 ** math.floor(math.log2(65504 / (amax / used)) - 2)
            assert math.log2(new).is_integer()


def test_optimizer_state_dict_round_trips_the_predictive_state():
    from lossscale import LossScaleOptimizer
    model = tiny_model()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=PredictiveScale(history=4))
    for _ in range(3):
        opt.zero_grad()
        opt.backward(model(torch.ones(2, 4)).sum())
        opt.step()
    saved = opt.state_dict()
    assert len(saved["policy_state"]["history"]) == 4 and saved["policy_state"]["position"] == 3
    other = LossScaleOptimizer(torch.optim.SGD(tiny_model().parameters(), lr=0.1), policy=PredictiveScale(history=4))
    other.load_state_dict(saved)
    assert torch.equal(other.scale_state.history, opt.scale_state.history)
