"""Every public entry point that takes arguments, or sets or loads a scale, calls its checks: one test per entry
point.

Each refusal is one bad call on a fresh small training setup (``World``: a model whose SGD-with-momentum optimizer
has taken one step, so it holds state) and whatever the entry point needs built on it. The call must raise the
stated error, the message must name the call and the argument (and show the value where given), and afterwards the
model's parameters, the optimizer's state and the subject's own ``state_dict()`` must be exactly as before.

One bad value per argument: the checks themselves are tested over all values in test_checks.py. Entry points whose
checks are their own file's subject are tested there: the presets (test_presets.py, under the peers' names),
PrecisionSchedule's mode grammar and ``update`` (test_schedule.py), GradScaler's call order (test_scaler.py),
a checkpoint's optional parts (test_optimizer_checkpoint.py), and the facades' call-specific arguments that their
test_compat_*.py files cover (Ascend's ``update_loss_scale``, MindSpore's cell ``loss_scale`` dtype, nnabla's
``loss``/``comm``, Keras's ``name``/``ema_momentum``/``scale_loss`` and unknown keywords).

"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from lossscale import (
    EMA,
    DynamicScale,
    FixedScale,
    GradScaler,
    LossScale,
    LossScaleOptimizer,
    PrecisionSchedule,
    PredictiveScale,
    presets,
)
from lossscale.compat import ascend, keras, mindspore, nnabla
from lossscale.validation import StateDictError

inf, nan = math.inf, math.nan


class World:
    """A tiny model and its SGD-with-momentum optimizer after one clean step (so its state is not empty)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.model = torch.nn.Linear(3, 2)
        with torch.no_grad():
            self.model.weight.copy_(torch.randn(2, 3, generator=gen))
            self.model.bias.copy_(torch.randn(2, generator=gen))
        self.params = list(self.model.parameters())
        self.opt = torch.optim.SGD(self.params, lr=0.125, momentum=0.5)
        self.x = torch.randn(4, 3, generator=gen)
        self.loss().backward()
        self.opt.step()
        self.opt.zero_grad()
        self.saved: Any = None  # a state dict a setup prepared for the bad call

    def loss(self) -> torch.Tensor:
        return self.model(self.x).square().mean()


def same(a: Any, b: Any) -> bool:
    """Equal, tensors bit for bit with their shape and dtype."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def snapshot(world: World, subject: Any) -> tuple:
    """The parameters, the optimizer's state and the subject's own saved state."""
    own = copy.deepcopy(subject.state_dict()) if hasattr(subject, "state_dict") else None
    return [p.detach().clone() for p in world.params], copy.deepcopy(world.opt.state_dict()), own


@dataclass(frozen=True)
class Refusal:
    """``act(world, subject)`` raises ``error`` whose message holds ``words``: the call first, then the argument
    (and the value shown where given)."""

    what: str
    act: Callable[[World, Any], Any]
    error: type[BaseException]
    words: tuple[str, ...]
    starts: bool = False  # the message starts with the call (words[0])


@dataclass(frozen=True)
class EntryPoint:
    setup: Callable[[World], Any]
    refusals: list[Refusal]


def nothing(world: World) -> None:
    return None


def bad_args(call: str, build: Callable[..., Any], table: list[tuple]) -> list[Refusal]:
    """One refusal per ``(argument, value, error)`` row of a constructor: ``build(world, **{argument: value})``."""
    return [
        Refusal(
            f"{name}={value!r}",
            lambda w, s, name=name, value=value: build(w, **{name: value}),
            error,
            (f"{call}(", f"{name}=", repr(value)),
            True,
        )
        for name, value, error in table
    ]


# --- the policies and their owner ------------------------------------------------------------------------------


POLICIES = {
    "DynamicScale(...)": EntryPoint(
        nothing,
        bad_args(
            "DynamicScale",
            lambda w, **kw: DynamicScale(**kw),
            [
                ("init_scale", 0.0, ValueError),
                ("init_scale", "8", TypeError),
                ("growth_factor", 1.0, ValueError),
                ("backoff_factor", 1.0, ValueError),
                ("growth_interval", 0, ValueError),
                ("growth_interval", 2**31, ValueError),
                ("hysteresis", 1.5, TypeError),
                ("hysteresis_mode", "sometimes", ValueError),
                ("refill_after_backoff", None, ValueError),
                ("min_scale", 1e-45, ValueError),
                ("max_scale", inf, ValueError),
                ("at_floor", "explode", ValueError),
                ("arithmetic", "float16", ValueError),
                ("backoff_divisor", 0.5, ValueError),
                ("growth_guard", "both", ValueError),
                ("growth_delay", -1, ValueError),
            ],
        )
        + [
            Refusal(
                "min_scale > max_scale",
                lambda w, s: DynamicScale(min_scale=8.0, max_scale=4.0, init_scale=4.0),
                ValueError,
                ("DynamicScale(", "min_scale=8.0, max_scale=4.0", "min_scale must be <= max_scale"),
            ),
            Refusal(
                "init_scale below min_scale",
                lambda w, s: DynamicScale(min_scale=8.0, init_scale=4.0),
                ValueError,
                ("DynamicScale(", "init_scale=4.0", "[8.0, "),
            ),
            Refusal(
                "backoff_factor and backoff_divisor",
                lambda w, s: DynamicScale(backoff_factor=0.25, backoff_divisor=3.0),
                ValueError,
                ("DynamicScale(", "backoff_factor=0.25, backoff_divisor=3.0", "pass one of them"),
            ),
        ],
    ),
    "FixedScale(...)": EntryPoint(
        nothing,
        bad_args(
            "FixedScale", lambda w, **kw: FixedScale(**kw), [("scale", 0.0, ValueError), ("scale", "8", TypeError)]
        ),
    ),
    "PredictiveScale(...)": EntryPoint(
        nothing,
        bad_args(
            "PredictiveScale",
            lambda w, **kw: PredictiveScale(**kw),
            [
                ("init_scale", 0.0, ValueError),
                ("target_interval", 5, ValueError),
                ("history", 0, ValueError),
                ("tail_history", 0, ValueError),
                ("margin", -1, ValueError),
                ("backoff_factor", 1.0, ValueError),
                ("learn_margin", "yes", ValueError),
                ("forget_interval", 0, ValueError),
                ("fault_gap", 0, ValueError),
                ("cuda_graph", 1, ValueError),
                ("dtype", torch.int8, ValueError),
                ("min_scale", 0.0, ValueError),
                ("max_scale", nan, ValueError),
            ],
        )
        + [
            Refusal(
                "no power of two in the bounds",
                lambda w, s: PredictiveScale(min_scale=3.0, max_scale=3.5, init_scale=3.0),
                ValueError,
                ("PredictiveScale(", "min_scale=3.0, max_scale=3.5", "no power of two"),
            )
        ],
    ),
    "LossScale(...)": EntryPoint(
        nothing,
        [
            Refusal(
                "policy='dynamic'",
                lambda w, s: LossScale("dynamic"),
                TypeError,
                ("LossScale(", "policy='dynamic'", "lossscale.Policy"),
            )
        ],
    ),
    "LossScale.set_scale": EntryPoint(
        lambda w: LossScale(DynamicScale(init_scale=1024.0)),
        [
            Refusal("0.0", lambda w, s: s.set_scale(0.0), ValueError, ("LossScale.set_scale(", "the scale", "0.0")),
            Refusal("'8'", lambda w, s: s.set_scale("8"), TypeError, ("LossScale.set_scale(", "the scale", "'8'")),
        ],
    ),
    "LossScale.set_policy": EntryPoint(
        lambda w: LossScale(DynamicScale(init_scale=1024.0)),
        [
            Refusal(
                "bounds without the scale",
                lambda w, s: s.set_policy(DynamicScale(init_scale=4.0, max_scale=8.0)),
                ValueError,
                ("LossScale.set_policy(", "the current scale", "tensor(1024.)"),
            ),
            Refusal(
                "not a policy", lambda w, s: s.set_policy(None), TypeError, ("LossScale.set_policy(", "policy=None")
            ),
        ],
    ),
    "LossScale.load_state_dict": EntryPoint(
        lambda w: LossScale(DynamicScale(init_scale=1024.0)),
        [
            Refusal(
                "scale 0",
                lambda w, s: s.load_state_dict({**s.state_dict(), "scale": 0.0}),
                ValueError,
                ("LossScale.load_state_dict", "field 'scale'", "0.0"),
            ),
            Refusal(
                "a field missing",
                lambda w, s: s.load_state_dict({"scale": 8.0}),
                StateDictError,
                ("LossScale.load_state_dict", "missing ['growth_tracker'"),
            ),
            Refusal(
                "a list",
                lambda w, s: s.load_state_dict([8.0]),
                TypeError,
                ("LossScale.load_state_dict", "a dict of its fields", "list"),
            ),
        ],
    ),
}


# --- GradScaler ----------------------------------------------------------------------------------------------


def scaled(world: World) -> GradScaler:
    """A scaler after scale(loss).backward(): ready for unscale_/step."""
    scaler = GradScaler("cpu", init_scale=1024.0)
    scaler.scale(world.loss()).backward()
    return scaler


def fresh(world: World) -> GradScaler:
    return GradScaler("cpu", init_scale=1024.0)


def torch_dict(**changes: Any) -> dict:
    return {
        "scale": 1024.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 0,
        **changes,
    }


def loads(call: str, table: list[tuple]) -> list[Refusal]:
    """``subject.load_state_dict(d)`` for each ``(what, d, error, words)``; ``d`` may be a function of the subject's
    own state_dict (or of the world's prepared ``saved`` dict)."""
    return [
        Refusal(what, lambda w, s, d=d: s.load_state_dict(d(w, s) if callable(d) else d), error, (call,) + words)
        for what, d, error, words in table
    ]


SCALER = {
    "GradScaler(...)": EntryPoint(
        nothing,
        bad_args(
            "GradScaler",
            lambda w, **kw: GradScaler("cpu", **kw),
            [
                ("enabled", "yes", ValueError),
                ("overflow_mode", "saturate", ValueError),
                ("policy", "dynamic", TypeError),
                ("skip_mode", "masked", ValueError),
            ],
        )
        + bad_args(
            "GradScaler",
            lambda w, **kw: GradScaler("cpu", **kw),
            [
                ("init_scale", 0.0, ValueError),
                ("init_scale", "1024", TypeError),
                ("growth_factor", 1.0, ValueError),
                ("backoff_factor", 1.5, ValueError),
                ("growth_interval", 0, ValueError),
            ],
        )
        + bad_args(
            "GradScaler", lambda w, **kw: GradScaler("cpu", **kw), [("saturation_dtype", torch.int32, ValueError)]
        )
        + [
            Refusal(
                "process_group='nccl'",
                lambda w, s: GradScaler("cpu", process_group="nccl"),
                TypeError,
                ("GradScaler(", "process_group="),
            )
        ],
    ),
    "GradScaler.scale": EntryPoint(
        fresh,
        [
            Refusal("'loss'", lambda w, s: s.scale("loss"), TypeError, ("scale(", "outputs", "str")),
            Refusal("[tensor, 'x']", lambda w, s: s.scale([w.loss(), "x"]), TypeError, ("scale(", "outputs", "str")),
        ],
    ),
    "GradScaler.unscale_": EntryPoint(
        scaled, [Refusal("model", lambda w, s: s.unscale_(w.model), TypeError, ("unscale_(", "optimizer", "Linear"))]
    ),
    "GradScaler.step": EntryPoint(
        scaled, [Refusal("model", lambda w, s: s.step(w.model), TypeError, ("step(", "optimizer", "Linear"))]
    ),
    "GradScaler.update": EntryPoint(
        scaled,
        [
            Refusal(
                "new_scale=0.0",
                lambda w, s: s.update(new_scale=0.0),
                ValueError,
                ("GradScaler.update(", "new_scale", "0.0"),
            ),
            Refusal(
                "new_scale='2048'",
                lambda w, s: s.update(new_scale="2048"),
                TypeError,
                ("GradScaler.update(", "new_scale", "'2048'"),
            ),
            Refusal(
                "new_scale requires grad",
                lambda w, s: s.update(new_scale=torch.tensor(2.0, requires_grad=True)),
                TypeError,
                ("GradScaler.update(", "new_scale", "requires grad"),
            ),
        ],
    ),
    "GradScaler._scale =": EntryPoint(
        scaled,
        [
            Refusal(
                "0.0",
                lambda w, s: setattr(s, "_scale", torch.tensor(0.0)),
                ValueError,
                ("GradScaler._scale = tensor(0.)", "_scale"),
            ),
            Refusal("None", lambda w, s: setattr(s, "_scale", None), ValueError, ("GradScaler._scale = None",)),
        ],
    ),
    "GradScaler._init_scale =": EntryPoint(
        fresh,
        [
            Refusal(
                "inf",
                lambda w, s: setattr(s, "_init_scale", inf),
                ValueError,
                ("GradScaler._init_scale = inf", "_init_scale"),
            )
        ],
    ),
    "GradScaler._init_growth_tracker =": EntryPoint(
        fresh,
        [
            Refusal(
                "1.5",
                lambda w, s: setattr(s, "_init_growth_tracker", 1.5),
                ValueError,
                ("GradScaler._init_growth_tracker = 1.5", "growth_tracker"),
            )
        ],
    ),
    "GradScaler.set_growth_factor and friends": EntryPoint(
        fresh,
        [
            Refusal(
                "set_growth_factor(0.5)",
                lambda w, s: s.set_growth_factor(0.5),
                ValueError,
                ("set_growth_factor", "growth_factor", "0.5"),
            ),
            Refusal(
                "set_backoff_factor(2.0)",
                lambda w, s: s.set_backoff_factor(2.0),
                ValueError,
                ("set_backoff_factor", "backoff_factor", "2.0"),
            ),
            Refusal(
                "set_growth_interval(1.5)",
                lambda w, s: s.set_growth_interval(1.5),
                TypeError,
                ("set_growth_interval", "growth_interval", "1.5"),
            ),
        ],
    ),
    "GradScaler.load_state_dict": EntryPoint(
        scaled,
        loads(
            "GradScaler.load_state_dict",
            [
                ("scale=0.0", torch_dict(scale=0.0), ValueError, ("field 'scale'", "0.0")),
                ("scale=1e39", torch_dict(scale=1e39), ValueError, ("field 'scale'", "1e+39")),
                ("scale='1024'", torch_dict(scale="1024"), TypeError, ("field 'scale'", "'1024'")),
                ("_growth_tracker=1.5", torch_dict(_growth_tracker=1.5), ValueError, ("growth_tracker", "1.5")),
                ("no scale key", {"growth_factor": 2.0}, StateDictError, ("scale",)),
                ("an optimizer's state_dict", {"state": {}, "param_groups": []}, StateDictError, ("scale",)),
                ("None", None, TypeError, ("state_dict", "NoneType")),
                ("{}", {}, RuntimeError, ("({})",)),
            ],
        )
        + [
            Refusal(
                "policy_state missing fields",
                lambda w, s: s.load_state_dict({"scale": 8.0, "policy_state": {"scale": 8.0}}),
                StateDictError,
                ("GradScaler.load_state_dict", "growth_tracker"),
            )
        ]
        + [
            Refusal(
                f"{knob}={value!r}",
                lambda w, s, knob=knob, value=value: s.load_state_dict(torch_dict(**{knob: value})),
                error,
                ("GradScaler.load_state_dict", knob, repr(value)),
            )
            for knob, value, error in [("growth_factor", 0.5, ValueError), ("growth_interval", 1.5, TypeError)]
        ],
    ),
    "GradScaler.load_state_dict before the first scale()": EntryPoint(
        fresh,
        loads(
            "GradScaler.load_state_dict",
            [
                ("scale=0.0", torch_dict(scale=0.0), ValueError, ("field 'scale'", "0.0")),
                (
                    "policy_state scale=-8",
                    lambda w, s: {
                        **s.state_dict(),
                        "scale": -8.0,
                        "policy_state": {**s.state_dict()["policy_state"], "scale": -8.0},
                    },
                    ValueError,
                    ("field 'scale'", "-8.0"),
                ),
            ],
        ),
    ),
}


# --- LossScaleOptimizer and its addons -------------------------------------------------------------------------


def wrapped(world: World) -> LossScaleOptimizer:
    return LossScaleOptimizer(world.opt, policy=DynamicScale(init_scale=1024.0))


def mid_window(world: World) -> LossScaleOptimizer:
    """A 2-step accumulation after one micro-batch; ``world.saved`` is its state_dict then (it holds
    accumulated_grads and window)."""
    opt = LossScaleOptimizer(world.opt, policy=DynamicScale(init_scale=1024.0), accumulation_steps=2)
    opt.backward(world.loss())
    opt.step()
    world.saved = opt.state_dict()
    return opt


def saved_with(**changes: Any) -> Callable[[World, Any], dict]:
    """The world's saved dict with ``changes`` (a function of the saved dict, or a value)."""
    return lambda w, s: {**w.saved, **{k: (v(w.saved) if callable(v) else v) for k, v in changes.items()}}


def grads_with(i: int, value: Any) -> Callable[[dict], list]:
    return lambda d: [value if j == i else g for j, g in enumerate(d["accumulated_grads"])]


def policy_state_with(**changes: Any) -> Callable[[World, Any], dict]:
    return lambda w, s: {**s.state_dict(), "policy_state": {**s.state_dict()["policy_state"], **changes}}


LSO = "LossScaleOptimizer"
OTHER_SGD = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0).state_dict()  # one group of one parameter
OPTIMIZER = {
    "LossScaleOptimizer(...)": EntryPoint(
        nothing,
        bad_args(
            LSO,
            lambda w, **kw: LossScaleOptimizer(w.opt, **kw),
            [
                ("overflow_mode", "both", ValueError),
                ("clip_grad_norm", 0.0, ValueError),
                ("clip_grad_value", "1", TypeError),
                ("accumulation_steps", 0, ValueError),
                ("ema", 0.99, TypeError),
                ("diagnose", "model", TypeError),
                ("skip_mode", "none", ValueError),
                ("check_when_unscaled", "yes", ValueError),
                ("underflow_stride", 0, ValueError),
                ("schedule", "fast|step|0.9", TypeError),
                ("sharded_grads", "yes", ValueError),
                ("flat_grads", "yes", ValueError),
                ("module", "model", TypeError),
                ("process_group", "nccl", TypeError),
                ("add_ons", 3, TypeError),
            ],
        )
        + bad_args(
            LSO,
            lambda w, **kw: LossScaleOptimizer(w.opt, **kw),
            [("saturation_dtype", torch.int32, ValueError), ("saturation_dtype", "float16", TypeError)],
        )
        + bad_args(LSO, lambda w, **kw: LossScaleOptimizer(w.opt, **kw), [("policy", "dynamic", TypeError)])
        + [
            Refusal("inner='sgd'", lambda w, s: LossScaleOptimizer("sgd"), TypeError, (f"{LSO}(", "inner=", "str")),
            Refusal(
                "inner=model", lambda w, s: LossScaleOptimizer(w.model), TypeError, (f"{LSO}(", "inner=", "Linear")
            ),
            Refusal(
                "inner=LossScaleOptimizer",
                lambda w, s: LossScaleOptimizer(LossScaleOptimizer(w.opt)),
                TypeError,
                (f"{LSO}(", "inner=LossScaleOptimizer"),
            ),
            Refusal(
                "two clips",
                lambda w, s: LossScaleOptimizer(w.opt, clip_grad_norm=1.0, clip_grad_value=1.0),
                ValueError,
                (f"{LSO}(", "clip_grad_norm, clip_grad_value"),
            ),
            Refusal(
                "skip_mode='fused' on SGD",
                lambda w, s: LossScaleOptimizer(w.opt, skip_mode="fused"),
                ValueError,
                (f"{LSO}(", "skip_mode='fused'", "SGD"),
            ),
        ],
    ),
    "LossScaleOptimizer.set_scale": EntryPoint(
        wrapped,
        [
            Refusal("0.0", lambda w, s: s.set_scale(0.0), ValueError, (f"{LSO}.set_scale(", "new_scale", "0.0")),
            Refusal("'8'", lambda w, s: s.set_scale("8"), TypeError, (f"{LSO}.set_scale(", "new_scale", "'8'")),
            Refusal(
                "a meta tensor",
                lambda w, s: s.set_scale(torch.tensor(8.0, device="meta")),
                ValueError,
                (f"{LSO}.set_scale(", "new_scale", "meta"),
            ),
        ],
    ),
    "LossScaleOptimizer.backward": EntryPoint(
        wrapped, [Refusal("'loss'", lambda w, s: s.backward("loss"), TypeError, ("backward(", "loss", "str"))]
    ),
    "LossScaleOptimizer.attach_add_ons": EntryPoint(
        wrapped,
        [
            Refusal("'fast|step'", lambda w, s: s.attach_add_ons(["fast|step"]), TypeError, ("add_ons", "str")),
            Refusal("two EMAs", lambda w, s: s.attach_add_ons([EMA(), EMA()]), ValueError, ("'ema'", "once")),
        ],
    ),
    "LossScaleOptimizer.load_state_dict": EntryPoint(
        wrapped,
        loads(
            f"{LSO}.load_state_dict",
            [
                ("scale=0.0", policy_state_with(scale=0.0), ValueError, ("scale", "0.0")),
                ("scale=1e-46", policy_state_with(scale=1e-46), ValueError, ("scale", "1e-46")),
                ("growth_tracker=2**40", policy_state_with(growth_tracker=2**40), ValueError, ("growth_tracker",)),
                ("micro_step=-1", lambda w, s: {**s.state_dict(), "micro_step": -1}, ValueError, ("micro_step", "-1")),
                ("None", None, TypeError, ("state_dict", "None")),
                ("{}", {}, StateDictError, ("state_dict", "inner")),
                ("GradScaler's", lambda w, s: GradScaler("cpu").state_dict(), StateDictError, ("state_dict", "inner")),
            ],
        )
        + [
            Refusal(
                "another optimizer's groups",
                lambda w, s: s.load_state_dict({**s.state_dict(), "inner": OTHER_SGD}),
                ValueError,
                (f"{LSO}.load_state_dict", "parameter group"),
            )
        ],
    ),
    "LossScaleOptimizer.load_state_dict mid-window": EntryPoint(
        mid_window,
        loads(
            f"{LSO}.load_state_dict",
            [
                (
                    "accumulated_grads short",
                    saved_with(accumulated_grads=lambda d: d["accumulated_grads"][:1]),
                    ValueError,
                    ("accumulated_grads", "per parameter", "(2)", "1 entries"),
                ),
                (
                    "accumulated_grads missing",
                    saved_with(accumulated_grads=None),
                    ValueError,
                    ("micro_step=1", "accumulated_grads"),
                ),
                (
                    "accumulated_grads[0] of another shape",
                    saved_with(accumulated_grads=grads_with(0, torch.ones(5))),
                    ValueError,
                    ("accumulated_grads[0]", "(2, 3)", "(5,)"),
                ),
                (
                    "accumulated_grads[1] int64",
                    saved_with(accumulated_grads=grads_with(1, torch.ones(2, dtype=torch.int64))),
                    ValueError,
                    ("accumulated_grads[1]", "torch.int64"),
                ),
                (
                    "accumulated_grads[0] a string",
                    saved_with(accumulated_grads=grads_with(0, "g")),
                    ValueError,
                    ("accumulated_grads[0]", "str"),
                ),
                ("window junk", saved_with(window="junk"), ValueError, ("window", "'junk'")),
                ("window missing", saved_with(window=None), ValueError, ("window", "None")),
                ("window precision float8", saved_with(window=(True, "float8")), ValueError, ("window", "float8")),
                ("window at micro_step 0", saved_with(micro_step=0), ValueError, ("micro_step=0", "window")),
                ("loss_finite 'yes'", saved_with(loss_finite="yes"), ValueError, ("loss_finite", "'yes'")),
                (
                    "loss_finite at micro_step 0",
                    saved_with(micro_step=0, accumulated_grads=None, window=None, loss_finite=False),
                    ValueError,
                    ("micro_step=0", "loss_finite"),
                ),
            ],
        ),
    ),
    "EMA(...)": EntryPoint(
        nothing,
        bad_args(
            "EMA",
            lambda w, **kw: EMA(**kw),
            [("momentum", 1.0, ValueError), ("momentum", "0.9", TypeError), ("overwrite_every", 0, ValueError)],
        ),
    ),
    "PrecisionSchedule(...)": EntryPoint(
        nothing,
        bad_args(
            "PrecisionSchedule",
            lambda w, **kw: PrecisionSchedule(**{"mode": "fast|step|0.9", "total_steps": 10, **kw}),
            [("mode", "fast", ValueError), ("total_steps", 0, ValueError)],
        ),
    ),
    "PrecisionSchedule.load_state_dict": EntryPoint(
        lambda w: PrecisionSchedule("fast|step|0.9", total_steps=10),
        loads(
            "PrecisionSchedule",
            [
                (
                    "another mode",
                    {"mode": "fast|step|0.5", "step": 1, "switch_step": None},
                    ValueError,
                    ("mode", "'fast|step|0.5'"),
                ),
                ("no step", {"mode": "fast|step|0.9", "switch_step": None}, ValueError, ("step",)),
                ("step=-1", {"mode": "fast|step|0.9", "step": -1, "switch_step": None}, ValueError, ("step", "-1")),
                ("step='3'", {"mode": "fast|step|0.9", "step": "3", "switch_step": None}, TypeError, ("step", "'3'")),
                (
                    "switch_step=1.5",
                    {"mode": "fast|step|0.9", "step": 3, "switch_step": 1.5},
                    TypeError,
                    ("switch_step", "1.5"),
                ),
                ("None", None, TypeError, ("state_dict", "None")),
            ],
        ),
    ),
}


# --- the facades -----------------------------------------------------------------------------------------------


def manager(world: World) -> ascend.ExponentialUpdateLossScaleManager:
    return ascend.ExponentialUpdateLossScaleManager(init_loss_scale=1024.0, incr_every_n_steps=10)


def npu(world: World) -> ascend.NPULossScaleOptimizer:
    return ascend.NPULossScaleOptimizer(world.opt, manager(world))


def cell(world: World) -> mindspore.DynamicLossScaleUpdateCell:
    return mindspore.DynamicLossScaleUpdateCell(loss_scale_value=1024.0, scale_factor=2, scale_window=10)


def ms_manager(world: World) -> mindspore.DynamicLossScaleManager:
    return mindspore.DynamicLossScaleManager(init_loss_scale=1024.0, scale_window=10)


def train_cell(world: World) -> mindspore.TrainOneStepWithLossScaleCell:
    return mindspore.TrainOneStepWithLossScaleCell(lambda: world.loss(), world.opt, cell(world))


def updater(world: World, **kwargs: Any) -> nnabla.DynamicLossScalingUpdater:
    return nnabla.DynamicLossScalingUpdater(world.opt, world.loss, **kwargs)


def keras_opt(world: World) -> keras.LossScaleOptimizer:
    return keras.LossScaleOptimizer(world.opt, initial_scale=1024.0, dynamic_growth_steps=10)


def policy_state(scale: float) -> dict:
    return {"scale": scale, "growth_tracker": 0, "hysteresis_left": 1, "floor_hits": 0}


EXP = "ExponentialUpdateLossScaleManager"
CELL = "DynamicLossScaleUpdateCell"
TRAIN = "TrainOneStepWithLossScaleCell"
UPDATER = "DynamicLossScalingUpdater"
KERAS = "LossScaleOptimizer"  # the Keras facade's calls are named as Keras names them
COUNTER_TYPE = [("-5", -5, ValueError), ("2.5", 2.5, TypeError)]  # a saved count: refused, never truncated

FACADES = {
    "ascend.ExponentialUpdateLossScaleManager(...)": EntryPoint(
        nothing,
        bad_args(
            EXP,
            lambda w, **kw: ascend.ExponentialUpdateLossScaleManager(
                **{"init_loss_scale": 1024.0, "incr_every_n_steps": 10, **kw}
            ),
            [
                ("init_loss_scale", 0.5, ValueError),
                ("incr_every_n_steps", 0, ValueError),
                ("decr_every_n_nan_or_inf", 1.5, TypeError),
                ("incr_ratio", 1, ValueError),
                ("decr_ratio", 1.0, ValueError),
            ],
        ),
    ),
    "ascend.ExponentialUpdateLossScaleManager.load_state_dict": EntryPoint(
        manager,
        loads(
            f"{EXP}.load_state_dict",
            [
                ("scale 1e-46", {"policy_state": policy_state(1e-46)}, ValueError, ("scale", "1e-46")),
                ("None", None, TypeError, ("state_dict", "None")),
                ("{}", {}, StateDictError, ("state_dict", "policy_state")),
            ],
        ),
    ),
    "ascend.FixedLossScaleManager(...)": EntryPoint(
        nothing,
        bad_args(
            "FixedLossScaleManager",
            lambda w, **kw: ascend.FixedLossScaleManager(**kw),
            [("loss_scale", 0.5, ValueError), ("loss_scale", "8", TypeError)],
        ),
    ),
    "ascend.NPULossScaleOptimizer(...)": EntryPoint(
        nothing,
        bad_args(
            "NPULossScaleOptimizer",
            lambda w, **kw: ascend.NPULossScaleOptimizer(**{"opt": w.opt, "loss_scale_manager": manager(w), **kw}),
            [("loss_scale_manager", None, TypeError), ("is_distributed", "yes", ValueError)],
        )
        + bad_args(
            "NPULossScaleOptimizer",
            lambda w, **kw: ascend.NPULossScaleOptimizer(w.opt, manager(w), **kw),
            [("overflow_mode", "clamp", ValueError)],
        )
        + [
            Refusal(
                "opt=model",
                lambda w, s: ascend.NPULossScaleOptimizer(w.model, manager(w)),
                TypeError,
                ("NPULossScaleOptimizer(", "opt=", "Linear"),
            ),
            Refusal(
                "a preset for the manager",
                lambda w, s: ascend.NPULossScaleOptimizer(w.opt, presets.ascend(8.0, 2)),
                TypeError,
                ("NPULossScaleOptimizer(", "loss_scale_manager=", "DynamicScale"),
            ),
        ],
    ),
    "ascend.NPULossScaleOptimizer.set_scale": EntryPoint(
        npu,
        [
            Refusal("0.0", lambda w, s: s.set_scale(0.0), ValueError, ("set_scale(", "0.0")),
            Refusal(
                "tensor(1e-40)", lambda w, s: s.set_scale(torch.tensor(1e-40)), ValueError, ("set_scale(", "tensor(")
            ),
        ],
    ),
    "ascend.NPULossScaleOptimizer.load_state_dict": EntryPoint(
        npu, loads("load_state_dict", [("scale 0", policy_state_with(scale=0.0), ValueError, ("scale", "0.0"))])
    ),
    "mindspore.DynamicLossScaleUpdateCell(...)": EntryPoint(
        nothing,
        bad_args(
            CELL,
            lambda w, **kw: mindspore.DynamicLossScaleUpdateCell(
                **{"loss_scale_value": 1024.0, "scale_factor": 2, "scale_window": 10, **kw}
            ),
            [("loss_scale_value", 0.5, ValueError), ("scale_factor", 1, ValueError), ("scale_window", 0, ValueError)],
        ),
    ),
    "mindspore.DynamicLossScaleUpdateCell(loss_scale, overflow)": EntryPoint(
        cell,
        [
            Refusal("overflow='yes'", lambda w, s: s(torch.tensor(1024.0), "yes"), TypeError, (CELL, "overflow")),
            Refusal(
                "overflow of two values",
                lambda w, s: s(torch.tensor(1024.0), torch.tensor([True, False])),
                ValueError,
                (CELL, "overflow"),
            ),
        ],
    ),
    "mindspore.FixedLossScaleUpdateCell(...)": EntryPoint(
        nothing,
        bad_args(
            "FixedLossScaleUpdateCell",
            lambda w, **kw: mindspore.FixedLossScaleUpdateCell(**kw),
            [("loss_scale_value", 0.5, ValueError)],
        ),
    ),
    "mindspore.DynamicLossScaleManager(...)": EntryPoint(
        nothing,
        bad_args(
            "DynamicLossScaleManager",
            lambda w, **kw: mindspore.DynamicLossScaleManager(**kw),
            [("init_loss_scale", nan, ValueError), ("scale_factor", "2", TypeError), ("scale_window", 1.5, TypeError)],
        ),
    ),
    "mindspore.DynamicLossScaleManager.update_loss_scale": EntryPoint(
        ms_manager,
        [
            Refusal("'yes'", lambda w, s: s.update_loss_scale("yes"), TypeError, ("update_loss_scale(", "overflow")),
            Refusal(
                "two values",
                lambda w, s: s.update_loss_scale(torch.tensor([True, False])),
                ValueError,
                ("update_loss_scale", "overflow"),
            ),
        ],
    ),
    "mindspore.DynamicLossScaleManager.load_state_dict": EntryPoint(
        ms_manager,
        loads(
            "DynamicLossScaleManager.load_state_dict",
            [
                ("None", None, TypeError, ("state_dict", "None")),
                *[
                    (
                        f"bad_steps={shown}",
                        lambda w, s, v=v: {**s.state_dict(), "bad_steps": v},
                        error,
                        ("state_dict['bad_steps']", shown),
                    )
                    for shown, v, error in COUNTER_TYPE
                ],
            ],
        ),
    ),
    "mindspore.FixedLossScaleManager(...)": EntryPoint(
        nothing,
        bad_args(
            "FixedLossScaleManager",
            lambda w, **kw: mindspore.FixedLossScaleManager(**kw),
            [("loss_scale", 0.5, ValueError), ("drop_overflow_update", "no", ValueError)],
        ),
    ),
    "mindspore.TrainOneStepWithLossScaleCell(...)": EntryPoint(
        nothing,
        bad_args(
            TRAIN,
            lambda w, **kw: mindspore.TrainOneStepWithLossScaleCell(
                **{"network": w.loss, "optimizer": w.opt, "scale_sense": cell(w), **kw}
            ),
            [
                ("network", "net", TypeError),
                ("optimizer", "sgd", TypeError),
                ("scale_sense", 1024.0, TypeError),
                ("scale_sense", torch.tensor(0.0), ValueError),
            ],
        )
        + [
            Refusal(
                "scale_sense of shape (2,)",
                lambda w, s: mindspore.TrainOneStepWithLossScaleCell(w.loss, w.opt, torch.ones(2)),
                ValueError,
                (f"{TRAIN}(", "scale_sense", "(2,)"),
            )
        ],
    ),
    "mindspore.TrainOneStepWithLossScaleCell.set_sense_scale": EntryPoint(
        train_cell,
        [
            Refusal(
                "tensor(0.)",
                lambda w, s: s.set_sense_scale(torch.tensor(0.0)),
                ValueError,
                (f"{TRAIN}.set_sense_scale(", "tensor(0.)"),
            ),
            Refusal(
                "tensor(1e-40)",
                lambda w, s: s.set_sense_scale(torch.tensor(1e-40)),
                ValueError,
                (f"{TRAIN}.set_sense_scale(", "tensor("),
            ),
        ],
    ),
    "mindspore.TrainOneStepWithLossScaleCell.load_state_dict": EntryPoint(
        train_cell, loads("load_state_dict", [("scale 0", policy_state_with(scale=0.0), ValueError, ("scale", "0.0"))])
    ),
    "nnabla.DynamicLossScalingUpdater(...)": EntryPoint(
        nothing,
        bad_args(
            UPDATER,
            updater,
            [
                ("scale", 0.0, ValueError),
                ("scaling_factor", 1.0, ValueError),
                ("N", -1, ValueError),
                ("accum_grad", 0, ValueError),
                ("weight_decay", -1.0, ValueError),
                ("weight_decay", "0.1", TypeError),
                ("clear_buffer", "yes", ValueError),
                ("grads", 5, TypeError),
                ("data_feeder", 3, TypeError),
            ],
        ),
    ),
    "nnabla.DynamicLossScalingUpdater.scale =": EntryPoint(
        updater,
        [
            Refusal("0.0", lambda w, s: setattr(s, "scale", 0.0), ValueError, (f"{UPDATER}.scale = 0.0",)),
            Refusal("'8'", lambda w, s: setattr(s, "scale", "8"), TypeError, (f"{UPDATER}.scale = '8'",)),
        ],
    ),
    "nnabla.DynamicLossScalingUpdater.load_state_dict": EntryPoint(
        updater, loads("load_state_dict", [("scale 0", policy_state_with(scale=0.0), ValueError, ("scale", "0.0"))])
    ),
    "keras.LossScaleOptimizer(...)": EntryPoint(
        nothing,
        bad_args(
            KERAS,
            lambda w, **kw: keras.LossScaleOptimizer(w.opt, **kw),
            [
                ("initial_scale", 0.0, ValueError),
                ("dynamic_growth_steps", 0, ValueError),
                ("weight_decay", -1.0, ValueError),
                ("clipnorm", 0.0, ValueError),
                ("clipvalue", "1", TypeError),
                ("global_clipnorm", nan, ValueError),
                ("loss_scale_factor", -1.0, ValueError),
                ("use_ema", "yes", ValueError),
                ("ema_overwrite_frequency", 0, ValueError),
                ("gradient_accumulation_steps", 1, ValueError),
            ],
        )
        + [
            Refusal(
                "inner_optimizer='sgd'",
                lambda w, s: keras.LossScaleOptimizer("sgd"),
                TypeError,
                (f"{KERAS}(", "inner_optimizer="),
            ),
            Refusal(
                "clipnorm and clipvalue",
                lambda w, s: keras.LossScaleOptimizer(w.opt, clipnorm=1.0, clipvalue=1.0),
                ValueError,
                (f"{KERAS}(", "clipnorm=1.0", "clipvalue=1.0"),
            ),
        ],
    ),
    "keras.LossScaleOptimizer.apply": EntryPoint(
        keras_opt,
        [
            Refusal(
                "[None, None]", lambda w, s: s.apply([None, None]), ValueError, ("apply(", "No gradients", "grads")
            ),
            Refusal("[1.0, 2.0]", lambda w, s: s.apply([1.0, 2.0]), TypeError, ("apply(", "grads", "float")),
            Refusal("'ab'", lambda w, s: s.apply("ab"), TypeError, ("apply(", "grads", "str")),
            Refusal(
                "a gradient of another shape",
                lambda w, s: s.apply([torch.ones(3, 2), torch.ones(2)]),
                ValueError,
                ("apply(", "grads", "(3, 2)"),
            ),
        ],
    ),
    "keras.LossScaleOptimizer.apply_gradients": EntryPoint(
        keras_opt,
        [
            Refusal(
                "triples",
                lambda w, s: s.apply_gradients([(torch.ones(2, 3), w.params[0], 1), (torch.ones(2), w.params[1], 1)]),
                TypeError,
                ("apply_gradients(", "grads_and_vars"),
            )
        ],
    ),
    "keras.LossScaleOptimizer.load_state_dict": EntryPoint(
        keras_opt,
        loads(
            f"{KERAS}.load_state_dict",
            [
                ("None", None, TypeError, ("state_dict", "None")),
                ("{}", {}, StateDictError, ("state_dict", "core")),
                (
                    "scale 0",
                    lambda w, s: {
                        **s.state_dict(),
                        "core": {**s.state_dict()["core"], "policy_state": policy_state(0.0)},
                    },
                    ValueError,
                    ("scale", "0.0"),
                ),
                *[
                    (
                        f"{key}={shown}",
                        lambda w, s, key=key, v=v: {**s.state_dict(), key: v},
                        error,
                        (f"state_dict[{key!r}]", shown),
                    )
                    for key in ("iterations", "applied")
                    for shown, v, error in COUNTER_TYPE
                ],
            ],
        ),
    ),
}


ENTRY_POINTS: dict[str, EntryPoint] = {**POLICIES, **SCALER, **OPTIMIZER, **FACADES}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_the_entry_point_refuses_each_bad_argument_and_changes_nothing(name):
    entry = ENTRY_POINTS[name]
    for refusal in entry.refusals:
        where = f"{name}: {refusal.what}"
        world = World()
        subject = entry.setup(world)
        before = snapshot(world, subject)
        with pytest.raises(refusal.error) as info:
            refusal.act(world, subject)
        message = str(info.value)
        missing = [word for word in refusal.words if word not in message]
        assert not missing, f"{where}: {missing} not in the message: {message}"
        assert message.endswith("."), f"{where}: not a sentence: {message}"
        assert message.startswith(refusal.words[0]) or not refusal.starts, f"{where}: echo the call first"
        after = snapshot(world, subject)
        for part, a, b in zip(("parameters", "optimizer state", "saved state"), before, after):
            assert same(a, b), f"{where}: the {part} changed"
        assert all(torch.isfinite(p).all() for p in world.params), where
