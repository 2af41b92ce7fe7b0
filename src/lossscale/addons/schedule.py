"""PrecisionSchedule: Ascend's ``accelerate_train_mode`` for PyTorch; which dtype to autocast to at each step.

A mode is ``type|trigger|ratio``::

    type     'fast' = float16, 'fast1' = bfloat16              (the low-precision phase)
    trigger  'step': low precision while step < total_steps * ratio, ratio in [0.2, 0.9], default 0.9
             'loss': low precision until a reported loss <= target_loss * ratio, ratio in [1.01, 1.5],
                     default 1.05
    ratio    may be left out with its separator ('fast|step' means 'fast|step|0.9')

Then the run goes back to its original precision (autocast off) once, for good. The state is two integers
(step, switch_step) and is checkpointed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import re
import warnings
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal, cast

import torch

from lossscale.addons.base import AddOn, FrontEnd, StepOutcome
from lossscale.validation import ArgumentTypeError

Trigger = Literal["step", "loss"]

LOW_DTYPES: dict[str, torch.dtype] = {"fast": torch.float16, "fast1": torch.bfloat16}
RATIOS: dict[str, tuple[str, str, str]] = {"step": ("0.2", "0.9", "0.9"), "loss": ("1.01", "1.5", "1.05")}
ALLOWED = (
    "mode is 'type|trigger|ratio' with type 'fast' (float16) or 'fast1' (bfloat16), trigger 'step' "
    "(ratio in [0.2, 0.9], default 0.9; needs total_steps) or 'loss' (ratio in [1.01, 1.5], default 1.05; "
    "needs target_loss), e.g. 'fast|step|0.9' or 'fast1|loss|1.05'"
)
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")


def parse_mode(call: str, mode: object) -> tuple[torch.dtype, Trigger, Fraction]:
    """``'fast|step|0.9'`` -> ``(torch.float16, 'step', Fraction(9, 10))``; a ValueError naming the allowed values."""
    if not isinstance(mode, str):
        raise TypeError(f"{call}: mode must be a str; {ALLOWED}; got {type(mode).__name__} {mode!r}.")

    def bad(problem: str) -> ValueError:
        return ValueError(f"{call}: {ALLOWED}; got {problem}.")

    fields = mode.split("|")
    if len(fields) not in (2, 3):
        raise bad(f"{len(fields)} field{'s' if len(fields) != 1 else ''} in {mode!r}")
    if "" in fields:
        raise bad(f"an empty field in {mode!r}")
    kind, trigger = fields[0], fields[1]
    if kind not in LOW_DTYPES:
        raise bad(f"type {kind!r}")
    if trigger not in RATIOS:
        raise bad(f"trigger {trigger!r}")
    low, high, default = RATIOS[trigger]
    text = fields[2] if len(fields) == 3 else default
    if not _DECIMAL.fullmatch(text):
        raise bad(f"ratio {text!r}, which is not a plain decimal number")
    ratio = Fraction(text)
    if not Fraction(low) <= ratio <= Fraction(high):
        raise bad(f"ratio {text} for trigger {trigger!r}, outside [{low}, {high}]")
    return LOW_DTYPES[kind], cast(Trigger, trigger), ratio  # one of RATIOS' keys, checked above


@dataclass(frozen=True)
class ScheduleConfig:
    """The validated mode and what its trigger is measured against (frozen; built by PrecisionSchedule)."""

    mode: str
    low_dtype: torch.dtype
    trigger: Trigger
    ratio: float
    total_steps: int | None
    target_loss: float | None
    switch_at_step: int | None  # step trigger: ceil(total_steps * ratio), the first step back in original precision
    switch_below_loss: float | None  # loss trigger: target_loss * ratio, rounded once to the nearest float


@dataclass(frozen=True)
class ScheduleState:
    """``step``: the next step to run (= steps completed); ``switch_step``: first step back in original precision."""

    step: int = 0
    switch_step: int | None = None


def advance(config: ScheduleConfig, state: ScheduleState, step: int | None, loss: float | None) -> ScheduleState:
    """The whole rule, a pure function.

    The rule::

        step = step if given else state.step + 1        (a loss alone reports one more completed step)
        if not switched and (trigger == 'step' and step >= ceil(total_steps * ratio)
                             or trigger == 'loss' and loss is finite and loss <= target_loss * ratio):
            switch_step = step                          (never cleared again; NaN, inf and -inf never switch)
    """
    position = state.step + 1 if step is None else step
    if state.switch_step is not None:
        return ScheduleState(position, state.switch_step)
    if config.trigger == "step":
        switch = config.switch_at_step is not None and position >= config.switch_at_step
    else:
        switch = (
            loss is not None
            and config.switch_below_loss is not None
            and math.isfinite(loss)
            and loss <= config.switch_below_loss
        )
    return ScheduleState(position, position if switch else None)


class PrecisionSchedule(AddOn):
    """Trains the first share of a run in float16 or bfloat16, then switches back to the original precision once.

    Rule (see ``advance``): ``'fast|step|0.9'`` with ``total_steps=100`` is float16 for steps 0-89 and
    original precision from step 90; ``'fast1|loss|1.05'`` with ``target_loss=2.0`` is bfloat16 until a reported
    loss is <= 2.1. Feed it once per step with :meth:`update`. Host reads: one per tensor ``loss``.

    Example:
        >>> schedule = PrecisionSchedule("fast|step|0.9", total_steps=100)
        >>> for step in range(100):
        ...     schedule.update(step=step)  # then: with schedule.autocast("cuda"): ...
        >>> schedule.switch_step, schedule.dtype
        (90, None)

    Args:
        mode: ``'fast|step|0.9'``, ``'fast1|loss|1.05'``, ...: see the module docstring.
        total_steps: Length of the run in steps; required by (and only by) the ``step`` trigger.
        target_loss: The loss the run aims for (> 0); required by (and only by) the ``loss`` trigger.
    """

    def __init__(self, mode: str, total_steps: int | None = None, target_loss: float | None = None) -> None:
        call = f"PrecisionSchedule(mode={mode!r})"
        low_dtype, trigger, ratio = parse_mode(call, mode)
        call = f"PrecisionSchedule({mode!r}, total_steps={total_steps!r}, target_loss={target_loss!r})"
        switch_at_step = switch_below_loss = None
        if trigger == "step":
            if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)):
                raise ArgumentTypeError(
                    f"{call}: total_steps must be an integer >= 1; got {total_steps!r} ({type(total_steps).__name__})."
                )
            if total_steps is None or total_steps < 1:
                raise ValueError(
                    f"{call}: the 'step' trigger keeps low precision while step < total_steps * ratio, "
                    f"so total_steps must be an integer >= 1; got {total_steps!r}."
                )
            if target_loss is not None:
                raise ValueError(
                    f"{call}: target_loss is only used by the 'loss' trigger; this mode switches on "
                    f"the step. Leave target_loss out, or use a 'loss' mode such as 'fast|loss|1.05'."
                )
            switch_at_step = math.ceil(total_steps * ratio)
        else:
            if target_loss is not None and (isinstance(target_loss, bool) or not isinstance(target_loss, (int, float))):
                raise ArgumentTypeError(
                    f"{call}: target_loss must be a finite number > 0; got "
                    f"{target_loss!r} ({type(target_loss).__name__})."
                )
            if target_loss is None or not math.isfinite(target_loss) or target_loss <= 0:
                raise ValueError(
                    f"{call}: the 'loss' trigger keeps low precision until a loss <= target_loss * "
                    f"ratio, so target_loss must be a finite number > 0; got {target_loss!r}."
                )
            if total_steps is not None:
                raise ValueError(
                    f"{call}: total_steps is only used by the 'step' trigger; this mode switches on "
                    f"the loss. Leave total_steps out, or use a 'step' mode such as 'fast|step|0.9'."
                )
            switch_below_loss = float(ratio * Fraction(target_loss))
        self.config = ScheduleConfig(
            mode,
            low_dtype,
            trigger,
            float(ratio),
            total_steps,
            None if target_loss is None else float(target_loss),
            switch_at_step,
            switch_below_loss,
        )
        self._state = ScheduleState()
        self._told = False  # update() or load_state_dict() was called: the loop feeds the schedule
        self._unfed_steps = 0
        self._window: str | None = None  # the precision of the window under way (fixed at its first loss)
        self._reported: bool | None = None  # the switch back was reported (None: not attached yet)

    # --- what users read -----------------------------------------------------------------------

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def state(self) -> ScheduleState:
        return self._state

    @property
    def step(self) -> int:
        """The next step to run (= steps completed so far)."""
        return self._state.step

    @property
    def switched(self) -> bool:
        """True once the run is back in its original precision (for good)."""
        return self._state.switch_step is not None

    @property
    def switch_step(self) -> int | None:
        """Index of the first step run in the original precision, or None before the switch."""
        return self._state.switch_step

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype now: ``torch.float16``/``torch.bfloat16``, or None after the switch."""
        return None if self.switched else self.config.low_dtype

    def __repr__(self) -> str:
        args = [repr(self.config.mode)]
        args += [
            f"{k}={getattr(self.config, k)!r}"
            for k in ("total_steps", "target_loss")
            if getattr(self.config, k) is not None
        ]
        return f"PrecisionSchedule({', '.join(args)})"

    # --- the training-loop calls -------------------------------------------------------------------

    def update(self, step: int | None = None, loss: float | torch.Tensor | None = None) -> None:
        """Report progress: ``step`` = the next step to run (= steps completed), ``loss`` = the loss of the step
        just run (alone: one more completed step). Reads a tensor ``loss`` on the host."""

        def call() -> str:  # built only for an error: repr of a tensor would read it
            shown = f"tensor(shape={tuple(loss.shape)})" if isinstance(loss, torch.Tensor) else repr(loss)
            return f"{self!r}.update(step={step!r}, loss={shown})"

        if step is None and loss is None:
            raise TypeError(f"{call()}: report step= (the next step to run), loss= (the last step's loss), or both.")
        if step is not None:
            if isinstance(step, bool):
                raise TypeError(f"{call()}: step must be an integer >= 0; got a bool.")
            try:
                step = operator.index(step)
            except TypeError:
                raise TypeError(f"{call()}: step must be an integer >= 0; got {type(step).__name__}.") from None
            if step < 0:
                raise ValueError(f"{call()}: step must be an integer >= 0; got {step!r}.")
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(
                    f"{call()}: loss must be a number or a one-element tensor; got shape {tuple(loss.shape)}."
                )
            loss = float(loss.detach())
        elif loss is not None:
            if isinstance(loss, bool) or not isinstance(loss, (int, float)):
                raise TypeError(f"{call()}: loss must be a number or a one-element tensor; got {type(loss).__name__}.")
            loss = float(loss)
        self._state = advance(self.config, self._state, step, loss)
        self._told = True

    key = "schedule"
    label = "a precision schedule"

    def attach(self, front_end: FrontEnd) -> None:
        """Refuse parameters already in low precision (``validate_attachable``); the first time, a schedule
        already back in its original precision has no switch left to report."""
        validate_attachable(self, front_end.params, front_end.call)
        if self._reported is None:
            self._reported = self.switched

    def on_loss(self, loss: torch.Tensor | None, opens_window: bool) -> bool:
        """At a window's first loss, note the precision it runs in; its losses are scaled while that is float16."""
        if opens_window:
            self._window = self.precision()
        return self.dtype == torch.float16

    def after_step(self, outcome: StepOutcome) -> dict[str, Any]:
        """``precision``: what the step's forward passes ran in; ``switched``: True on the first step run in the
        original precision after the low-precision phase (once). Warns once if the schedule is never fed."""
        self.note_optimizer_step()
        precision = self._window if self._window is not None else self.precision()
        self._window = None
        switched = precision == "float32" and not self._reported
        self._reported = self._reported or switched
        return {"precision": precision, "switched": switched}

    def precision(self) -> str:
        """``"float16"`` or ``"bfloat16"`` before the switch, ``"float32"`` after it."""
        return "float32" if self.dtype is None else str(self.dtype).replace("torch.", "")

    def note_optimizer_step(self) -> None:
        """Called after each optimizer step: warns once when two ran and the schedule was never fed (:meth:`update`,
        or a checkpoint loaded)."""
        if self._told:
            return
        self._unfed_steps += 1
        if self._unfed_steps == 2:
            warnings.warn(
                f"{self!r}: {self._unfed_steps} optimizer steps ran and schedule.update() was never called, so "
                f"the schedule cannot leave {self.config.low_dtype} (it stays there for the whole run). Call "
                f"schedule.update(step=step) at the start of each step, or schedule.update(loss=loss) after it.",
                UserWarning,
                stacklevel=3,
            )

    def autocast(self, device_type: str) -> AbstractContextManager[None]:
        """``torch.autocast(device_type, dtype=self.dtype)`` before the switch; a context that does nothing after."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.dtype)

    # --- checkpoints ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{'mode': ..., 'step': ..., 'switch_step': ..., 'reported': ..., 'window': ...}``: the rule's state,
        whether the switch back was reported, and the precision of the accumulation window under way (None
        between windows)."""
        return {
            "mode": self.config.mode,
            **dataclasses.asdict(self._state),
            "reported": self.switched if self._reported is None else self._reported,
            "window": self._window,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the mode must match (total_steps/target_loss may change on resume). A state
        saved before ``reported`` and ``window`` were kept takes the switch as reported once it happened."""
        self._state = self.validate_state_dict(state_dict)
        self._reported = state_dict.get("reported", self.switched)
        self._window = state_dict.get("window")
        self._told = True

    def validate_state_dict(self, state_dict: object) -> ScheduleState:
        """The state :meth:`load_state_dict` would install, or the error it would raise; changes nothing."""
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"{self!r}.load_state_dict(state_dict={state_dict!r}): state_dict must be a dict "
                f"from PrecisionSchedule.state_dict(); got {type(state_dict).__name__}."
            )
        if state_dict.get("mode") != self.config.mode:
            raise ValueError(
                f"{self!r}.load_state_dict(...): the checkpoint was saved by a schedule with mode "
                f"{state_dict.get('mode')!r}; build the schedule with that mode to resume it."
            )
        call = f"{self!r}.load_state_dict"
        reported, window = state_dict.get("reported", False), state_dict.get("window")
        if not isinstance(reported, bool):
            raise TypeError(f"{call}(reported={reported!r}): reported must be a bool; got {type(reported).__name__}.")
        if window not in (None, "float16", "bfloat16", "float32"):
            raise ValueError(
                f"{call}(window={window!r}): window must be None or the precision of the accumulation window "
                f"under way ('float16', 'bfloat16' or 'float32'); got {window!r}."
            )
        return _validated_state(call, state_dict)


def _validated_state(call: str, state_dict: Mapping[str, object]) -> ScheduleState:
    """The saved ``step`` (an integer >= 0) and ``switch_step`` (None or an integer >= 0), checked."""
    values: dict[str, int | None] = {}
    for f in dataclasses.fields(ScheduleState):
        if f.name not in state_dict:
            raise ValueError(
                f"{call}(state_dict={state_dict!r}): the state dict has no {f.name!r}; expected the "
                f"keys mode, step, switch_step of PrecisionSchedule.state_dict()."
            )
        value = state_dict[f.name]
        if value is None and f.name == "switch_step":
            values[f.name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"{call}({f.name}={value!r}): {f.name} must be an integer >= 0"
                f"{' or None' if f.name == 'switch_step' else ''}; got {type(value).__name__}."
            )
        if value < 0:
            raise ValueError(f"{call}({f.name}={value!r}): {f.name} must be an integer >= 0; got {value!r}.")
        values[f.name] = value
    return ScheduleState(**values)  # type: ignore[arg-type]  # None only for switch_step, as checked above


def validate_attachable(schedule: object, params: Iterable[torch.Tensor], call: str = "LossScaleOptimizer") -> None:
    """Refuse a non-schedule, and parameters already in float16/bfloat16 (no original precision to return to)."""
    if not isinstance(schedule, PrecisionSchedule):
        raise TypeError(f"{call}(schedule={schedule!r}): schedule must be a lossscale.PrecisionSchedule.")
    for i, p in enumerate(params):
        if p.dtype in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"{call}(schedule={schedule!r}): parameter {i} of the optimizer is already {p.dtype}. "
                f"The schedule autocasts full-precision parameters to {schedule.config.low_dtype} for the first "
                f"share of the run and then trains in their original precision, so the parameters must stay in "
                f"float32 (there is no higher precision to switch to otherwise). Keep the model in float32 "
                f"(model.float()) and let schedule.autocast(...) lower the compute."
            )
