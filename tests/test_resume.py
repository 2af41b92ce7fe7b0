"""Resume anywhere: one property test over everything in the library that has a state_dict.

hypothesis draws a run of up to 40 micro-steps with inf or NaN injected at random steps (into one entry of the
output's gradient, or the loss made infinite) and a point where the run breaks, inside an accumulation window where
the object accumulates. The run is taken twice: straight through, and broken at that point, where the state goes
through the object's own save and load (torch.save and torch.load(weights_only=True), or the framework's
checkpoint) into fresh objects over a fresh model and inner optimizer built with the same seed. The broken run must
equal the straight one bit for bit: what every step reports (scale, counters, decision) and, at the end, the
parameters, the optimizer state and every state dict.

One driver (:func:`check_resume`) and one adapter per object (:class:`Case`: build, step, save, load, final). Where
the docs say a state loads across front ends (torch's GradScaler and ours, directly and inside Lightning, Fabric and
Accelerate), the adapter's load builds the other front end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace as Live  # the objects of one run (model, optimizer, scaler, ...)
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import lossscale
from lossscale import EMA, DynamicScale, FloorError, LossScaleOptimizer, PrecisionSchedule, PredictiveScale, presets
from lossscale.compat import ascend, keras, mindspore, nnabla
from lossscale.compat.keras import _KerasStep

MAX_STEPS = 40
SCHEDULE_STEPS = 20  # a precision schedule's total_steps: 'fast|step|0.5' switches back at optimizer step 10
TORCH_ARGS = dict(init_scale=2.0**10, growth_interval=3)  # grows and backs off within a short run
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
POISONS = ("inf", "nan", "loss")  # an inf or a NaN in the output's gradient; an infinite loss


@dataclasses.dataclass(frozen=True)
class Run:
    """``steps`` micro-steps, broken after ``stop`` of them; ``poison`` maps a step to what overflows in it."""

    steps: int
    stop: int
    poison: dict[int, str] = dataclasses.field(default_factory=dict)


# --- the model, its data and the injected overflow -------------------------------------------------------------


class Net(nn.Module):
    """Two linear layers (two units for per-layer scales), the same weights every time it is built."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), 10 * torch.randn(8, 2, generator=g)


def poisoned_loss(out: torch.Tensor, y: torch.Tensor, poison: str | None) -> torch.Tensor:
    """The MSE loss, with ``poison`` (see POISONS) injected into the backward pass or the loss itself."""
    if poison in ("inf", "nan"):
        value = float(poison)

        def inject(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            grad[0, 0] = value
            return grad

        out.register_hook(inject)
    loss = F.mse_loss(out, y)
    return loss * math.inf if poison == "loss" else loss


def loss_of(model: nn.Module, i: int, poison: str | None) -> torch.Tensor:
    x, y = batch(i)
    return poisoned_loss(model(x).float(), y, poison)


# --- the driver ------------------------------------------------------------------------------------------------


class Case:
    """How the driver holds one object: build it, run steps with injected overflow, save, load, read its end."""

    id = ""
    stride = 1  # the run breaks only after a multiple of this many micro-steps (a framework checkpoints there)
    first_stop = 0  # ... and not before this many
    poisons: tuple[str, ...] = POISONS
    examples = 10
    regressions: tuple[Run, ...] = ()
    marks: tuple[Any, ...] = ()

    def build(self) -> Any:
        """The objects of a run, built from the seed."""
        raise NotImplementedError

    def fresh(self) -> Any:
        """The objects a checkpoint is loaded into (another front end where the docs say it loads there)."""
        return self.build()

    def run(self, live: Any, start: int, stop: int, poison: dict[int, str]) -> list[Any]:
        """What each of the micro-steps ``start .. stop - 1`` reports."""
        return [snapshot(self.step(live, i, poison.get(i))) for i in range(start, stop)]

    def step(self, live: Any, i: int, poison: str | None) -> Any:
        raise NotImplementedError

    def save(self, live: Any, directory: Path) -> None:
        torch.save(self.state(live), directory / "state.pt")

    def load(self, directory: Path) -> Any:
        live = self.fresh()
        self.restore(live, torch.load(directory / "state.pt", weights_only=True))
        return live

    def state(self, live: Any) -> dict[str, Any]:
        """What a user saves: the model, and the object's state (with its inner optimizer's)."""
        raise NotImplementedError

    def restore(self, live: Any, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def final(self, live: Any) -> Any:
        """The end of a run: parameters, optimizer state, every state dict."""
        raise NotImplementedError

    def close(self) -> None:
        """Undo what the case set up outside its objects."""


def check_resume(case: Case, run: Run) -> None:
    """The run broken at ``run.stop`` and resumed from its checkpoint equals the run taken straight through."""
    straight = case.build()
    expected = case.run(straight, 0, run.steps, run.poison)
    expected_end = snapshot(case.final(straight))
    with tempfile.TemporaryDirectory() as tmp:
        head = case.build()
        got = case.run(head, 0, run.stop, run.poison)
        case.save(head, Path(tmp))
        resumed = case.load(Path(tmp))
        got += case.run(resumed, run.stop, run.steps, run.poison)
        got_end = snapshot(case.final(resumed))
    assert_same(got, expected, "steps")
    assert_same(got_end, expected_end, "end")


@st.composite
def runs(draw: Any, case: Case) -> Run:
    first = case.first_stop // case.stride
    units = draw(st.integers(first + 1, MAX_STEPS // case.stride))
    steps = units * case.stride
    stop = draw(st.integers(first, units - 1)) * case.stride  # at least one step after the break
    clean = draw(st.integers(0, 16))  # how many times likelier a step is clean than poisoned with a given kind
    kinds = draw(st.lists(st.sampled_from((None,) * clean + case.poisons), min_size=steps, max_size=steps))
    if stop and draw(st.booleans()):  # the step before the break overflows: the most state in flight at the break
        kinds[stop - 1] = draw(st.sampled_from(case.poisons))
    return Run(steps, stop, {i: kind for i, kind in enumerate(kinds) if kind is not None})


def snapshot(value: Any) -> Any:
    """``value`` frozen as read now: tensors copied, dataclasses (StepResult) as dicts, tuples as lists."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: snapshot(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [snapshot(v) for v in value]
    return value


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def assert_same(got: Any, expected: Any, where: str) -> None:
    """``got`` equals ``expected`` bit for bit (tensors and floats by their bits, NaN included), naming the place."""
    if isinstance(expected, torch.Tensor):
        same = (
            isinstance(got, torch.Tensor)
            and got.dtype == expected.dtype
            and got.shape == expected.shape
            and torch.equal(_bits(got), _bits(expected))
        )
        assert same, f"{where}: resumed {got!r}, straight {expected!r}"
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), (
            f"{where}: resumed keys {sorted(map(str, got)) if isinstance(got, dict) else got!r}, straight "
            f"{sorted(map(str, expected))}"
        )
        for key in expected:
            assert_same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), (
            f"{where}: resumed {len(got) if isinstance(got, list) else got!r} entries, straight {len(expected)}"
        )
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(expected, float):
        same = isinstance(got, float) and struct.pack("<d", got) == struct.pack("<d", expected)
        assert same, f"{where}: resumed {got!r}, straight {expected!r}"
    else:
        assert type(got) is type(expected) and got == expected, f"{where}: resumed {got!r}, straight {expected!r}"


# --- GradScaler, ours and torch's --------------------------------------------------------------------------------


def torch_keys(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The keys torch's GradScaler and ours both write."""
    return {k: state_dict[k] for k in TORCH_KEYS if k in state_dict}


def make_scaler(kind: str, policy: Callable[[], Any] | None = None) -> Any:
    if kind == "torch":
        return torch.amp.GradScaler("cpu", **TORCH_ARGS)
    if policy is None:
        return lossscale.GradScaler("cpu", **TORCH_ARGS)
    return lossscale.GradScaler("cpu", policy=policy())


class ScalerCase(Case):
    """``scaler.scale(loss).backward(); [unscale_, clip]; scaler.step(opt); scaler.update()``, saved as a user
    saves it: the model, the optimizer and the scaler's state dict."""

    def __init__(
        self,
        id: str,
        first: str = "ours",
        then: str = "ours",
        policy: Callable[[], Any] | None = None,
        fused: bool = False,
        examples: int = 10,
    ) -> None:
        self.id, self.first, self.then, self.policy = id, first, then, policy
        self.fused, self.examples = fused, examples

    def _make(self, kind: str) -> Live:
        model = Net()
        params = model.parameters()
        opt = (
            torch.optim.Adam(params, lr=1e-2, fused=True)
            if self.fused
            else torch.optim.SGD(params, lr=0.05, momentum=0.9)
        )
        return Live(model=model, opt=opt, scaler=make_scaler(kind, self.policy))

    def build(self) -> Live:
        return self._make(self.first)

    def fresh(self) -> Live:
        return self._make(self.then)

    def _scaler_state(self, scaler: Any) -> dict[str, Any]:
        state = scaler.state_dict()
        return state if self.first == self.then == "ours" else torch_keys(state)

    def step(self, live: Live, i: int, poison: str | None) -> Any:
        live.opt.zero_grad()
        live.scaler.scale(loss_of(live.model, i, poison)).backward()
        if not self.fused:
            live.scaler.unscale_(live.opt)
            torch.nn.utils.clip_grad_norm_(live.model.parameters(), 1.0)
        live.scaler.step(live.opt)
        live.scaler.update()
        return self._scaler_state(live.scaler)

    def state(self, live: Live) -> dict[str, Any]:
        return {"model": live.model.state_dict(), "opt": live.opt.state_dict(), "scaler": live.scaler.state_dict()}

    def restore(self, live: Live, state: dict[str, Any]) -> None:
        live.model.load_state_dict(state["model"])
        live.opt.load_state_dict(state["opt"])
        live.scaler.load_state_dict(state["scaler"])

    def final(self, live: Live) -> Any:
        return {
            "params": list(live.model.parameters()),
            "opt": live.opt.state_dict(),
            "scaler": self._scaler_state(live.scaler),
        }


# --- LossScaleOptimizer and the facades built on it ---------------------------------------------------------------


def optimizer_step(
    opt: LossScaleOptimizer,
    model: nn.Module,
    i: int,
    poison: str | None,
    schedule: PrecisionSchedule | None = None,
    feed: Callable[..., None] | None = None,
) -> Any:
    """One micro-step of a LossScaleOptimizer loop (under the schedule's autocast, fed after each optimizer step);
    what it reports, with the scale's whole state."""
    opt.zero_grad()
    with schedule.autocast("cpu") if schedule is not None else contextlib.nullcontext():
        loss = loss_of(model, i, poison)
    opt.backward(loss)
    try:
        result = opt.step()
    except FloorError as err:  # a policy that raises at its floor: the resumed run raises at the same step
        return {"raised": str(err), "state": opt.loss_scale.state_dict()}
    if schedule is not None and not result.accumulating:
        (feed or schedule.update)(step=schedule.step + 1)
    return {"result": result, "state": opt.loss_scale.state_dict()}


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def fused_adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


class OptimizerCase(Case):
    """``LossScaleOptimizer(inner, policy=..., **options)``, with an EMA, a precision schedule or per-layer scales."""

    def __init__(
        self,
        id: str,
        inner: Callable[[Any], torch.optim.Optimizer],
        policy: Callable[[], Any] | None = None,
        *,
        ema: tuple[float, int | None] | None = None,
        schedule: bool = False,
        layerwise: bool = False,
        examples: int = 10,
        regressions: tuple[Run, ...] = (),
        **options: Any,
    ) -> None:
        self.id, self.inner, self.policy, self.ema, self.schedule = id, inner, policy, ema, schedule
        self.layerwise, self.examples, self.regressions, self.options = layerwise, examples, regressions, options

    def build(self) -> Live:
        model = Net()
        schedule = PrecisionSchedule("fast|step|0.5", total_steps=SCHEDULE_STEPS) if self.schedule else None
        options = dict(self.options)
        inner = self.inner(model.parameters())
        decay = options.pop("weight_decay", None)  # Keras's decoupled decay, the facade's step around the inner one
        opt = LossScaleOptimizer(
            _KerasStep(inner, None, decay) if decay else inner,
            policy=None if self.policy is None else self.policy(),
            ema=None if self.ema is None else EMA(*self.ema),
            schedule=schedule,
            layerwise=model if self.layerwise else None,
            **options,
        )
        return Live(model=model, opt=opt, schedule=schedule)

    def step(self, live: Live, i: int, poison: str | None) -> Any:
        return optimizer_step(live.opt, live.model, i, poison, live.schedule)

    def state(self, live: Live) -> dict[str, Any]:
        return {"model": live.model.state_dict(), "opt": live.opt.state_dict()}

    def restore(self, live: Live, state: dict[str, Any]) -> None:
        live.model.load_state_dict(state["model"])
        live.opt.load_state_dict(state["opt"])

    def final(self, live: Live) -> Any:
        return {"params": list(live.model.parameters()), "opt": live.opt.state_dict()}


class AscendCase(OptimizerCase):
    """``NPULossScaleOptimizer`` on an ``ExponentialUpdateLossScaleManager``, with the precision mode fed by
    ``TellMeStepOrLossHook``; the manager's and the optimizer's state dicts saved."""

    def __init__(self) -> None:
        super().__init__("ascend-manager-npu-optimizer", sgd)

    def build(self) -> Live:
        model = Net()
        manager = ascend.ExponentialUpdateLossScaleManager(2.0**10, 3, decr_every_n_nan_or_inf=2)
        hook = ascend.TellMeStepOrLossHook(step=0, total_step=SCHEDULE_STEPS)
        schedule = ascend.ExperimentalConfig("fast|step|0.5").schedule(hook)
        opt = ascend.NPULossScaleOptimizer(
            sgd(model.parameters()), manager, accumulation_steps=2, schedule=schedule, clip_grad_norm=1.0
        )
        return Live(model=model, opt=opt, manager=manager, schedule=schedule, hook=hook)

    def step(self, live: Live, i: int, poison: str | None) -> Any:
        report = optimizer_step(live.opt, live.model, i, poison, live.schedule, feed=live.hook)
        return dict(report, loss_scale=live.manager.get_loss_scale(), manager=live.manager.state_dict())

    def state(self, live: Live) -> dict[str, Any]:
        return dict(super().state(live), manager=live.manager.state_dict())

    def restore(self, live: Live, state: dict[str, Any]) -> None:
        live.manager.load_state_dict(state["manager"])
        super().restore(live, state)


class MindSporeLoopCase(Case):
    """MindSpore's loop by hand: the loss times the scale, unscale and step unless a gradient overflowed, then
    ``cell(loss_scale, overflow)`` (the scale a tensor the user keeps and saves, MindSpore's Parameter) or
    ``manager.update_loss_scale(overflow)``."""

    def __init__(self, id: str, manager: bool) -> None:
        self.id, self.manager = id, manager

    def build(self) -> Live:
        model = Net()
        if self.manager:
            rule, loss_scale = mindspore.DynamicLossScaleManager(init_loss_scale=2.0**10, scale_window=3), None
        else:
            rule, loss_scale = mindspore.DynamicLossScaleUpdateCell(2.0**10, 2, 3), torch.tensor([2.0**10])
        return Live(model=model, opt=sgd(model.parameters()), rule=rule, loss_scale=loss_scale)

    def step(self, live: Live, i: int, poison: str | None) -> Any:
        scale = torch.tensor(live.rule.get_loss_scale()) if self.manager else live.loss_scale.clone()
        live.opt.zero_grad()
        (loss_of(live.model, i, poison) * scale).sum().backward()
        grads = [p.grad for p in live.model.parameters()]
        overflow = not all(bool(torch.isfinite(g).all()) for g in grads)
        if not overflow:
            for g in grads:
                g.div_(scale)
            live.opt.step()
        if self.manager:
            live.rule.update_loss_scale(overflow)
        else:
            live.rule(live.loss_scale, torch.tensor(overflow))
        return {"overflow": overflow, "scale": scale, "state": live.rule.state_dict()}

    def state(self, live: Live) -> dict[str, Any]:
        state = {"model": live.model.state_dict(), "opt": live.opt.state_dict(), "rule": live.rule.state_dict()}
        return state if self.manager else dict(state, loss_scale=live.loss_scale)

    def restore(self, live: Live, state: dict[str, Any]) -> None:
        live.model.load_state_dict(state["model"])
        live.opt.load_state_dict(state["opt"])
        live.rule.load_state_dict(state["rule"])
        if not self.manager:
            live.loss_scale.copy_(state["loss_scale"])

    def final(self, live: Live) -> Any:
        return {"params": list(live.model.parameters()), **self.state(live)}


class TrainCellCase(Case):
    """``TrainOneStepWithLossScaleCell(network, SGD, DynamicLossScaleUpdateCell(...), accumulation_steps=2)``."""

    id = "mindspore-train-cell"

    def build(self) -> Live:
        model = Net()
        cell = mindspore.DynamicLossScaleUpdateCell(2.0**10, 2, 3)
        train = mindspore.TrainOneStepWithLossScaleCell(
            lambda i, poison: loss_of(model, i, poison), sgd(model.parameters()), cell, accumulation_steps=2
        )
        return Live(model=model, cell=cell, train=train)

    def step(self, live: Live, i: int, poison: str | None) -> Any:
        loss, overflow, scale = live.train(i, poison)
        return {
            "loss": loss,
            "overflow": overflow,
            "scale": scale,
            "sense": live.train.scale_sense,
            "cell": live.cell.state_dict(),
        }

    def state(self, live: Live) -> dict[str, Any]:
        return {"model": live.model.state_dict(), "train_cell": live.train.state_dict()}

    def restore(self, live: Live, state: dict[str, Any]) -> None:
        live.model.load_state_dict(state["model"])
        live.train.load_state_dict(state["train_cell"])

    def final(self, live: Live) -> Any:
        return {"params": list(live.model.parameters()), **self.state(live)}


class NnablaCase(Case):
    """``DynamicLossScalingUpdater(SGD, loss, data_feeder, accum_grad=2, weight_decay=...)``: each ``update()``
    re-runs with new data after an overflow; the poison is in the first pass of a step only."""

    id = "nnabla-updater"

    def build(self) -> Live:
        live = Live(model=Net(), i=0, passes=0, poison=None)

        def feed() -> None:
            live.passes += 1

        def loss() -> torch.Tensor:
            return loss_of(live.model, 100 * live.i + live.passes, live.poison if live.passes == 1 else None)

        live.updater = nnabla.DynamicLossScalingUpdater(
            sgd(live.model.parameters()), loss, feed, scale=8.0, N=2, accum_grad=2, weight_decay=1e-3
        )
        return live

    def step(self, live: Live, i: int, poison: str | None) -> Any:
        live.i, live.passes, live.poison = i, 0, poison
        live.updater.update()
        return {
            "scale": live.updater.scale,
            "passes": live.passes,
            "result": live.updater.last_result,
            "state": live.updater.state_dict()["policy_state"],
        }

    def state(self, live: Live) -> dict[str, Any]:
        return {"model": live.model.state_dict(), "updater": live.updater.state_dict()}

    def restore(self, live: Live, state: dict[str, Any]) -> None:
        live.model.load_state_dict(state["model"])
        live.updater.load_state_dict(state["updater"])

    def final(self, live: Live) -> Any:
        return {"params": list(live.model.parameters()), "updater": live.updater.state_dict()}


class KerasCase(Case):
    """Keras 3's loop: ``grads = grad(opt.scale_loss(loss))``, then ``opt.apply(grads)`` (accumulating without a
    backward of ours when ``gradient_accumulation_steps`` is set)."""

    def __init__(
        self,
        id: str,
        inner: Callable[[Any], torch.optim.Optimizer],
        examples: int = 10,
        regressions: tuple[Run, ...] = (),
        **kwargs: Any,
    ) -> None:
        self.id, self.inner, self.examples, self.regressions, self.kwargs = id, inner, examples, regressions, kwargs

    def build(self) -> Live:
        model = Net()
        opt = keras.LossScaleOptimizer(
            self.inner(model.parameters()), initial_scale=2.0**10, dynamic_growth_steps=3, **self.kwargs
        )
        return Live(model=model, opt=opt)

    def step(self, live: Live, i: int, poison: str | None) -> Any:
        params = list(live.model.parameters())
        grads = torch.autograd.grad(live.opt.scale_loss(loss_of(live.model, i, poison)), params)
        live.opt.apply(grads)
        return {"scale": live.opt.dynamic_scale, "iterations": live.opt.iterations, "result": live.opt.last_result}

    def state(self, live: Live) -> dict[str, Any]:
        return {"model": live.model.state_dict(), "opt": live.opt.state_dict()}

    def restore(self, live: Live, state: dict[str, Any]) -> None:
        live.model.load_state_dict(state["model"])
        live.opt.load_state_dict(state["opt"])

    def final(self, live: Live) -> Any:
        return {"params": list(live.model.parameters()), "opt": live.opt.state_dict()}


# --- the integrations, through their frameworks' own checkpoints ------------------------------------------------


class LightningCase(Case):
    """A Trainer run of ``_lightning_models.Tiny`` (8 micro-batches an epoch, ``accumulate_grad_batches=2``, inf
    losses at the poisoned micro-batches), checkpointed with ``trainer.save_checkpoint`` at an epoch's end and
    resumed with ``fit(ckpt_path=...)``. ``optimizer``: ``LossScalePrecision`` with a LossScaleOptimizer and a
    ``LossScaleMonitor``; else ``MixedPrecision``, lossscale's or Lightning's with torch's scaler."""

    stride = first_stop = 8
    poisons = ("loss",)
    examples = 4

    def __init__(self, id: str, first: str = "ours", then: str = "ours", optimizer: bool = False) -> None:
        self.id, self.first, self.then, self.optimizer = id, first, then, optimizer
        from _lightning_models import LIGHTNING_WARNINGS

        self.marks = tuple(pytest.mark.filterwarnings(w) for w in LIGHTNING_WARNINGS)

    def build(self) -> Live:
        return Live(kind=self.first, ckpt=None)

    def _plugin(self, kind: str) -> Any:
        from _lightning_models import TORCH_ARGS as LIGHTNING_ARGS
        from _lightning_models import torch_plugin
        from lossscale.integrations import lightning

        if self.optimizer:
            return lightning.LossScalePrecision(torch.float16, "cpu")
        return torch_plugin() if kind == "torch" else lightning.MixedPrecision("16-mixed", "cpu", **LIGHTNING_ARGS)

    def run(self, live: Live, start: int, stop: int, poison: dict[int, str]) -> list[Any]:
        from _lightning_models import Tiny, fit
        from lossscale.integrations.lightning import LossScaleMonitor

        module = Tiny(inf_at={divmod(i, self.stride) for i in poison}, wrap={} if self.optimizer else None)
        extra: dict[str, Any] = {}
        if self.optimizer:
            live.monitor = LossScaleMonitor()
            extra = dict(callbacks=[live.monitor], logger=_discarding_logger(), log_every_n_steps=1)
        _, recorder, live.trainer = fit(
            self._plugin(live.kind), module, ckpt=live.ckpt, epochs=stop // self.stride, **extra
        )
        live.module = module
        return list(recorder.scales)

    def save(self, live: Live, directory: Path) -> None:
        live.trainer.save_checkpoint(str(directory / "lightning.ckpt"))

    def load(self, directory: Path) -> Live:
        return Live(kind=self.then, ckpt=str(directory / "lightning.ckpt"))

    def final(self, live: Live) -> Any:
        trainer = live.trainer
        end = {
            "params": list(live.module.parameters()),
            "opt": trainer.optimizers[0].state_dict(),
            "global_step": trainer.global_step,
        }
        if self.optimizer:
            return dict(end, monitor=live.monitor.state_dict())
        return dict(end, scaler=torch_keys(trainer.precision_plugin.scaler.state_dict()))


def _discarding_logger() -> Any:
    """A Lightning logger that keeps nothing (LossScaleMonitor needs one to log to)."""
    from lightning.pytorch.loggers import Logger

    class Discarding(Logger):
        name = "discarding"
        version = 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            pass

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    return Discarding()


class FabricCase(Case):
    """``test_integration_fabric``'s loop (accumulation 2 with ``no_backward_sync``, clip 1.0), checkpointed with
    ``fabric.save`` / ``fabric.load`` of the model, the optimizer and the scaler."""

    stride = 2
    examples = 4

    def __init__(self, id: str, first: str = "ours", then: str = "ours") -> None:
        self.id, self.first, self.then = id, first, then

    def _make(self, kind: str) -> Live:
        import test_integration_fabric as loop

        fabric, model, opt = loop.setup(loop.torch_plugin() if kind == "torch" else loop.ours())
        return Live(fabric=fabric, model=model, opt=opt, batches=loop.batches())

    def build(self) -> Live:
        return self._make(self.first)

    def fresh(self) -> Live:
        return self._make(self.then)

    def step(self, live: Live, i: int, poison: str | None) -> Any:
        x, y = live.batches[i % len(live.batches)]
        boundary = i % 2 == 1
        with live.fabric.no_backward_sync(live.model, enabled=not boundary):
            live.fabric.backward(poisoned_loss(live.model(x).float(), y, poison) / 2)
        if boundary:
            live.fabric.clip_gradients(live.model, live.opt, max_norm=1.0, error_if_nonfinite=False)
            live.opt.step()
            live.opt.zero_grad()
        return torch_keys(live.fabric.strategy.precision.scaler.state_dict())

    @staticmethod
    def _parts(live: Live) -> dict[str, Any]:
        return {"model": live.model, "optimizer": live.opt, "scaler": live.fabric.strategy.precision.scaler}

    def save(self, live: Live, directory: Path) -> None:
        live.fabric.save(directory / "fabric.ckpt", self._parts(live))

    def load(self, directory: Path) -> Live:
        live = self.fresh()
        live.fabric.load(directory / "fabric.ckpt", self._parts(live))
        return live

    def final(self, live: Live) -> Any:
        return {
            "params": list(live.model.parameters()),
            "opt": live.opt.state_dict(),
            "scaler": torch_keys(live.fabric.strategy.precision.scaler.state_dict()),
        }


class AccelerateCase(Case):
    """``test_integration_accelerate``'s prepared objects (``gradient_accumulation_steps=2``) in its loop
    (``accumulate``, ``backward``, ``clip_grad_norm_``, ``step``) over epochs of its loader, checkpointed with
    ``accelerator.save_state`` / ``load_state``."""

    stride = 2
    examples = 4

    def __init__(self, id: str, first: str = "ours", then: str = "ours") -> None:
        self.id, self.first, self.then = id, first, then

    @staticmethod
    def _make(kind: str) -> Live:
        import test_integration_accelerate as loop

        acc, model, opt, loader = loop.prepared(kind)
        return Live(acc=acc, model=model, opt=opt, loader=loader)

    def build(self) -> Live:
        return self._make(self.first)

    def run(self, live: Live, start: int, stop: int, poison: dict[int, str]) -> list[Any]:
        acc, reports = live.acc, []
        per_epoch = len(live.loader)
        for epoch in range(-(-stop // per_epoch)):
            for j, (x, y) in enumerate(live.loader):
                i = epoch * per_epoch + j
                if not start <= i < stop:
                    continue
                with acc.accumulate(live.model):
                    acc.backward(poisoned_loss(live.model(x).float(), y, poison.get(i)))
                    if acc.sync_gradients:
                        acc.clip_grad_norm_(live.model.parameters(), 1.0)
                    live.opt.step()
                    live.opt.zero_grad()
                reports.append(torch_keys(acc.scaler.state_dict()))
        return reports

    def save(self, live: Live, directory: Path) -> None:
        live.acc.save_state(str(directory / "accelerate"))

    def load(self, directory: Path) -> Live:
        live = self._make(self.then)
        live.acc.load_state(str(directory / "accelerate"))
        return live

    def final(self, live: Live) -> Any:
        return {
            "params": list(live.model.parameters()),
            "opt": live.opt.state_dict(),
            "scaler": torch_keys(live.acc.scaler.state_dict()),
        }

    def close(self) -> None:
        from test_integration_accelerate import reset_accelerate_state

        reset_accelerate_state()


# --- every object --------------------------------------------------------------------------------------------

# Each preset with a short window, over the three skip modes and accumulation 1-3 in turn. tf_keras2, tf_v1,
# mindspore and deepspeed start low enough to reach their floor of 1 (deepspeed raises there).
PRESET_POLICIES = {
    "torch_amp": lambda: presets.torch_amp(init_scale=2.0**10, growth_interval=3),
    "keras": lambda: presets.keras(initial_scale=2.0**10, dynamic_growth_steps=3),
    "tf_keras2": lambda: presets.tf_keras2(initial_scale=2.0**3, dynamic_growth_steps=3),
    "tf_v1": lambda: presets.tf_v1(initial_loss_scale=2.0**3, increment_period=3, multiplier=3.0),
    "mindspore": lambda: presets.mindspore(init_loss_scale=2.0**3, scale_factor=2, scale_window=3),
    "nnabla": lambda: presets.nnabla(scale=8.0, scaling_factor=2.0, N=2),
    "deepspeed": lambda: presets.deepspeed(init_scale=2.0**3, scale_window=3, delayed_shift=2),
    "megatron": lambda: presets.megatron(initial_scale=2.0**10, growth_interval=3, hysteresis=2),
    "paddle": lambda: presets.paddle(init_loss_scaling=2.0**10, incr_every_n_steps=3, decr_every_n_nan_or_inf=2),
    "ascend": lambda: presets.ascend(2.0**10, 3, decr_every_n_nan_or_inf=2),
}
SKIP_MODES = (("fused", fused_adamw), ("masked", adam), ("host", sgd))


def preset_cases() -> list[Case]:
    cases: list[Case] = []
    for n, (name, policy) in enumerate(PRESET_POLICIES.items()):
        mode, inner = SKIP_MODES[n % 3]
        steps = (n + n // 3) % 3 + 1
        cases.append(
            OptimizerCase(
                f"optimizer-preset-{name}-{mode}-accumulation-{steps}",
                inner,
                policy,
                skip_mode=mode,
                accumulation_steps=steps,
                examples=5,
            )
        )
    return cases


KERAS_MID_WINDOW = Run(steps=4, stop=1)  # the Keras facade's own mid-window checkpoint did not load (8159e0e)
# An infinite loss, then the break mid-window: the checkpoint lost that the window's loss was not finite, so the
# resumed PredictiveScale took the overflow for evidence against the scale and backed off (it is a fault).
PREDICTIVE_LOSS_IN_WINDOW = Run(steps=4, stop=1, poison={0: "loss"})

CASES: list[Case] = [
    ScalerCase("scaler"),
    ScalerCase("scaler-fused", fused=True),
    ScalerCase("scaler-torch-into-ours", first="torch"),
    ScalerCase("scaler-ours-into-torch", then="torch"),
    ScalerCase("scaler-predictive", policy=lambda: PredictiveScale(init_scale=2.0**10, target_interval=10)),
    ScalerCase(
        "scaler-preset-deepspeed",
        policy=lambda: presets.deepspeed(init_scale=2.0**10, scale_window=3, raise_error_at_min_scale=False),
    ),
    OptimizerCase(
        "optimizer-fused-accumulation-clip-norm",
        fused_adamw,
        lambda: DynamicScale(init_scale=2.0**10, growth_interval=3, hysteresis=2),
        skip_mode="fused",
        accumulation_steps=3,
        clip_grad_norm=1.0,
    ),
    OptimizerCase(
        "optimizer-masked-accumulation-ema-decay",
        adam,
        lambda: DynamicScale(**TORCH_ARGS),
        skip_mode="masked",
        accumulation_steps=2,
        ema=(0.5, 3),
        weight_decay=0.01,
    ),
    OptimizerCase(
        "optimizer-host-clip-value-underflow",
        sgd,
        lambda: DynamicScale(**TORCH_ARGS),
        skip_mode="host",
        clip_grad_value=0.5,
        underflow_stride=2,
    ),
    OptimizerCase(
        "optimizer-schedule",
        sgd,
        lambda: DynamicScale(**TORCH_ARGS),
        schedule=True,
        accumulation_steps=2,
        clip_grad_norm=1.0,
    ),
    OptimizerCase("optimizer-layerwise", sgd, lambda: DynamicScale(**TORCH_ARGS), layerwise=True, accumulation_steps=2),
    OptimizerCase(
        "optimizer-predictive",
        adam,
        lambda: PredictiveScale(init_scale=2.0**10, target_interval=10),
        skip_mode="masked",
        accumulation_steps=2,
        regressions=(PREDICTIVE_LOSS_IN_WINDOW,),
    ),
    *preset_cases(),
    AscendCase(),
    MindSporeLoopCase("mindspore-update-cell", manager=False),
    MindSporeLoopCase("mindspore-manager", manager=True),
    TrainCellCase(),
    NnablaCase(),
    KerasCase(
        "keras-accumulation-ema",
        adam,
        regressions=(KERAS_MID_WINDOW,),
        gradient_accumulation_steps=3,
        use_ema=True,
        ema_momentum=0.9,
        ema_overwrite_frequency=2,
    ),
    KerasCase("keras-clipnorm-decay", sgd, clipnorm=1.0, weight_decay=0.01),
    LightningCase("lightning-mixed-precision"),
    LightningCase("lightning-torch-into-ours", first="torch"),
    LightningCase("lightning-ours-into-torch", then="torch"),
    LightningCase("lightning-optimizer-monitor", optimizer=True),
    FabricCase("fabric"),
    FabricCase("fabric-torch-into-ours", first="torch"),
    FabricCase("fabric-ours-into-torch", then="torch"),
    AccelerateCase("accelerate"),
    AccelerateCase("accelerate-torch-into-ours", first="torch"),
    AccelerateCase("accelerate-ours-into-torch", then="torch"),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_a_run_broken_anywhere_resumes_from_its_checkpoint_bit_for_bit(case: Case) -> None:
    @settings(
        max_examples=case.examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(run=runs(case))
    def check(run: Run) -> None:
        check_resume(case, run)

    for regression in case.regressions:
        check = example(run=regression)(check)
    try:
        check()
    finally:
        case.close()
