"""One contract over every preset and facade: checkpoints, pickling, dtypes, host reads, error messages.

Each subject is driven the same way: ``make()`` builds it, ``step(obj, overflow)`` runs one step with or
without an injected overflow, ``obj.scale_state`` is its state record. The kind decides what pickling
means: policies and scale holders (managers, cells) pickle; optimizer wrappers refuse and point to
``state_dict()``, as the core ``LossScaleOptimizer`` does.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

from lossscale import HostReadCounter, presets
from lossscale.compat import ascend, keras, mindspore, nnabla
from lossscale.policies.base import state_from_dict, state_to_dict

PATTERN = [False, True, False, False, True, True, False, False, False, True, False, False, False, False, True,
           False, False]
SPLIT = 7  # where the checkpoint is taken


class PolicyRun:
    """A preset and its state: the smallest stateful object around a policy."""

    def __init__(self, policy: Any) -> None:
        self.policy, self.scale_state = policy, policy.init()

    def step(self, overflow: bool) -> None:
        self.scale_state = self.policy.update(self.scale_state, torch.tensor(overflow))

    def state_dict(self) -> dict:
        return {"policy": self.policy, "state": state_to_dict(self.scale_state)}

    def load_state_dict(self, sd: dict) -> None:
        self.policy, self.scale_state = sd["policy"], state_from_dict(self.scale_state, sd["state"])


@dataclass
class Subject:
    name: str
    kind: str  # "policy", "holder" or "optimizer"
    make: Callable[[], Any]
    step: Callable[[Any, bool], None]
    bad_args: list[tuple[Any, str]] = field(default_factory=list)  # (overrides for make, or a callable; message)
    reads: Callable[[bool], int] = lambda overflow: 0  # host reads one step makes

    def build(self, **override: Any) -> Any:
        return self.make(**override)

    def build_bad(self, bad: Any) -> Any:
        return bad() if callable(bad) else self.make(**bad)

    def __repr__(self) -> str:
        return self.name


def _preset(name: str, bad: dict, **args: Any) -> Subject:
    def make(**override: Any) -> PolicyRun:
        return PolicyRun(presets.PRESETS[name](**{**args, **override}))

    (arg, value), = bad.items()
    return Subject(f"presets.{name}", "policy", make, lambda run, o: run.step(o), [(bad, f"{arg}.*got {value!r}")])


def _weight():
    w = torch.nn.Parameter(torch.ones(1))
    x = torch.ones(1)
    return w, x, torch.optim.SGD([w], lr=1e-3, fused=True)


def _npu(**override):
    w, x, sgd = _weight()
    manager = ascend.ExponentialUpdateLossScaleManager(**{"init_loss_scale": 2.0**10, "incr_every_n_steps": 2,
                                                          **override})
    opt = ascend.NPULossScaleOptimizer(sgd, manager)
    opt.test_input = (w, x)
    return opt


def _npu_step(opt, o):
    w, x = opt.test_input
    opt.zero_grad()
    opt.backward((w * x.fill_(math.inf if o else 1.0)).sum())
    opt.step()


def _keras(**override):
    w, x, sgd = _weight()
    opt = keras.LossScaleOptimizer(sgd, **{"initial_scale": 2.0**10, "dynamic_growth_steps": 2, **override})
    opt.test_input = (w, x)
    return opt


def _keras_step(opt, o):
    w, x = opt.test_input
    opt.apply([opt.scale_loss(x.fill_(math.inf if o else 1.0))])


def _train_cell(**override):
    w, x, sgd = _weight()
    cell = mindspore.DynamicLossScaleUpdateCell(**{"loss_scale_value": 2.0**10, "scale_factor": 2, "scale_window": 2,
                                                   **override})
    train = mindspore.TrainOneStepWithLossScaleCell(lambda x: (w * x).sum(), sgd, cell)
    train.test_input = x
    return train


def _nnabla(**override):
    w, x, sgd = _weight()
    queue: list[bool] = []

    def feeder():
        x.fill_(math.inf if (queue and queue.pop(0)) else 1.0)

    updater = nnabla.DynamicLossScalingUpdater(sgd, lambda: (w * x).sum(), data_feeder=feeder,
                                               **{"scale": 2.0**10, "N": 1, **override})
    updater.test_queue = queue
    return updater


def _nnabla_step(updater, o):
    updater.test_queue[:] = [o]  # an overflow is re-run once, on clean data
    updater.update()


def _cell_step(cell, o):
    cell(cell.scale_state.scale.clone(), torch.tensor(o))


SUBJECTS = [
    _preset("torch_amp", dict(growth_factor=1.0), init_scale=2.0**10, growth_interval=2),
    _preset("keras", dict(initial_scale=0.0), initial_scale=2.0**10, dynamic_growth_steps=2),
    _preset("tf_keras2", dict(dynamic_growth_steps=0), initial_scale=2.0**10, dynamic_growth_steps=2),
    _preset("tf_v1", dict(multiplier=0.5), initial_loss_scale=2.0**10, increment_period=2, multiplier=3.0),
    _preset("mindspore", dict(scale_window=0), init_loss_scale=2.0**10, scale_factor=3, scale_window=2),
    _preset("nnabla", dict(N=-1), scale=2.0**10, N=1),
    _preset("deepspeed", dict(delayed_shift=0), init_scale=2.0**10, scale_window=2),
    _preset("megatron", dict(backoff_factor=2.0), initial_scale=2.0**10, growth_interval=2, backoff_factor=0.3),
    _preset("paddle", dict(decr_ratio=0.0), init_loss_scaling=2.0**10, incr_every_n_steps=2,
            decr_every_n_nan_or_inf=2, decr_ratio=0.8),
    _preset("ascend", dict(incr_ratio=1), init_loss_scale=2.0**10, incr_every_n_steps=2),
    Subject("ascend.ExponentialUpdateLossScaleManager", "holder",
            lambda **o: ascend.ExponentialUpdateLossScaleManager(**{"init_loss_scale": 2.0**10,
                                                                    "incr_every_n_steps": 2, **o}),
            lambda m, o: m.update_loss_scale(torch.tensor(not o)),
            [(dict(incr_every_n_steps=0), "incr_every_n_steps must be an integer >= 1; got 0"),
             (dict(decr_ratio=1.2), r"decr_ratio must be in \(0, 1\)")]),
    Subject("ascend.FixedLossScaleManager", "holder",
            lambda **o: ascend.FixedLossScaleManager(**{"loss_scale": 128.0, **o}),
            lambda m, o: m.update_loss_scale(not o),
            [(dict(loss_scale=0.5), r"loss_scale must be a finite number in \[1.0")]),
    Subject("mindspore.DynamicLossScaleUpdateCell", "holder",
            lambda **o: mindspore.DynamicLossScaleUpdateCell(**{"loss_scale_value": 2.0**10, "scale_factor": 2,
                                                                "scale_window": 2, **o}),
            _cell_step,
            [(dict(scale_window=0), "scale_window must be an integer >= 1; got 0"),
             (dict(scale_factor=1), "scale_factor must be a finite number > 1")]),
    Subject("mindspore.FixedLossScaleUpdateCell", "holder",
            lambda **o: mindspore.FixedLossScaleUpdateCell(**{"loss_scale_value": 128.0, **o}), _cell_step,
            [(dict(loss_scale_value=float("nan")), "loss_scale_value must be a finite number")]),
    Subject("mindspore.DynamicLossScaleManager", "holder",
            lambda **o: mindspore.DynamicLossScaleManager(**{"init_loss_scale": 2.0**10, "scale_window": 2, **o}),
            lambda m, o: m.update_loss_scale(o),
            [(dict(init_loss_scale=0.5), r"init_loss_scale must be a finite number in \[1.0"),
             (dict(scale_window=1.5), "scale_window must be an integer >= 1; got 1.5")]),
    Subject("mindspore.FixedLossScaleManager", "holder",
            lambda **o: mindspore.FixedLossScaleManager(**o), lambda m, o: m.update_loss_scale(o),
            [(dict(drop_overflow_update="no"), "drop_overflow_update must be one of True, False")]),
    Subject("ascend.NPULossScaleOptimizer", "optimizer", _npu, _npu_step,
            [(lambda: ascend.NPULossScaleOptimizer(_weight()[2], ascend.FixedLossScaleManager(8), is_distributed=True),
              r"is_distributed=True\): .* none is initialized; call torch.distributed.init_process_group"),
             (lambda: ascend.NPULossScaleOptimizer(_weight()[2], presets.ascend(8.0, 2)),
              "loss_scale_manager must be an ExponentialUpdateLossScaleManager or a FixedLossScaleManager")]),
    Subject("keras.LossScaleOptimizer", "optimizer", _keras, _keras_step,
            [(dict(dynamic_growth_steps=0), "dynamic_growth_steps must be an integer >= 1; got 0"),
             (dict(clipnorm=-1.0), "clipnorm must be None or a finite number > 0; got -1.0"),
             (dict(gradient_accumulation_steps=1), "gradient_accumulation_steps must be an integer >= 2; got 1"),
             (dict(ema_momentum=1.5), r"ema_momentum must be None or a number in \[0, 1\]; got 1.5"),
             (dict(clipnorm=1.0, clipvalue=1.0), "only one of clipnorm, clipvalue and global_clipnorm")]),
    Subject("mindspore.TrainOneStepWithLossScaleCell", "optimizer", _train_cell,
            lambda t, o: t(t.test_input.fill_(math.inf if o else 1.0)),
            [(lambda: mindspore.TrainOneStepWithLossScaleCell(lambda x: x.sum(), _weight()[2], torch.ones(2)),
              r"the shape of scale_sense must be \(1,\) or \(\); got \(2,\)"),
             (lambda: mindspore.TrainOneStepWithLossScaleCell(lambda x: x.sum(), _weight()[2], 1024.0),
              "scale_sense must be an update cell .* or a tensor; got float")]),
    Subject("nnabla.DynamicLossScalingUpdater", "optimizer", _nnabla, _nnabla_step,
            [(dict(N=-2), "N must be an integer >= 0; got -2"),
             (dict(scaling_factor=1.0), "scaling_factor must be a finite number > 1"),
             (dict(accum_grad=0), "accum_grad must be an integer >= 1; got 0")],
            reads=lambda overflow: 2 if overflow else 1),  # the retry decides on the host, once per attempt
]

ids = [s.name for s in SUBJECTS]


def scales(obj, subject, flags):
    out = []
    for o in flags:
        subject.step(obj, o)
        out.append(float(obj.scale_state.scale))
    return out


@pytest.mark.parametrize("subject", SUBJECTS, ids=ids)
def test_state_dict_round_trip_continues_the_trajectory(subject):
    a = subject.build()
    scales(a, subject, PATTERN[:SPLIT])
    saved = pickle.loads(pickle.dumps(a.state_dict()))
    b = subject.build()
    b.load_state_dict(saved)
    assert scales(b, subject, PATTERN[SPLIT:]) == scales(a, subject, PATTERN[SPLIT:])
    for f in dataclasses.fields(a.scale_state):
        assert torch.equal(getattr(a.scale_state, f.name), getattr(b.scale_state, f.name)), f.name


@pytest.mark.parametrize("subject", SUBJECTS, ids=ids)
def test_pickling(subject):
    obj = subject.build()
    scales(obj, subject, PATTERN[:SPLIT])
    if subject.kind == "optimizer":
        with pytest.raises(TypeError, match=r"is not pickled directly; save .*state_dict\(\)"):
            pickle.dumps(obj)
        return
    copy = pickle.loads(pickle.dumps(obj))
    assert scales(copy, subject, PATTERN[SPLIT:]) == scales(obj, subject, PATTERN[SPLIT:])


@pytest.mark.parametrize("subject", SUBJECTS, ids=ids)
def test_state_dtypes_are_stable(subject):
    obj = subject.build()
    seen = set()
    for o in PATTERN + [True] * 12:
        subject.step(obj, o)
        state = obj.scale_state
        seen.add(float(state.scale))
        assert state.scale.dtype == torch.float32 and state.scale.dim() == 0
        for f in dataclasses.fields(state)[1:]:
            value = getattr(state, f.name)
            assert value.dtype == torch.int32 and value.dim() == 0, f.name
    assert all(math.isfinite(s) and s > 0 for s in seen)


@pytest.mark.parametrize("subject", SUBJECTS, ids=ids)
def test_host_reads_per_step(subject):
    obj = subject.build()
    subject.step(obj, False)  # first steps create optimizer state
    with HostReadCounter() as reads:
        for o in PATTERN:
            subject.step(obj, o)
    assert reads.count == sum(subject.reads(o) for o in PATTERN)


@pytest.mark.parametrize("subject,bad,needle", [
    pytest.param(s, b, n, id=f"{s.name}-{i}") for s in SUBJECTS for i, (b, n) in enumerate(s.bad_args)])
def test_validation_names_the_call_the_argument_and_the_value(subject, bad, needle):
    with pytest.raises((ValueError, TypeError), match=needle) as err:
        subject.build_bad(bad)
    message = err.value.args[0]
    call = subject.name if subject.kind == "policy" else subject.name.split(".")[-1]
    assert message.startswith(call + "("), message
    assert message.rstrip().endswith(".")


def test_every_subject_has_error_cases():
    assert all(s.bad_args for s in SUBJECTS)


def test_every_preset_and_facade_is_under_contract():
    named = {s.name for s in SUBJECTS}
    assert {f"presets.{n}" for n in presets.PRESETS} <= named
    for module in (ascend, mindspore, nnabla, keras):
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type) and name not in ("ExperimentalConfig", "TellMeStepOrLossHook"):
                assert f"{module.__name__.split('.')[-1]}.{name}" in named, name
