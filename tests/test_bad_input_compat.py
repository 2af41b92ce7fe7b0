"""Bad input to every facade: Ascend, MindSpore, nnabla, Keras.

Each case asserts a clear error (type, the argument's name, the value received) and that the model's
parameters and optimizer state are unchanged and finite afterwards (see tests/bad_inputs.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from bad_inputs import Bad, World, ctor_cases, params, run
from lossscale import presets
from lossscale.compat import ascend, keras, mindspore, nnabla

inf, nan = math.inf, math.nan

SCALE = [0.0, -1.0, inf, nan, 1e39, "8", None, True]
SCALE_GE1 = SCALE + [0.5]
FACTOR = [1.0, 0.5, inf, nan, "2", True]
FRACTION = [0.0, 1.0, nan, "0.5"]
INT1 = [0, -1, 1.5, "10", None]
CHOICE = [("yes", ValueError), (1, ValueError), (None, ValueError)]
COUNTER = [(-5, ValueError), (2.5, TypeError), (nan, TypeError), ("3", TypeError), (True, TypeError),
           (None, TypeError), (2**63, ValueError)]  # a saved step count: refused, never truncated
TINY_OR_NON_FINITE = [1e-40, 2.0**-140, torch.tensor(0.0), torch.tensor(1e-40), torch.tensor(inf), torch.tensor(nan)]


def _policy_state_with(scale):
    return {"scale": scale, "growth_tracker": 0, "hysteresis_left": 1, "floor_hits": 0}


# --- Ascend ------------------------------------------------------------------------------------------------

ASCEND_BASE = {"init_loss_scale": 1024.0, "incr_every_n_steps": 10}
ASCEND = ctor_cases("ExponentialUpdateLossScaleManager",
                    lambda w, kw: ascend.ExponentialUpdateLossScaleManager(**{**ASCEND_BASE, **kw}), {
                        "init_loss_scale": SCALE, "incr_every_n_steps": INT1, "decr_every_n_nan_or_inf": INT1,
                        "incr_ratio": FACTOR, "decr_ratio": FRACTION})
ASCEND += ctor_cases("ascend.FixedLossScaleManager", lambda w, kw: ascend.FixedLossScaleManager(**kw),
                     {"loss_scale": SCALE_GE1})


def manager(world):
    return ascend.ExponentialUpdateLossScaleManager(init_loss_scale=1024.0, incr_every_n_steps=10)


def npu(world):
    return ascend.NPULossScaleOptimizer(world.opt, manager(world))


ASCEND += [
    *[Bad(f"update_loss_scale({v!r})", lambda w, s, v=v: s.update_loss_scale(v), err, ("finite_grads",), manager)
      for v, err in [(torch.tensor([True, False]), ValueError), (torch.tensor(1), TypeError), ("yes", TypeError),
                     (None, TypeError), (1, TypeError), (torch.zeros(8), ValueError)]],
    *[Bad(f"NPULossScaleOptimizer(loss_scale_manager={v!r})",
          lambda w, s, v=v: ascend.NPULossScaleOptimizer(w.opt, v), TypeError, ("loss_scale_manager",))
      for v in [None, "manager", presets.ascend(8.0, 2)]],
    *[Bad(f"NPULossScaleOptimizer(opt={v!r})", lambda w, s, v=v: ascend.NPULossScaleOptimizer(v, manager(w)),
          TypeError, ("opt=",)) for v in ["sgd", None]],
    Bad("NPULossScaleOptimizer(opt=model)", lambda w, s: ascend.NPULossScaleOptimizer(w.model, manager(w)),
        TypeError, ("opt=", "Linear")),
    *[Bad(f"NPULossScaleOptimizer(is_distributed={v!r})",
          lambda w, s, v=v: ascend.NPULossScaleOptimizer(w.opt, manager(w), is_distributed=v), ValueError,
          ("is_distributed",)) for v in ["yes", 1, None, True]],
    Bad("NPULossScaleOptimizer(overflow_mode='clamp')",
        lambda w, s: ascend.NPULossScaleOptimizer(w.opt, manager(w), overflow_mode="clamp"), ValueError,
        ("overflow_mode", "'clamp'")),
    *[Bad(f"NPULossScaleOptimizer.set_scale({v!r})", lambda w, s, v=v: s.set_scale(v), ValueError, ("scale",), npu)
      for v in [0.0, -2.0, inf, nan]],
    *[Bad(f"NPULossScaleOptimizer.set_scale({v!r})", lambda w, s, v=v: s.set_scale(v), ValueError, ("scale",), npu)
      for v in TINY_OR_NON_FINITE],
    Bad("NPULossScaleOptimizer.load_state_dict(scale 0)",
        lambda w, s: s.load_state_dict({**s.state_dict(), "policy_state": _policy_state_with(0.0)}), ValueError,
        ("scale", "0.0"), npu),
    Bad("ExponentialUpdateLossScaleManager.load_state_dict(scale 1e-46)",
        lambda w, s: s.load_state_dict({"policy_state": _policy_state_with(1e-46)}), ValueError,
        ("scale", "1e-46"), manager),
    Bad("ExponentialUpdateLossScaleManager.load_state_dict(None)", lambda w, s: s.load_state_dict(None), TypeError,
        ("state_dict", "None"), manager),
    Bad("ExponentialUpdateLossScaleManager.load_state_dict({})", lambda w, s: s.load_state_dict({}), ValueError,
        ("state_dict", "policy_state"), manager),
]

# --- MindSpore ---------------------------------------------------------------------------------------------

MS_CELL = {"loss_scale_value": 1024.0, "scale_factor": 2, "scale_window": 10}
MINDSPORE = ctor_cases("DynamicLossScaleUpdateCell",
                       lambda w, kw: mindspore.DynamicLossScaleUpdateCell(**{**MS_CELL, **kw}), {
                           "loss_scale_value": SCALE_GE1, "scale_factor": FACTOR, "scale_window": INT1})
MINDSPORE += ctor_cases("DynamicLossScaleManager", lambda w, kw: mindspore.DynamicLossScaleManager(**kw), {
    "init_loss_scale": SCALE_GE1, "scale_factor": FACTOR, "scale_window": INT1})
MINDSPORE += ctor_cases("mindspore.FixedLossScaleManager", lambda w, kw: mindspore.FixedLossScaleManager(**kw), {
    "loss_scale": SCALE_GE1, "drop_overflow_update": CHOICE})
MINDSPORE += ctor_cases("FixedLossScaleUpdateCell", lambda w, kw: mindspore.FixedLossScaleUpdateCell(**kw), {
    "loss_scale_value": SCALE_GE1})


def cell(world):
    return mindspore.DynamicLossScaleUpdateCell(**MS_CELL)


def ms_manager(world):
    return mindspore.DynamicLossScaleManager(init_loss_scale=1024.0, scale_window=10)


def train_cell(world):
    return mindspore.TrainOneStepWithLossScaleCell(lambda: world.loss(), world.opt, cell(world))


MINDSPORE += [
    *[Bad(f"DynamicLossScaleUpdateCell(loss_scale={v!r})", lambda w, s, v=v: s(v, torch.tensor(False)), err,
          ("loss_scale", t), cell) for v, err, t in [
              (torch.tensor(1024), TypeError, "torch.int64"), (torch.tensor(1024.0, dtype=torch.float16), TypeError,
                                                                "torch.float16"),
              (1024.0, TypeError, "float"), (None, TypeError, "NoneType"),
              (torch.tensor([1024.0, 2.0]), ValueError, "(2,)")]],
    *[Bad(f"DynamicLossScaleUpdateCell(overflow={v!r})", lambda w, s, v=v: s(torch.tensor(1024.0), v), err,
          ("overflow",), cell) for v, err in [("yes", TypeError), (None, TypeError), (1, TypeError),
                                              (torch.tensor([True, False]), ValueError)]],
    *[Bad(f"DynamicLossScaleManager.update_loss_scale({v!r})", lambda w, s, v=v: s.update_loss_scale(v), err,
          ("overflow",), ms_manager) for v, err in [("yes", TypeError), (None, TypeError), (1, TypeError),
                                                    (torch.tensor([True, False]), ValueError)]],
    Bad("TrainOneStepWithLossScaleCell(network='net')",
        lambda w, s: mindspore.TrainOneStepWithLossScaleCell("net", w.opt, cell(w)), TypeError, ("network", "'net'")),
    Bad("TrainOneStepWithLossScaleCell(optimizer='sgd')",
        lambda w, s: mindspore.TrainOneStepWithLossScaleCell(w.loss, "sgd", cell(w)), TypeError,
        ("optimizer=", "'sgd'")),
    *[Bad(f"TrainOneStepWithLossScaleCell(scale_sense={v!r})",
          lambda w, s, v=v: mindspore.TrainOneStepWithLossScaleCell(w.loss, w.opt, v), err, ("scale_sense",))
      for v, err in [(1024.0, TypeError), (None, TypeError), (torch.ones(2), ValueError), (ms_manager, TypeError)]],
    *[Bad(f"TrainOneStepWithLossScaleCell(scale_sense={v!r})",
          lambda w, s, v=v: mindspore.TrainOneStepWithLossScaleCell(w.loss, w.opt, v), ValueError, ("scale_sense",))
      for v in [torch.tensor(0.0), torch.tensor(inf), torch.tensor(nan), torch.tensor(-8.0)]],
    *[Bad(f"set_sense_scale({v!r})", lambda w, s, v=v: s.set_sense_scale(v), err, ("sens",), train_cell)
      for v, err in [(1024.0, TypeError), (None, TypeError), (torch.tensor([1024.0, 2.0]), ValueError)]],
    *[Bad(f"set_sense_scale({v!r})", lambda w, s, v=v: s.set_sense_scale(v), ValueError, ("sens",), train_cell)
      for v in [torch.tensor(0.0), torch.tensor(1e-40), torch.tensor(inf), torch.tensor(nan),
                               torch.tensor(-8.0)]],
    Bad("TrainOneStepWithLossScaleCell.load_state_dict(scale 0)",
        lambda w, s: s.load_state_dict({**s.state_dict(), "policy_state": _policy_state_with(0.0)}), ValueError,
        ("scale", "0.0"), train_cell),
    Bad("DynamicLossScaleManager.load_state_dict(None)", lambda w, s: s.load_state_dict(None), TypeError,
        ("state_dict", "None"), ms_manager),
    *[Bad(f"DynamicLossScaleManager.load_state_dict(bad_steps={v!r})",
          lambda w, s, v=v: s.load_state_dict({**s.state_dict(), "bad_steps": v}), err,
          ("state_dict['bad_steps']", repr(v)), ms_manager) for v, err in COUNTER],
]

# --- nnabla ------------------------------------------------------------------------------------------------


def updater(world, **kwargs):
    return nnabla.DynamicLossScalingUpdater(world.opt, world.loss, **kwargs)


NNABLA = ctor_cases("DynamicLossScalingUpdater", lambda w, kw: updater(w, **kw), {
    "scale": SCALE, "scaling_factor": FACTOR, "N": [-1, 1.5, "10", None], "accum_grad": INT1,
    "weight_decay": [-1.0, nan, inf, "0.1", True], "clear_buffer": CHOICE,
    "comm": [("nccl", TypeError), (3, TypeError)], "grads": [(5, TypeError), (["w"], TypeError), ("ab", TypeError)],
    "data_feeder": [(3, TypeError), (None, TypeError)],
})
NNABLA += ctor_cases("DynamicLossScalingUpdater", lambda w, kw: nnabla.DynamicLossScalingUpdater(w.opt, **kw),
                     {"loss": [("loss", TypeError), (None, TypeError)]})


def make_updater(world):
    return updater(world)


NNABLA += [
    Bad("DynamicLossScalingUpdater(comm=group, grads=[])",
        lambda w, s: updater(w, comm=torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)),
        ValueError, ("comm=", "grads=[]")),
    *[Bad(f"updater.scale = {v!r}", lambda w, s, v=v: setattr(s, "scale", v), err, ("scale",), make_updater)
      for v, err in [(0.0, ValueError), (-8.0, ValueError), (inf, ValueError), (nan, ValueError), ("8", TypeError),
                     (True, TypeError), (None, TypeError), (torch.tensor([8.0, 2.0]), ValueError)]],
    *[Bad(f"updater.scale = {v!r}", lambda w, s, v=v: setattr(s, "scale", v), ValueError, ("scale",), make_updater)
      for v in TINY_OR_NON_FINITE],
    Bad("DynamicLossScalingUpdater.load_state_dict(scale 0)",
        lambda w, s: s.load_state_dict({**s.state_dict(), "policy_state": _policy_state_with(0.0)}), ValueError,
        ("scale", "0.0"), make_updater),
]

# --- Keras -------------------------------------------------------------------------------------------------


def keras_opt(world, **kwargs):
    return keras.LossScaleOptimizer(world.opt, initial_scale=1024.0, dynamic_growth_steps=10, **kwargs)


POSITIVE = [0.0, -1.0, nan, inf, "1", True]
KERAS = ctor_cases("keras.LossScaleOptimizer", lambda w, kw: keras.LossScaleOptimizer(w.opt, **kw), {
    "initial_scale": SCALE, "dynamic_growth_steps": INT1, "weight_decay": [-1.0, nan, inf, "0.1", True],
    "clipnorm": POSITIVE, "clipvalue": POSITIVE, "global_clipnorm": POSITIVE, "loss_scale_factor": POSITIVE,
    "use_ema": [("yes", ValueError), (1, ValueError)], "ema_momentum": [1.5, -0.5, nan, "0.9"],
    "ema_overwrite_frequency": [0, -1, 1.5, "3"], "gradient_accumulation_steps": [1, 0, 1.5, "2"],
    "name": [(3, TypeError), (["lso"], TypeError)], "momentum": [(0.9, TypeError)],
})


def keras_made(world):
    return keras_opt(world)


KERAS += [
    *[Bad(f"keras.LossScaleOptimizer(inner_optimizer={v!r})", lambda w, s, v=v: keras.LossScaleOptimizer(v),
          TypeError, ("inner_optimizer=",)) for v in ["sgd", None]],
    Bad("keras.LossScaleOptimizer(clipnorm and clipvalue)", lambda w, s: keras_opt(w, clipnorm=1.0, clipvalue=1.0),
        ValueError, ("clipnorm=1.0", "clipvalue=1.0")),
    Bad("apply(one grad for two variables)", lambda w, s: s.apply([torch.ones(2, 3)]), ValueError, ("grads",),
        keras_made),
    Bad("apply(a variable of another model)",
        lambda w, s: s.apply([torch.ones(1)], [torch.nn.Parameter(torch.zeros(1))]), ValueError,
        ("trainable_variables",), keras_made),
    Bad("apply([None, None])", lambda w, s: s.apply([None, None]), ValueError, ("No gradients", "grads"), keras_made),
    Bad("apply([1.0, 2.0])", lambda w, s: s.apply([1.0, 2.0]), TypeError, ("grads", "float"), keras_made),
    Bad("apply('ab')", lambda w, s: s.apply("ab"), TypeError, ("grads", "str"), keras_made),
    Bad("apply(wrong shape)", lambda w, s: s.apply([torch.ones(3, 2), torch.ones(2)]), ValueError,
        ("grads", "(3, 2)"), keras_made),
    Bad("apply_gradients(triples)",
        lambda w, s: s.apply_gradients([(torch.ones(2, 3), w.params[0], 1), (torch.ones(2), w.params[1], 1)]),
        TypeError, ("grads_and_vars",), keras_made),
    *[Bad(f"scale_loss({v!r})", lambda w, s, v=v: s.scale_loss(v), TypeError, ("loss",), keras_made)
      for v in ["1.0", None, True, [1.0]]],
    Bad("keras load_state_dict(None)", lambda w, s: s.load_state_dict(None), TypeError, ("state_dict", "None"),
        keras_made),
    Bad("keras load_state_dict({})", lambda w, s: s.load_state_dict({}), ValueError, ("state_dict", "core"),
        keras_made),
    Bad("keras load_state_dict(scale 0)",
        lambda w, s: s.load_state_dict({**s.state_dict(), "core": {**s.state_dict()["core"],
                                                                   "policy_state": _policy_state_with(0.0)}}),
        ValueError, ("scale", "0.0"), keras_made),
    *[Bad(f"keras load_state_dict({key}={v!r})",
          lambda w, s, key=key, v=v: s.load_state_dict({**s.state_dict(), key: v}), err,
          (f"state_dict[{key!r}]", repr(v)), keras_made)
      for key in ("iterations", "applied") for v, err in COUNTER],
]


@pytest.mark.parametrize("case", params(ASCEND))
def test_ascend_bad_input(case):
    run(case)


@pytest.mark.parametrize("case", params(MINDSPORE))
def test_mindspore_bad_input(case):
    run(case)


@pytest.mark.parametrize("case", params(NNABLA))
def test_nnabla_bad_input(case):
    run(case)


@pytest.mark.parametrize("case", params(KERAS))
def test_keras_bad_input(case):
    run(case)
