"""The policy engine against pure-Python oracles, torch's own update kernel, and its bounds."""

import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale import DynamicScale, FixedScale, FloorError, HostReadCounter
from lossscale.policies.base import FLOAT32_MAX, SMALLEST_NORMAL_FLOAT32, state_from_dict, state_to_dict
from oracles import DynamicOracle, TorchOracle

flags = st.lists(st.booleans(), min_size=1, max_size=3000)


def run(policy, overflows):
    state = policy.init()
    out = []
    for o in overflows:
        state = policy.update(state, torch.tensor(o))
        out.append(float(state.scale))
    return out, state


def test_defaults_are_torch_defaults():
    p = DynamicScale()
    assert (p.init_scale, p.growth_factor, p.backoff_factor, p.growth_interval, p.hysteresis) == (
        2.0**16, 2.0, 0.5, 2000, 1)
    assert p.min_scale == 2.0**-126 and p.max_scale == FLOAT32_MAX


def test_step_by_step_small_example():
    # interval 3: grows on the 3rd clean step in a row; an overflow halves and restarts the count.
    scales, _ = run(DynamicScale(init_scale=16.0, growth_interval=3), [0, 0, 0, 1, 0, 0, 1, 0, 0, 0])
    assert scales == [16, 16, 32, 16, 16, 16, 8, 8, 8, 16]


@settings(max_examples=60, deadline=None)
@given(flags, st.integers(1, 50), st.sampled_from([1, 2, 3]), st.sampled_from(["consecutive", "cumulative"]),
       st.booleans(), st.sampled_from([1.0, 2.0**-126, 2.0**-3]), st.sampled_from([FLOAT32_MAX, 2.0**20, 2.0**40]),
       st.sampled_from([(2.0, 0.5), (2.0, 0.8), (1.5, 0.25), (4.0, 0.5)]))
def test_matches_oracle(overflows, interval, hysteresis, mode, refill, floor, cap, factors):
    cfg = dict(init_scale=2.0**16 if cap > 2**16 else 2.0**10, growth_factor=factors[0], backoff_factor=factors[1],
               growth_interval=interval, hysteresis=hysteresis, hysteresis_mode=mode, refill_after_backoff=refill,
               min_scale=floor, max_scale=cap)
    policy, oracle = DynamicScale(**cfg), DynamicOracle(**cfg)
    state = policy.init()
    for i, o in enumerate(overflows):
        state = policy.update(state, torch.tensor(o))
        expected = oracle.step(o)
        assert float(state.scale) == expected, (i, o)
        assert int(state.growth_tracker) == oracle.tracker
        assert int(state.hysteresis_left) == oracle.left
        assert int(state.floor_hits) == oracle.floor_hits


@settings(max_examples=40, deadline=None)
@given(flags, st.integers(1, 40), st.sampled_from([2.0**16, 3.0, 1e38, 2.0**-100]),
       st.sampled_from([(2.0, 0.5), (2.0, 0.8), (1.5, 0.3), (1.0001, 0.9999)]))
def test_torch_rule_equals_torch_kernel_bit_for_bit(overflows, interval, init, factors):
    """With torch's arguments the trajectory equals torch._amp_update_scale_ while torch stays normal."""
    policy = DynamicScale(init_scale=init, growth_factor=factors[0], backoff_factor=factors[1], growth_interval=interval)
    state = policy.init()
    t_scale = torch.full((), init, dtype=torch.float32)
    t_tracker = torch.zeros((), dtype=torch.int32)
    oracle = TorchOracle(init, factors[0], factors[1], interval)
    for o in overflows:
        torch._amp_update_scale_(t_scale, t_tracker, torch.tensor(float(o)), factors[0], factors[1], interval)
        state = policy.update(state, torch.tensor(float(o)))
        assert oracle.step(o) == float(t_scale)  # the oracle describes torch's kernel
        if float(t_scale) < SMALLEST_NORMAL_FLOAT32:  # torch keeps halving into subnormals; we stop at the floor
            assert float(state.scale) == SMALLEST_NORMAL_FLOAT32
            return
        assert state.scale.item() == t_scale.item()
        assert int(state.growth_tracker) == int(t_tracker)


def test_found_inf_may_be_a_count_or_bool():
    p = DynamicScale(init_scale=8.0)
    for found in [torch.tensor(2.0), torch.tensor(True), torch.tensor(1, dtype=torch.int32)]:
        assert float(p.update(p.init(), found).scale) == 4.0
    assert float(p.update(p.init(), torch.tensor(0.0)).scale) == 8.0


@pytest.mark.parametrize("mode,expected", [
    # hysteresis 2. consecutive: a clean step forgives; cumulative: only a change of scale forgives.
    ("consecutive", [64, 64, 64, 32, 32, 32, 32, 16]),
    ("cumulative", [64, 64, 32, 32, 16, 16, 16, 8]),
])
def test_hysteresis_modes(mode, expected):
    p = DynamicScale(init_scale=64.0, hysteresis=2, hysteresis_mode=mode, growth_interval=1000)
    scales, _ = run(p, [1, 0, 1, 1, 1, 0, 1, 1])
    assert scales == expected


def test_no_refill_after_backoff_backs_off_at_every_later_overflow():
    p = DynamicScale(init_scale=64.0, hysteresis=3, hysteresis_mode="cumulative", refill_after_backoff=False,
                     growth_interval=2)
    scales, _ = run(p, [1, 1, 1, 1, 1, 0, 0, 1, 1, 1])
    # three overflows for the first backoff, then one each until a growth refills the count
    assert scales == [64, 64, 32, 16, 8, 8, 16, 16, 16, 8]


def test_floor_keeps_skipping_and_never_reaches_zero():
    p = DynamicScale(init_scale=2.0**16)
    state = p.init()
    found = torch.tensor(True)
    for _ in range(10_000):
        state = p.update(state, found)
    assert float(state.scale) == SMALLEST_NORMAL_FLOAT32 and float(state.scale) > 0
    assert int(state.floor_hits) == 10_000 - (16 + 126)


def test_floor_raise_mode_names_the_floor_and_the_cause():
    p = DynamicScale(init_scale=4.0, min_scale=1.0, at_floor="raise")
    state = p.init()
    for _ in range(2):  # 4 -> 2 -> 1: reaching the floor is fine
        state = p.update(state, torch.tensor(True))
        p.check_floor(state)
    state = p.update(state, torch.tensor(True))  # backing off *at* the floor is not
    with pytest.raises(FloorError, match=r"min_scale=1.0.*1 step\(s\).*NaN or inf in the data"):
        p.check_floor(state)


def test_cap_and_finite_guard_from_1e38():
    p = DynamicScale(init_scale=1e38, growth_interval=1)
    scales, _ = run(p, [False] * 500)
    assert all(math.isfinite(s) and s > 0 for s in scales)
    assert scales[-1] == pytest.approx(2e38, rel=1e-6)  # as torch: 4e38 would be inf, so growth stops
    capped, _ = run(DynamicScale(init_scale=2.0**10, growth_interval=1, max_scale=2.0**12), [False] * 5)
    assert capped == [2**11, 2**12, 2**12, 2**12, 2**12]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=2000), st.sampled_from([1e38, 2.0**-126, 1.0, 2.0**127]),
       st.integers(1, 5), st.sampled_from([(2.0, 0.5), (8.0, 0.125), (1.01, 0.99)]))
def test_scale_always_finite_positive_normal(overflows, init, interval, factors):
    p = DynamicScale(init_scale=init, growth_interval=interval, growth_factor=factors[0], backoff_factor=factors[1])
    scales, _ = run(p, overflows)
    assert all(math.isfinite(s) and s >= SMALLEST_NORMAL_FLOAT32 for s in scales)


def test_update_makes_no_host_read():
    p = DynamicScale(hysteresis=2, hysteresis_mode="cumulative")
    state = p.init()
    with HostReadCounter() as reads:
        for o in [True, False, True, True]:
            state = p.update(state, torch.tensor(o))
    assert reads.count == 0


def test_state_dtypes_are_stable():
    p = DynamicScale(growth_interval=2)
    state = p.init()
    for o in [True, False, False, True]:
        state = p.update(state, torch.tensor(o))
        assert state.scale.dtype == torch.float32 and state.scale.dim() == 0
        for name in ("growth_tracker", "hysteresis_left", "floor_hits"):
            assert getattr(state, name).dtype == torch.int32


def test_state_dict_round_trip_mid_run_continues_trajectory():
    p = DynamicScale(init_scale=2.0**8, growth_interval=3, hysteresis=2, hysteresis_mode="cumulative")
    seq = [0, 1, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0]
    full, _ = run(p, seq)
    _, mid = run(p, seq[:5])
    restored = state_from_dict(p.init(), pickle.loads(pickle.dumps(state_to_dict(mid))))
    rest = []
    for o in seq[5:]:
        restored = p.update(restored, torch.tensor(o))
        rest.append(float(restored.scale))
    assert rest == full[5:]
    with pytest.raises(KeyError, match="missing"):
        state_from_dict(p.init(), {"scale": 1.0})


def test_policies_are_frozen_and_picklable():
    p = DynamicScale(hysteresis=3)
    with pytest.raises(Exception):
        p.growth_factor = 3.0
    assert pickle.loads(pickle.dumps(p)) == p


def test_fixed_scale_never_moves():
    p = FixedScale(128.0)
    scales, _ = run(p, [True, False, True] * 10)
    assert set(scales) == {128.0}


@pytest.mark.parametrize("kwargs,needle", [
    (dict(growth_factor=1.0), "growth_factor must be a finite number > 1"),
    (dict(growth_factor=0.5), "got 0.5"),
    (dict(growth_factor=float("inf")), "growth_factor"),
    (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(backoff_factor=-0.5), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval must be an integer >= 1; got 0"),
    (dict(growth_interval=2.5), "growth_interval"),
    (dict(growth_interval=True), "growth_interval"),
    (dict(init_scale=0.0), "init_scale must be a finite number"),
    (dict(init_scale=-1.0), "init_scale"),
    (dict(init_scale=float("nan")), "init_scale"),
    (dict(init_scale=float("inf")), "init_scale"),
    (dict(min_scale=4.0, max_scale=2.0, init_scale=3.0), "min_scale must be <= max_scale"),
    (dict(min_scale=1e-45), "min_scale must be a finite number in"),
    (dict(init_scale=0.5, min_scale=1.0), "init_scale"),
    (dict(hysteresis=0), "hysteresis must be an integer >= 1"),
    (dict(hysteresis_mode="sometimes"), "hysteresis_mode must be one of 'consecutive', 'cumulative'"),
    (dict(at_floor="explode"), "at_floor must be one of 'skip', 'raise'"),
])
def test_validation_names_parameter_rule_and_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle) as err:
        DynamicScale(**kwargs)
    assert err.value.args[0].startswith("DynamicScale(")


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan"), "8"])
def test_fixed_scale_validation(value):
    with pytest.raises(ValueError, match="FixedScale\\(scale="):
        FixedScale(value)


def test_update_rejects_non_tensor_found_inf():
    with pytest.raises(TypeError, match="found_inf must be a tensor"):
        DynamicScale().update(DynamicScale().init(), True)
