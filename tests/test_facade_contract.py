"""One contract over every facade class: its own checkpoint (``state_dict``/``load_state_dict``), pickling, and
the host reads of one step through its API.

The facades' rules are their presets', replayed against the real frameworks in test_golden.py and checked by the
policy contract in test_policies.py; their other behaviours are in their test_compat_*.py files. Each subject is
driven the same way: ``make()`` builds it, ``step(obj, overflow)`` runs one step with or without an injected
overflow, ``obj.scale_state`` is its state record. Scale holders (managers, cells) pickle; optimizer wrappers
refuse and point to ``state_dict()``, as the core LossScaleOptimizer does.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from lossscale.compat import ascend, keras, mindspore, nnabla
from lossscale.testing import HostReadCounter

PATTERN = [
    False,
    True,
    False,
    False,
    True,
    True,
    False,
    False,
    False,
    True,
    False,
    False,
    False,
    False,
    True,
    False,
    False,
]
SPLIT = 7  # where the checkpoint is taken


@dataclass
class Subject:
    name: str
    pickles: bool  # a scale holder; an optimizer wrapper refuses
    make: Callable[[], Any]
    step: Callable[[Any, bool], None]
    reads: Callable[[bool], int] = lambda overflow: 0  # host reads one step makes

    def __repr__(self) -> str:
        return self.name


def _weight():
    w = torch.nn.Parameter(torch.ones(1))
    return w, torch.ones(1), torch.optim.SGD([w], lr=1e-3, fused=True)


def _npu():
    w, x, sgd = _weight()
    opt = ascend.NPULossScaleOptimizer(sgd, ascend.ExponentialUpdateLossScaleManager(2.0**10, 2))
    opt.test_input = (w, x)
    return opt


def _npu_step(opt, overflow):
    w, x = opt.test_input
    opt.zero_grad()
    opt.backward((w * x.fill_(math.inf if overflow else 1.0)).sum())
    opt.step()


def _keras():
    _w, x, sgd = _weight()
    opt = keras.LossScaleOptimizer(sgd, initial_scale=2.0**10, dynamic_growth_steps=2)
    opt.test_input = x
    return opt


def _train_cell():
    w, x, sgd = _weight()
    train = mindspore.TrainOneStepWithLossScaleCell(
        lambda x: (w * x).sum(), sgd, mindspore.DynamicLossScaleUpdateCell(2.0**10, 2, 2)
    )
    train.test_input = x
    return train


def _nnabla():
    w, x, sgd = _weight()
    queue: list[bool] = []

    def feeder():
        x.fill_(math.inf if (queue and queue.pop(0)) else 1.0)

    updater = nnabla.DynamicLossScalingUpdater(sgd, lambda: (w * x).sum(), data_feeder=feeder, scale=2.0**10, N=1)
    updater.test_queue = queue
    return updater


def _nnabla_step(updater, overflow):
    updater.test_queue[:] = [overflow]  # an overflow is re-run once, on clean data
    updater.update()


def _cell_step(cell, overflow):
    cell(cell.scale_state.scale.clone(), torch.tensor(overflow))


SUBJECTS = [
    Subject(
        "ascend.ExponentialUpdateLossScaleManager",
        True,
        lambda: ascend.ExponentialUpdateLossScaleManager(2.0**10, 2),
        lambda m, o: m.update_loss_scale(torch.tensor(not o)),
    ),
    Subject(
        "ascend.FixedLossScaleManager",
        True,
        lambda: ascend.FixedLossScaleManager(128.0),
        lambda m, o: m.update_loss_scale(not o),
    ),
    Subject(
        "mindspore.DynamicLossScaleUpdateCell",
        True,
        lambda: mindspore.DynamicLossScaleUpdateCell(2.0**10, 2, 2),
        _cell_step,
    ),
    Subject("mindspore.FixedLossScaleUpdateCell", True, lambda: mindspore.FixedLossScaleUpdateCell(128.0), _cell_step),
    Subject(
        "mindspore.DynamicLossScaleManager",
        True,
        lambda: mindspore.DynamicLossScaleManager(2.0**10, 2, 2),
        lambda m, o: m.update_loss_scale(o),
    ),
    Subject(
        "mindspore.FixedLossScaleManager",
        True,
        lambda: mindspore.FixedLossScaleManager(),
        lambda m, o: m.update_loss_scale(o),
    ),
    Subject("ascend.NPULossScaleOptimizer", False, _npu, _npu_step),
    Subject(
        "keras.LossScaleOptimizer",
        False,
        _keras,
        lambda opt, o: opt.apply([opt.scale_loss(opt.test_input.fill_(math.inf if o else 1.0))]),
    ),
    Subject(
        "mindspore.TrainOneStepWithLossScaleCell",
        False,
        _train_cell,
        lambda t, o: t(t.test_input.fill_(math.inf if o else 1.0)),
    ),
    Subject(
        "nnabla.DynamicLossScalingUpdater", False, _nnabla, _nnabla_step, reads=lambda overflow: 2 if overflow else 1
    ),  # the retry decides on the host, once per attempt
]


def scales(obj, subject: Subject, flags) -> list[float]:
    out = []
    for o in flags:
        subject.step(obj, o)
        out.append(float(obj.scale_state.scale))
    return out


@pytest.fixture(params=SUBJECTS, ids=repr)
def subject(request) -> Subject:
    return request.param


def test_every_facade_class_is_under_contract():
    named = {s.name for s in SUBJECTS}
    for module in (ascend, mindspore, nnabla, keras):
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type) and name not in (
                "ExperimentalConfig",
                "TellMeStepOrLossHook",
            ):  # no scale
                assert f"{module.__name__.split('.')[-1]}.{name}" in named, name


def test_a_saved_state_continues_the_trajectory(subject):
    a = subject.make()
    scales(a, subject, PATTERN[:SPLIT])
    saved = pickle.loads(pickle.dumps(a.state_dict()))
    b = subject.make()
    b.load_state_dict(saved)
    assert scales(b, subject, PATTERN[SPLIT:]) == scales(a, subject, PATTERN[SPLIT:])
    for f in dataclasses.fields(a.scale_state):
        assert torch.equal(getattr(a.scale_state, f.name), getattr(b.scale_state, f.name)), f.name


def test_a_holder_pickles_and_an_optimizer_points_to_its_state_dict(subject):
    obj = subject.make()
    scales(obj, subject, PATTERN[:SPLIT])
    if not subject.pickles:
        with pytest.raises(TypeError, match=r"is not pickled directly; save .*state_dict\(\) with torch.save"):
            pickle.dumps(obj)
        return
    copy = pickle.loads(pickle.dumps(obj))
    assert scales(copy, subject, PATTERN[SPLIT:]) == scales(obj, subject, PATTERN[SPLIT:])


def test_host_reads_per_step(subject):
    obj = subject.make()
    subject.step(obj, False)  # the first step creates the optimizer's state
    with HostReadCounter() as reads:
        for o in PATTERN:
            subject.step(obj, o)
    assert reads.count == sum(subject.reads(o) for o in PATTERN)
