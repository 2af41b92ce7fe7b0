"""The policies: DynamicScale and FixedScale against the pure-Python oracles, their bounds, the Policy protocol,
and one contract over every distinct policy.

DynamicScale is checked step by step against ``oracles.DynamicOracle`` with hypothesis over random overflow
sequences and every knob, and with torch's arguments against torch's own update kernel. The contract runs every
distinct policy (DynamicScale with its knobs, FixedScale, PredictiveScale, each preset with a short window) the
same way, with no per-name case. The facades hold these same policies: their rules are replayed against the
real frameworks' recordings in test_golden.py, their own state in test_facade_contract.py.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale import DynamicScale, FixedScale, FloorError, LossScale, Policy, PredictiveScale, presets
from lossscale.policies.base import state_from_dict, state_to_dict
from lossscale.testing import HostReadCounter
from lossscale.validation import FLOAT32_MAX, SMALLEST_NORMAL_FLOAT32
from oracles import DynamicOracle, TorchOracle, f32


def run(policy, overflows):
    """The scale after each step, and the last state."""
    state = policy.init()
    out = []
    for o in overflows:
        state = policy.update(state, torch.tensor(bool(o)))
        out.append(float(state.scale))
    return out, state


def oracle_of(policy: DynamicScale) -> DynamicOracle:
    return DynamicOracle(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})


# --- DynamicScale against its oracle ---------------------------------------------------------------------------

ASCEND_LIMIT = f32(3.4e38 / 2)
ASCEND_BELOW = f32(ASCEND_LIMIT * (1 - 2**-23))  # a float32 one or two units below it

#: Hand-worked trajectories: each is checked against the oracle and the policy, so the oracle is pinned too.
EXAMPLES = {
    # interval 3: grows on the 3rd clean step in a row; an overflow halves and restarts the count
    "growth and backoff": (
        dict(init_scale=16.0, growth_interval=3),
        [0, 0, 0, 1, 0, 0, 1, 0, 0, 0],
        [16, 16, 32, 16, 16, 16, 8, 8, 8, 16],
    ),
    # hysteresis 2, consecutive: a clean step forgives an overflow
    "hysteresis consecutive": (
        dict(init_scale=64.0, hysteresis=2, hysteresis_mode="consecutive"),
        [1, 0, 1, 1, 1, 0, 1, 1],
        [64, 64, 64, 32, 32, 32, 32, 16],
    ),
    # cumulative: only a change of scale forgives
    "hysteresis cumulative": (
        dict(init_scale=64.0, hysteresis=2, hysteresis_mode="cumulative"),
        [1, 0, 1, 1, 1, 0, 1, 1],
        [64, 64, 32, 32, 16, 16, 16, 8],
    ),
    # three overflows for the first backoff, then one each until a growth refills the count
    "no refill after backoff": (
        dict(
            init_scale=64.0, hysteresis=3, hysteresis_mode="cumulative", refill_after_backoff=False, growth_interval=2
        ),
        [1, 1, 1, 1, 1, 0, 0, 1, 1, 1],
        [64, 64, 32, 16, 8, 8, 16, 16, 16, 8],
    ),
    # start: 3 clean steps to grow, then every 2; after an overflow 3 again
    "growth delay": (
        dict(init_scale=8.0, growth_interval=2, growth_delay=1),
        [0, 0, 0, 0, 0, 1, 0, 0, 0],
        [8, 8, 16, 16, 32, 16, 16, 16, 32],
    ),
    # 0.8 is not a float32: torch multiplies by the double 0.8, float32 frameworks by 0.800000011920929
    "float64 arithmetic": (dict(init_scale=13.0, backoff_factor=0.8, min_scale=1.0), [1], [10.399999618530273]),
    "float32 arithmetic": (
        dict(init_scale=13.0, backoff_factor=0.8, min_scale=1.0, arithmetic="float32"),
        [1],
        [10.40000057220459],
    ),
    "backoff divisor": (
        dict(init_scale=1000.0, growth_factor=3.0, backoff_divisor=3.0, arithmetic="float32"),
        [1],
        [f32(1000.0 / 3.0)],
    ),
    "cap": (dict(init_scale=2.0**10, growth_interval=1, max_scale=2.0**12), [0] * 4, [2**11, 2**12, 2**12, 2**12]),
    # Ascend grows only while S < float32(3.4e38 / 2): just below that it grows, at it it does not
    "operand guard below": (
        dict(
            init_scale=ASCEND_BELOW, growth_interval=1, max_scale=3.4e38, growth_guard="operand", arithmetic="float32"
        ),
        [0],
        [ASCEND_BELOW * 2],
    ),
    "operand guard at": (
        dict(
            init_scale=ASCEND_LIMIT, growth_interval=1, max_scale=3.4e38, growth_guard="operand", arithmetic="float32"
        ),
        [0, 0],
        [ASCEND_LIMIT, ASCEND_LIMIT],
    ),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_hand_worked_examples(name):
    cfg, overflows, expected = EXAMPLES[name]
    policy = DynamicScale(**cfg)
    oracle = oracle_of(policy)
    assert [oracle.step(bool(o)) for o in overflows] == expected
    assert run(policy, overflows)[0] == expected


def test_the_defaults_are_torchs():
    p = DynamicScale()
    assert (p.init_scale, p.growth_factor, p.backoff_factor, p.growth_interval, p.hysteresis) == (
        2.0**16,
        2.0,
        0.5,
        2000,
        1,
    )
    assert (p.min_scale, p.max_scale, p.growth_delay, p.arithmetic) == (
        SMALLEST_NORMAL_FLOAT32,
        FLOAT32_MAX,
        0,
        "float64",
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.booleans(), min_size=1, max_size=400),
    st.integers(1, 6),
    st.sampled_from([1, 2, 3]),
    st.sampled_from(["consecutive", "cumulative"]),
    st.booleans(),
    st.sampled_from(["float64", "float32"]),
    st.sampled_from([None, 2.0, 3.0, 1.7]),
    st.sampled_from(["result", "operand"]),
    st.integers(0, 2),
    st.sampled_from(["skip", "raise"]),
    st.sampled_from([(2.0, 0.5), (3.0, 0.8), (1.5, 0.3), (4.0, 0.25)]),
    st.sampled_from(
        [
            (1000.0, 1.0, FLOAT32_MAX),
            (2.0**120, 1.0, 3.4e38),
            (3.0, 3.0, 2.0**20),
            (2.0**16, SMALLEST_NORMAL_FLOAT32, FLOAT32_MAX),
            (2.0**-100, 2.0**-126, 2.0**40),
            (1e38, 2.0**-3, FLOAT32_MAX),
        ]
    ),
)
def test_every_knob_matches_the_oracle_step_by_step(
    overflows, interval, hysteresis, mode, refill, arithmetic, divisor, guard, delay, at_floor, factors, bounds
):
    init, floor, cap = bounds
    policy = DynamicScale(
        init_scale=init,
        growth_factor=factors[0],
        backoff_factor=0.5 if divisor is not None else factors[1],
        growth_interval=interval,
        hysteresis=hysteresis,
        hysteresis_mode=mode,
        refill_after_backoff=refill,
        min_scale=floor,
        max_scale=cap,
        at_floor=at_floor,
        arithmetic=arithmetic,
        backoff_divisor=divisor,
        growth_guard=guard,
        growth_delay=delay,
    )
    oracle = oracle_of(policy)
    state = policy.init()
    assert int(state.growth_tracker) == oracle.tracker == -delay
    for i, o in enumerate(overflows):
        state = policy.update(state, torch.tensor(o))
        oracle.step(o)
        got = (float(state.scale), int(state.growth_tracker), int(state.hysteresis_left), int(state.floor_hits))
        assert got == (oracle.scale, oracle.tracker, oracle.left, oracle.floor_hits), (i, o)
        assert floor <= got[0] <= cap and got[0] >= SMALLEST_NORMAL_FLOAT32  # finite, normal, inside the bounds


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.booleans(), min_size=1, max_size=1000),
    st.integers(1, 40),
    st.sampled_from([2.0**16, 3.0, 1e38, 2.0**-100]),
    st.sampled_from([(2.0, 0.5), (2.0, 0.8), (1.5, 0.3), (1.0001, 0.9999)]),
)
def test_torchs_arguments_give_torchs_kernel_bit_for_bit(overflows, interval, init, factors):
    """With torch's arguments the trajectory is torch._amp_update_scale_'s while torch's scale stays normal (torch
    then halves into subnormals; ours stops at 2**-126). The oracle describes the kernel too."""
    policy = DynamicScale(
        init_scale=init, growth_factor=factors[0], backoff_factor=factors[1], growth_interval=interval
    )
    state = policy.init()
    t_scale, t_tracker = torch.full((), init, dtype=torch.float32), torch.zeros((), dtype=torch.int32)
    oracle = TorchOracle(init, factors[0], factors[1], interval)
    for o in overflows:
        torch._amp_update_scale_(t_scale, t_tracker, torch.tensor(float(o)), factors[0], factors[1], interval)
        state = policy.update(state, torch.tensor(float(o)))
        assert oracle.step(o) == float(t_scale)
        if float(t_scale) < SMALLEST_NORMAL_FLOAT32:
            assert float(state.scale) == SMALLEST_NORMAL_FLOAT32
            return
        assert state.scale.item() == t_scale.item() and int(state.growth_tracker) == int(t_tracker)


@pytest.mark.parametrize(
    "policy",
    [DynamicScale(init_scale=8.0), DynamicScale(init_scale=8.0, hysteresis_mode="cumulative", arithmetic="float32")],
    ids=["torch's kernel", "tensor ops"],
)
def test_found_inf_is_a_bool_or_a_count_and_must_be_a_tensor(policy):
    for found in [torch.tensor(2.0), torch.tensor(True), torch.tensor(1, dtype=torch.int32)]:
        assert float(policy.update(policy.init(), found).scale) == 4.0
    for clean in [torch.tensor(0.0), torch.tensor(False), torch.tensor(0, dtype=torch.int32)]:
        assert float(policy.update(policy.init(), clean).scale) == 8.0
    with pytest.raises(TypeError, match="found_inf must be a tensor"):
        policy.update(policy.init(), True)


def test_a_raising_step_at_the_floor_changes_nothing_but_floor_hits():
    """``at_floor="raise"``: the step that backs off at the floor raises in enforce_floor and leaves the counters, so
    a caller that catches it carries on as if it had not happened (DeepSpeed raises before touching its state)."""
    policy = DynamicScale(
        init_scale=2.0,
        min_scale=1.0,
        hysteresis=2,
        hysteresis_mode="cumulative",
        refill_after_backoff=False,
        growth_interval=3,
        growth_delay=1,
        at_floor="raise",
    )
    state = policy.init()
    for o in [True, True, False, False]:  # 2 -> 1 (the floor), then two clean steps toward a growth
        state = policy.update(state, torch.tensor(o))
        policy.enforce_floor(state)  # reaching the floor is fine
    frozen = policy.update(state, torch.tensor(True))
    assert (float(frozen.scale), int(frozen.floor_hits)) == (1.0, 1)
    assert (
        (int(frozen.growth_tracker), int(frozen.hysteresis_left))
        == (1, 0)
        == (int(state.growth_tracker), int(state.hysteresis_left))
    )
    with pytest.raises(
        FloorError,
        match=r"min_scale=1.0 .*\(1 step\(s\) in a row at the floor\).*NaN or inf in the "
        r"data.*at_floor='skip'",
    ):
        policy.enforce_floor(frozen)
    scales, _ = [], None
    for o in [False, False]:  # the two clean steps before the raise still count
        frozen = policy.update(frozen, torch.tensor(o))
        scales.append(float(frozen.scale))
    assert scales == [1.0, 2.0]


# --- bounds ------------------------------------------------------------------------------------------------------


def test_from_1e38_growth_stops_below_inf():
    scales, _ = run(DynamicScale(init_scale=1e38, growth_interval=1), [False] * 50)
    assert scales[0] == f32(2e38) and set(scales[1:]) == {f32(2e38)}  # as torch: 4e38 would be inf, so it stays


def test_overflows_in_a_row_reach_the_floor_and_stay_there():
    """From 2**16, 142 halvings reach 2**-126; 300 overflows in a row: the floor is a fixed point, never 0."""
    policy = DynamicScale(init_scale=2.0**16)
    scales, state = run(policy, [True] * 300)
    assert scales[141] == SMALLEST_NORMAL_FLOAT32 and scales[140] == 2 * SMALLEST_NORMAL_FLOAT32
    assert set(scales[141:]) == {SMALLEST_NORMAL_FLOAT32}
    assert int(state.floor_hits) == 300 - 142  # overflows that found the scale already at the floor
    assert float(policy.update(state, torch.tensor(False)).floor_hits) == 0  # a clean step resets the count


def test_the_largest_growth_interval_never_grows_early():
    policy = DynamicScale(init_scale=1024.0, growth_interval=2**31 - 1)
    scales, state = run(policy, [False] * 20)
    assert set(scales) == {1024.0} and int(state.growth_tracker) == 20


def test_a_growth_tracker_past_the_interval_means_the_same_on_both_paths():
    kernel = DynamicScale(init_scale=8.0, growth_interval=2)
    tensor_ops = DynamicScale(init_scale=8.0, growth_interval=2, max_scale=2.0**100)  # the same rule below the cap
    assert kernel._torch_rule and not tensor_ops._torch_rule
    past = {"scale": 8.0, "growth_tracker": 5, "hysteresis_left": 1, "floor_hits": 0}
    runs = []
    for policy in (kernel, tensor_ops):
        state = state_from_dict(policy.init(), past)
        runs.append([float((state := policy.update(state, torch.tensor(False))).scale) for _ in range(4)])
    assert runs[0] == runs[1]


def test_fixed_scale_never_moves():
    scales, _ = run(FixedScale(128.0), [True, False, True] * 10)
    assert set(scales) == {128.0}


# --- the Policy protocol -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CountingState:
    scale: torch.Tensor
    steps: torch.Tensor


@dataclass(frozen=True)
class HalveOnOverflow(Policy):
    """A user's own rule with its own state record: halve on overflow, count steps."""

    min_scale: float = 1.0

    def init(self, device=None):
        return CountingState(torch.full((), 64.0, device=device), torch.zeros((), dtype=torch.int32, device=device))

    def update(self, state, found_inf, amax=None):
        bad = found_inf.bool()
        return CountingState(
            torch.where(bad, (state.scale / 2).clamp_min(self.min_scale), state.scale), state.steps + 1
        )


def test_a_users_policy_with_its_own_state_runs_through_the_owner():
    owner = LossScale(HalveOnOverflow())
    for o in [True, False, True]:
        owner.update(torch.tensor(o))
    assert owner.state_dict() == {"scale": 16.0, "steps": 3}
    other = LossScale(HalveOnOverflow())
    other.load_state_dict(owner.state_dict())
    assert other.state_dict() == {"scale": 16.0, "steps": 3}
    with pytest.raises(ValueError, match=r"in \[1.0, "):  # the policy's own bounds
        other.set_scale(0.5)


def test_the_protocol_names_what_a_policy_lacks():
    with pytest.raises(NotImplementedError, match=r"Policy.init\(device\) is required by the Policy protocol"):
        Policy().init()
    with pytest.raises(NotImplementedError, match=r"Policy.update\(state, found_inf, amax\) is required"):
        Policy().update(None, torch.tensor(False))
    assert (Policy.observes_amax, Policy.observes_loss_finite) == (False, False)
    assert (Policy.min_scale, Policy.max_scale) == (SMALLEST_NORMAL_FLOAT32, FLOAT32_MAX)


def test_state_records_save_every_field_and_load_only_a_whole_record():
    policy = DynamicScale(init_scale=2.0**8, growth_interval=3, hysteresis=2, hysteresis_mode="cumulative")
    _, state = run(policy, [0, 1, 0, 0, 1])
    saved = state_to_dict(state)
    assert saved == {"scale": 128.0, "growth_tracker": 0, "hysteresis_left": 2, "floor_hits": 0}
    restored = state_from_dict(policy.init(), saved)
    assert all(
        torch.equal(getattr(restored, f), getattr(state, f)) and getattr(restored, f).dtype == getattr(state, f).dtype
        for f in saved
    )
    with pytest.raises(KeyError, match=r"missing \['growth_tracker', 'hysteresis_left', 'floor_hits'\]"):
        state_from_dict(policy.init(), {"scale": 1.0})


@pytest.mark.parametrize(
    "policy",
    [
        DynamicScale(
            init_scale=2.0**10, growth_interval=2, hysteresis=2, hysteresis_mode="cumulative", arithmetic="float32"
        ),
        PredictiveScale(init_scale=2.0**10, history=4),
    ],
    ids=["DynamicScale", "PredictiveScale"],
)
def test_a_batch_of_states_advances_as_each_state_alone(policy):
    """``update`` is element-wise: state fields with a leading dimension advance that many independent scales
    (how test_golden.py checks every recorded transition at once)."""
    flags = [[False, True, True, False], [True, True, False, False], [False, False, False, True]]
    alone = []
    for row in flags:
        state = policy.init()
        for o in row:
            state = policy.update(state, torch.tensor(o), amax=torch.tensor(math.inf if o else 100.0))
        alone.append(state)
    batch = type(policy.init())(
        *(getattr(policy.init(), f.name).expand(3).clone() for f in dataclasses.fields(policy.init()))
    )
    for step in zip(*flags):
        batch = policy.update(batch, torch.tensor(step), amax=torch.tensor([math.inf if o else 100.0 for o in step]))
    for f in dataclasses.fields(batch):
        assert torch.equal(getattr(batch, f.name), torch.stack([getattr(s, f.name) for s in alone])), f.name


def test_policies_are_frozen_and_compare_by_value():
    p = DynamicScale(hysteresis=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.growth_factor = 3.0  # type: ignore[misc]
    assert p == DynamicScale(hysteresis=3) != DynamicScale(hysteresis=2)


# --- one contract over every distinct policy --------------------------------------------------------------------

#: Each distinct rule, with a short window so that growth and its cap are reached in a few steps.
CONTRACT = {
    "DynamicScale": DynamicScale(init_scale=2.0**10, growth_interval=3),
    "DynamicScale(hysteresis)": DynamicScale(
        init_scale=2.0**10, growth_interval=3, hysteresis=2, hysteresis_mode="cumulative", refill_after_backoff=False
    ),
    "DynamicScale(float32)": DynamicScale(
        init_scale=1000.0,
        growth_factor=3.0,
        backoff_divisor=3.0,
        arithmetic="float32",
        growth_guard="operand",
        growth_delay=1,
        growth_interval=2,
        min_scale=1.0,
        max_scale=2.0**40,
    ),
    "FixedScale": FixedScale(2.0**10),
    "PredictiveScale": PredictiveScale(init_scale=2.0**10, history=4),
    "presets.torch_amp": presets.torch_amp(2.0**10, growth_interval=2),
    "presets.keras": presets.keras(2.0**10, dynamic_growth_steps=2),
    "presets.tf_keras2": presets.tf_keras2(2.0**10, dynamic_growth_steps=2),
    "presets.tf_v1": presets.tf_v1(2.0**10, increment_period=2, multiplier=3.0),
    "presets.mindspore": presets.mindspore(2.0**10, scale_factor=3, scale_window=2),
    "presets.nnabla": presets.nnabla(2.0**10, N=1),
    "presets.deepspeed": presets.deepspeed(2.0**10, scale_window=2),
    "presets.megatron": presets.megatron(2.0**10, growth_interval=2, backoff_factor=0.3),
    "presets.paddle": presets.paddle(2.0**10, incr_every_n_steps=2, decr_every_n_nan_or_inf=2),
    "presets.ascend": presets.ascend(2.0**10, 2),
}
PATTERN = [False, True, False, False, False, True, True, False, False, False, True, False, False, False]
#: Enough overflows in a row for the slowest rule here to reach its floor (paddle: 2 per halving, 136 halvings).
OVERFLOWS_TO_THE_FLOOR = 400


def amax_for(policy, state, overflow: bool) -> torch.Tensor | None:
    """What the overflow pass measures, for a policy that observes it: inf, or a scaled maximum 3 * scale."""
    if not policy.observes_amax:
        return None
    return torch.tensor(math.inf if overflow else 3.0 * float(state.scale))


def advance(owner: LossScale, overflow: bool) -> None:
    owner.update(torch.tensor(overflow), amax_for(owner.policy, owner.state, overflow))


@pytest.fixture(params=sorted(CONTRACT))
def policy(request):
    return CONTRACT[request.param]


def test_every_preset_is_under_contract():
    assert {f"presets.{name}" for name in presets.PRESETS} <= set(CONTRACT)


def test_is_a_policy_with_the_whole_protocol(policy):
    assert isinstance(policy, Policy) and isinstance(policy.observes_amax, bool)
    assert SMALLEST_NORMAL_FLOAT32 <= policy.min_scale <= policy.max_scale <= FLOAT32_MAX
    state = policy.init("cpu")
    assert state.scale.dtype == torch.float32 and state.scale.shape == () and state.scale.device.type == "cpu"
    policy.enforce_floor(state)  # nothing to say about a fresh state


def test_update_is_pure_reads_nothing_on_the_host_and_keeps_each_fields_dtype(policy):
    state = policy.init()
    layout = {f.name: (getattr(state, f.name).dtype, getattr(state, f.name).shape) for f in dataclasses.fields(state)}
    for overflow in PATTERN + [True] * 8:
        before = {name: getattr(state, name).clone() for name in layout}
        amax = amax_for(policy, state, overflow)
        with HostReadCounter() as reads:
            new = policy.update(state, torch.tensor(overflow), amax=amax)
        assert reads.count == 0
        for name, value in before.items():
            assert torch.equal(getattr(state, name), value), f"update changed its input's {name}"
            assert (getattr(new, name).dtype, getattr(new, name).shape) == layout[name], name
        state = new


def test_a_pickled_policy_and_its_saved_state_continue_the_trajectory(policy):
    a = LossScale(policy)
    for overflow in PATTERN[:6]:
        advance(a, overflow)
    b = LossScale(pickle.loads(pickle.dumps(policy)))
    assert b.policy == policy
    b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
    for overflow in PATTERN[6:]:
        advance(a, overflow)
        advance(b, overflow)
        for f in dataclasses.fields(a.state):
            assert torch.equal(getattr(a.state, f.name), getattr(b.state, f.name)), f.name


def test_overflows_in_a_row_reach_the_floor_and_stay_inside_the_bounds(policy):
    """A rule that backs off reaches its floor and stays; one that never moves stays put. A rule that raises at
    its floor (at_floor="raise") raises there and nowhere else."""
    owner = LossScale(policy)
    start, moved, at_floor = float(owner.scale), False, 0
    for _ in range(OVERFLOWS_TO_THE_FLOOR):
        try:
            advance(owner, True)
        except FloorError:
            assert float(owner.scale) == policy.min_scale
            return
        scale = float(owner.scale)
        assert math.isfinite(scale) and policy.min_scale <= scale <= policy.max_scale
        moved |= scale != start
        at_floor = at_floor + 1 if scale == policy.min_scale else 0
        if at_floor == 3:  # a fixed point: three more overflows left it there
            break
    assert float(owner.scale) == (policy.min_scale if moved else start)


def test_clean_runs_from_the_top_never_pass_the_cap(policy):
    owner = LossScale(policy)
    owner.set_scale(policy.max_scale / 2)
    for _ in range(40):
        advance(owner, False)
        assert math.isfinite(float(owner.scale)) and float(owner.scale) <= policy.max_scale
