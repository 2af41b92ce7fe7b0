"""``OverflowDiagnosis``: the add-on that notices the loss scale collapsing without a host read, traces the next step
the user's loop runs, and warns once per cause with an :class:`~lossscale.diagnosis.report.OverflowReport`."""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import torch
from torch import nn

from lossscale.addons.base import AddOn, FrontEnd, StepOutcome
from lossscale.diagnosis.report import OverflowReport, OverflowWarning
from lossscale.diagnosis.trace import Tracer
from lossscale.validation import ArgumentTypeError, validate_int_at_least

_STREAK_CAP = 2**30  # the streak saturates here (bound everything that grows)


class TriggerState(NamedTuple):
    """The trigger's device-side state: 0-d tensors, updated by :func:`advance_trigger` with tensor ops only.

    Attributes:
        streak: int32, overflowing steps in a row (0 after a clean step).
        seen_clean: bool, whether any step was clean.
        fired: bool, latched True when the rule fired, until the host acknowledges it.
    """

    streak: torch.Tensor
    seen_clean: torch.Tensor
    fired: torch.Tensor

    @classmethod
    def init(cls, device: torch.device | str | None = None) -> TriggerState:
        return cls(
            torch.zeros((), dtype=torch.int32, device=device),
            torch.zeros((), dtype=torch.bool, device=device),
            torch.zeros((), dtype=torch.bool, device=device),
        )


def advance_trigger(
    state: TriggerState, found_inf: torch.Tensor, next_scale: torch.Tensor, *, patience: int, initial_limit: int
) -> TriggerState:
    """One step of the trigger (element-wise, so a batch of runs moves at once). No host read.

    The rule::

        streak     = streak + 1 if found_inf else 0          (saturating)
        seen_clean = seen_clean or not found_inf
        fire       = streak >= patience and (seen_clean or next_scale <= 1 or streak >= initial_limit)
        fired      = fired or fire

    Before the first clean step the scale is still searching down from its initial value (Megatron's 2**32 with
    hysteresis 2 takes up to 33 overflows to reach 1), so there the streak counts only once the scale is down to 1
    or after ``initial_limit`` steps.
    """
    over = found_inf.to(torch.bool)
    streak = torch.where(over, (state.streak + 1).clamp_max(_STREAK_CAP), torch.zeros_like(state.streak))
    seen_clean = state.seen_clean | ~over
    fire = (streak >= patience) & (seen_clean | (next_scale <= 1) | (streak >= initial_limit))
    return TriggerState(streak, seen_clean, state.fired | fire)


class OverflowDiagnosis(AddOn):
    """Diagnose a collapsing loss scale: trace the next step, then warn with an :class:`OverflowReport`.

    The trigger (:func:`advance_trigger`) runs on the device at every ``after_step``; its latched flag is copied to
    a host buffer without blocking (pinned memory and an event on CUDA) and read once that copy has completed, one
    step later on CUDA, at once on the CPU. When it has fired, the module hooks go on at that ``after_step``: the
    user's next forward and backward are traced (nothing is re-run), and the following ``after_step`` removes the
    hooks, reads the trace, stores :attr:`last_report` and issues an :class:`OverflowWarning` (naming the rank under
    torch.distributed) unless the same cause (kind, module) was already reported. The trigger then starts again
    from zero.

    Bound: a fault that overflows every step fires at most ``patience`` steps after it begins when training had a
    clean step before, else after at most ``initial_limit`` steps (or as soon as the scale is down to 1, at the
    earliest after ``patience``); the warning comes with the traced step, one or two steps later (two on CUDA).
    Never fires: the search down from the initial scale while a clean step comes before the scale reaches 1 or
    ``initial_limit`` steps pass; overflow runs shorter than ``patience`` (isolated overflows, bursts).
    Host reads on a healthy step: none (on the CPU the flag is read from host memory, no sync; on other devices
    than CPU and CUDA, one blocking copy per step).

    Args:
        model: The module whose calls the traced step records.
        patience: Overflowing steps in a row that mean a collapse (default 16: 2**16 of scale lost).
        initial_limit: Overflowing steps in a row from the start that mean a collapse even while the scale is still
            above 1 (default 128).

    Example:
        >>> import torch
        >>> from lossscale.addons.base import StepOutcome
        >>> diagnosis = OverflowDiagnosis(torch.nn.Linear(2, 2), patience=2)
        >>> clean = StepOutcome(torch.tensor(True), torch.tensor(False), torch.tensor(8.0), torch.tensor(8.0), 0)
        >>> diagnosis.after_step(clean)  # the fields it adds to the step's result
        {'overflow_kind': None, 'overflow_module': None}
        >>> diagnosis.tracing, diagnosis.log_fields
        (False, {'overflow_kind': None, 'overflow_module': None})
    """

    key = None
    label = "overflow diagnosis"

    def __init__(self, model: nn.Module, *, patience: int = 16, initial_limit: int = 128) -> None:
        call = (
            f"OverflowDiagnosis(model={type(model).__name__}, patience={patience!r}, initial_limit={initial_limit!r})"
        )
        if not isinstance(model, nn.Module):
            raise ArgumentTypeError(
                f"OverflowDiagnosis(model={model!r:.60}): model must be the torch.nn.Module "
                f"being trained; got {type(model).__name__}."
            )
        validate_int_at_least(call, "patience", patience, 1)
        validate_int_at_least(call, "initial_limit", initial_limit, patience)
        self.model = model
        self.patience = patience
        self.initial_limit = initial_limit
        self.front_end: FrontEnd | None = None
        #: The last traced step's report (None until one was traced).
        self.last_report: OverflowReport | None = None
        #: Each (kind, module) already warned about.
        self.reported: set[tuple[str, str | None]] = set()
        self._state: TriggerState | None = None
        self._tracer: Tracer | None = None
        self._slots: list[tuple[torch.Tensor, Any]] = []
        self._slot = 0

    # the add-on interface ---------------------------------------------------------------------------------------

    def attach(self, front_end: FrontEnd) -> None:
        self.front_end = front_end

    def on_loss(self, loss: torch.Tensor | None, opens_window: bool) -> bool:
        """The end of a traced forward pass (its loss)."""
        if self._tracer is not None:
            self._tracer.end_forward(loss)
        return True

    def after_step(self, outcome: StepOutcome) -> dict[str, Any]:
        """The trigger; the trace it asked for; ``overflow_kind`` and ``overflow_module`` of the report the trace made
        (None in every other step)."""
        fields: dict[str, Any] = {"overflow_kind": None, "overflow_module": None}
        if self._tracer is not None:
            report = self._finish_trace(outcome)
            return report.log_fields() if report is not None else fields
        if self._state is None:
            self._state = TriggerState.init(outcome.found_inf.device)
        self._state = advance_trigger(
            self._state, outcome.found_inf, outcome.next_scale, patience=self.patience, initial_limit=self.initial_limit
        )
        if self._publish_and_poll():
            self._tracer = Tracer(self.model)
        return fields

    # state for users and loggers --------------------------------------------------------------------------------

    @property
    def tracing(self) -> bool:
        """Whether the next forward and backward are being traced."""
        return self._tracer is not None

    @property
    def log_fields(self) -> dict[str, str | None]:
        """``{"overflow_kind": ..., "overflow_module": ...}`` of :attr:`last_report` (None before one)."""
        if self.last_report is None:
            return {"overflow_kind": None, "overflow_module": None}
        return self.last_report.log_fields()

    def remove(self) -> None:
        """Remove the trace's hooks now, if a step is being traced (e.g. when training stops mid-trace)."""
        if self._tracer is not None:
            self._tracer.remove()
            self._tracer = None

    # the flag's way to the host ---------------------------------------------------------------------------------

    def _publish_and_poll(self) -> bool:
        """Copy the latched flag towards the host without blocking; True if a completed copy says it fired."""
        assert self._state is not None  # after_step moved it first
        fired = self._state.fired
        if fired.device.type != "cuda":
            if not self._slots:
                self._slots = [(torch.zeros((), dtype=torch.bool), None)]
            buffer = self._slots[0][0]
            buffer.copy_(fired)  # on the CPU this is a memory copy; elsewhere a blocking one
            return bool(buffer.numpy())
        if not self._slots:
            self._slots = [(torch.zeros((), dtype=torch.bool, pin_memory=True), None) for _ in range(2)]
        previous = self._slots[1 - self._slot]
        now, _ = self._slots[self._slot]
        now.copy_(fired, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._slots[self._slot] = (now, event)
        self._slot = 1 - self._slot
        for buffer, done in (previous, self._slots[1 - self._slot]):
            if done is not None and done.query() and bool(buffer.numpy()):
                return True
        return False

    # the traced step --------------------------------------------------------------------------------------------

    def _finish_trace(self, outcome: StepOutcome) -> OverflowReport:
        tracer, self._tracer = self._tracer, None
        assert tracer is not None
        tracer.remove()
        rank = _rank()
        scale = float(outcome.scale)
        report = tracer.report(scale, rank=rank)
        if report.kind == "none":  # the backward was finite: its magnitudes bound the scale
            report = tracer.report(scale, _safe_from_trace(tracer, scale), rank=rank)
        self.last_report = report
        state = self._state
        if state is not None:  # start again from zero; copies issued before this are stale
            self._state = TriggerState.init(state.streak.device)._replace(seen_clean=state.seen_clean)
        self._slots = [(buffer, None) for buffer, _ in self._slots]  # their values predate the reset
        cause = (report.kind, report.module)
        if cause in self.reported:
            return report
        self.reported.add(cause)
        where = f"rank {rank}: " if rank is not None else ""
        warnings.warn(
            OverflowWarning(
                f"{where}the loss scale collapsed ({self.patience} or more overflowing steps in "
                f"a row); the traced step {outcome.step} found:\n{report}",
                report,
            ),
            stacklevel=3,
        )
        return report


def _safe_from_trace(tracer: Tracer, scale: float) -> float | None:
    finite, ratio = tracer.backward_peak(0)
    if not finite or not tracer.events:
        return None
    if math.isinf(ratio):
        return 2.0**127
    return 2.0 ** max(-126, min(127, math.floor(math.log2(scale * ratio))))


def _rank() -> int | None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


def validate_diagnose(call: str, diagnose: object, true_means: str | None = None) -> None:
    """The one check of a ``diagnose=`` argument: None or False (no diagnosis), a ``torch.nn.Module`` (the model to
    trace), an :class:`OverflowDiagnosis`, or True where ``true_means`` says which module True traces (a framework's
    own model; None: True is refused, there is no model to offer).

    Raises:
        ArgumentTypeError: naming ``call``, the values allowed and the value received.
    """
    if diagnose is None or diagnose is False or isinstance(diagnose, (nn.Module, OverflowDiagnosis)):
        return
    if diagnose is True and true_means is not None:
        return
    allowed = (f"True ({true_means}), " if true_means else "") + (
        "a torch.nn.Module (the model to trace when the loss scale collapses), a lossscale.OverflowDiagnosis, "
        "or None/False (no diagnosis)"
    )
    hint = " Pass the model itself: diagnose=model." if diagnose is True else ""
    raise ArgumentTypeError(
        f"{call}(diagnose={diagnose!r:.60}): diagnose must be {allowed}; got {type(diagnose).__name__}.{hint}"
    )


def diagnosis_from(
    call: str, diagnose: object, model: nn.Module | None = None, true_means: str = "the model being trained"
) -> OverflowDiagnosis | None:
    """The diagnosis ``diagnose=`` asks for (checked by :func:`validate_diagnose`): None for None and False, an
    :class:`OverflowDiagnosis` as it is, ``OverflowDiagnosis(diagnose)`` for a module, and for True
    ``OverflowDiagnosis(model)``, the framework's own model (``true_means`` says which, for the error where there is
    none; a framework that meets it later builds it then)."""
    validate_diagnose(call, diagnose, None if model is None else true_means)
    if diagnose is None or diagnose is False:
        return None
    if isinstance(diagnose, OverflowDiagnosis):
        return diagnose
    target = model if diagnose is True else diagnose
    assert isinstance(target, nn.Module)  # validated above
    return OverflowDiagnosis(target)
