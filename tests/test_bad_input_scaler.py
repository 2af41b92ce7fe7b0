"""Bad input to lossscale.GradScaler: constructor, every call, call order, state dicts.

Each case asserts a clear error (type, the argument's name, the value received) and that the model's
parameters and optimizer state are unchanged and finite afterwards (see tests/bad_inputs.py).
"""

from __future__ import annotations

import math

import pytest
import torch

import lossscale
from bad_inputs import Bad, World, ctor_cases, params, run

inf, nan = math.inf, math.nan


def scaler_ctor(world: World, kwargs: dict) -> None:
    lossscale.GradScaler("cpu", **kwargs)


CTOR = ctor_cases("GradScaler", scaler_ctor, {
    "init_scale": [0.0, -1.0, inf, -inf, nan, 1e-46, 1e39, "1024", None, True, [1024.0], torch.tensor(1024.0)],
    "growth_factor": [1.0, 0.5, 0.0, -2.0, inf, nan, "2", None, True],
    "backoff_factor": [0.0, 1.0, 1.5, -0.5, inf, nan, "0.5", None, True],
    "growth_interval": [0, -1, 1.5, "10", None, True, 2**31, 2**40],
    "enabled": [("yes", ValueError), (1, ValueError), (None, ValueError), (0, ValueError)],
    "overflow_mode": [("saturate", ValueError), ("", ValueError), (None, ValueError), (1, ValueError)],
    "policy": [("dynamic", TypeError), (object(), TypeError), (3, TypeError)],
})


def scaled(world: World) -> lossscale.GradScaler:
    """A scaler after scale(loss).backward(): ready for unscale_/step."""
    scaler = lossscale.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(world.loss()).backward()
    return scaler


def stepped(world: World) -> lossscale.GradScaler:
    scaler = scaled(world)
    scaler.step(world.opt)
    return scaler


def fresh(world: World) -> lossscale.GradScaler:
    return lossscale.GradScaler("cpu", init_scale=1024.0)


def after_update(world: World) -> lossscale.GradScaler:
    scaler = stepped(world)
    scaler.update()
    world.opt.zero_grad()
    return scaler


CALLS = [
    # scale(outputs)
    *[Bad(f"scale({v!r})", lambda w, s, v=v: s.scale(v), TypeError, ("outputs", type(v).__name__), fresh)
      for v in ["loss", 3.0, None, 2]],
    Bad("scale([tensor, 'x'])", lambda w, s: s.scale([w.loss(), "x"]), TypeError, ("outputs", "str"), fresh),
    # unscale_(optimizer)
    Bad("unscale_(model)", lambda w, s: s.unscale_(w.model), TypeError, ("optimizer", "Linear"), scaled),
    Bad("unscale_(None)", lambda w, s: s.unscale_(None), TypeError, ("optimizer", "None"), scaled),
    Bad("unscale_ before scale", lambda w, s: s.unscale_(w.opt), RuntimeError, ("unscale_()", "scale()"), fresh),
    Bad("unscale_ twice", lambda w, s: (s.unscale_(w.opt), s.unscale_(w.opt)), RuntimeError,
        ("unscale_()", "update()"), scaled),
    Bad("unscale_ after step", lambda w, s: s.unscale_(w.opt), RuntimeError, ("unscale_()", "step()"), stepped),
    # step(optimizer)
    Bad("step(model)", lambda w, s: s.step(w.model), TypeError, ("optimizer", "Linear"), scaled),
    Bad("step before scale", lambda w, s: s.step(w.opt), RuntimeError, ("step()", "scale()"), fresh),
    Bad("step twice", lambda w, s: s.step(w.opt), RuntimeError, ("step()", "update()"), stepped),
    Bad("step(closure=)", lambda w, s: s.step(w.opt, closure=w.loss), RuntimeError, ("closure",), scaled),
    Bad("step without gradients", lambda w, s: (s.scale(w.loss()), s.step(w.opt)), RuntimeError, ("optimizer",),
        fresh),
    # update(new_scale=None)
    Bad("update before scale", lambda w, s: s.update(), RuntimeError, ("update()", "scale()"), fresh),
    Bad("update without step", lambda w, s: s.update(), RuntimeError, ("update()", "step("), scaled),
    Bad("update twice", lambda w, s: s.update(), RuntimeError, ("update()", "step("), after_update),
    # set_* of torch's API
    *[Bad(f"set_growth_factor({v!r})", lambda w, s, v=v: s.set_growth_factor(v), err, ("growth_factor", repr(v)),
          fresh) for v, err in [(0.5, ValueError), (1.0, ValueError), (nan, ValueError), (inf, ValueError),
                                ("2", TypeError)]],
    *[Bad(f"set_backoff_factor({v!r})", lambda w, s, v=v: s.set_backoff_factor(v), err, ("backoff_factor", repr(v)),
          fresh) for v, err in [(2.0, ValueError), (0.0, ValueError), (nan, ValueError),
                                                       ("0.5", TypeError)]],
    *[Bad(f"set_growth_interval({v!r})", lambda w, s, v=v: s.set_growth_interval(v), err,
          ("growth_interval", repr(v)), fresh) for v, err in [(0, ValueError), (-3, ValueError), (1.5, TypeError),
                                                              ("5", TypeError)]],
]

NEW_SCALE_OUT_OF_RANGE = [0.0, -1.0, inf, -inf, nan, torch.tensor([1.0, 2.0]), torch.ones(0),
                         torch.tensor(2.0, requires_grad=True)]
NEW_SCALE_TINY_OR_WRONG = [1e-46, 2.0**-140, 1e-40, 1e39, torch.tensor(0.0), torch.tensor(1e-40), torch.tensor(inf),
                  torch.tensor(nan), torch.tensor(-8.0), "2048", True, [2048.0],
                  torch.tensor(2048.0, device="meta"), torch.tensor(2048, dtype=torch.bool)]


def _new_scale_error(v):
    wrong_type = isinstance(v, (str, bool, list)) or (isinstance(v, torch.Tensor) and v.dtype == torch.bool)
    return TypeError if wrong_type else ValueError


NEW_SCALE = [Bad(f"update(new_scale={v!r})", lambda w, s, v=v: s.update(new_scale=v), _new_scale_error(v),
                 ("new_scale",), scaled)
             for v in NEW_SCALE_OUT_OF_RANGE + NEW_SCALE_TINY_OR_WRONG]


def torch_dict(**changes):
    out = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
           "_growth_tracker": 0}
    out.update(changes)
    return out


def load_on(factory):
    return lambda w, s, d=None: s.load_state_dict(d)


LOADS_REFUSED = {
    "growth_factor=0.5": (torch_dict(growth_factor=0.5), ValueError, ("growth_factor", "0.5")),
    "backoff_factor=2": (torch_dict(backoff_factor=2.0), ValueError, ("backoff_factor", "2.0")),
    "growth_interval=0": (torch_dict(growth_interval=0), ValueError, ("growth_interval", "0")),
    "growth_interval=1.5": (torch_dict(growth_interval=1.5), TypeError, ("growth_interval", "1.5")),
    "empty dict": ({}, RuntimeError, ("load_state_dict", "{}")),
}
LOADS_SCALE = {
    "scale=0.0": (torch_dict(scale=0.0), ValueError, ("scale", "0.0")),
    "scale=-1.0": (torch_dict(scale=-1.0), ValueError, ("scale", "-1.0")),
    "scale=inf": (torch_dict(scale=inf), ValueError, ("scale", "inf")),
    "scale=nan": (torch_dict(scale=nan), ValueError, ("scale", "nan")),
    "scale=1e-46": (torch_dict(scale=1e-46), ValueError, ("scale", "1e-46")),
    "scale=2**-140": (torch_dict(scale=2.0**-140), ValueError, ("scale",)),
    "scale=1e39": (torch_dict(scale=1e39), ValueError, ("scale", "1e+39")),
    "scale=tensor(0.)": (torch_dict(scale=torch.tensor(0.0)), ValueError, ("scale",)),
    "scale=tensor(1e-40)": (torch_dict(scale=torch.tensor(1e-40)), ValueError, ("scale",)),
    "scale='1024'": (torch_dict(scale="1024"), TypeError, ("scale", "'1024'")),
    "scale=None": (torch_dict(scale=None), TypeError, ("scale", "None")),
    "_growth_tracker=1.5": (torch_dict(_growth_tracker=1.5), ValueError, ("growth_tracker", "1.5")),
    "_growth_tracker=2**40": (torch_dict(_growth_tracker=2**40), ValueError, ("growth_tracker",)),
    "no scale key": ({"growth_factor": 2.0}, ValueError, ("scale",)),
    "an optimizer's state_dict": ({"state": {}, "param_groups": []}, ValueError, ("scale",)),
    "policy_state missing fields": ({"scale": 8.0, "policy_state": {"scale": 8.0}}, ValueError, ("growth_tracker",)),
    "policy_state scale 0": ({"scale": 8.0, "policy_state": {"scale": 0.0, "growth_tracker": 0,
                                                             "hysteresis_left": 1, "floor_hits": 0}},
                             ValueError, ("scale", "0.0")),
    "None": (None, TypeError, ("state_dict", "None")),
    "a list": ([1024.0], TypeError, ("state_dict", "list")),
    "a str": ("scale", TypeError, ("state_dict", "str")),
}


def _load_cases(table, factory, tag):
    return [Bad(f"load_state_dict[{tag}]({name})", lambda w, s, d=d: s.load_state_dict(d), err, words, factory)
            for name, (d, err, words) in table.items()]


LOADS = (_load_cases({**LOADS_REFUSED, **LOADS_SCALE}, scaled, "started")
         + _load_cases({k: v for k, v in LOADS_SCALE.items() if k.startswith("scale=")}, fresh, "fresh"))


WAITING = frozenset({
    "GradScaler(backoff_factor='0.5')", "GradScaler(backoff_factor=None)", "GradScaler(backoff_factor=True)",
    "scale('loss')", "scale(3.0)", "scale(None)", "scale(2)", "scale([tensor, 'x'])", "unscale_(model)",
    "unscale_(None)", "step(model)", "set_backoff_factor('0.5')",
    "update(new_scale=tensor(..., device='meta', size=()))", "load_state_dict[started](no scale key)",
    "load_state_dict[started](an optimizer's state_dict)", "load_state_dict[started](policy_state missing fields)",
})


@pytest.mark.parametrize("case", params(CTOR + CALLS + NEW_SCALE + LOADS, WAITING))
def test_gradscaler_bad_input(case):
    run(case)


def test_every_waiting_id_names_a_case():
    ids = {c.id for c in CTOR + CALLS + NEW_SCALE + LOADS}
    assert WAITING <= ids, sorted(WAITING - ids)


def test_a_refused_new_scale_leaves_the_scale_and_the_next_step_exact():
    world = World()
    scaler = scaled(world)
    with pytest.raises(ValueError):
        scaler.update(new_scale=0.0)
    assert scaler.get_scale() == 1024.0
