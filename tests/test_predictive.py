"""PredictiveScale: a pure-Python oracle of its rule, the issue-18 targets on seeded streams, faults,
bounds, state and host reads."""

import functools
import math
import pickle
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale import HostReadCounter
from lossscale.policies.base import state_from_dict, state_to_dict
from lossscale.policies.predictive import PredictiveScale
from lossscale.ops.underflow import underflow_share

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import _streams as streams  # noqa: E402  (the seeded stream generator the benchmark uses)

LIMIT = 65504.0


class PredictiveOracle:
    """The documented rule in plain Python floats (float64; the policy keeps float32)."""

    def __init__(self, policy: PredictiveScale):
        self.p = policy
        self.scale = 2.0 ** math.floor(math.log2(policy.init_scale))
        self.level = self.threshold = self.excess = self.extra = 0.0
        self.observed = self.run = 0
        self.pre = None  # log2 of the forecast before the floor (to spot float32/float64 ties)
        self.tie = False  # this step's residual equalled the threshold (float32 and float64 may disagree)

    def step(self, overflow, amax, loss_finite=None):
        p = self.p
        fault = overflow and (loss_finite is False or (math.isfinite(amax) and amax < LIMIT * 2.0**-p.fault_gap
                                                         and self.run > 0))
        evidence = overflow and not fault
        missed = evidence and self.observed > 0
        if not overflow and math.isfinite(amax) and amax > 0:
            x = math.log2(amax) - math.log2(self.scale)
            if self.observed == 0:
                self.level = x
            else:
                r = x - self.level
                self.tie = abs(r - self.threshold) < 1e-5
                self.level += r / p.history
                self.excess += (max(r - self.threshold, 0.0) - self.excess) / p.tail_history
                self.threshold += 0.05 * ((1.0 if r > self.threshold else 0.0) - 0.1)
            self.observed += 1
        self.extra = max(self.extra - 1.0 / p.forget_interval, 0.0) + (1.0 if missed and p.learn_margin else 0.0)
        w = self.observed / (self.observed + 50)
        width = w * self.excess / 0.1 + (1 - w) * 0.5
        self.pre = math.log2(LIMIT) - self.level - (self.threshold + width * math.log(0.1 * p.target_interval)
                                                    + self.extra + p.margin)
        forecast = 2.0 ** min(max(math.floor(self.pre), -126), 127)
        if fault:
            new = self.scale
        elif evidence:
            new = min(forecast, self.scale * p.backoff_factor) if self.observed else self.scale * 2.0**-8
        else:
            new = forecast if self.observed else self.scale
        self.scale = 2.0 ** math.floor(math.log2(new))
        self.run = 0 if overflow else self.run + 1
        return self.scale


def near_a_tie(oracle):
    return oracle.tie or (oracle.pre is not None and abs(oracle.pre - round(oracle.pre)) < 1e-3)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["clean", "clean", "clean", "inf", "fault-loss", "fault-amax"]),
                          st.floats(1e-6, 1e2)), min_size=1, max_size=120),
       st.integers(1, 40), st.integers(1, 60), st.integers(0, 2), st.booleans(), st.integers(1, 50),
       st.sampled_from([0.5, 0.25]), st.sampled_from([10, 1000, 20_000]))
def test_matches_oracle(steps, history, tail_history, margin, learn, forget, backoff, target):
    policy = PredictiveScale(init_scale=2.0**15, target_interval=target, history=history, tail_history=tail_history,
                             margin=margin, learn_margin=learn, forget_interval=forget, backoff_factor=backoff)
    oracle = PredictiveOracle(policy)
    state = policy.init()
    for kind, unscaled in steps:
        scale = float(state.scale)
        overflow = kind != "clean"
        amax = {"clean": unscaled * scale, "inf": math.inf, "fault-loss": math.inf, "fault-amax": 1e-3}[kind]
        loss_finite = False if kind == "fault-loss" else None
        state = policy.update(state, torch.tensor(overflow), amax=torch.tensor(amax),
                              loss_finite=None if loss_finite is None else torch.tensor(loss_finite))
        oracle.scale, oracle.tie = scale, False  # judge each step from the same scale
        expected = oracle.step(overflow, amax, loss_finite)
        assert float(state.scale) == expected or near_a_tie(oracle), (kind, float(state.scale), expected)
        if oracle.tie:  # a float32/float64 tie may take the other branch: continue from the policy's state
            oracle.threshold, oracle.excess = float(state.threshold), float(state.excess)
        assert float(state.level) == pytest.approx(oracle.level, rel=1e-4, abs=1e-4)
        assert float(state.extra) == pytest.approx(oracle.extra, rel=1e-5, abs=1e-5)


def torch_rule(amaxes_log2):
    """torch.amp.GradScaler's defaults in plain Python: skipped steps and log2 scales."""
    scale, tracker, logs = 16, 0, []
    for a in amaxes_log2:
        logs.append(scale)
        if a + scale >= streams.LOG2_LIMIT:
            scale, tracker = scale - 1, 0
        else:
            tracker += 1
            if tracker == 2000:
                scale, tracker = scale + 1, 0
    return logs


@pytest.fixture(scope="module")
def stream_outcomes():
    """(torch, predictive) outcomes on the three issue-18 streams, seeds 0-2, 20,000 steps each."""
    runs = [streams.make_stream(kind, 20_000, seed) for kind in ("stationary", "drifting", "heavy-tailed")
            for seed in range(3)]
    ours = streams.run_policy(PredictiveScale(), runs)
    theirs = [streams.account(s, torch_rule(s.amax)) for s in runs]
    return list(zip(runs, theirs, ours))


def test_the_torch_rule_here_is_torchs_kernel():
    s = streams.make_stream("heavy-tailed", 3000, 7)
    assert streams.run_torch_rule(s) == streams.account(s, torch_rule(s.amax))


def test_five_times_fewer_skips_than_torch_with_at_most_three_times_its_underflow(stream_outcomes):
    for stream, theirs, ours in stream_outcomes:
        where = f"{stream.kind} seed {stream.seed}: torch {theirs}, predictive {ours}"
        assert theirs.skipped >= 5 * ours.skipped and ours.skipped >= 1, where  # step 0 overflows for both
        assert ours.underflow <= 3 * theirs.underflow, where


def test_drift_is_followed_not_lagged(stream_outcomes):
    """Gradients shrink 2**6 over the drifting stream: torch grows one power per 2000 steps and
    underflows more; the forecast follows."""
    for stream, theirs, ours in stream_outcomes:
        if stream.kind == "drifting":
            assert ours.underflow < 0.5 * theirs.underflow


@functools.lru_cache(maxsize=None)
def settle(policy, steps=3000, seed=0):
    """Both rules after ``steps`` steps of a stationary stream: (policy state, torch log2 scale, amaxes)."""
    s = streams.make_stream("stationary", steps + 60, seed)
    state = policy.init()
    for a in s.amax[:steps]:
        log2_scale = math.log2(float(state.scale))
        over = a + log2_scale >= streams.LOG2_LIMIT
        state = policy.update(state, torch.tensor(over), amax=torch.tensor(math.inf if over else 2 ** (a + log2_scale)))
    return state, torch_rule(s.amax[:steps] + (-100.0,))[-1], s.amax[steps:]


@pytest.mark.parametrize("evidence", ["non-finite loss", "finite amax far below the limit", "none (amax inf)"])
@pytest.mark.parametrize("k", [1, 4])
def test_infs_the_scale_did_not_cause_never_collapse_it(evidence, k):
    """k infs that the scale did not cause, in 50 steps: torch halves k times; with evidence the scale
    holds, without it it halves at most k times (within 2**k of torch, better or equal)."""
    policy = PredictiveScale()
    state, torch_log2, rest = settle(policy)
    before = float(state.scale)
    bad_steps = set(range(3, 50, 50 // k)[:k])
    for t, a in enumerate(rest[:50]):
        log2_scale = math.log2(float(state.scale))
        if t in bad_steps:
            amax = LIMIT * 2.0**-9 if evidence.startswith("finite") else math.inf  # the finite tensors' max
            loss_finite = torch.tensor(False) if evidence == "non-finite loss" else None
            state = policy.update(state, torch.tensor(True), amax=torch.tensor(amax), loss_finite=loss_finite)
            torch_log2 -= 1
        else:
            assert a + log2_scale < streams.LOG2_LIMIT  # the scale itself causes no overflow here
            state = policy.update(state, torch.tensor(False), amax=torch.tensor(2 ** (a + log2_scale)))
    after = float(state.scale)
    assert after >= 2.0 ** (torch_log2 - k)
    if evidence == "none (amax inf)":
        assert after >= before * 2.0**-k
    else:
        assert after >= before and after >= 2.0**torch_log2


def test_a_repeated_finite_amax_overflow_is_evidence():
    """A fault is forgiven only after a clean step: an overflow that repeats backs off, so a real
    overflow that the amax does not show cannot skip forever."""
    policy = PredictiveScale()
    state, _, _ = settle(policy, steps=200)
    scales = []
    for _ in range(4):
        state = policy.update(state, torch.tensor(True), amax=torch.tensor(1.0))
        scales.append(float(state.scale))
    assert scales[0] == float(settle(policy, steps=200)[0].scale)  # the first is forgiven
    assert scales[1] <= scales[0] / 2 and scales[2] <= scales[1] / 2 and scales[3] <= scales[2] / 2


def test_first_overflows_before_any_observation_search_down_then_the_first_clean_step_predicts():
    policy = PredictiveScale(init_scale=2.0**24)
    state = policy.init()
    state = policy.update(state, torch.tensor(True), amax=torch.tensor(math.inf))
    assert float(state.scale) == 2.0**16  # 2**-8 at once: no observation to say how far
    state = policy.update(state, torch.tensor(False), amax=torch.tensor(0.5 * 2**16))
    fresh = policy.update(policy.init(), torch.tensor(False), amax=torch.tensor(0.5 * 2**24))
    assert float(state.scale) == float(fresh.scale)  # the same forecast from the same unscaled amax


def test_zero_gradients_hold_and_bounds_keep_a_power_of_two():
    policy = PredictiveScale(max_scale=2.0**40, min_scale=1.0)
    state = policy.init()
    scales = []
    for unscaled in [1e-3] * 50 + [0.0] * 300 + [1e-30] * 100 + [1e6] * 20:
        scale = float(state.scale)
        over = unscaled * scale >= LIMIT
        state = policy.update(state, torch.tensor(over), amax=torch.tensor(math.inf if over else unscaled * scale))
        scales.append(float(state.scale))
    assert all(1.0 <= s <= 2.0**40 and math.log2(s).is_integer() for s in scales)
    assert scales[349] == scales[49]  # all-zero gradients carry no information: the scale holds
    assert max(scales) == 2.0**40
    # a 2**60 jump of the gradients: each overflow backs off by torch's factor, never more
    assert scales[-20:] == [2.0 ** (39 - i) for i in range(20)]


def test_extreme_init_and_ten_thousand_overflows_in_a_row_stay_bounded():
    policy = PredictiveScale(init_scale=1e38)
    state = policy.init()
    assert float(state.scale) == 2.0**126
    for _ in range(10_000):
        state = policy.update(state, torch.tensor(True), amax=torch.tensor(math.inf))
    assert float(state.scale) == 2.0**-126 and float(state.extra) <= 10_000
    state = policy.update(state, torch.tensor(False), amax=torch.tensor(1e-30))
    assert torch.isfinite(state.scale) and math.log2(float(state.scale)).is_integer()


def test_update_has_no_host_read_and_state_round_trips():
    policy = PredictiveScale(history=5)
    state = policy.init()
    with HostReadCounter() as reads:
        for i in range(7):
            state = policy.update(state, torch.tensor(i == 3), amax=torch.tensor(float(i + 1)),
                                  loss_finite=torch.tensor(i != 5))
    assert reads.count == 0
    restored = state_from_dict(policy.init(), pickle.loads(pickle.dumps(state_to_dict(state))))
    a = policy.update(state, torch.tensor(False), amax=torch.tensor(3.0))
    b = policy.update(restored, torch.tensor(False), amax=torch.tensor(3.0))
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(margin=-1), "margin must be an integer >= 0"),
    (dict(history=0), "history must be an integer >= 1"),
    (dict(tail_history=0), "tail_history must be an integer >= 1"),
    (dict(target_interval=5), "target_interval must be an integer >= 10"),
    (dict(fault_gap=0), "fault_gap must be an integer >= 1"),
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
@pytest.mark.parametrize("shell", ["scaler", "optimizer"])
def test_both_scalers_feed_it_the_observed_maximum(make_opt, shell):
    """Each step's new scale is the policy's forecast from the largest scaled gradient the step measured."""
    from lossscale import GradScaler, LossScaleOptimizer
    x = torch.randn(16, 4)
    model = tiny_model()
    policy = PredictiveScale(init_scale=2.0**4)
    if shell == "scaler":
        opt, scaler = make_opt(model.parameters()), GradScaler(policy=policy)
    else:
        opt = LossScaleOptimizer(make_opt(model.parameters()), policy=policy)
    expected = policy.init()
    for step in range(6):
        opt.zero_grad()
        loss = model(x).square().mean()
        if shell == "scaler":
            scaler.scale(loss).backward()
        else:
            opt.backward(loss)
        amax = max(p.grad.abs().max() for p in model.parameters())
        if step == 2:
            model[0].bias.grad[0] = float("inf")
            amax = torch.tensor(float("inf"))
        if shell == "scaler":
            scaler.step(opt)
            scaler.update()
            new = scaler.get_scale()
        else:
            new = float(opt.step().next_scale)
        expected = policy.update(expected, torch.tensor(step == 2), amax=amax.float())
        assert new == float(expected.scale) and math.log2(new).is_integer()


def test_optimizer_state_dict_round_trips_the_predictive_state():
    from lossscale import LossScaleOptimizer
    model = tiny_model()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=PredictiveScale())
    for _ in range(3):
        opt.zero_grad()
        opt.backward(model(torch.ones(2, 4)).sum())
        opt.step()
    saved = opt.state_dict()
    assert saved["policy_state"]["observed"] == 3
    other = LossScaleOptimizer(torch.optim.SGD(tiny_model().parameters(), lr=0.1), policy=PredictiveScale())
    other.load_state_dict(saved)
    assert torch.equal(other.scale_state.level, opt.scale_state.level)
