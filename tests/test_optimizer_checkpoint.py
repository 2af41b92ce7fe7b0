"""LossScaleOptimizer's checkpoints: a round trip in the middle of an accumulation window with hysteresis in flight,
and the optional parts (EMA, per-layer scales, PrecisionSchedule): each part refuses a bad checkpoint of its own,
naming it, and the optimizer refuses a dict with a bad part before it loads the scale or the inner optimizer.

The checks of the position and the accumulated gradients: test_entry_point_checks.py. The schedule's and the
per-layer scales' own resumes: test_schedule.py, test_layerwise.py.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

from lossscale import EMA, DynamicScale, LossScaleOptimizer, PrecisionSchedule
from lossscale.layerwise import LayerScales


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _run(opt, model, batches, inject, start):
    out = []
    for i, (x, y) in enumerate(batches, start):
        opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(model(x), y))
        if i in inject:
            model[0].weight.grad[1, 1] = math.inf
        r = opt.step()
        out.append((r.accumulating, bool(r.stepped), float(r.next_scale)))
    return out


@pytest.mark.parametrize("flat", [False, True])
def test_a_round_trip_mid_window_with_hysteresis_in_flight_continues_the_same_trajectory(flat):
    inject = {4, 12, 16}
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(16, 3, generator=gen), torch.randn(16, 2, generator=gen)) for _ in range(20)]

    def make():
        model, ema = _model(), EMA(0.5)
        opt = LossScaleOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True),
            policy=DynamicScale(init_scale=2.0**9, growth_interval=2, hysteresis=2, hysteresis_mode="cumulative"),
            accumulation_steps=3,
            ema=ema,
            flat_grads=flat,
        )
        return model, opt, ema

    model, opt, ema = make()
    full = _run(opt, model, batches, inject, 0)
    final = [p.detach().clone() for p in model.parameters()] + [s.clone() for s in ema.shadow]

    model, opt, _ = make()
    first = _run(opt, model, batches[:10], inject, 0)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    assert saved["opt"]["micro_step"] == 1 and saved["opt"]["policy_state"]["hysteresis_left"] == 1
    model, opt, ema = make()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    if flat:  # the accumulated gradients were loaded into the buffer
        assert opt._flat.attached(list(model.parameters()))
    rest = _run(opt, model, batches[10:], inject, 10)
    assert first + rest == full
    assert len({s for *_, s in full}) > 1 and [a for a, *_ in full].count(False) == 6
    resumed = [p.detach() for p in model.parameters()] + ema.shadow
    assert all(torch.equal(p, q) for p, q in zip(resumed, final))


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
    "NaN shadow": (
        lambda d: {**d, "shadow": _shadow_with(1, torch.full((4,), math.nan))(d)},
        ("shadow[1]", "finite", "non-finite"),
    ),
    "wrong shape (broadcast)": (
        lambda d: {**d, "shadow": _shadow_with(0, torch.ones(1))(d)},
        ("shadow[0]", "(4, 3)", "(1,)"),
    ),
    "float64 shadow": (
        lambda d: {**d, "shadow": _shadow_with(2, torch.ones(2, 4, dtype=torch.float64))(d)},
        ("shadow[2]", "torch.float32", "torch.float64"),
    ),
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
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), policy=DynamicScale(init_scale=1024.0), **kwargs
    )
    opt.backward(model(torch.ones(2, 3)).sum())
    opt.step()
    return opt


PART_CASES = {
    "ema NaN shadow": (
        dict(ema=EMA(0.9)),
        lambda d: {**d, "ema": {**d["ema"], "shadow": [torch.full_like(s, math.nan) for s in d["ema"]["shadow"]]}},
        "shadow[0]",
    ),
    "schedule of another mode": (
        dict(schedule=PrecisionSchedule("fast|step|0.5", total_steps=10)),
        lambda d: {**d, "schedule": {**d["schedule"], "mode": "fast|step|0.9"}},
        "mode",
    ),
    "schedule step -1": (
        dict(schedule=PrecisionSchedule("fast|step|0.5", total_steps=10)),
        lambda d: {**d, "schedule": {**d["schedule"], "step": -1}},
        "step",
    ),
    "seen_switch 'no'": (
        dict(schedule=PrecisionSchedule("fast|step|0.5", total_steps=10)),
        lambda d: {**d, "seen_switch": "no"},
        "seen_switch",
    ),
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


PARTS = {
    "ema": lambda: dict(ema=EMA(0.9)),
    "schedule": lambda: dict(schedule=PrecisionSchedule("fast|step|0.5", total_steps=10)),
    "layerwise": lambda: dict(layerwise=None),
}  # layerwise: attached to the model below


def _lso_with(part):
    """A LossScaleOptimizer that has ``part`` (or none), after one step."""
    if part != "layerwise":
        return _lso(**(PARTS[part]() if part else {}))
    model = _model()
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), policy=DynamicScale(init_scale=1024.0), layerwise=model
    )
    opt.backward(model(torch.ones(2, 3)).sum())
    opt.step()
    return opt


@pytest.mark.parametrize("part", sorted(PARTS))
def test_a_part_on_one_side_only_warns_naming_it_and_what_happens(part):
    with pytest.warns(UserWarning, match=rf"has no {part!r} entry; the {part} part keeps its current state"):
        _lso_with(part).load_state_dict(_lso_with(None).state_dict())
    with pytest.warns(UserWarning, match=rf"holds a {part!r} entry and this optimizer has no .*; the entry is ignored"):
        _lso_with(None).load_state_dict(_lso_with(part).state_dict())


@pytest.mark.parametrize("part", [None, *sorted(PARTS)])
def test_matching_parts_load_without_a_warning(part):
    import warnings

    opt, saved = _lso_with(part), _lso_with(part).state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(saved)
