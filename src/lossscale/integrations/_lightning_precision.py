"""LossScalePrecision: a Lightning precision plugin for :class:`~lossscale.LossScaleOptimizer`."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from lossscale.optimizer import LossScaleOptimizer
from lossscale.result import StepResult

__all__ = ["LossScalePrecision"]

_PRECISIONS = {torch.float16: "16-mixed", torch.bfloat16: "bf16-mixed"}


def _unwrap(optimizer: Any) -> Any:
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
