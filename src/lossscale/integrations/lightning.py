"""lossscale inside Lightning's ``Trainer``: precision plugins and a monitoring callback.

==============================  ===================================================================
name                            what it is
==============================  ===================================================================
``MixedPrecision``              Lightning's own float16 AMP plugin with :class:`lossscale.GradScaler`
``LossScalePrecision``          a precision plugin for :class:`lossscale.LossScaleOptimizer`
``LossScaleMonitor``            a callback logging the scale, skipped steps and underflow
==============================  ===================================================================

Install with ``pip install 'lossscale[lightning]'``; see docs/integrations.md. Without Lightning,
importing this module raises an ImportError that names that extra.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, Callable

import torch

from lossscale.integrations import require

require("lightning.pytorch", "lightning", "lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision as _LightningMixedPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import Precision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

from lossscale.integrations._scaler import make_scaler, scaler_result  # noqa: E402
from lossscale.optimizer import LossScaleOptimizer  # noqa: E402
from lossscale.reporting import ScalerStep, StepResult, read_scalars  # noqa: E402
from lossscale.scaler import GradScaler  # noqa: E402

__all__ = ["LossScaleMonitor", "LossScalePrecision", "MixedPrecision"]


# --- MixedPrecision: Lightning's AMP plugin with lossscale's GradScaler -------------------------------------


class MixedPrecision(_LightningMixedPrecision):
    """Lightning's float16 AMP plugin driving a :class:`lossscale.GradScaler`; use it alone in ``plugins=``.

    Usage::

        from lossscale.integrations.lightning import MixedPrecision
        trainer = Trainer(plugins=[MixedPrecision("16-mixed", "cuda", growth_interval=1000)])

    Everything is Lightning's plugin (autocast, ``scaler.scale(loss)`` in backward, unscale before
    ``on_before_optimizer_step`` and clipping, ``scaler.step`` + ``update``); with torch's scaler
    arguments the scale trajectory and weights equal Lightning's plugin with ``torch.amp.GradScaler``,
    bit for bit. Added: ``last_result``, the :class:`~lossscale.StepResult` of the last optimizer step
    (skipped or not, scale before and after, and the gradient norm when Lightning clipped by norm),
    built without a host read.

    Checkpoints: the class keeps Lightning's name, so its state is saved under the same key
    (``"MixedPrecision"``) in torch's format plus ``policy_state``; a checkpoint written with
    Lightning's plugin and torch's scaler resumes here, and one written here resumes there.

    Args:
        precision: ``"16-mixed"`` (the only precision that uses a scaler).
        device: The autocast device type (``"cuda"``, ``"cpu"``, ...).
        scaler: An existing :class:`~lossscale.GradScaler`; or leave it out and pass ``scaler_kwargs``.
        **scaler_kwargs: Arguments of ``GradScaler`` (``init_scale``, ``growth_interval``, ``policy``, ...).

    Raises:
        ValueError: a precision other than ``"16-mixed"``, or both ``scaler`` and ``scaler_kwargs``.
        TypeError: ``device`` is not a string, or ``scaler`` not a :class:`~lossscale.GradScaler`.
    """

    def __init__(self, precision: str = "16-mixed", device: str = "cuda", scaler: GradScaler | None = None,
                 **scaler_kwargs: Any) -> None:
        scaler = make_scaler("MixedPrecision", precision, device, scaler, scaler_kwargs)
        super().__init__(precision, device, scaler=scaler)  # type: ignore[arg-type]
        self.last_result: StepResult | None = None
        self._carried: torch.Tensor | None = None
        self._grad_norm: torch.Tensor | None = None

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        """After backward and unscale: hooks and clipping (Lightning's), then note the scale the gradients carry."""
        self._grad_norm = None
        super()._after_closure(model, optimizer)
        self._carried = self.scaler.get_scale_tensor()

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        """Lightning's clip (``torch.nn.utils.clip_grad_norm_``), keeping the norm for ``last_result``."""
        self._grad_norm = torch.nn.utils.clip_grad_norm_(self.main_params(optimizer), clip_val)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Lightning's step; returns what ``optimizer.step()`` returned (as with torch's scaler) and records
        the decision in ``last_result``."""
        out = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if not isinstance(out, ScalerStep):  # no step: the closure skipped backward
            return out
        self.last_result = scaler_result(out, self._carried, self.scaler, model.trainer.global_step, self._grad_norm)
        return out.value


# --- LossScalePrecision: a precision plugin for LossScaleOptimizer -------------------------------------------

_PRECISIONS = {torch.float16: "16-mixed", torch.bfloat16: "bf16-mixed"}


def _unwrap(optimizer: Any) -> Any:
    """The optimizer inside Lightning's ``LightningOptimizer`` proxy (or ``optimizer`` itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _lightning_module(model: Any) -> pl.LightningModule:
    """The LightningModule itself, or the one a strategy wrapped (DDP: ``model.module``)."""
    found = model
    while not isinstance(found, pl.LightningModule) and isinstance(getattr(found, "module", None), torch.nn.Module):
        found = found.module
    if not isinstance(found, pl.LightningModule):
        raise TypeError(f"LossScalePrecision.connect: found no LightningModule in the strategy's model "
                        f"{type(model).__name__}; LossScalePrecision serves single-device and DDP strategies.")
    return found


class LossScalePrecision(Precision):
    """Lightning's precision slot driving :class:`~lossscale.LossScaleOptimizer`, returned from
    ``configure_optimizers`` as in a plain loop.

    Usage::

        def configure_optimizers(self):
            return LossScaleOptimizer(torch.optim.AdamW(self.parameters(), fused=True))
        trainer = Trainer(plugins=[LossScalePrecision(torch.float16, "cuda")], accumulate_grad_batches=4,
                          gradient_clip_val=1.0)

    Rule, per optimizer step (Lightning's order)::

        forward under autocast(device, dtype)       # or the wrapper's PrecisionSchedule, fed trainer.global_step
        backward: wrapper.scale_loss(loss).backward()      # Lightning has divided by accumulate_grad_batches
        on_before_optimizer_step, configure_gradient_clipping   # the gradients are still SCALED here
        last_result = wrapper.step()               # unscale + check + clip + skip/apply + policy, one pass

    Lightning keeps counting ``global_step`` (attempted steps, skipped ones included, as with torch's
    scaler), stepping LR schedulers and checkpointing (the wrapper's state is in the optimizer's).
    ``last_result`` is the last :class:`~lossscale.StepResult`; in manual optimization ``opt.step()``
    returns it too.

    Clipping: ``gradient_clip_val`` with the ``"norm"`` algorithm becomes the wrapper's fused global-norm
    clip (``clip_grad_norm``) when the wrapper has none; the same value is accepted; anything else
    (another value, another kind, ``"value"`` without the wrapper's ``clip_grad_value``) is refused:
    Lightning would clip the scaled gradients. Use ``last_result.grad_norm`` rather than the gradients in
    ``on_before_optimizer_step``, which are still scaled there.

    Accumulation: use ``Trainer(accumulate_grad_batches=n)``; a wrapper with ``accumulation_steps > 1`` is
    refused in automatic optimization (Lightning would count its micro-batches as steps). In manual
    optimization the wrapper's ``accumulation_steps`` is the way, and ``self.manual_backward(loss)``
    scales with the one ``LossScaleOptimizer`` the Trainer holds.

    Args:
        dtype: The autocast dtype, ``torch.float16`` (default) or ``torch.bfloat16``; with a wrapper's
            schedule it must be the schedule's low-precision dtype.
        device: The autocast device type (``"cuda"``, ``"cpu"``, ...).

    Raises:
        ValueError: another ``dtype``; at ``connect``, wiring that would scale, clip or count wrongly.
        TypeError: ``device`` is not a string; at ``connect``, an optimizer that is not a LossScaleOptimizer.
    """

    def __init__(self, dtype: torch.dtype = torch.float16, device: str = "cuda") -> None:
        if dtype not in _PRECISIONS:
            raise ValueError(f"LossScalePrecision(dtype={dtype!r}): dtype must be torch.float16 or torch.bfloat16 "
                             f"(the autocast dtype); got {dtype!r}.")
        if not isinstance(device, str):
            raise TypeError(f"LossScalePrecision(device={device!r}): device must be a device type string such as "
                            f"'cuda' or 'cpu'; got {type(device).__name__}.")
        self.dtype = dtype
        self.device = device
        self.precision = _PRECISIONS[dtype]  # type: ignore[assignment]
        self.last_result: StepResult | None = None
        self._wrappers: list[LossScaleOptimizer] = []
        self._module: pl.LightningModule | None = None

    # --- set-up: check the wiring once ---------------------------------------------------------------

    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[Any, list[Any], list[Any]]:
        """Find the wrappers and refuse wiring that would scale, clip or count wrongly."""
        wrong = [type(o).__name__ for o in optimizers if not isinstance(_unwrap(o), LossScaleOptimizer)]
        if wrong:
            raise TypeError(f"LossScalePrecision drives lossscale.LossScaleOptimizer; configure_optimizers returned "
                            f"{', '.join(wrong)}. Wrap it: LossScaleOptimizer({wrong[0]}(...)), or use "
                            f"lossscale.integrations.lightning.MixedPrecision for a plain optimizer.")
        self._wrappers = [_unwrap(o) for o in optimizers]
        self._module = _lightning_module(model)
        trainer = self._module.trainer
        if self._module.automatic_optimization:
            self._check_accumulation(trainer.accumulate_grad_batches)
            self._map_clip(trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        self._check_schedules()
        return model, optimizers, lr_schedulers

    def _check_accumulation(self, accumulate_grad_batches: int) -> None:
        for w in self._wrappers:
            if w.accumulation_steps > 1:
                raise ValueError(f"LossScalePrecision: LossScaleOptimizer(accumulation_steps={w.accumulation_steps}) "
                                 f"with Trainer(accumulate_grad_batches={accumulate_grad_batches}): in automatic "
                                 f"optimization Lightning counts every step() call as a step, so accumulate with "
                                 f"Trainer(accumulate_grad_batches=n) and leave the wrapper's accumulation_steps=1.")

    def _map_clip(self, value: int | float | None, algorithm: Any) -> None:
        if not value:
            return
        for w in self._wrappers:
            self._check_clip(w, value, algorithm, mapping=True)

    @staticmethod
    def _check_clip(w: LossScaleOptimizer, value: int | float, algorithm: Any, mapping: bool = False) -> None:
        algorithm = GradClipAlgorithmType(algorithm or "norm")
        own = {"clip_grad_norm": w.clip_grad_norm, "clip_grad_value": w.clip_grad_value,
               "transform_unscaled": w.transform_unscaled}
        wanted = "clip_grad_norm" if algorithm == GradClipAlgorithmType.NORM else "clip_grad_value"
        if own[wanted] == value:
            return
        if mapping and wanted == "clip_grad_norm" and not any(v is not None for v in own.values()):
            w.configure(clip_grad_norm=float(value))  # the wrapper's fused global-norm clip, after unscaling
            return
        have = ", ".join(f"{k}={v!r}" for k, v in own.items() if v is not None) or "no clipping"
        raise ValueError(f"LossScalePrecision: gradient clipping (gradient_clip_val={value!r}, "
                         f"gradient_clip_algorithm={algorithm.value!r}) must run inside the wrapper, after "
                         f"unscaling, and the LossScaleOptimizer has {have}. Build it with "
                         f"LossScaleOptimizer(..., {wanted}={value!r}) and use the same value here, or leave "
                         f"Lightning's clipping off.")

    def _check_schedules(self) -> None:
        schedules = {id(w.schedule): w.schedule for w in self._wrappers if w.schedule is not None}
        if len(schedules) > 1:
            raise ValueError(f"LossScalePrecision: the optimizers carry {len(schedules)} different "
                             f"PrecisionSchedules, but one forward pass has one autocast; share one schedule.")
        for schedule in schedules.values():
            if schedule.config.low_dtype != self.dtype:
                raise ValueError(f"LossScalePrecision(dtype={self.dtype!r}) with {schedule!r}, whose low precision "
                                 f"is {schedule.config.low_dtype!r}: pass LossScalePrecision(dtype="
                                 f"{schedule.config.low_dtype!r}).")

    def _wrapper(self, optimizer: Any, call: str) -> LossScaleOptimizer:
        if optimizer is not None:
            wrapper = _unwrap(optimizer)
            if not isinstance(wrapper, LossScaleOptimizer):
                raise TypeError(f"LossScalePrecision.{call}: the optimizer is {type(wrapper).__name__}, not a "
                                f"LossScaleOptimizer; return LossScaleOptimizer(...) from configure_optimizers.")
            return wrapper
        if len(self._wrappers) != 1:
            raise RuntimeError(f"LossScalePrecision.{call}: manual_backward(loss) cannot tell which of the "
                               f"{len(self._wrappers)} LossScaleOptimizers scales this loss; call "
                               f"opt.backward(loss) on the right one instead.")
        return self._wrappers[0]

    # --- the step --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Autocast to ``dtype``; with a schedule, the schedule's autocast at ``trainer.global_step``."""
        schedule = next((w.schedule for w in self._wrappers if w.schedule is not None), None)
        if schedule is None:
            with torch.autocast(self.device, dtype=self.dtype):
                yield
            return
        if self._module is not None and self._module.trainer.training:
            schedule.update(step=self._module.trainer.global_step)
        with schedule.autocast(self.device):
            yield

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """``model.backward(wrapper.scale_loss(loss))``: the loss times the wrapper's scale."""
        model.backward(self._wrapper(optimizer, "backward").scale_loss(tensor), *args, **kwargs)

    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """Lightning's clipping request: the wrapper clips in its step, so the value must be the wrapper's."""
        if clip_val and clip_val > 0:
            self._check_clip(self._wrapper(optimizer, "clip_gradients"), clip_val, gradient_clip_algorithm)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run Lightning's closure, then its after-closure hooks, then ``wrapper.step()``; return the StepResult."""
        wrapper = self._wrapper(optimizer, "optimizer_step")
        if kwargs:
            raise TypeError(f"LossScalePrecision.optimizer_step: LossScaleOptimizer.step() takes no arguments; "
                            f"got {sorted(kwargs)}.")
        closure_result = closure()
        self._after_closure(model, optimizer)
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: no backward, nothing to step (Lightning's AMP rule)
        self.last_result = wrapper.step()
        return self.last_result


# --- LossScaleMonitor: a callback logging the scale ----------------------------------------------------------


class LossScaleMonitor(Callback):
    """Logs ``<prefix>/scale``, ``<prefix>/skipped_steps`` and ``<prefix>/underflow`` to the Trainer's loggers.

    In the style of Lightning's ``LearningRateMonitor``: values go to ``logger.log_metrics`` at
    Lightning's logging cadence (``Trainer(log_every_n_steps=...)``), at the step Lightning logs its own
    metrics under. Works with the lossscale precision plugins, whose ``last_result`` it reads.

    Rule, after each optimizer step (a new ``last_result``)::

        skipped_steps += result.skipped          # on the device: no host read
        if Lightning logs at this step:          # one host read for all values
            log(scale=result.scale, skipped_steps, underflow=result.underflow if measured)

    ``scale`` is the scale the step's gradients carried (as :class:`~lossscale.StepLogger` writes it);
    ``underflow`` appears when the plugin measures it (``LossScaleOptimizer(underflow_stride=n)``).
    The running count is saved in the callback's checkpoint state (one host read at save).

    Args:
        prefix: The metric-name prefix (default ``"lossscale"``).

    Raises:
        ValueError: ``prefix`` is not a non-empty string.
        RuntimeError: at ``setup``, a Trainer without a logger.
        TypeError: at ``setup``, a Trainer whose precision plugin does not report its steps.
    """

    def __init__(self, prefix: str = "lossscale") -> None:
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"LossScaleMonitor(prefix={prefix!r}): prefix must be a non-empty string; "
                             f"got {prefix!r}.")
        self.prefix = prefix
        self._skipped: torch.Tensor | int = 0
        self._seen: StepResult | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a Trainer without a logger or without a lossscale precision plugin."""
        if not trainer.loggers:
            raise RuntimeError("LossScaleMonitor: the Trainer has no logger (logger=False); give it one, e.g. "
                               "Trainer(logger=CSVLogger('logs')), or drop the callback.")
        plugin = trainer.precision_plugin
        if not hasattr(plugin, "last_result"):
            raise TypeError(f"LossScaleMonitor: the Trainer's precision plugin is "
                            f"{type(plugin).__module__}.{type(plugin).__qualname__}, which does not report its "
                            f"steps; use lossscale.integrations.lightning.MixedPrecision or LossScalePrecision "
                            f"in Trainer(plugins=[...]).")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        """Count a new step's skip on the device; read and log only when Lightning logs."""
        result = trainer.precision_plugin.last_result
        if result is None or result is self._seen:
            return
        self._seen = result
        self._skipped = result.skipped.to(torch.int64) + self._skipped
        if not trainer._logger_connector.should_update_logs:  # Lightning's own cadence (LearningRateMonitor's)
            return
        values: dict[str, Any] = {"scale": result.scale, "skipped_steps": self._skipped}
        if result.underflow is not None:
            values["underflow"] = result.underflow
        metrics = {f"{self.prefix}/{k}": v for k, v in read_scalars(values).items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.fit_loop.epoch_loop._batches_that_stepped)

    def state_dict(self) -> dict[str, Any]:
        """The running count of skipped steps (a host read)."""
        return {"skipped_steps": int(self._skipped)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the count from a checkpoint."""
        self._skipped = int(state_dict["skipped_steps"])
