"""Bad input to the core API: policies, presets, LossScaleOptimizer, EMA, PrecisionSchedule.

Each case asserts a clear error (type, the argument's name, the value received) and that the model's
parameters and optimizer state are unchanged and finite afterwards (see tests/bad_inputs.py).
"""

from __future__ import annotations

import math

import pytest
import torch

import lossscale
from bad_inputs import Bad, World, ctor_cases, params, run
from lossscale import EMA, DynamicScale, FixedScale, LossScaleOptimizer, PrecisionSchedule, presets

inf, nan = math.inf, math.nan

SCALE = [0.0, -1.0, inf, -inf, nan, 1e-46, 1e39, "8", None, True]
FACTOR = [1.0, 0.5, 0.0, -2.0, inf, nan, "2", None, True]
FRACTION = [0.0, 1.0, 1.5, -0.5, inf, nan, "0.5", None, True]
INT1 = [0, -1, 1.5, "10", None, True]
INT0 = [-1, 1.5, "1", None]
CHOICE = [("both", ValueError), (None, ValueError), (1, ValueError)]


def dynamic(world, kwargs):
    DynamicScale(**kwargs)


POLICIES = ctor_cases("DynamicScale", dynamic, {
    "init_scale": SCALE, "growth_factor": FACTOR, "backoff_factor": FRACTION,
    "growth_interval": INT1 + [2**31, 2**40], "hysteresis": INT1 + [2**31], "hysteresis_mode": CHOICE,
    "refill_after_backoff": CHOICE, "min_scale": SCALE, "max_scale": SCALE, "at_floor": CHOICE,
    "arithmetic": CHOICE, "backoff_divisor": [1.0, 0.5, inf, nan, "2", True], "growth_guard": CHOICE,
    "growth_delay": INT0 + [2**40],
})
POLICIES += [
    Bad("DynamicScale(min_scale > max_scale)", lambda w, s: DynamicScale(min_scale=8.0, max_scale=4.0, init_scale=4.0),
        ValueError, ("min_scale=8.0", "max_scale=4.0")),
    Bad("DynamicScale(init_scale below min_scale)", lambda w, s: DynamicScale(min_scale=8.0, init_scale=4.0),
        ValueError, ("init_scale=4.0",)),
    Bad("DynamicScale(backoff_factor and backoff_divisor)",
        lambda w, s: DynamicScale(backoff_factor=0.25, backoff_divisor=3.0), ValueError,
        ("backoff_factor=0.25", "backoff_divisor=3.0")),
]
POLICIES += ctor_cases("FixedScale", lambda w, kw: FixedScale(**kw), {"scale": SCALE})

PRESET_VALUES = {"scale": [0.0, nan, "8"], "factor": [1.0, inf, "2"], "fraction": [1.0, nan, "0.5"],
                 "int1": [0, 1.5, "10"], "int0": [-1, 1.5], "choice": [("yes", ValueError)]}
PRESET_ARGS = {
    "torch_amp": ({}, {"init_scale": "scale", "growth_factor": "factor", "backoff_factor": "fraction",
                       "growth_interval": "int1"}),
    "keras": ({}, {"initial_scale": "scale", "dynamic_growth_steps": "int1"}),
    "tf_keras2": ({}, {"initial_scale": "scale", "dynamic_growth_steps": "int1"}),
    "tf_v1": ({}, {"initial_loss_scale": "scale", "increment_period": "int1", "multiplier": "factor"}),
    "mindspore": ({}, {"init_loss_scale": "scale", "scale_factor": "factor", "scale_window": "int1"}),
    "nnabla": ({}, {"scale": "scale", "scaling_factor": "factor", "N": "int0"}),
    "deepspeed": ({}, {"init_scale": "scale", "scale_factor": "factor", "scale_window": "int1",
                       "min_scale": "scale", "delayed_shift": "int1", "consecutive_hysteresis": "choice",
                       "raise_error_at_min_scale": "choice"}),
    "megatron": ({}, {"initial_scale": "scale", "min_scale": "scale", "growth_factor": "factor",
                      "backoff_factor": "fraction", "growth_interval": "int1", "hysteresis": "int1"}),
    "paddle": ({}, {"init_loss_scaling": "scale", "incr_ratio": "factor", "decr_ratio": "fraction",
                    "incr_every_n_steps": "int1", "decr_every_n_nan_or_inf": "int1"}),
    "ascend": ({"init_loss_scale": 1024.0, "incr_every_n_steps": 10},
               {"init_loss_scale": "scale", "incr_every_n_steps": "int1", "decr_every_n_nan_or_inf": "int1",
                "incr_ratio": "factor", "decr_ratio": "fraction"}),
}
PRESETS = [case for name, (base, args) in PRESET_ARGS.items()
           for case in ctor_cases(f"presets.{name}", lambda w, kw, name=name, base=base:
                                  getattr(presets, name)(**{**base, **kw}),
                                  {arg: PRESET_VALUES[kind] for arg, kind in args.items()})]


def lso(world, kwargs):
    LossScaleOptimizer(world.opt, **kwargs)


POSITIVE = [0.0, -1.0, nan, inf, "1", True]
OPTIMIZER = ctor_cases("LossScaleOptimizer", lso, {
    "policy": [("dynamic", TypeError), (object(), TypeError), (3, TypeError)],
    "overflow_mode": CHOICE, "clip_grad_norm": POSITIVE, "clip_grad_value": POSITIVE,
    "accumulation_steps": INT1, "ema": [("ema", TypeError), (0.99, TypeError)],
    "weight_decay": [-1.0, nan, inf, "0.1", True], "skip_mode": [("none", ValueError), (None, ValueError)],
    "check_when_unscaled": CHOICE, "underflow_stride": [0, -1, 1.5, "4"],
    "saturation_dtype": [(torch.int32, ValueError), ("float16", TypeError), (None, TypeError)],
    "schedule": [("fast|step|0.9", TypeError), (3, TypeError)],
    "sharded_grads": [("yes", ValueError), (1, ValueError)],
    "module": [("model", TypeError), (3, TypeError)],
    "process_group": [("nccl", TypeError), (3, TypeError)],
})
OPTIMIZER += [
    *[Bad(f"LossScaleOptimizer(inner={v!r})", lambda w, s, v=v: LossScaleOptimizer(v), TypeError, ("inner",))
      for v in ["sgd", None, 3]],
    Bad("LossScaleOptimizer(inner=model)", lambda w, s: LossScaleOptimizer(w.model), TypeError, ("inner", "Linear")),
    Bad("LossScaleOptimizer(inner=LossScaleOptimizer)", lambda w, s: LossScaleOptimizer(LossScaleOptimizer(w.opt)),
        TypeError, ("inner", "LossScaleOptimizer")),
    Bad("LossScaleOptimizer(two clips)", lambda w, s: LossScaleOptimizer(w.opt, clip_grad_norm=1.0,
                                                                         clip_grad_value=1.0),
        ValueError, ("clip_grad_norm", "clip_grad_value")),
    Bad("LossScaleOptimizer(skip_mode='fused', non-fused)", lambda w, s: LossScaleOptimizer(w.opt, skip_mode="fused"),
        ValueError, ("skip_mode='fused'", "SGD")),
]


def wrapped(world):
    return LossScaleOptimizer(world.opt, policy=DynamicScale(init_scale=1024.0))


SET_SCALE_OUT_OF_RANGE = [0.0, -1.0, inf, -inf, nan, torch.tensor([1.0, 2.0])]
SET_SCALE_TINY_OR_WRONG = [1e-40, 2.0**-140, 1e39, torch.tensor(0.0), torch.tensor(1e-40), torch.tensor(inf),
                  torch.tensor(nan), "8", True, torch.tensor(8.0, device="meta")]
OPTIMIZER_CALLS = [
    *[Bad(f"LossScaleOptimizer.set_scale({v!r})", lambda w, s, v=v: s.set_scale(v),
          TypeError if isinstance(v, (str, bool)) else ValueError, ("new_scale",), wrapped)
      for v in SET_SCALE_OUT_OF_RANGE + SET_SCALE_TINY_OR_WRONG],
    Bad("LossScaleOptimizer.step() before any backward", lambda w, s: s.step(), RuntimeError, ("gradient",),
        wrapped),
    *[Bad(f"LossScaleOptimizer.backward({v!r})", lambda w, s, v=v: s.backward(v), TypeError, ("loss",), wrapped)
      for v in ["loss", None, [1.0]]],
    Bad("LossScaleOptimizer.attach_schedule('fast|step')", lambda w, s: s.attach_schedule("fast|step"), TypeError,
        ("schedule=", "'fast|step'"), wrapped),
]


def lso_dict(**policy_changes):
    def make(world):
        opt = wrapped(world)
        d = opt.state_dict()
        d["policy_state"] = {**d["policy_state"], **policy_changes}
        return opt, d
    return make


LSO_LOADS = {
    "scale=0.0": (lso_dict(scale=0.0), ValueError, ("scale", "0.0")),
    "scale=1e-46": (lso_dict(scale=1e-46), ValueError, ("scale", "1e-46")),
    "scale=inf": (lso_dict(scale=inf), ValueError, ("scale", "inf")),
    "scale=nan": (lso_dict(scale=nan), ValueError, ("scale", "nan")),
    "scale=-8": (lso_dict(scale=-8.0), ValueError, ("scale", "-8.0")),
    "scale=tensor(0.)": (lso_dict(scale=torch.tensor(0.0)), ValueError, ("scale",)),
    "growth_tracker=2**40": (lso_dict(growth_tracker=2**40), ValueError, ("growth_tracker",)),
}
def mid_window(**changes):
    """A LossScaleOptimizer with 2-step accumulation and its state dict saved after one micro-batch (it holds
    accumulated_grads and window), with ``changes`` applied; the world's optimizer has the same parameters."""
    def make(world):
        opt = LossScaleOptimizer(world.opt, policy=DynamicScale(init_scale=1024.0), accumulation_steps=2)
        opt.backward(world.loss())
        opt.step()
        d = opt.state_dict()
        opt.zero_grad()  # a window in progress; the load must not change it either
        d.update({k: (v(d) if callable(v) else v) for k, v in changes.items()})
        return opt, d
    return make


def _grads_with(i, value):
    return lambda d: [value if j == i else g for j, g in enumerate(d["accumulated_grads"])]


LSO_LOADS.update({
    "accumulated_grads short": (mid_window(accumulated_grads=lambda d: d["accumulated_grads"][:1]), ValueError,
                                ("accumulated_grads", "per parameter", "(2)", "1 entries")),
    "accumulated_grads missing": (mid_window(accumulated_grads=None), ValueError,
                                  ("micro_step=1", "accumulated_grads")),
    "accumulated_grads[0] wrong shape": (mid_window(accumulated_grads=_grads_with(0, torch.ones(5))), ValueError,
                                         ("accumulated_grads[0]", "(2, 3)", "(5,)")),
    "accumulated_grads[1] int64": (mid_window(accumulated_grads=_grads_with(1, torch.ones(2, dtype=torch.int64))),
                                   ValueError, ("accumulated_grads[1]", "torch.int64")),
    "accumulated_grads[0] a string": (mid_window(accumulated_grads=_grads_with(0, "g")), ValueError,
                                      ("accumulated_grads[0]", "str")),
    "window junk": (mid_window(window="junk"), ValueError, ("window", "'junk'")),
    "window missing": (mid_window(window=None), ValueError, ("window", "None")),
    "window precision float8": (mid_window(window=(True, "float8")), ValueError, ("window", "float8")),
    "window at micro_step 0": (mid_window(micro_step=0), ValueError, ("micro_step=0", "window")),
})
OPTIMIZER_LOADS = [
    Bad(f"LossScaleOptimizer.load_state_dict({name})", lambda w, s: s[0].load_state_dict(s[1]), err, words, make)
    for name, (make, err, words) in LSO_LOADS.items()]
OPTIMIZER_LOADS += [
    Bad("LossScaleOptimizer.load_state_dict(None)", lambda w, s: s.load_state_dict(None), TypeError,
        ("state_dict", "None"), wrapped),
    Bad("LossScaleOptimizer.load_state_dict({})", lambda w, s: s.load_state_dict({}), ValueError,
        ("state_dict", "inner"), wrapped),
    Bad("LossScaleOptimizer.load_state_dict(GradScaler's)",
        lambda w, s: s.load_state_dict(lossscale.GradScaler("cpu").state_dict()), ValueError,
        ("state_dict", "inner"), wrapped),
    Bad("LossScaleOptimizer.load_state_dict(micro_step=-1)",
        lambda w, s: s.load_state_dict({**s.state_dict(), "micro_step": -1}), ValueError, ("micro_step", "-1"),
        wrapped),
    Bad("LossScaleOptimizer.load_state_dict(another optimizer's groups)",
        lambda w, s: s.load_state_dict({**s.state_dict(), "inner": torch.optim.SGD(
            [torch.nn.Parameter(torch.ones(1))] * 0 + [torch.nn.Parameter(torch.ones(1))], lr=1.0).state_dict()}),
        ValueError, ("param",), wrapped),
]

EMAS = ctor_cases("EMA", lambda w, kw: EMA(**kw), {
    "momentum": [1.0, -0.1, nan, inf, "0.9", True], "overwrite_every": [0, -1, 1.5, "2"]})

STEP_MODE = {"mode": "fast|step|0.9", "total_steps": 10}
LOSS_MODE = {"mode": "fast|loss|1.05", "target_loss": 2.0}
SCHEDULES = ctor_cases("PrecisionSchedule", lambda w, kw: PrecisionSchedule(**kw), {
    "mode": [("fast", ValueError), ("slow|step", ValueError), ("fast|time|0.5", ValueError),
             ("fast|step|0.1", ValueError), ("fast|step|1", ValueError), ("fast|loss|2", ValueError),
             ("fast|step|abc", ValueError), ("", ValueError), ("fast|step|0.5|x", ValueError),
             (3, TypeError), (None, TypeError), (b"fast|step", TypeError)],
})
SCHEDULES += ctor_cases("PrecisionSchedule(step)", lambda w, kw: PrecisionSchedule(**{**STEP_MODE, **kw}), {
    "total_steps": [0, -1, 1.5, "10", True, (None, ValueError)], "target_loss": [(2.0, ValueError)]})
SCHEDULES += ctor_cases("PrecisionSchedule(loss)", lambda w, kw: PrecisionSchedule(**{**LOSS_MODE, **kw}), {
    "target_loss": [0.0, -1.0, nan, inf, "1", True, (None, ValueError)], "total_steps": [(10, ValueError)]})


def schedule(world):
    return PrecisionSchedule("fast|step|0.9", total_steps=10)


SCHEDULES += [
    *[Bad(f"PrecisionSchedule.update(step={v!r})", lambda w, s, v=v: s.update(step=v), err, ("step=", repr(v)),
          schedule) for v, err in [(-1, ValueError), (1.5, TypeError), ("1", TypeError), (True, TypeError)]],
    *[Bad(f"PrecisionSchedule.update(loss={v!r})", lambda w, s, v=v: s.update(loss=v), err, ("loss=",), schedule)
      for v, err in [("x", TypeError), ([1.0], TypeError), (torch.tensor([1.0, 2.0]), ValueError), (True, TypeError)]],
    Bad("PrecisionSchedule.update()", lambda w, s: s.update(), TypeError, ("step=", "loss="), schedule),
    Bad("PrecisionSchedule.load_state_dict(other mode)",
        lambda w, s: s.load_state_dict({"mode": "fast|step|0.5", "step": 1, "switch_step": None}), ValueError,
        ("mode", "'fast|step|0.5'"), schedule),
    Bad("PrecisionSchedule.load_state_dict(no step)",
        lambda w, s: s.load_state_dict({"mode": "fast|step|0.9", "switch_step": None}), ValueError,
        ("step",), schedule),
    Bad("PrecisionSchedule.load_state_dict(step=-1)",
        lambda w, s: s.load_state_dict({"mode": "fast|step|0.9", "step": -1, "switch_step": None}), ValueError,
        ("step", "-1"), schedule),
    Bad("PrecisionSchedule.load_state_dict(step='3')",
        lambda w, s: s.load_state_dict({"mode": "fast|step|0.9", "step": "3", "switch_step": None}), TypeError,
        ("step", "'3'"), schedule),
    Bad("PrecisionSchedule.load_state_dict(switch_step=1.5)",
        lambda w, s: s.load_state_dict({"mode": "fast|step|0.9", "step": 3, "switch_step": 1.5}), TypeError,
        ("switch_step", "1.5"), schedule),
    Bad("PrecisionSchedule.load_state_dict(None)", lambda w, s: s.load_state_dict(None), TypeError,
        ("state_dict", "None"), schedule),
]


WAITING: frozenset[str] = frozenset()


@pytest.mark.parametrize("case", params(POLICIES, WAITING))
def test_policy_bad_input(case):
    run(case)


@pytest.mark.parametrize("case", params(PRESETS))
def test_preset_bad_input(case):
    run(case)


@pytest.mark.parametrize("case", params(OPTIMIZER + OPTIMIZER_CALLS + OPTIMIZER_LOADS, WAITING))
def test_loss_scale_optimizer_bad_input(case):
    run(case)


@pytest.mark.parametrize("case", params(EMAS + SCHEDULES))
def test_ema_and_schedule_bad_input(case):
    run(case)


def test_every_waiting_id_names_a_case():
    ids = {c.id for c in POLICIES + PRESETS + OPTIMIZER + OPTIMIZER_CALLS + OPTIMIZER_LOADS + EMAS + SCHEDULES}
    assert WAITING <= ids, sorted(WAITING - ids)
