"""The presets as translation tables: each peer's argument names and defaults onto DynamicScale's fields, and the
errors that speak the peer's names.

Whether each translated rule reproduces the real framework is test_golden.py's question (the recorded
trajectories); the rule itself is checked against its oracle in test_policies.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest

from lossscale import DynamicScale, presets
from lossscale.validation import SMALLEST_NORMAL_FLOAT32

#: Each peer's defaults, as the whole DynamicScale they translate to.
DEFAULTS = {
    "torch_amp": DynamicScale(init_scale=2.0**16, growth_interval=2000, growth_factor=2.0, backoff_factor=0.5),
    "keras": DynamicScale(
        init_scale=2.0**15,
        growth_interval=2000,
        growth_factor=2.0,
        backoff_divisor=2.0,
        min_scale=SMALLEST_NORMAL_FLOAT32,
        arithmetic="float32",
    ),
    "tf_keras2": DynamicScale(
        init_scale=2.0**15,
        growth_interval=2000,
        growth_factor=2.0,
        backoff_divisor=2.0,
        min_scale=1.0,
        arithmetic="float32",
    ),
    "tf_v1": DynamicScale(
        init_scale=2.0**15,
        growth_interval=2000,
        growth_factor=2.0,
        backoff_divisor=2.0,
        min_scale=1.0,
        arithmetic="float32",
    ),
    "mindspore": DynamicScale(
        init_scale=2.0**24,
        growth_interval=2000,
        growth_factor=2.0,
        backoff_factor=0.5,
        min_scale=1.0,
        arithmetic="float32",
    ),
    "nnabla": DynamicScale(
        init_scale=8.0, growth_interval=2001, growth_delay=1, growth_factor=2.0, backoff_divisor=2.0
    ),
    "deepspeed": DynamicScale(
        init_scale=2.0**16,
        growth_interval=1000,
        growth_factor=2.0,
        backoff_divisor=2.0,
        hysteresis=2,
        hysteresis_mode="cumulative",
        refill_after_backoff=False,
        min_scale=1.0,
        at_floor="raise",
        growth_delay=1,
    ),
    "megatron": DynamicScale(
        init_scale=2.0**32,
        growth_interval=1000,
        growth_factor=2.0,
        backoff_factor=0.5,
        hysteresis=2,
        hysteresis_mode="cumulative",
        refill_after_backoff=False,
        min_scale=1.0,
        arithmetic="float32",
    ),
    "paddle": DynamicScale(
        init_scale=2.0**16,
        growth_interval=2000,
        growth_factor=2.0,
        backoff_factor=0.5,
        hysteresis=1,
        arithmetic="float32",
    ),
    # Ascend has no defaults for these two: its table below starts from (2**32, 1000)
    "ascend": DynamicScale(
        init_scale=2.0**32,
        growth_interval=1000,
        growth_factor=2.0,
        backoff_factor=0.8,
        hysteresis=2,
        hysteresis_mode="cumulative",
        min_scale=1.0,
        max_scale=3.4e38,
        growth_guard="operand",
        arithmetic="float32",
    ),
}
REQUIRED = {"ascend": {"init_loss_scale": 2.0**32, "incr_every_n_steps": 1000}}

#: preset -> {peer's argument: (a good value, the fields it sets, a bad value)}
TABLE = {
    "torch_amp": {
        "init_scale": (8.0, {"init_scale": 8.0}, 0.0),
        "growth_factor": (3.0, {"growth_factor": 3.0}, 1.0),
        "backoff_factor": (0.25, {"backoff_factor": 0.25}, 1.5),
        "growth_interval": (7, {"growth_interval": 7}, 0),
    },
    "keras": {
        "initial_scale": (8.0, {"init_scale": 8.0}, math.inf),
        "dynamic_growth_steps": (7, {"growth_interval": 7}, 0),
    },
    "tf_keras2": {
        "initial_scale": (8.0, {"init_scale": 8.0}, 0.5),
        "dynamic_growth_steps": (7, {"growth_interval": 7}, 2.5),
    },
    "tf_v1": {
        "initial_loss_scale": (8.0, {"init_scale": 8.0}, "8"),
        "increment_period": (7, {"growth_interval": 7}, 2.5),
        "multiplier": (3.0, {"growth_factor": 3.0, "backoff_divisor": 3.0, "backoff_factor": 1 / 3}, 1.0),
    },
    "mindspore": {
        "init_loss_scale": (8.0, {"init_scale": 8.0}, 0.5),
        "scale_factor": (4, {"growth_factor": 4.0, "backoff_factor": 0.25}, 1),
        "scale_window": (7, {"growth_interval": 7}, -3),
    },
    "nnabla": {
        "scale": (16.0, {"init_scale": 16.0}, math.nan),
        "scaling_factor": (3.0, {"growth_factor": 3.0, "backoff_divisor": 3.0, "backoff_factor": 1 / 3}, 0.5),
        "N": (3, {"growth_interval": 4}, -1),
    },
    "deepspeed": {
        "init_scale": (8.0, {"init_scale": 8.0}, 0.5),
        "scale_factor": (3.0, {"growth_factor": 3.0, "backoff_divisor": 3.0, "backoff_factor": 1 / 3}, 1.0),
        "scale_window": (7, {"growth_interval": 7}, 0),
        "min_scale": (4.0, {"min_scale": 4.0}, 0.0),
        "delayed_shift": (1, {"hysteresis": 1}, 0),
        "consecutive_hysteresis": (True, {"hysteresis_mode": "consecutive"}, "yes"),
        "raise_error_at_min_scale": (False, {"at_floor": "skip"}, 1),
    },
    "megatron": {
        "initial_scale": (8.0, {"init_scale": 8.0}, 0.0),
        "min_scale": (4.0, {"min_scale": 4.0}, -1.0),
        "growth_factor": (3.0, {"growth_factor": 3.0}, 0.5),
        "backoff_factor": (0.25, {"backoff_factor": 0.25}, 0.0),
        "growth_interval": (7, {"growth_interval": 7}, 0),
        "hysteresis": (3, {"hysteresis": 3}, 0),
    },
    "paddle": {
        "init_loss_scaling": (8.0, {"init_scale": 8.0}, math.inf),
        "incr_ratio": (3.0, {"growth_factor": 3.0}, 0.9),
        "decr_ratio": (0.25, {"backoff_factor": 0.25}, 0.0),
        "incr_every_n_steps": (7, {"growth_interval": 7}, 0),
        "decr_every_n_nan_or_inf": (3, {"hysteresis": 3}, 0),
    },
    "ascend": {
        "init_loss_scale": (8.0, {"init_scale": 8.0}, 0.5),
        "incr_every_n_steps": (7, {"growth_interval": 7}, 0),
        "decr_every_n_nan_or_inf": (3, {"hysteresis": 3}, 0),
        "incr_ratio": (3, {"growth_factor": 3.0}, 1),
        "decr_ratio": (0.5, {"backoff_factor": 0.5}, 1.0),
    },
}
ARGUMENTS = [(name, arg) for name in sorted(TABLE) for arg in TABLE[name]]


def build(name: str, **args):
    return presets.PRESETS[name](**{**REQUIRED.get(name, {}), **args})


def test_every_peer_has_a_preset_and_every_argument_is_in_the_table():
    assert sorted(presets.PRESETS) == sorted(DEFAULTS) == sorted(TABLE)
    for name, preset in presets.PRESETS.items():
        assert preset.__name__ == name and presets.__all__.count(name) == 1
        arguments = set(inspect.signature(preset).parameters) - {"call"}
        assert arguments == set(TABLE[name]), name


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_the_defaults_are_the_peers(name):
    assert build(name) == DEFAULTS[name]


@pytest.mark.parametrize("name,arg", ARGUMENTS)
def test_each_argument_sets_its_fields_and_only_those(name, arg):
    value, fields, _ = TABLE[name][arg]
    assert build(name, **{arg: value}) == dataclasses.replace(build(name), **fields)


@pytest.mark.parametrize("name,arg", ARGUMENTS)
def test_each_argument_is_checked_under_the_peers_name_and_the_call_given(name, arg):
    """The check is DynamicScale's one check (its rules: test_checks.py), with the peer's names in the message;
    ``call=`` is the name a facade gives."""
    bad = TABLE[name][arg][2]
    for call in (f"presets.{name}", "SomeFacade"):
        with pytest.raises(ValueError) as info:
            build(name, **{arg: bad}, call=call)
        message = str(info.value)
        assert message.startswith(f"{call}(") and f"{arg}=" in message and repr(bad) in message, message
        assert message.endswith("."), message


def test_ascend_has_no_default_for_its_scale_and_window():
    with pytest.raises(TypeError, match="init_loss_scale"):
        presets.ascend()  # type: ignore[call-arg]
