"""lossscale inside Lightning's ``Trainer``: precision plugins and a monitoring callback.

==============================  ===================================================================
name                            what it is
==============================  ===================================================================
``MixedPrecision``              Lightning's own AMP plugin with :class:`lossscale.GradScaler` (float16)
``LossScalePrecision``          a precision plugin for :class:`lossscale.LossScaleOptimizer`
``LossScaleMonitor``            a callback logging the scale, skipped steps, underflow and diagnosis
==============================  ===================================================================

Both plugins take ``diagnose=True``: when the loss scale collapses, trace the next step of the LightningModule
being trained and warn with a :class:`lossscale.OverflowWarning` naming the module (:mod:`lossscale.diagnosis`).
``MixedPrecision("bf16-mixed", ...)`` runs as Lightning's own: bfloat16 autocast, no scaler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any, Literal, Protocol, cast

import torch

from lossscale.integrations import require

require("lightning.pytorch", "lightning", "lightning")

import lightning.pytorch as pl
from lightning.fabric.utilities.types import Optimizable, Steppable
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision as _LightningMixedPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from lossscale.addons.schedule import PrecisionSchedule
from lossscale.diagnosis.addon import OverflowDiagnosis, validate_diagnose, validate_heal
from lossscale.integrations._scaler import carried, diagnose_later, diagnose_model, make_scaler, scaler_result
from lossscale.keywords import add_ons_from
from lossscale.optimizer import LossScaleOptimizer
from lossscale.reporting import EventFields, ScalerStep, StepResult, read_scalars
from lossscale.scaler import GradScaler

__all__ = ["LossScaleMonitor", "LossScalePrecision", "MixedPrecision"]

_TRAINED = "the LightningModule being trained"


class MixedPrecision(_LightningMixedPrecision):
    """Lightning's AMP plugin driving a :class:`lossscale.GradScaler`: ``Trainer(plugins=[MixedPrecision()])``.

    Adds ``last_result``, the :class:`~lossscale.StepResult` of the last optimizer step, with the gradient
    norm when Lightning clipped by norm (no host read). Its state is saved under Lightning's key
    (``"MixedPrecision"``) in torch's format plus ``policy_state``, so checkpoints resume either way.
    ``"bf16-mixed"`` is Lightning's own path: bfloat16 autocast, ``scaler`` None, ``last_result`` None.

    Args:
        precision: ``"16-mixed"`` (float16 autocast, loss scaling) or ``"bf16-mixed"`` (bfloat16 autocast).
        device: The autocast device type (``"cuda"``, ``"cpu"``, ...).
        scaler: An existing :class:`~lossscale.GradScaler`; or leave it out and pass ``scaler_kwargs``.
        diagnose: True: when the loss scale collapses, trace the LightningModule's next step and warn with a
            :class:`~lossscale.OverflowWarning` (:mod:`lossscale.diagnosis`). Or a module to trace, or an
            :class:`~lossscale.OverflowDiagnosis` (its ``patience``); None or False: no diagnosis.
        heal: True (or ``torch.bfloat16``): with ``diagnose``, a forward overflow keeps the faulting modules in
            float32 (or bfloat16) at once, skips the step without lowering the scale and warns with a
            :class:`~lossscale.HealWarning` (:ref:`healing`); False (default): diagnosis only.
        **scaler_kwargs: Arguments of ``GradScaler`` (``init_scale``, ``growth_interval``, ``policy``, ...).

    Raises:
        ValueError: another precision (Lightning's message), or both ``scaler`` and ``scaler_kwargs``; ``diagnose``
            and a ``scaler`` built with ``diagnose=`` of its own; with ``"bf16-mixed"``, a ``scaler``,
            ``scaler_kwargs`` or a ``diagnose`` that asks for a diagnosis (there is no scale to collapse).
        TypeError: with ``"16-mixed"``, ``device`` is not a string or ``scaler`` not a
            :class:`~lossscale.GradScaler`; ``diagnose`` none of the values above.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed",
        device: str = "cuda",
        scaler: GradScaler | None = None,
        *,
        diagnose: bool | torch.nn.Module | OverflowDiagnosis | None = None,
        heal: bool | torch.dtype = False,
        **scaler_kwargs: Any,
    ) -> None:
        validate_diagnose("MixedPrecision", diagnose, _TRAINED)
        scaler = make_scaler("MixedPrecision", precision, device, scaler, scaler_kwargs, diagnose, heal)  # None: bf16
        self._diagnose_module = scaler is not None and diagnose_later(
            "MixedPrecision", diagnose, _TRAINED, scaler, "GradScaler", heal
        )
        self._heal = heal
        super().__init__(precision, device, scaler=scaler)  # type: ignore[arg-type]  # Lightning types the slot as torch's GradScaler; lossscale's has its surface
        self.last_result: StepResult | None = None
        self._carried: torch.Tensor | None = None
        self._grad_norm: torch.Tensor | None = None

    @property
    def _grad_scaler(self) -> GradScaler | None:
        """``scaler``, the lossscale GradScaler the plugin was built with (Lightning types it as torch's); None under
        ``"bf16-mixed"``."""
        return cast("GradScaler | None", self.scaler)

    @property
    def diagnosis(self) -> OverflowDiagnosis | None:
        """The overflow diagnosis (``diagnose=``'s, or the scaler's own), or None; with ``diagnose=True`` it exists
        once the Trainer connected the plugin to the LightningModule."""
        scaler = self._grad_scaler
        return None if scaler is None else carried(scaler.add_ons)

    def connect(
        self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Lightning's connect; with ``diagnose=True``, the LightningModule becomes the module traced."""
        if self._diagnose_module:
            module = _lightning_module(model, "MixedPrecision.connect")
            diagnose_model("MixedPrecision", cast(GradScaler, self._grad_scaler), module, "being trained", self._heal)
        return super().connect(model, optimizers, lr_schedulers)

    def _after_closure(self, model: pl.LightningModule, optimizer: Steppable) -> None:
        """Lightning's hooks and clipping, then note the scale the gradients carry."""
        self._grad_norm = None
        super()._after_closure(model, optimizer)
        scaler = self._grad_scaler
        self._carried = None if scaler is None else scaler.get_scale_tensor()

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        """Lightning's clip, keeping the norm for ``last_result``."""
        self._grad_norm = torch.nn.utils.clip_grad_norm_(self.main_params(optimizer), clip_val)

    def optimizer_step(  # type: ignore[override]  # Lightning's own signature, which narrows Fabric's
        self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Lightning's step; returns what ``optimizer.step()`` returned."""
        out = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        scaler = self._grad_scaler
        if scaler is None or not isinstance(out, ScalerStep):  # "bf16-mixed", or the closure skipped backward
            return out
        self.last_result = scaler_result(out, self._carried, scaler, model.trainer.global_step, self._grad_norm)
        return out.value


_PRECISIONS: dict[torch.dtype, Literal["16-mixed", "bf16-mixed"]] = {
    torch.float16: "16-mixed",
    torch.bfloat16: "bf16-mixed",
}


def _unwrap(optimizer: object) -> object:
    """The optimizer inside Lightning's ``LightningOptimizer`` proxy (or ``optimizer`` itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _lightning_module(model: torch.nn.Module, call: str = "LossScalePrecision.connect") -> pl.LightningModule:
    """The LightningModule itself, or the one a strategy wrapped (DDP: ``model.module``); ``call`` is for the
    error."""
    found = model
    while not isinstance(found, pl.LightningModule):
        inner = getattr(found, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        found = inner
    if not isinstance(found, pl.LightningModule):
        raise TypeError(
            f"{call}: found no LightningModule in the strategy's model {type(model).__name__}; it serves "
            f"single-device and DDP strategies."
        )
    return found


class LossScalePrecision(Precision):
    """Lightning's precision plugin for a :class:`~lossscale.LossScaleOptimizer` returned from
    ``configure_optimizers``.

    Rule, per optimizer step::

        forward under autocast(device, dtype)            # or the wrapper's PrecisionSchedule at global_step
        wrapper.scale_loss(loss).backward()
        on_before_optimizer_step, configure_gradient_clipping     # gradients still scaled
        last_result = wrapper.step()                     # unscale, check, clip, skip or apply, update the scale

    Clipping: ``gradient_clip_val`` by norm becomes the wrapper's ``clip_grad_norm`` when the wrapper clips
    nothing; the wrapper's own value is accepted; anything else is refused. Accumulation: use
    ``Trainer(accumulate_grad_batches=n)``; a wrapper with ``accumulation_steps > 1`` is refused in automatic
    optimization. ``global_step`` counts skipped steps too. In manual optimization ``manual_backward(loss)``
    needs exactly one LossScaleOptimizer (else call ``opt.backward(loss)``).

    Diagnosis: ``diagnose=True`` traces the LightningModule's next step when the wrapper's scale collapses and warns
    with a :class:`~lossscale.OverflowWarning` (:mod:`lossscale.diagnosis`); the plugin feeds it the losses it scales
    and the wrapper's steps. It needs exactly one LossScaleOptimizer; the same is ``LossScaleOptimizer(...,
    diagnose=self)`` in ``configure_optimizers`` (one per optimizer, and for ``opt.backward(loss)`` in manual
    optimization, which bypasses the plugin).

    Args:
        dtype: The autocast dtype, ``torch.float16`` (default) or ``torch.bfloat16``; with a wrapper's
            schedule, the schedule's low-precision dtype.
        device: The autocast device type (``"cuda"``, ``"cpu"``, ...).
        diagnose: True (the LightningModule), a module to trace, an :class:`~lossscale.OverflowDiagnosis` (its
            ``patience``), or None or False (no diagnosis).
        heal: True (or ``torch.bfloat16``): with ``diagnose``, a forward overflow keeps the faulting modules in
            float32 (or bfloat16) at once, skips the step without lowering the scale and warns with a
            :class:`~lossscale.HealWarning` (:ref:`healing`); False (default): diagnosis only.

    Raises:
        ValueError: another ``dtype``; at ``connect``, wiring that would scale, clip or count wrongly, or
            ``diagnose`` with several LossScaleOptimizers or with a wrapper built with ``diagnose=``.
        TypeError: ``device`` is not a string, or ``diagnose`` none of the values above; at ``connect``, an
            optimizer that is not a LossScaleOptimizer.
        RuntimeError: ``manual_backward(loss)`` with several LossScaleOptimizers.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float16,
        device: str = "cuda",
        *,
        diagnose: bool | torch.nn.Module | OverflowDiagnosis | None = None,
        heal: bool | torch.dtype = False,
    ) -> None:
        if dtype not in _PRECISIONS:
            raise ValueError(
                f"LossScalePrecision(dtype={dtype!r}): dtype must be torch.float16 or torch.bfloat16 "
                f"(the autocast dtype); got {dtype!r}."
            )
        if not isinstance(device, str):
            raise TypeError(
                f"LossScalePrecision(device={device!r}): device must be a device type string such as "
                f"'cuda' or 'cpu'; got {type(device).__name__}."
            )
        self.dtype = dtype
        self.device = device
        self.precision = _PRECISIONS[dtype]
        validate_heal("LossScalePrecision", diagnose, heal, _TRAINED)
        self._diagnose = diagnose
        self._heal = heal
        self.last_result: StepResult | None = None
        self._wrappers: list[LossScaleOptimizer] = []
        self._module: pl.LightningModule | None = None
        self._bound: OverflowDiagnosis | None = None  # the diagnosis diagnose= gave the wrapper

    @property
    def diagnosis(self) -> OverflowDiagnosis | None:
        """The overflow diagnosis (``diagnose=``'s, or the first one a wrapper carries), or None; with
        ``diagnose=True`` it exists once the Trainer connected the plugin to the LightningModule."""
        return next((d for w in self._wrappers if (d := carried(w.add_ons)) is not None), None)

    def connect(
        self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Find the wrappers and refuse wiring that would scale, clip or count wrongly."""
        wrong = [type(o).__name__ for o in optimizers if not isinstance(_unwrap(o), LossScaleOptimizer)]
        if wrong:
            raise TypeError(
                f"LossScalePrecision drives lossscale.LossScaleOptimizer; configure_optimizers returned "
                f"{', '.join(wrong)}. Wrap it: LossScaleOptimizer({wrong[0]}(...)), or use "
                f"lossscale.integrations.lightning.MixedPrecision for a plain optimizer."
            )
        self._wrappers = [cast(LossScaleOptimizer, _unwrap(o)) for o in optimizers]  # each checked just above
        self._module = _lightning_module(model)
        if self._diagnose is not None and self._diagnose is not False:
            if len(self._wrappers) != 1:
                raise ValueError(
                    f"LossScalePrecision(diagnose=...) follows one LossScaleOptimizer's steps; configure_optimizers "
                    f"returned {len(self._wrappers)}. Pass diagnose=self to the LossScaleOptimizer(s) in "
                    f"configure_optimizers instead."
                )
            self._diagnose_wrapper(self._wrappers[0], self._module)
        trainer = self._module.trainer
        if self._module.automatic_optimization:
            self._validate_accumulation(trainer.accumulate_grad_batches)
            if trainer.gradient_clip_val:
                for w in self._wrappers:
                    self._validate_clip(w, trainer.gradient_clip_val, trainer.gradient_clip_algorithm, mapping=True)
        self._check_schedules()
        return model, optimizers, lr_schedulers

    def _diagnose_wrapper(self, wrapper: LossScaleOptimizer, module: pl.LightningModule) -> None:
        """Give the wrapper the diagnosis ``diagnose=`` asks for, once (through the keyword table).

        Raises:
            ValueError: the wrapper carries a diagnosis of its own, or ``diagnose=True``'s traces another module.
        """
        own = carried(wrapper.add_ons)
        if own is not None and own is self._bound:
            if self._diagnose is True and own.model is not module:
                raise ValueError(
                    f"LossScalePrecision(diagnose=True) traces the one LightningModule being trained, and another one "
                    f"({type(module).__name__}) came after {type(own.model).__name__}; pass the module to trace: "
                    f"LossScalePrecision(..., diagnose=model)."
                )
            return
        if own is not None:
            raise ValueError(
                "LossScalePrecision(diagnose=...) and a LossScaleOptimizer built with diagnose= of its own: give the "
                "diagnosis once, in one of the two; got both."
            )
        wrapper.attach_add_ons(
            add_ons_from("LossScalePrecision", diagnose=self._diagnose, heal=self._heal, model=module)
        )
        self._bound = carried(wrapper.add_ons)

    def _validate_accumulation(self, accumulate_grad_batches: int) -> None:
        for w in self._wrappers:
            if w.accumulation_steps > 1:
                raise ValueError(
                    f"LossScalePrecision: LossScaleOptimizer(accumulation_steps={w.accumulation_steps}) "
                    f"with Trainer(accumulate_grad_batches={accumulate_grad_batches}): in automatic "
                    f"optimization Lightning counts every step() call as a step, so accumulate with "
                    f"Trainer(accumulate_grad_batches=n) and leave the wrapper's accumulation_steps=1."
                )

    @staticmethod
    def _validate_clip(
        w: LossScaleOptimizer, value: int | float, algorithm: GradClipAlgorithmType | str | None, mapping: bool = False
    ) -> None:
        algorithm = GradClipAlgorithmType(algorithm or "norm")
        own = {"clip_grad_norm": w.clip_grad_norm, "clip_grad_value": w.clip_grad_value}
        wanted = "clip_grad_norm" if algorithm == GradClipAlgorithmType.NORM else "clip_grad_value"
        if own[wanted] == value:
            return
        if mapping and wanted == "clip_grad_norm" and not any(v is not None for v in own.values()):
            w.configure(clip_grad_norm=float(value))  # the wrapper's fused global-norm clip, after unscaling
            return
        have = ", ".join(f"{k}={v!r}" for k, v in own.items() if v is not None) or "no clipping"
        raise ValueError(
            f"LossScalePrecision: gradient clipping (gradient_clip_val={value!r}, "
            f"gradient_clip_algorithm={algorithm.value!r}) must run inside the wrapper, after "
            f"unscaling, and the LossScaleOptimizer has {have}. Build it with "
            f"LossScaleOptimizer(..., {wanted}={value!r}) and use the same value here, or leave "
            f"Lightning's clipping off."
        )

    def _schedules(self) -> list[PrecisionSchedule]:
        """The wrappers' precision schedules (add-ons), one entry per wrapper that has one."""
        return [a for w in self._wrappers for a in w.add_ons if isinstance(a, PrecisionSchedule)]

    def _check_schedules(self) -> None:
        schedules = {id(s): s for s in self._schedules()}
        if len(schedules) > 1:
            raise ValueError(
                f"LossScalePrecision: the optimizers carry {len(schedules)} different "
                f"PrecisionSchedules, but one forward pass has one autocast; share one schedule."
            )
        for schedule in schedules.values():
            if schedule.config.low_dtype != self.dtype:
                raise ValueError(
                    f"LossScalePrecision(dtype={self.dtype!r}) with {schedule!r}, whose low precision "
                    f"is {schedule.config.low_dtype!r}: pass LossScalePrecision(dtype="
                    f"{schedule.config.low_dtype!r})."
                )

    def _wrapper(self, optimizer: Steppable | None, call: str) -> LossScaleOptimizer:
        if optimizer is not None:
            wrapper = _unwrap(optimizer)
            if not isinstance(wrapper, LossScaleOptimizer):
                raise TypeError(
                    f"LossScalePrecision.{call}: the optimizer is {type(wrapper).__name__}, not a "
                    f"LossScaleOptimizer; return LossScaleOptimizer(...) from configure_optimizers."
                )
            return wrapper
        if len(self._wrappers) != 1:
            raise RuntimeError(
                f"LossScalePrecision.{call}: manual_backward(loss) cannot tell which of the "
                f"{len(self._wrappers)} LossScaleOptimizers scales this loss; call "
                f"opt.backward(loss) on the right one instead."
            )
        return self._wrappers[0]

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Autocast to ``dtype``; with a schedule, the schedule's autocast at ``trainer.global_step``."""
        schedule = next(iter(self._schedules()), None)
        if schedule is None:
            with torch.autocast(self.device, dtype=self.dtype):
                yield
            return
        if self._module is not None and self._module.trainer.training:
            schedule.update(step=self._module.trainer.global_step)
        with schedule.autocast(self.device):
            yield

    def backward(  # type: ignore[override]  # Lightning's own signature, which narrows Fabric's
        self, tensor: torch.Tensor, model: pl.LightningModule, optimizer: Steppable | None, *args: Any, **kwargs: Any
    ) -> None:
        model.backward(self._wrapper(optimizer, "backward").scale_loss(tensor), *args, **kwargs)

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Lightning's clipping request: the wrapper clips in its step, so the value must be the wrapper's."""
        if clip_val and clip_val > 0:
            self._validate_clip(self._wrapper(optimizer, "clip_gradients"), clip_val, gradient_clip_algorithm)

    def optimizer_step(  # type: ignore[override]  # Lightning's own signature, which narrows Fabric's
        self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> StepResult | None:
        """Run Lightning's closure, then its after-closure hooks, then ``wrapper.step()``; return the StepResult."""
        wrapper = self._wrapper(optimizer, "optimizer_step")
        if kwargs:
            raise TypeError(
                f"LossScalePrecision.optimizer_step: LossScaleOptimizer.step() takes no arguments; "
                f"got {sorted(kwargs)}."
            )
        closure_result = closure()
        self._after_closure(model, optimizer)
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: nothing to step
        self.last_result = wrapper.step()
        return self.last_result


class _ReportsSteps(Protocol):
    """A precision plugin that reports its steps (this module's two)."""

    last_result: StepResult | None


class LossScaleMonitor(Callback):
    """Logs ``<prefix>/scale``, ``<prefix>/skipped_steps`` and ``<prefix>/underflow`` to the Trainer's loggers,
    read from the lossscale precision plugin's ``last_result``, and the overflow diagnosis's findings.

    Rule, after each optimizer step::

        skipped_steps += result.skipped          # on the device
        if Lightning logs at this step:          # one host read for all values
            log(scale=result.scale, skipped_steps, underflow=result.underflow if measured)
            if the plugin's diagnosis made a report since the last log:     # no host read
                log(overflow_kind=report.kind, overflow_module=report.module)   # text; module left out if None

    The diagnosis's values are strings, which Lightning's ``self.log`` refuses: they go to each logger's
    ``log_metrics`` (CSVLogger, WandbLogger and others take them; MLFlowLogger drops strings with a warning),
    except a TensorBoardLogger, which gets them through ``add_text``. ``skipped_steps`` is saved in the
    callback's checkpoint state. Under ``MixedPrecision("bf16-mixed", ...)`` there is no scale: the plugin reports no
    step and the callback logs nothing.

    Args:
        prefix: The metric-name prefix (default ``"lossscale"``).

    Raises:
        ValueError: ``prefix`` is not a non-empty string.
        RuntimeError: at ``setup``, a Trainer without a logger.
        TypeError: at ``setup``, a Trainer whose precision plugin does not report its steps.
    """

    def __init__(self, prefix: str = "lossscale") -> None:
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"LossScaleMonitor(prefix={prefix!r}): prefix must be a non-empty string; got {prefix!r}.")
        self.prefix = prefix
        self._skipped: torch.Tensor | int = 0
        self._faults: torch.Tensor | int = 0  # forward faults, where the plugin finds them (heal=)
        self._seen: StepResult | None = None
        self._events = EventFields()  # the fields the steps' add-ons added, kept until Lightning logs

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not trainer.loggers:
            raise RuntimeError(
                "LossScaleMonitor: the Trainer has no logger (logger=False); give it one, e.g. "
                "Trainer(logger=CSVLogger('logs')), or drop the callback."
            )
        plugin = trainer.precision_plugin
        if not hasattr(plugin, "last_result"):
            raise TypeError(
                f"LossScaleMonitor: the Trainer's precision plugin is "
                f"{type(plugin).__module__}.{type(plugin).__qualname__}, which does not report its "
                f"steps; use lossscale.integrations.lightning.MixedPrecision or LossScalePrecision "
                f"in Trainer(plugins=[...])."
            )

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        """Count a new step's skip on the device; read and log only when Lightning logs."""
        result = cast(_ReportsSteps, trainer.precision_plugin).last_result  # setup() checked it has last_result
        if result is None or result is self._seen:
            return
        self._seen = result
        self._skipped = result.skipped.to(torch.int64) + self._skipped
        if result.forward_fault is not None:
            self._faults = result.forward_fault.to(torch.int64) + self._faults
        self._events.add(result.fields)
        if not trainer._logger_connector.should_update_logs:  # Lightning's cadence, as in LearningRateMonitor
            return
        values: dict[str, torch.Tensor | int] = {"scale": result.scale, "skipped_steps": self._skipped}
        if result.forward_fault is not None:
            values["forward_faults"] = self._faults
        if result.underflow is not None:
            values["underflow"] = result.underflow
        metrics: dict[str, Any] = {f"{self.prefix}/{k}": v for k, v in read_scalars(values).items()}
        found = self._events.take()
        text: dict[str, Any] = {f"{self.prefix}/{k}": v for k, v in found.items() if isinstance(v, str)}
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):  # its log_metrics takes numbers only
                logger.log_metrics(metrics, step=step)
                for tag, value in text.items():
                    logger.experiment.add_text(tag, value, global_step=step)
            else:  # typed as numbers, the other loggers' log_metrics write strings too (MLflow's drops them)
                logger.log_metrics({**metrics, **text}, step=step)

    def state_dict(self) -> dict[str, Any]:
        """The running count of skipped steps, and of forward faults where the plugin finds them (one host read)."""
        state: dict[str, Any] = {"skipped_steps": int(self._skipped)}
        if self._seen is not None and self._seen.forward_fault is not None:  # the plugin finds them (heal=)
            state["forward_faults"] = int(self._faults)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._skipped = int(state_dict["skipped_steps"])
        self._faults = int(state_dict.get("forward_faults", 0))
