"""The presets' rules and defaults, and the DynamicScale knobs they need, against oracles and torch's kernel.

The recorded trajectories of the real frameworks are replayed in test_golden.py; here: the new knobs
against the pure-Python oracle over random overflow sequences, torch's own update kernel for
``torch_amp``, each peer's defaults, the edges the recordings do not reach, and the error messages.
"""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale import DynamicScale, FloorError, LossScaleOptimizer, presets
from lossscale.policies.base import FLOAT32_MAX, SMALLEST_NORMAL_FLOAT32
from oracles import DynamicOracle, f32


def run(policy, overflows):
    state = policy.init()
    out = []
    for o in overflows:
        state = policy.update(state, torch.tensor(bool(o)))
        out.append(float(state.scale))
    return out, state


# --- the knobs --------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=200), st.integers(1, 6), st.sampled_from([1, 2, 3]),
       st.sampled_from(["consecutive", "cumulative"]), st.booleans(), st.sampled_from(["float64", "float32"]),
       st.sampled_from([None, 2.0, 3.0, 1.7]), st.sampled_from(["result", "operand"]), st.integers(0, 2),
       st.sampled_from(["skip", "raise"]), st.sampled_from([(2.0, 0.5), (3.0, 0.8), (1.5, 0.3)]),
       st.sampled_from([(1000.0, 1.0, FLOAT32_MAX), (2.0**120, 1.0, 3.4e38), (3.0, 3.0, 2.0**20)]))
def test_knobs_match_the_oracle(overflows, interval, hysteresis, mode, refill, arithmetic, divisor, guard, delay,
                                at_floor, factors, bounds):
    init, floor, cap = bounds
    cfg = dict(init_scale=init, growth_factor=factors[0], backoff_factor=factors[1], growth_interval=interval,
               hysteresis=hysteresis, hysteresis_mode=mode, refill_after_backoff=refill, min_scale=floor,
               max_scale=cap, at_floor=at_floor, arithmetic=arithmetic, backoff_divisor=divisor,
               growth_guard=guard, growth_delay=delay)
    if divisor is not None:
        cfg["backoff_factor"] = 0.5
    policy = DynamicScale(**cfg)
    oracle = DynamicOracle(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})
    state = policy.init()
    assert int(state.growth_tracker) == oracle.tracker == -delay
    for i, o in enumerate(overflows):
        state = policy.update(state, torch.tensor(o))
        oracle.step(o)
        got = (float(state.scale), int(state.growth_tracker), int(state.hysteresis_left), int(state.floor_hits))
        assert got == (oracle.scale, oracle.tracker, oracle.left, oracle.floor_hits), (i, o)


def test_float32_arithmetic_rounds_the_factor_first():
    # 0.8 is not a float32: float32 frameworks multiply by 0.800000011920929, torch by the double 0.8
    f64 = DynamicScale(init_scale=13.0, backoff_factor=0.8, min_scale=1.0)
    f32_ = dataclasses.replace(f64, arithmetic="float32")
    assert run(f64, [1])[0] == [f32(13.0 * 0.8)] == [10.399999618530273]
    assert run(f32_, [1])[0] == [f32(13.0 * f32(0.8))] == [10.40000057220459]
    assert run(f64, [1])[0] != run(f32_, [1])[0]


def test_backoff_divisor_divides_and_reports_its_factor():
    p = DynamicScale(init_scale=1000.0, growth_factor=3.0, backoff_divisor=3.0, arithmetic="float32")
    assert p.backoff_factor == 1 / 3
    assert run(p, [1])[0] == [f32(1000.0 / 3.0)]
    assert dataclasses.replace(p, growth_interval=5).backoff_divisor == 3.0  # replace keeps a valid pair
    with pytest.raises(ValueError, match=r"DynamicScale\(backoff_factor=0.25, backoff_divisor=3.0\): pass one"):
        DynamicScale(backoff_factor=0.25, backoff_divisor=3.0)
    with pytest.raises(ValueError, match=r"backoff_divisor must be a finite number > 1.*got 0.5"):
        DynamicScale(backoff_divisor=0.5)


def test_growth_delay_waits_once_after_start_and_after_overflow():
    p = DynamicScale(init_scale=8.0, growth_interval=2, growth_delay=1)
    scales, _ = run(p, [0, 0, 0, 0, 0, 1, 0, 0, 0])
    #          start: 3 clean to grow, then every 2     overflow: 3 clean again
    assert scales == [8, 8, 16, 16, 32, 16, 16, 16, 32]


def test_operand_guard_is_ascends_comparison():
    limit = f32(3.4e38 / 2)  # Ascend grows only while S < float32(3.4e38 / incr_ratio)
    below = math.nextafter(limit, 0.0)
    below = f32(below) if f32(below) < limit else f32(limit * (1 - 2**-23))
    p = DynamicScale(init_scale=below, growth_interval=1, max_scale=3.4e38, growth_guard="operand",
                     arithmetic="float32")
    assert run(p, [0])[0] == [f32(below * 2)]
    assert run(dataclasses.replace(p, init_scale=limit), [0])[0] == [limit]  # S == limit: refused


def test_raising_step_leaves_the_counters_as_deepspeed_does():
    p = presets.deepspeed(init_scale=2.0, scale_window=3, delayed_shift=1)
    state = p.init()
    for o in [True, False, False]:  # 2 -> 1 (floor), then 2 clean steps toward a growth
        state = p.update(state, torch.tensor(o))
    frozen = p.update(state, torch.tensor(True))  # at the floor: DeepSpeed raises, touching nothing
    assert (int(frozen.growth_tracker), int(frozen.hysteresis_left)) == (
        int(state.growth_tracker), int(state.hysteresis_left))
    assert int(frozen.floor_hits) == 1 and float(frozen.scale) == 1.0
    with pytest.raises(FloorError, match="min_scale=1.0"):
        p.check_floor(frozen)
    # caught and carried on: the two clean steps before the raise still count (DeepSpeed's stable_interval)
    scales, _ = [], None
    for o in [False, False]:
        frozen = p.update(frozen, torch.tensor(o))
        scales.append(float(frozen.scale))
    assert scales == [1.0, 2.0]


def test_optimizer_raises_floor_error_with_the_deepspeed_preset():
    w = torch.nn.Parameter(torch.ones(1))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.1), policy=presets.deepspeed(init_scale=2.0, delayed_shift=1))
    for expect_raise in [False, True]:  # 2 -> 1, then at the floor
        opt.zero_grad()
        opt.backward((w * float("inf")).sum())
        if expect_raise:
            with pytest.raises(FloorError, match="LossScaleOptimizer step 2"):
                opt.step()
        else:
            opt.step()
    assert float(opt.scale) == 1.0 and float(w.detach()) == 1.0


# --- each preset ------------------------------------------------------------------------------


@pytest.mark.parametrize("overflows", [[0] * 7, [0, 1, 0, 0, 1, 1, 0, 0, 0, 0], [1] * 30 + [0] * 9])
@pytest.mark.parametrize("args", [(2.0**16, 2.0, 0.5, 3), (3.0, 1.5, 0.3, 2), (1e38, 2.0, 0.5, 1)])
def test_torch_amp_equals_torchs_kernel(args, overflows):
    init, growth, backoff, interval = args
    ours, _ = run(presets.torch_amp(init, growth, backoff, interval), overflows)
    scale, tracker = torch.full((), init), torch.zeros((), dtype=torch.int32)
    theirs = []
    for o in overflows:
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(o)), growth, backoff, interval)
        theirs.append(float(scale))
    assert ours == theirs


DEFAULTS = {  # the peers' own defaults, as the core knobs that express them
    "torch_amp": dict(init_scale=2.0**16, growth_interval=2000, growth_factor=2.0, backoff_factor=0.5),
    "keras": dict(init_scale=2.0**15, growth_interval=2000, backoff_divisor=2.0, min_scale=SMALLEST_NORMAL_FLOAT32),
    "tf_keras2": dict(init_scale=2.0**15, growth_interval=2000, backoff_divisor=2.0, min_scale=1.0),
    "tf_v1": dict(init_scale=2.0**15, growth_interval=2000, backoff_divisor=2.0, min_scale=1.0),
    "mindspore": dict(init_scale=2.0**24, growth_interval=2000, backoff_factor=0.5, min_scale=1.0),
    "nnabla": dict(init_scale=8.0, growth_interval=2001, growth_delay=1, backoff_divisor=2.0),
    "deepspeed": dict(init_scale=2.0**16, growth_interval=1000, hysteresis=2, hysteresis_mode="cumulative",
                      refill_after_backoff=False, min_scale=1.0, at_floor="raise", growth_delay=1),
    "megatron": dict(init_scale=2.0**32, growth_interval=1000, hysteresis=2, hysteresis_mode="cumulative",
                     refill_after_backoff=False, min_scale=1.0, arithmetic="float32"),
    "paddle": dict(init_scale=2.0**16, growth_interval=2000, hysteresis=1, backoff_factor=0.5,
                   arithmetic="float32"),
}


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_defaults_are_the_peers(name):
    policy = presets.PRESETS[name]()
    for knob, value in DEFAULTS[name].items():
        assert getattr(policy, knob) == value, knob


def test_ascend_has_tf1s_defaults_and_required_arguments():
    p = presets.ascend(2.0**32, 1000)
    assert (p.hysteresis, p.growth_factor, p.backoff_factor, p.min_scale, p.hysteresis_mode) == (
        2, 2.0, 0.8, 1.0, "cumulative")
    with pytest.raises(TypeError):
        presets.ascend()


def test_every_peer_has_a_preset():
    assert sorted(presets.PRESETS) == sorted(["torch_amp", "keras", "tf_keras2", "tf_v1", "mindspore", "nnabla",
                                              "deepspeed", "megatron", "paddle", "ascend"])


def test_nnabla_grows_on_the_n_plus_2th_then_every_n_plus_1th_clean_update():
    scales, _ = run(presets.nnabla(scale=8.0, N=2), [0] * 10)
    assert scales == [8, 8, 8, 16, 16, 16, 32, 32, 32, 64]


def test_ascend_counts_bad_steps_cumulatively_and_tf_v1_does_not_count_them():
    ascend, _ = run(presets.ascend(1024.0, 100), [1, 0, 0, 1])  # 2 bad steps, not in a row, back off
    paddle, _ = run(presets.paddle(1024.0, decr_every_n_nan_or_inf=2), [1, 0, 0, 1])  # in a row only
    assert ascend[-1] == f32(1024.0 * f32(0.8)) and paddle[-1] == 1024.0


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_bounded_from_huge_scales_and_under_endless_overflows(name):
    build = presets.PRESETS[name]
    policy = build(1e38, 2) if name == "ascend" else dataclasses.replace(build(), init_scale=1e38, growth_interval=2,
                                                                          growth_delay=0)
    scales, state = run(policy, [0] * 40)
    assert all(math.isfinite(s) and s <= FLOAT32_MAX for s in scales)
    found = torch.tensor(True)
    for _ in range(1000):  # down to the floor: at worst x0.8 per two overflows (Ascend)
        state = policy.update(state, found)
        assert float(state.scale) >= policy.min_scale
        if float(state.scale) == policy.min_scale and int(state.floor_hits):
            break
    assert float(state.scale) == policy.min_scale > 0
    again = policy.update(state, found)  # the floor is a fixed point: 10,000 more overflows change nothing
    assert float(again.scale) == policy.min_scale and int(again.growth_tracker) == int(state.growth_tracker)


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("name,kwargs,needle", [
    ("torch_amp", dict(growth_interval=0), "growth_interval must be an integer >= 1; got 0"),
    ("torch_amp", dict(backoff_factor=1.5), r"backoff_factor must be in \(0, 1\).*got 1.5"),
    ("keras", dict(dynamic_growth_steps=0), "dynamic_growth_steps must be an integer >= 1; got 0"),
    ("keras", dict(initial_scale=float("inf")), "initial_scale must be a finite number"),
    ("tf_keras2", dict(initial_scale=0.5), r"initial_scale must be a finite number in \[1.0, .*got 0.5"),
    ("tf_v1", dict(multiplier=1.0), "multiplier must be a finite number > 1"),
    ("tf_v1", dict(increment_period=2.5), "increment_period must be an integer"),
    ("mindspore", dict(scale_factor=1), "scale_factor must be a finite number > 1"),
    ("mindspore", dict(scale_window=-3), "scale_window must be an integer >= 1; got -3"),
    ("nnabla", dict(N=-1), "N must be an integer >= 0; got -1"),
    ("nnabla", dict(scaling_factor=0.5), "scaling_factor must be a finite number > 1"),
    ("deepspeed", dict(delayed_shift=0), "delayed_shift must be an integer >= 1; got 0"),
    ("deepspeed", dict(min_scale=4.0, init_scale=2.0), r"init_scale must be a finite number in \[4.0"),
    ("deepspeed", dict(consecutive_hysteresis="yes"), "consecutive_hysteresis must be one of True, False"),
    ("megatron", dict(hysteresis=0), "hysteresis must be an integer >= 1; got 0"),
    ("megatron", dict(backoff_factor=0.0), r"backoff_factor must be in \(0, 1\)"),
    ("paddle", dict(decr_every_n_nan_or_inf=0), "decr_every_n_nan_or_inf must be an integer >= 1; got 0"),
    ("paddle", dict(incr_ratio=0.9), "incr_ratio must be a finite number > 1"),
    ("ascend", dict(init_loss_scale=2.0**10, incr_every_n_steps=0), "incr_every_n_steps must be an integer >= 1"),
    ("ascend", dict(init_loss_scale=0.5, incr_every_n_steps=10), r"init_loss_scale must be a finite number in \[1.0"),
    ("ascend", dict(init_loss_scale=8.0, incr_every_n_steps=10, decr_ratio=1.0), r"decr_ratio must be in \(0, 1\)"),
])
def test_validation_names_the_preset_the_argument_and_the_value(name, kwargs, needle):
    with pytest.raises(ValueError, match=needle) as err:
        presets.PRESETS[name](**kwargs)
    assert err.value.args[0].startswith(f"presets.{name}(")


@pytest.mark.parametrize("module", ["lossscale.policies.presets", "lossscale.compat.ascend", "lossscale.compat.mindspore",
                                    "lossscale.compat.nnabla", "lossscale.compat.keras"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
