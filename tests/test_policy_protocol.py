"""One contract over every policy: the core's, every preset's, every facade's rule.

Each is checked the same way, with no per-name cases: it is a ``Policy``; ``update`` is pure (the input
state is unchanged) and makes no host read; the state round-trips through ``LossScale``; the scale stays
finite and inside the policy's bounds through 10,000 overflows in a row and through long clean runs from
a scale near the top.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lossscale import DynamicScale, FixedScale, FloorError, HostReadCounter, LossScale, Policy, PredictiveScale, presets
from lossscale.compat import ascend, keras, mindspore, nnabla


def _facade_policies() -> dict[str, Policy]:
    w = torch.nn.Parameter(torch.zeros(2))
    return {
        "ascend.ExponentialUpdateLossScaleManager": ascend.ExponentialUpdateLossScaleManager(2**10, 3).policy,
        "ascend.FixedLossScaleManager": ascend.FixedLossScaleManager(64).policy,
        "mindspore.DynamicLossScaleUpdateCell": mindspore.DynamicLossScaleUpdateCell(2**10, 2, 3).policy,
        "mindspore.DynamicLossScaleManager": mindspore.DynamicLossScaleManager(2**10, 2, 3).policy,
        "mindspore.FixedLossScaleManager": mindspore.FixedLossScaleManager(64.0).policy,
        "nnabla.DynamicLossScalingUpdater": nnabla.DynamicLossScalingUpdater(
            torch.optim.SGD([w], lr=0.1), lambda: w.sum(), N=3)._opt.policy,
        "keras.LossScaleOptimizer": keras.LossScaleOptimizer(torch.optim.SGD([w], lr=0.1), dynamic_growth_steps=3)
        ._opt.policy,
    }


POLICIES: dict[str, Policy] = {
    "DynamicScale": DynamicScale(init_scale=2.0**10, growth_interval=3),
    "DynamicScale(hysteresis)": DynamicScale(init_scale=2.0**10, growth_interval=3, hysteresis=2,
                                             hysteresis_mode="cumulative", refill_after_backoff=False),
    "FixedScale": FixedScale(2.0**10),
    "PredictiveScale": PredictiveScale(init_scale=2.0**10, history=4),
    **{f"presets.{name}": getattr(presets, name)() for name in
       ("torch_amp", "keras", "tf_keras2", "tf_v1", "mindspore", "nnabla", "deepspeed", "megatron", "paddle")},
    "presets.ascend": presets.ascend(2.0**10, 3),
    **_facade_policies(),
}
PATTERN = [False, True, False, False, False, True, True, False, False, False, False]


def _amax(policy: Policy, state, overflow: bool) -> torch.Tensor | None:
    if not policy.observes_amax:
        return None
    return torch.tensor(math.inf if overflow else 3.0 * float(state.scale))


@pytest.fixture(params=sorted(POLICIES), ids=str)
def policy(request) -> Policy:
    return POLICIES[request.param]


def test_is_a_policy_with_the_whole_protocol(policy):
    assert isinstance(policy, Policy)
    assert isinstance(policy.observes_amax, bool)
    assert 0 < policy.min_scale <= policy.max_scale < math.inf
    state = policy.init("cpu")
    assert state.scale.dtype == torch.float32 and state.scale.shape == ()
    policy.check_floor(state)  # the default floor rule does nothing on a fresh state


def test_update_is_pure_and_reads_nothing_on_the_host(policy):
    state = policy.init("cpu")
    for overflow in PATTERN:
        before = {f.name: getattr(state, f.name).clone() for f in dataclasses.fields(state)}
        amax = _amax(policy, state, overflow)
        with HostReadCounter() as reads:
            new = policy.update(state, torch.tensor(overflow), amax=amax)
        assert reads.count == 0
        for name, value in before.items():  # the input record is untouched
            assert torch.equal(getattr(state, name), value), name
        state = new


def test_state_round_trips_through_the_owner(policy):
    a, b = LossScale(policy), LossScale(policy)
    for overflow in PATTERN[:6]:
        a.update(torch.tensor(overflow), _amax(policy, a.state, overflow))
    b.load_state_dict(a.state_dict())
    for overflow in PATTERN[6:]:
        for owner in (a, b):
            owner.update(torch.tensor(overflow), _amax(policy, owner.state, overflow))
    for f in dataclasses.fields(a.state):
        assert torch.equal(getattr(a.state, f.name), getattr(b.state, f.name)), f.name


def test_ten_thousand_overflows_stay_inside_the_bounds(policy):
    """A policy with a floor rule may raise FloorError at its floor (DeepSpeed's); the scale is in bounds then."""
    owner = LossScale(policy)
    for _ in range(10_000):
        try:
            owner.update(torch.tensor(True), _amax(policy, owner.state, True))
        except FloorError:
            assert float(owner.scale) == policy.min_scale
            break
    scale = float(owner.scale)
    assert math.isfinite(scale) and policy.min_scale <= scale <= policy.max_scale


def test_long_clean_runs_from_the_top_never_reach_inf(policy):
    top = LossScale(policy)
    top.set_scale(policy.max_scale / 2)
    for _ in range(40):
        top.update(torch.tensor(False), _amax(policy, top.state, False))
    assert math.isfinite(float(top.scale)) and float(top.scale) <= policy.max_scale


@pytest.mark.parametrize("bad", [0.0, 1e-46, 2.0**-140, math.inf, math.nan, -1.0, torch.tensor(0.0),
                                 torch.tensor(1e-40), torch.tensor(math.nan)], ids=repr)
def test_every_policy_refuses_a_scale_outside_float32_normal_range(policy, bad):
    owner = LossScale(policy)
    before = float(owner.scale)
    with pytest.raises(ValueError, match="must be a finite number > 0 whose float32 value is a normal number"):
        owner.set_scale(bad, "door")
    assert float(owner.scale) == before
