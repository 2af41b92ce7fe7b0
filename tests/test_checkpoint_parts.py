"""Checkpoint doors of the optional parts (EMA, LayerScales, PrecisionSchedule) and their whole-dict check in
LossScaleOptimizer.load_state_dict: a bad part is refused, naming it, before anything is loaded."""

from __future__ import annotations

import math
import re

import pytest
import torch

from lossscale import EMA, DynamicScale, LossScaleOptimizer, PrecisionSchedule
from lossscale.addons.layerwise import LayerScales


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _bound_ema(momentum=0.9, every=None):
    ema = EMA(momentum, every)
    ema.bind(_model().parameters())
    return ema


def _shadow_with(i, value):
    return lambda d: [value if j == i else s for j, s in enumerate(d["shadow"])]


EMA_CASES = {
    "not a dict": (lambda d: None, ("state must be the dict",)),
    "missing shadow": (lambda d: {"momentum": 0.9, "overwrite_every": None}, ("keys momentum",)),
    "another momentum": (lambda d: {**d, "momentum": 0.99}, ("momentum=0.99", "momentum=0.9", "saved arguments")),
    "another overwrite_every": (lambda d: {**d, "overwrite_every": 3}, ("overwrite_every=3",)),
    "momentum 1.5": (lambda d: {**d, "momentum": 1.5}, ("momentum=1.5", "saved arguments")),
    "one shadow short": (lambda d: {**d, "shadow": d["shadow"][:-1]}, ("one tensor per tracked parameter (4)",)),
    "NaN shadow": (lambda d: {**d, "shadow": _shadow_with(1, torch.full((4,), math.nan))(d)},
                   ("shadow[1]", "finite", "non-finite")),
    "wrong shape (broadcast)": (lambda d: {**d, "shadow": _shadow_with(0, torch.ones(1))(d)},
                                ("shadow[0]", "(4, 3)", "(1,)")),
    "float64 shadow": (lambda d: {**d, "shadow": _shadow_with(2, torch.ones(2, 4, dtype=torch.float64))(d)},
                       ("shadow[2]", "torch.float32", "torch.float64")),
}


@pytest.mark.parametrize("case", sorted(EMA_CASES))
def test_ema_load_refuses_a_bad_checkpoint_and_changes_nothing(case):
    ema = _bound_ema()
    saved = ema.state_dict()
    before = [s.clone() for s in ema.shadow]
    change, words = EMA_CASES[case]
    with pytest.raises((ValueError, TypeError)) as info:
        ema.load_state_dict(change({**saved, "shadow": [s + 1 for s in saved["shadow"]]}))
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"
    assert all(torch.equal(a, b) for a, b in zip(before, ema.shadow))


def test_ema_load_restores_a_good_checkpoint():
    ema, other = _bound_ema(), _bound_ema()
    with torch.no_grad():
        for s in other.shadow:
            s.add_(1.0)
    ema.load_state_dict(other.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow, other.shadow))


def _layers():
    return LayerScales(_model())


LAYER_CASES = {
    "not a dict": (lambda d: [1], ("state must be the dict",)),
    "other units": (lambda d: {**d, "units": ["a", "b"]}, ("units", "differ")),
    "NaN exponent": (lambda d: {**d, "exponent": [math.nan, 0.0]}, ("exponent", "2 finite numbers")),
    "inf level": (lambda d: {**d, "level": [0.0, math.inf]}, ("level",)),
    "exponent too short": (lambda d: {**d, "exponent": [1.0]}, ("exponent", "one per unit")),
    "observed not bools": (lambda d: {**d, "observed": [1, 0]}, ("observed", "2 bools")),
    "negative penalty": (lambda d: {**d, "penalty": [-1.0, 0.0]}, ("penalty", ">= 0")),
    "order repeats a unit": (lambda d: {**d, "order": [0, 0]}, ("order", "distinct")),
    "order out of range": (lambda d: {**d, "order": [0, 2]}, ("order", "[0, 2)")),
    "exponent a string": (lambda d: {**d, "exponent": "12"}, ("exponent",)),
}


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_layer_scales_load_refuses_a_bad_checkpoint_and_changes_nothing(case):
    layers = _layers()
    saved = layers.state_dict()
    before = layers.state_dict()
    change, words = LAYER_CASES[case]
    with pytest.raises(ValueError) as info:
        layers.load_state_dict(change({**saved, "exponent": [3.0, -1.0]}))
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"
    assert layers.state_dict() == before


def test_layer_scales_load_restores_a_good_checkpoint():
    layers = _layers()
    saved = {**layers.state_dict(), "exponent": [3.0, -1.0], "observed": [True, False], "order": [1, 0]}
    layers.load_state_dict(saved)
    assert layers.state_dict() == saved


def _lso(**kwargs):
    model = _model()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             policy=DynamicScale(init_scale=1024.0), **kwargs)
    opt.backward(model(torch.ones(2, 3)).sum())
    opt.step()
    return opt


PART_CASES = {
    "ema NaN shadow": (dict(ema=EMA(0.9)), lambda d: {**d, "ema": {**d["ema"], "shadow": [
        torch.full_like(s, math.nan) for s in d["ema"]["shadow"]]}}, "shadow[0]"),
    "schedule of another mode": (dict(schedule=PrecisionSchedule("fast|step|0.5", total_steps=10)),
                                 lambda d: {**d, "schedule": {**d["schedule"], "mode": "fast|step|0.9"}}, "mode"),
    "schedule step -1": (dict(schedule=PrecisionSchedule("fast|step|0.5", total_steps=10)),
                         lambda d: {**d, "schedule": {**d["schedule"], "step": -1}}, "step"),
    "seen_switch 'no'": (dict(schedule=PrecisionSchedule("fast|step|0.5", total_steps=10)),
                         lambda d: {**d, "seen_switch": "no"}, "seen_switch"),
}


@pytest.mark.parametrize("case", sorted(PART_CASES))
def test_a_bad_part_is_refused_before_the_scale_or_the_inner_optimizer_is_loaded(case):
    kwargs, change, word = PART_CASES[case]
    opt = _lso(**kwargs)
    saved = opt.state_dict()
    saved["policy_state"] = {**saved["policy_state"], "scale": 8.0}
    saved["inner"]["param_groups"][0]["lr"] = 0.5
    with pytest.raises(ValueError, match=re.escape(word)):
        opt.load_state_dict(change(saved))
    assert float(opt.loss_scale.scale) == 1024.0 and opt.param_groups[0]["lr"] == 0.1
    opt.load_state_dict(saved)  # the same checkpoint without the bad part loads whole
    assert float(opt.loss_scale.scale) == 8.0 and opt.param_groups[0]["lr"] == 0.5


def test_a_keras_average_with_momentum_one_round_trips():
    """Keras's momentum range is [0, 1] (1 freezes the average): its checkpoint is its own, not the core's range."""
    from lossscale.compat import keras

    param = torch.nn.Parameter(torch.ones(2))
    opt = keras.LossScaleOptimizer(torch.optim.SGD([param], lr=0.1), use_ema=True, ema_momentum=1.0)
    opt.apply([torch.ones(2)])
    saved = opt.state_dict()
    opt.load_state_dict(saved)
    assert torch.equal(opt.ema.shadow[0], saved["core"]["ema"]["shadow"][0])
