"""Ascend (npu_bridge) loss scaling for PyTorch: the TF1 managers, ``NPULossScaleOptimizer`` and the
precision mode. The rule is :func:`lossscale.presets.ascend`.

+------------------------------------------------------+---------------------------------------------------------------+
| Ascend / TF1 (npu_bridge)                            | lossscale                                                     |
+======================================================+===============================================================+
| ``ExponentialUpdateLossScaleManager(init_loss_scale, | ``presets.ascend(...)``: ``DynamicScale`` with                |
| incr_every_n_steps, decr_every_n_nan_or_inf=2,       | ``growth_interval=incr_every_n_steps``, cumulative            |
| incr_ratio=2, decr_ratio=0.8)``                      | ``hysteresis=decr_every_n_nan_or_inf``, floor 1, float32      |
|                                                      | products, no growth into inf                                  |
+------------------------------------------------------+---------------------------------------------------------------+
| ``FixedLossScaleManager(loss_scale)`` (>= 1)         | ``FixedScale(loss_scale)``                                    |
+------------------------------------------------------+---------------------------------------------------------------+
| ``manager.get_loss_scale()`` (a float32 variable)    | the 0-d float32 scale tensor (no host read)                   |
+------------------------------------------------------+---------------------------------------------------------------+
| ``manager.update_loss_scale(finite_grads)``          | ``LossScale.update(~finite_grads)`` (no host read); an NPU    |
|                                                      | float status (0 = finite) is accepted too                     |
+------------------------------------------------------+---------------------------------------------------------------+
| ``NPULossScaleOptimizer(opt, loss_scale_manager,     | ``LossScaleOptimizer(opt, policy=manager.loss_scale)``        |
| is_distributed=False)``                              |                                                               |
+------------------------------------------------------+---------------------------------------------------------------+
| ``compute_gradients(loss)``,                         | ``opt.backward(loss)``, ``opt.step()``                        |
| ``apply_gradients(...)``                             |                                                               |
+------------------------------------------------------+---------------------------------------------------------------+
| ``is_distributed=True``: float status all-reduced    | found_inf reduced over the torch.distributed world            |
| (HCCL)                                               |                                                               |
+------------------------------------------------------+---------------------------------------------------------------+
| NPU Inf/NaN mode, saturation mode (clamped to        | ``overflow_mode="inf_nan"`` (default), ``"saturation"``       |
| +-65504)                                             |                                                               |
+------------------------------------------------------+---------------------------------------------------------------+

The precision mode becomes a :class:`~lossscale.PrecisionSchedule`: ``config.schedule(hook)`` builds it and
binds the hook, which the loop calls once per step.

+---------------------------------------------------------------+------------------------------------------------------+
| Ascend (TF adapter)                                           | lossscale                                            |
+===============================================================+======================================================+
| ``ExperimentalConfig(accelerate_train_mode="fast|step|0.9")`` | same; checked like PrecisionSchedule                 |
+---------------------------------------------------------------+------------------------------------------------------+
| ``TellMeStepOrLossHook(step=global_step, total_step=N)``      | ``TellMeStepOrLossHook(step=0, total_step=N)``; each |
|                                                               | step ``hook(step=steps_completed)``                  |
+---------------------------------------------------------------+------------------------------------------------------+
| ``TellMeStepOrLossHook(loss=loss, final_loss=L)``             | ``TellMeStepOrLossHook(final_loss=L)``; each step    |
|                                                               | ``hook(loss=loss)``                                  |
+---------------------------------------------------------------+------------------------------------------------------+
| ``NPURunConfig(experimental_config=cfg)`` + ``hooks=[hook]``  | ``LossScaleOptimizer(...,                            |
|                                                               | schedule=cfg.schedule(hook))`` and ``with            |
|                                                               | schedule.autocast(device):`` around forward          |
+---------------------------------------------------------------+------------------------------------------------------+
| type ``fast`` / ``fast1``                                     | autocast to float16 (scaled) / bfloat16 (not scaled) |
+---------------------------------------------------------------+------------------------------------------------------+
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lossscale import presets
from lossscale.addons.schedule import PrecisionSchedule, parse_mode
from lossscale.compat._common import LossScaleHolder
from lossscale.ops.overflow import OverflowMode, validate_mode
from lossscale.optimizer import LossScaleOptimizer
from lossscale.policies.base import FixedScale
from lossscale.validation import FLOAT32_MAX, validate_choice, validate_int_at_least, validate_optimizer, validate_scale

__all__ = [
    "ExponentialUpdateLossScaleManager",
    "FixedLossScaleManager",
    "NPULossScaleOptimizer",
    "ExperimentalConfig",
    "TellMeStepOrLossHook",
]


def overflow_from_finite_grads(finite_grads: bool | torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The overflow flag of one step's ``finite_grads``: a bool, a bool tensor (True: all finite) or an NPU float
    status (0: no overflow; anything else, NaN included: overflow). One value, or one per entry of a batched scale."""
    call = f"update_loss_scale(finite_grads={finite_grads!r})"
    device = scale.device
    if isinstance(finite_grads, bool):
        return torch.tensor(not finite_grads, device=device)
    if not isinstance(finite_grads, torch.Tensor) or not (
        finite_grads.dtype == torch.bool or finite_grads.is_floating_point()
    ):
        kind = type(finite_grads).__name__ if not isinstance(finite_grads, torch.Tensor) else finite_grads.dtype
        raise TypeError(
            f"{call}: finite_grads must be a bool, a bool tensor (True when every gradient is finite) "
            f"or a floating NPU float status tensor (0 when nothing overflowed); got {kind}."
        )
    if finite_grads.numel() == 1:
        flag = finite_grads.reshape(scale.shape if scale.numel() == 1 else ()).to(device)
    elif finite_grads.shape == scale.shape:
        flag = finite_grads.to(device)
    else:
        raise ValueError(
            f"{call}: finite_grads must hold one value (one step's verdict for all gradients); got "
            f"shape {tuple(finite_grads.shape)}. Reduce it first, e.g. finite_grads.all()."
        )
    return ~flag if flag.dtype == torch.bool else flag != 0


class _LossScaleManager(LossScaleHolder):
    """A :class:`~lossscale.LossScale` with TF1's method names, shared with the optimizer built on it."""

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale: a 0-d float32 tensor (no host read)."""
        return self.loss_scale.scale

    def update_loss_scale(self, finite_grads: bool | torch.Tensor) -> None:
        """Update the rule with one step's ``finite_grads`` (True: no overflow). No host read."""
        self.loss_scale.update(overflow_from_finite_grads(finite_grads, self.loss_scale.scale))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.policy!r})"


class ExponentialUpdateLossScaleManager(_LossScaleManager):
    """TF1's dynamic manager, :func:`lossscale.presets.ascend`.

    Args:
        init_loss_scale: The first loss scale (required, as in npu_bridge); a number in [1, 3.4e38].
        incr_every_n_steps: An int >= 1 (required): the scale grows after this many steps in a row with finite
            gradients.
        decr_every_n_nan_or_inf: An int >= 1, default 2: the steps with non-finite gradients that make a backoff,
            counted since the scale last grew or backed off (a finite step between them keeps the count).
        incr_ratio: > 1, default 2: a growth multiplies the scale by it, only while the scale is below
            ``3.4e38 / incr_ratio``.
        decr_ratio: In (0, 1), default 0.8: a backoff multiplies the scale by it (in float32), down to 1.

    Example:
        >>> m = ExponentialUpdateLossScaleManager(init_loss_scale=1024, incr_every_n_steps=2)
        >>> for finite in [False, True, False]:
        ...     m.update_loss_scale(finite)
        >>> float(m.get_loss_scale())   # the second non-finite step backs off: 1024 * 0.8
        819.2000122070312
    """

    def __init__(
        self,
        init_loss_scale: float,
        incr_every_n_steps: int,
        decr_every_n_nan_or_inf: int = 2,
        incr_ratio: float = 2,
        decr_ratio: float = 0.8,
    ) -> None:
        super().__init__(
            presets.ascend(
                init_loss_scale,
                incr_every_n_steps,
                decr_every_n_nan_or_inf,
                incr_ratio,
                decr_ratio,
                call="ExponentialUpdateLossScaleManager",
            )
        )


class FixedLossScaleManager(_LossScaleManager):
    """A constant loss scale (>= 1); the optimizer still skips overflowing steps.

    Args:
        loss_scale: The loss scale, a number in [1, float32's largest finite value], as npu_bridge's
            ``FixedLossScaleManager(loss_scale)`` takes it.

    Example:
        >>> float(FixedLossScaleManager(128).get_loss_scale())
        128.0
    """

    def __init__(self, loss_scale: float) -> None:
        validate_scale("FixedLossScaleManager", "loss_scale", loss_scale, low=1.0, high=FLOAT32_MAX)
        super().__init__(FixedScale(float(loss_scale)))


class NPULossScaleOptimizer(LossScaleOptimizer):
    """The core :class:`~lossscale.LossScaleOptimizer` on an Ascend manager's LossScale.

    Args:
        opt: The torch optimizer to wrap.
        loss_scale_manager: An :class:`ExponentialUpdateLossScaleManager` or :class:`FixedLossScaleManager`.
        is_distributed: True requires an initialized torch.distributed process group. Ranks agree on overflow
            under torch.distributed either way.
        overflow_mode: ``"inf_nan"`` (default) or ``"saturation"``.
        **kwargs: Further :class:`~lossscale.LossScaleOptimizer` arguments (not ``layerwise``, which only a
            LossScaleOptimizer itself takes).

    Raises:
        TypeError: ``opt`` is not a torch optimizer, or ``loss_scale_manager`` not one of the managers above.
        ValueError: ``is_distributed`` is not a bool, or True without an initialized process group.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> opt = NPULossScaleOptimizer(torch.optim.SGD([w], lr=0.1), FixedLossScaleManager(128))
        >>> opt.backward((2 * w).sum())
        >>> (bool(opt.step().stepped), round(float(w.detach()), 4))
        (True, 0.8)
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        loss_scale_manager: _LossScaleManager,
        is_distributed: bool = False,
        overflow_mode: OverflowMode = "inf_nan",
        **kwargs: Any,
    ) -> None:
        call = "NPULossScaleOptimizer"
        validate_optimizer(call, opt, "opt")
        if not isinstance(loss_scale_manager, _LossScaleManager):
            raise TypeError(
                f"{call}(loss_scale_manager={loss_scale_manager!r}): loss_scale_manager must be an "
                f"ExponentialUpdateLossScaleManager or a FixedLossScaleManager from "
                f"lossscale.compat.ascend; got {type(loss_scale_manager).__name__}."
            )
        validate_choice(call, "is_distributed", is_distributed, (True, False))
        validate_mode(call, overflow_mode)
        if is_distributed and not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                f"{call}(is_distributed=True): overflow is agreed over a torch.distributed process "
                f"group, and none is initialized; call torch.distributed.init_process_group(...) "
                f"first, or pass is_distributed=False."
            )
        self.loss_scale_manager = loss_scale_manager
        self.is_distributed = is_distributed
        super().__init__(opt, policy=loss_scale_manager.loss_scale, overflow_mode=overflow_mode, **kwargs)

    def get_loss_scale(self) -> torch.Tensor:
        """The manager's current loss scale (0-d float32 tensor; no host read)."""
        return self.loss_scale_manager.get_loss_scale()


class TellMeStepOrLossHook:
    """Feeds a precision schedule: ``hook(step=, loss=)`` is ``schedule.update(step=, loss=)`` (a loss tensor is
    read on the host).

    Args:
        step: Steps completed when the run starts (step form; default 0).
        total_step: The schedule's ``total_steps`` (step form).
        loss: Latest loss when the run starts (loss form; optional).
        final_loss: The schedule's ``target_loss``, > 0 (loss form).

    Raises:
        ValueError: both forms or neither given, or a bad ``step``, ``total_step`` or ``final_loss``.
    """

    def __init__(
        self,
        step: int | None = None,
        total_step: int | None = None,
        loss: float | torch.Tensor | None = None,
        final_loss: float | None = None,
    ) -> None:
        call = (
            f"TellMeStepOrLossHook(step={step!r}, total_step={total_step!r}, loss={loss!r}, final_loss={final_loss!r})"
        )
        rule = (
            "give step= and total_step= (for a 'step' trigger) or loss= and final_loss= (for a 'loss' "
            "trigger), not both"
        )
        step_form = step is not None or total_step is not None
        loss_form = loss is not None or final_loss is not None
        if step_form == loss_form:
            raise ValueError(f"{call}: {rule}; got {'both' if step_form else 'neither'}.")
        if step_form:
            validate_int_at_least("TellMeStepOrLossHook", "total_step", total_step, 1)
            step = 0 if step is None else step
            validate_int_at_least("TellMeStepOrLossHook", "step", step, 0)
        elif (
            isinstance(final_loss, bool)
            or not isinstance(final_loss, (int, float))
            or not 0 < final_loss < float("inf")
        ):
            raise ValueError(
                f"{call}: final_loss must be a finite number > 0 (the schedule switches back at "
                f"a loss <= final_loss * ratio); got {final_loss!r}."
            )
        self.trigger = "step" if step_form else "loss"
        self.step, self.total_step, self.loss, self.final_loss = step, total_step, loss, final_loss
        self.schedule: PrecisionSchedule | None = None

    def __repr__(self) -> str:
        if self.trigger == "step":
            return f"TellMeStepOrLossHook(step={self.step!r}, total_step={self.total_step!r})"
        return f"TellMeStepOrLossHook(final_loss={self.final_loss!r})"

    def bind(self, schedule: PrecisionSchedule) -> None:
        """Feed ``schedule`` from now on, starting with ``step`` and ``loss``; a RuntimeError if already bound."""
        if self.schedule is not None:
            raise RuntimeError(
                f"{self!r}.bind(...): this hook already feeds {self.schedule!r}; make one hook per schedule."
            )
        self.schedule = schedule
        if self.trigger == "step" and self.step:
            schedule.update(step=self.step)
        if self.loss is not None:
            schedule.update(step=schedule.step, loss=self.loss)

    def __call__(self, step: int | None = None, loss: float | torch.Tensor | None = None) -> None:
        if self.schedule is None:
            raise RuntimeError(
                f"{self!r}(...): the hook feeds no schedule yet; call "
                f"ExperimentalConfig(accelerate_train_mode=...).schedule(hook) first."
            )
        self.schedule.update(step=step, loss=loss)


@dataclass(frozen=True)
class ExperimentalConfig:
    """Ascend's ``ExperimentalConfig``, reduced to ``accelerate_train_mode`` (None: off), checked at construction.

    Attributes:
        accelerate_train_mode: Ascend's precision mode ``'type|trigger|ratio'``: type ``fast`` (float16) or
            ``fast1`` (bfloat16) for the low-precision phase, trigger ``step`` or ``loss`` for its end, e.g.
            ``'fast|step|0.9'`` (docs/schedule.md lists the values); None (default): off, no schedule.
    """

    accelerate_train_mode: str | None = None

    def __post_init__(self) -> None:
        if self.accelerate_train_mode is not None:
            parse_mode(
                f"ExperimentalConfig(accelerate_train_mode={self.accelerate_train_mode!r})", self.accelerate_train_mode
            )

    def schedule(self, hook: TellMeStepOrLossHook) -> PrecisionSchedule:
        """The :class:`~lossscale.PrecisionSchedule` for this mode, with ``hook`` bound to feed it.

        Raises:
            TypeError: ``hook`` is not a :class:`TellMeStepOrLossHook`.
            ValueError: the mode is None (off), or the hook's form does not match the mode's trigger.
        """
        call = f"{self!r}.schedule({hook!r})"
        if not isinstance(hook, TellMeStepOrLossHook):
            raise TypeError(f"{call}: hook must be a TellMeStepOrLossHook.")
        mode = self.accelerate_train_mode
        if mode is None:
            raise ValueError(
                f"{call}: accelerate_train_mode is None (off), so there is no schedule; set a mode "
                f"such as 'fast|step|0.9', or leave LossScaleOptimizer(schedule=...) unset."
            )
        trigger = parse_mode(call, mode)[1]
        if trigger != hook.trigger:
            form = "step=..., total_step=..." if trigger == "step" else "loss=..., final_loss=..."
            raise ValueError(
                f"{call}: the {trigger!r} trigger is fed by TellMeStepOrLossHook({form}); got a hook "
                f"of the {hook.trigger!r} form."
            )
        if trigger == "step":
            schedule = PrecisionSchedule(mode, total_steps=hook.total_step)
        else:
            assert hook.final_loss is not None  # the loss form's, checked when the hook was made
            schedule = PrecisionSchedule(mode, target_loss=float(hook.final_loss))
        hook.bind(schedule)
        return schedule
