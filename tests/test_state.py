"""LossScale, the one holder of a scale: its setters and loaders, sharing it between holders, following a caller's
tensor, GradScaler's torch-private names as views of it, and the update replayed from a CUDA graph (its buffers and
copies, run here without the graph; the graph itself: tests/cuda/test_cuda_replayed_update.py).

That every entry point refuses a bad scale, naming itself, is test_entry_point_checks.py's; the value check's
rule is test_checks.py's. Here: what a setter or loader does with a value it accepts, and what it keeps when it
refuses one.
"""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch

from lossscale import DynamicScale, FloorError, GradScaler, LossScale, PredictiveScale, presets
from lossscale.state import ReplayedUpdate
from lossscale.testing import HostReadCounter
from oracles import f32


def advanced(policy=None, flags=(False, False, True, False)) -> LossScale:
    owner = LossScale(policy or DynamicScale(init_scale=1024.0, growth_interval=3))
    for o in flags:
        owner.update(torch.tensor(o))
    return owner


# --- setters ---------------------------------------------------------------------------------------------------


def test_set_scale_takes_the_float32_value_keeps_the_counters_and_reads_nothing_from_a_cpu_tensor():
    owner = advanced()
    counters = {k: v for k, v in owner.state_dict().items() if k != "scale"}
    with HostReadCounter() as reads:
        owner.set_scale(torch.tensor(0.1, dtype=torch.float64))
    assert reads.count == 0
    assert owner.scale.item() == f32(0.1) and owner.scale.dtype == torch.float32 and owner.scale.shape == ()
    assert owner.state_dict() == {"scale": f32(0.1), **counters} and counters["growth_tracker"] == 1


def test_set_scale_is_checked_against_the_policys_own_bounds():
    owner = LossScale(presets.tf_keras2(initial_scale=4.0))  # floor 1, as Keras 2
    with pytest.raises(
        ValueError,
        match=r"must be a finite number > 0 whose float32 value is a normal number in "
        r"\[1.0, 3.4028234663852886e\+38\].*got 0.5",
    ):
        owner.set_scale(0.5, call="Somebody.set_scale(0.5)")
    assert float(owner.scale) == 4.0
    owner.set_scale(1.0)
    assert float(owner.scale) == 1.0


def test_set_policy_changes_the_rule_from_the_next_update_and_keeps_the_state():
    owner = advanced()  # one clean step since the backoff
    before = owner.state_dict()
    owner.set_policy(DynamicScale(init_scale=8.0, growth_factor=4.0, growth_interval=3))
    assert owner.state_dict() == before  # the state carries on; init_scale of the new rule is not applied
    owner.update(torch.tensor(False))
    owner.update(torch.tensor(False))
    assert float(owner.scale) == before["scale"] * 4
    with pytest.raises(ValueError, match="the current scale"):
        owner.set_policy(DynamicScale(init_scale=4.0, max_scale=8.0))  # 4096 is outside its bounds
    assert owner.policy.growth_factor == 4.0


# --- loaders ---------------------------------------------------------------------------------------------------


def test_load_state_dict_restores_every_field_and_the_rule_continues():
    a = advanced()
    b = LossScale(DynamicScale(init_scale=1024.0, growth_interval=3))
    b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
    for owner in (a, b):
        owner.update(torch.tensor(False))
        owner.update(torch.tensor(False))
    assert a.state_dict() == b.state_dict() and b.state.growth_tracker.dtype == torch.int32


@pytest.mark.parametrize(
    "bad",
    [
        {"growth_tracker": 2**40},
        {"growth_tracker": 1.5},
        {"hysteresis_left": math.nan},
        {"floor_hits": "0"},
        {"scale": 1e-38},  # a normal double whose float32 value is subnormal
    ],
    ids=repr,
)
def test_load_state_dict_checks_the_whole_record_before_changing_anything(bad):
    owner = advanced()
    before = owner.state_dict()
    good = {**before, "scale": 8.0}
    with pytest.raises((ValueError, TypeError)):
        owner.load_state_dict({**good, **bad})
    assert owner.state_dict() == before


def test_a_batch_of_states_loads_and_each_scale_is_checked():
    owner = LossScale(DynamicScale(init_scale=8.0, arithmetic="float32"))
    batch = {"scale": [8.0, 4.0], "growth_tracker": [0, 1], "hysteresis_left": [1, 1], "floor_hits": [0, 0]}
    owner.load_state_dict(batch)
    assert owner.state_dict() == batch
    with pytest.raises(ValueError, match=r"got 0.0"):
        owner.load_state_dict({**batch, "scale": [8.0, 0.0]})
    with pytest.raises(ValueError, match="'growth_tracker' must have shape"):
        owner.load_state_dict({**batch, "growth_tracker": [0, 1, 2]})
    assert owner.state_dict() == batch


# --- sharing, following, moving --------------------------------------------------------------------------------


def test_shared_or_new_shares_an_owner_and_wraps_a_policy():
    owner = LossScale(DynamicScale(init_scale=8.0))
    assert LossScale.shared_or_new(owner, "cpu") is owner
    made = LossScale.shared_or_new(presets.keras(), "cpu")
    assert made is not owner and made.policy == presets.keras()
    assert LossScale.shared_or_new(None, "cpu").policy == DynamicScale()


def test_one_owner_moved_or_set_is_moved_or_set_for_every_holder():
    owner = LossScale(DynamicScale(init_scale=8.0))
    holders = [GradScaler("cpu", policy=DynamicScale()), owner]  # a second holder reads the same owner
    holders[0]._loss_scale = owner
    owner.set_scale(32.0)
    assert holders[0].loss_scale.scale is owner.scale and float(holders[0].loss_scale.scale) == 32.0
    owner.to("meta")
    assert holders[0].loss_scale.device.type == "meta" and owner.state.growth_tracker.device.type == "meta"


def test_follow_takes_the_callers_tensor_as_the_live_scale_without_a_check_or_a_host_read():
    """MindSpore's cell keeps the live scale in a Parameter the caller set through a checked setter; a corrupted
    one is turned into an overflow by the step's guard, not here."""
    owner = advanced()
    counters = owner.state.growth_tracker.clone()
    with HostReadCounter() as reads:
        owner.follow(torch.tensor([4.0], dtype=torch.float64))
        owner.follow(torch.tensor([2.0], dtype=torch.float64))
    assert reads.count == 0
    assert owner.scale.shape == () and owner.scale.dtype == torch.float32 and float(owner.scale) == 2.0
    assert torch.equal(owner.state.growth_tracker, counters)
    owner.follow(torch.tensor(0.0))
    assert float(owner.scale) == 0.0


def test_update_hands_loss_finite_only_to_a_policy_that_observes_it_and_applies_the_floor_rule():
    predictive = LossScale(PredictiveScale(init_scale=2.0**10))
    predictive.update(torch.tensor(False), amax=torch.tensor(2.0**10))
    before = float(predictive.scale)
    predictive.update(torch.tensor(True), amax=torch.tensor(math.inf), loss_finite=torch.tensor(False))
    assert float(predictive.scale) == before  # a non-finite loss: a fault of the data, not of the scale
    dynamic = LossScale(DynamicScale(init_scale=8.0))
    dynamic.update(torch.tensor(True), loss_finite=torch.tensor(False))  # not passed on: DynamicScale takes none
    assert float(dynamic.scale) == 4.0
    raising = LossScale(presets.deepspeed(init_scale=1.0, delayed_shift=1))
    with pytest.raises(FloorError):
        raising.update(torch.tensor(True))


def test_an_owner_pickles_with_its_rule_and_state():
    owner = advanced()
    copy = pickle.loads(pickle.dumps(owner))
    assert copy.policy == owner.policy and copy.state_dict() == owner.state_dict()
    assert repr(copy) == f"LossScale({owner.policy!r})"


# --- the update replayed from a graph (here without one: the same buffers and copies) -----------------------------


def _inputs(generator: torch.Generator, step: int, shape: tuple[int, ...]) -> tuple:
    """A step's (found_inf, amax, loss_finite): amax near 2**12 with a spread, an overflow in one step of 8, a NaN
    amax and a non-finite loss now and then; amax absent for two steps, loss_finite for two others, found_inf a
    count (torch's float) for ten: each change of the inputs' kind makes a new graph."""
    amax = torch.exp2(12 + 3 * torch.randn(shape, generator=generator))
    found = torch.rand(shape, generator=generator) < 0.125
    amax = torch.where(found, math.inf, amax)
    if step % 29 == 5:
        amax = torch.full(shape, math.nan)
        found = torch.ones(shape, dtype=torch.bool)
    loss_finite = torch.rand(shape, generator=generator) > 0.05
    return (
        found.float() if 80 <= step < 90 else found,
        None if step in (40, 41) else amax,
        None if step in (60, 61) else loss_finite,
    )


def _fields(record) -> dict[str, torch.Tensor]:
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


@pytest.mark.parametrize(
    "policy, shape",
    [
        (PredictiveScale(init_scale=2.0**16), ()),
        (PredictiveScale(init_scale=2.0**16, history=4), (3,)),
        (DynamicScale(init_scale=2.0**10, growth_interval=3, hysteresis=2), ()),
    ],
    ids=["predictive", "predictive-batch", "dynamic"],
)
def test_a_replayed_update_equals_the_rule_bit_for_bit_and_never_rewrites_a_record_it_returned(policy, shape):
    generator = torch.Generator().manual_seed(0)
    replayed = ReplayedUpdate(policy, capture=False)
    expected = policy.init()
    if shape:
        expected = type(expected)(**{k: v.expand(shape).clone() for k, v in _fields(expected).items()})
    got, returned = expected, []
    for step in range(120):
        found, amax, loss_finite = _inputs(generator, step, shape)
        passed = loss_finite if policy.observes_loss_finite else None
        expected = (
            policy.update(expected, found, amax=amax, loss_finite=passed)
            if passed is not None
            else policy.update(expected, found, amax=amax)
        )
        got = replayed(got, found, amax, passed)
        for name, tensor in _fields(expected).items():
            mine = getattr(got, name)
            assert (mine.dtype, mine.shape) == (tensor.dtype, tensor.shape), (step, name)
            assert torch.equal(mine, tensor), (step, name)
        returned.append((got, {k: v.clone() for k, v in _fields(got).items()}))
    assert not torch.equal(expected.scale, policy.init().scale)  # the stream moved the scale
    for record, values in returned:
        assert all(torch.equal(getattr(record, k), v) for k, v in values.items())


def test_a_replayed_update_reads_the_state_as_it_is_at_the_call():
    """A captured step of the caller's writes the state in place; a setter or loader replaces the record."""
    policy = PredictiveScale(init_scale=2.0**16)
    replayed = ReplayedUpdate(policy, capture=False)
    state = policy.init()
    for _ in range(3):
        state = replayed(state, torch.tensor(False), torch.tensor(2.0**13), torch.tensor(True))
    state.scale.fill_(2.0**5)  # in place, into the record it returned
    state.level.add_(1.0)
    expected = policy.update(state, torch.tensor(True), amax=torch.tensor(math.inf), loss_finite=torch.tensor(True))
    state = replayed(state, torch.tensor(True), torch.tensor(math.inf), torch.tensor(True))
    assert all(torch.equal(getattr(state, k), v) for k, v in _fields(expected).items())
    other = dataclasses.replace(policy.init(), scale=torch.tensor(2.0**9))  # a record it did not return
    expected = policy.update(other, torch.tensor(False), amax=torch.tensor(4.0), loss_finite=torch.tensor(True))
    state = replayed(other, torch.tensor(False), torch.tensor(4.0), torch.tensor(True))
    assert all(torch.equal(getattr(state, k), v) for k, v in _fields(expected).items())


def test_an_owner_on_the_cpu_runs_the_rule_itself_and_pickles_without_a_graph():
    owner = LossScale(PredictiveScale(init_scale=2.0**10))
    owner.update(torch.tensor(False), amax=torch.tensor(2.0**10))
    assert owner._replay is None  # a CUDA device only
    owner._replay = ReplayedUpdate(owner.policy, capture=False)  # as on a GPU, where it would hold a graph
    copy = pickle.loads(pickle.dumps(owner))
    assert copy._replay is None and copy.state_dict() == owner.state_dict()


# --- GradScaler's torch-private names --------------------------------------------------------------------------


def test_gradscalers_private_names_read_and_write_its_owner():
    scaler = GradScaler("cpu", init_scale=512.0)
    assert scaler._scale is None and scaler._growth_tracker is None  # as torch: nothing before the first scale()
    scaler._init_growth_tracker = 7
    scaler._init_scale = 256.0
    assert scaler.loss_scale.state_dict() == {
        "scale": 256.0,
        "growth_tracker": 7,
        "hysteresis_left": 1,
        "floor_hits": 0,
    }
    scaler.scale(torch.ones(()))
    assert scaler._scale is scaler.loss_scale.scale and scaler._growth_tracker is scaler.loss_scale.state.growth_tracker
