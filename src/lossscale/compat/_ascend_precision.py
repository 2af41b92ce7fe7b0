"""Ascend's ``accelerate_train_mode`` and ``TellMeStepOrLossHook``, translated onto :class:`PrecisionSchedule`.

On Ascend the config goes to ``NPURunConfig`` and the hook to the estimator, and the session links them. In
PyTorch there is no session: ``config.schedule(hook)`` builds the schedule and binds the hook to it, and the
loop calls the hook once per step.

============================================================  ==========================================================
Ascend (TF adapter)                                            lossscale
============================================================  ==========================================================
``ExperimentalConfig(accelerate_train_mode="fast|step|0.9")``  same; validated at construction like PrecisionSchedule
``TellMeStepOrLossHook(step=global_step, total_step=N)``       ``TellMeStepOrLossHook(step=0, total_step=N)``; each step
                                                               ``hook(step=steps_completed)``
``TellMeStepOrLossHook(loss=loss, final_loss=L)``              ``TellMeStepOrLossHook(final_loss=L)``; each step
                                                               ``hook(loss=loss)``
``NPURunConfig(experimental_config=cfg)`` + ``hooks=[hook]``   ``LossScaleOptimizer(..., schedule=cfg.schedule(hook))``
                                                               and ``with schedule.autocast(device):`` around forward
type ``fast`` / ``fast1``                                      autocast to float16 (scaled) / bfloat16 (not scaled)
============================================================  ==========================================================

Example::

    config = ExperimentalConfig(accelerate_train_mode="fast|step|0.9")
    hook = TellMeStepOrLossHook(step=0, total_step=100)
    schedule = config.schedule(hook)                # PrecisionSchedule('fast|step|0.9', total_steps=100)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), schedule=schedule)
    for step in range(100):
        with schedule.autocast("cpu"):
            loss = loss_fn(model(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        hook(step=step + 1)                         # a Lightning callback: hook(step=trainer.global_step)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lossscale._validate import check_int_at_least
from lossscale.schedule import PrecisionSchedule, parse_mode

__all__ = ["ExperimentalConfig", "TellMeStepOrLossHook"]


def _is_number(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float))


class TellMeStepOrLossHook:
    """Feeds a precision schedule each step: the step form ``(step=, total_step=)`` or the loss form
    ``(loss=, final_loss=)``.

    ``step`` is where the run starts (0, or the step a resumed run is at); ``loss``, if given, is the latest loss
    and is reported when the hook is bound. ``total_step`` and ``final_loss`` become the schedule's
    ``total_steps`` and ``target_loss``. Calling the hook is ``schedule.update(step=, loss=)``: ``step`` = steps
    completed, ``loss`` = the last step's loss (a tensor is read on the host: one sync).

    Args:
        step: Steps completed when the run starts (step form; default 0).
        total_step: Length of the run in steps (step form).
        loss: Latest loss when the run starts (loss form; optional).
        final_loss: Target loss, > 0 (loss form).
    """

    def __init__(self, step: int | None = None, total_step: int | None = None, loss: Any = None,
                 final_loss: float | None = None) -> None:
        call = (f"TellMeStepOrLossHook(step={step!r}, total_step={total_step!r}, loss={loss!r}, "
                f"final_loss={final_loss!r})")
        rule = ("give step= and total_step= (for a 'step' trigger) or loss= and final_loss= (for a 'loss' "
                "trigger), not both")
        step_form = step is not None or total_step is not None
        loss_form = loss is not None or final_loss is not None
        if step_form == loss_form:
            raise ValueError(f"{call}: {rule}; got {'both' if step_form else 'neither'}.")
        if step_form:
            check_int_at_least("TellMeStepOrLossHook", "total_step", total_step, 1)
            step = 0 if step is None else step
            check_int_at_least("TellMeStepOrLossHook", "step", step, 0)
        elif not _is_number(final_loss) or not (0 < final_loss < float("inf")):  # type: ignore[operator]
            raise ValueError(f"{call}: final_loss must be a finite number > 0 (the schedule switches back at "
                             f"a loss <= final_loss * ratio); got {final_loss!r}.")
        self.trigger = "step" if step_form else "loss"
        self.step, self.total_step, self.loss, self.final_loss = step, total_step, loss, final_loss
        self.schedule: PrecisionSchedule | None = None

    def __repr__(self) -> str:
        if self.trigger == "step":
            return f"TellMeStepOrLossHook(step={self.step!r}, total_step={self.total_step!r})"
        return f"TellMeStepOrLossHook(final_loss={self.final_loss!r})"

    def bind(self, schedule: PrecisionSchedule) -> None:
        """Feed ``schedule`` from now on (done by :meth:`ExperimentalConfig.schedule`); reports the start values."""
        if self.schedule is not None:
            raise RuntimeError(f"{self!r}.bind(...): this hook already feeds {self.schedule!r}; make one hook per "
                               f"schedule.")
        self.schedule = schedule
        if self.trigger == "step" and self.step:
            schedule.update(step=self.step)
        if self.loss is not None:
            schedule.update(step=schedule.step, loss=self.loss)

    def __call__(self, step: int | None = None, loss: Any = None) -> None:
        """``schedule.update(step=step, loss=loss)``: call once per optimizer step."""
        if self.schedule is None:
            raise RuntimeError(f"{self!r}(...): the hook feeds no schedule yet; call "
                               f"ExperimentalConfig(accelerate_train_mode=...).schedule(hook) first.")
        self.schedule.update(step=step, loss=loss)


@dataclass(frozen=True)
class ExperimentalConfig:
    """Ascend's ``ExperimentalConfig``, reduced to ``accelerate_train_mode`` (None: off).

    The mode is validated at construction exactly as :class:`~lossscale.PrecisionSchedule` validates it.
    """

    accelerate_train_mode: str | None = None

    def __post_init__(self) -> None:
        if self.accelerate_train_mode is not None:
            parse_mode(f"ExperimentalConfig(accelerate_train_mode={self.accelerate_train_mode!r})",
                       self.accelerate_train_mode)

    def schedule(self, hook: TellMeStepOrLossHook) -> PrecisionSchedule:
        """The :class:`PrecisionSchedule` for this mode, with ``hook`` bound to feed it."""
        call = f"{self!r}.schedule({hook!r})"
        if not isinstance(hook, TellMeStepOrLossHook):
            raise TypeError(f"{call}: hook must be a TellMeStepOrLossHook.")
        mode = self.accelerate_train_mode
        if mode is None:
            raise ValueError(f"{call}: accelerate_train_mode is None (off), so there is no schedule; set a mode "
                             f"such as 'fast|step|0.9', or leave LossScaleOptimizer(schedule=...) unset.")
        trigger = parse_mode(call, mode)[1]
        if trigger != hook.trigger:
            form = "step=..., total_step=..." if trigger == "step" else "loss=..., final_loss=..."
            raise ValueError(f"{call}: the {trigger!r} trigger is fed by TellMeStepOrLossHook({form}); got a hook "
                             f"of the {hook.trigger!r} form.")
        if trigger == "step":
            schedule = PrecisionSchedule(mode, total_steps=hook.total_step)
        else:
            schedule = PrecisionSchedule(mode, target_loss=float(hook.final_loss))  # type: ignore[arg-type]
        hook.bind(schedule)
        return schedule
