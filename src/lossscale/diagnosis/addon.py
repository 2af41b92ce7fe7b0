"""``OverflowDiagnosis``: the add-on that notices a fault without a host read (the loss scale collapsing, or the loss
non-finite steps in a row), traces the next step the user's loop runs, warns once per cause with an
:class:`~lossscale.diagnosis.report.OverflowReport`, and with ``heal=`` heals the run: the module a forward fault
names runs in float32 from then on, and the scale the run had before the fault is restored."""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import torch
from torch import nn

from lossscale.addons.base import AddOn, FrontEnd, StepOutcome
from lossscale.diagnosis.float32 import Float32Forward, keep_float32
from lossscale.diagnosis.report import HealError, HealWarning, OverflowReport, OverflowWarning
from lossscale.diagnosis.trace import Tracer
from lossscale.validation import (
    ArgumentTypeError,
    capturing,
    outside_caller,
    validate_choice,
    validate_int_at_least,
)

_STREAK_CAP = 2**30  # the streaks saturate here (bound everything that grows)
#: Steps in a row whose loss was non-finite that fire the trigger: an isolated bad batch never does.
FAULT_PATIENCE = 2
#: What fired the trigger, as its ``cause`` field holds it.
CAUSES = ("none", "overflow", "loss")
#: With ``give_up_after=None``, a warning every this many skipped steps in a row.
WARN_EVERY = 100
_PRECISIONS = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


class TriggerState(NamedTuple):
    """The trigger's device-side state: 0-d tensors (or one value per run of a batch), moved by
    :func:`advance_trigger` with tensor ops only.

    Attributes:
        streak: int32, overflowing steps in a row (0 after a step whose gradients were finite).
        seen_clean: bool, whether any step's gradients were finite.
        fault_streak: int32, steps in a row whose loss was non-finite (forward faults).
        skip_streak: int32, skipped steps in a row (an overflow or a forward fault).
        saved_scale: float32, the scale the first step of the current run of skipped steps ran at (0 before one):
            the scale healing restores.
        fired: bool, latched True when the rule fired, until the host acknowledges it.
        cause: int32, latched with ``fired``: 1 overflows in a row, 2 non-finite losses in a row (``CAUSES``).
    """

    streak: torch.Tensor
    seen_clean: torch.Tensor
    fault_streak: torch.Tensor
    skip_streak: torch.Tensor
    saved_scale: torch.Tensor
    fired: torch.Tensor
    cause: torch.Tensor

    @classmethod
    def init(cls, device: torch.device | str | None = None) -> TriggerState:
        def zero(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros((), dtype=dtype, device=device)

        return cls(
            zero(torch.int32),
            zero(torch.bool),
            zero(torch.int32),
            zero(torch.int32),
            zero(torch.float32),
            zero(torch.bool),
            zero(torch.int32),
        )


def advance_trigger(
    state: TriggerState,
    found_inf: torch.Tensor,
    next_scale: torch.Tensor,
    *,
    patience: int,
    initial_limit: int,
    forward_fault: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> TriggerState:
    """One step of the trigger (element-wise, so a batch of runs moves at once). No host read.

    The rule (``forward_fault``: the step's loss was non-finite; ``scale``: the scale the step ran at)::

        streak       = streak + 1 if found_inf else 0                        (saturating, as every streak)
        fault_streak = fault_streak + 1 if forward_fault else 0
        skip_streak  = skip_streak + 1 if found_inf or forward_fault else 0
        saved_scale  = scale if this step begins a run of skipped steps else saved_scale
        seen_clean   = seen_clean or not found_inf
        overflows    = streak >= patience and (seen_clean or next_scale <= 1 or streak >= initial_limit)
        losses       = fault_streak == FAULT_PATIENCE (2): once per run of non-finite losses
        fired, cause = fired or overflows or losses, the first of them to fire (latched)

    Before the first clean step the scale is still searching down from its initial value (Megatron's 2**32 with
    hysteresis 2 takes up to 33 overflows to reach 1), so there the overflow streak counts only once the scale is
    down to 1 or after ``initial_limit`` steps. A non-finite loss fires at its second in a row, whatever the scale.

    Args:
        state: The trigger's state before this step (``TriggerState.init()`` at the start); not changed: a new
            record is returned.
        found_inf: Bool (or 0/1) tensor, the step's verdict: True where its gradients overflowed.
        next_scale: The loss scale after the policy's update of this step (a tensor on the state's device): the
            overflow streak counts before the first clean step once it is <= 1.
        patience: An int >= 1: overflowing steps in a row that fire the trigger (:class:`OverflowDiagnosis`'s
            ``patience``).
        initial_limit: An int >= ``patience``: overflowing steps in a row that fire it before any clean step while
            the scale is still above 1.
        forward_fault: Bool tensor, True where the step's loss was non-finite (a forward fault); None (default):
            no forward fault.
        scale: The loss scale this step ran at, kept in ``saved_scale`` when the step begins a run of skipped steps;
            None (default): ``saved_scale`` is left as it is.
    """
    over = found_inf.to(torch.bool)
    fault = torch.zeros_like(over) if forward_fault is None else forward_fault.to(device=over.device, dtype=torch.bool)
    skipped = over | fault

    def counted(flag: torch.Tensor, streak: torch.Tensor) -> torch.Tensor:
        return torch.where(flag, (streak + 1).clamp_max(_STREAK_CAP), torch.zeros_like(streak))

    streak, fault_streak, skip_streak = (
        counted(over, state.streak),
        counted(fault, state.fault_streak),
        counted(skipped, state.skip_streak),
    )
    saved = state.saved_scale
    if scale is not None:
        saved = torch.where(skipped & (state.skip_streak == 0), scale.to(saved), saved)
    seen_clean = state.seen_clean | ~over
    overflows = (streak >= patience) & (seen_clean | (next_scale <= 1) | (streak >= initial_limit))
    losses = fault_streak == FAULT_PATIENCE  # once per run of non-finite losses
    cause = torch.where(
        state.fired,
        state.cause,
        torch.where(losses, torch.full_like(state.cause, 2), torch.where(overflows, torch.ones_like(state.cause), 0)),
    )
    return TriggerState(streak, seen_clean, fault_streak, skip_streak, saved, state.fired | overflows | losses, cause)


class OverflowDiagnosis(AddOn):
    """Diagnose a collapsing loss scale or a non-finite loss: trace the next step, warn with an
    :class:`OverflowReport`; with ``heal``, heal the run.

    The trigger (:func:`advance_trigger`) moves on the device at every ``after_step``, from the step's found_inf and
    forward fault (the front end's verdict where it finds them, as with ``heal``; else whether the losses this add-on
    saw were finite). Its latched flags are copied to host memory without blocking (pinned memory and an event on
    CUDA) and read at the next ``after_step``, once that copy is done (waited for, on CUDA: one step later it is), so
    the trigger is acted on exactly one step after it fires, on every device and every rank. Then the module hooks go
    on: the user's next forward and backward are traced (nothing is re-run), and the following ``after_step`` removes
    the hooks, reads the trace, stores :attr:`last_report` and issues an :class:`OverflowWarning` (naming the rank
    under torch.distributed, and which trigger fired) unless the same cause (kind, module) was already reported. The
    overflow streak then starts again from zero; the loss trigger fires once per run of non-finite losses (and again
    after a heal, whose check the following steps are).

    Healing (``heal=True``, or ``torch.bfloat16``): the front end skips a step whose loss was non-finite and its
    policy does not see it; a traced fault of kind ``"forward"`` keeps the module it names in float32 (bfloat16),
    its outputs in float32 (:func:`~lossscale.keep_float32`), and restores the scale the run had when the skipped
    steps began, with a :class:`HealWarning`; the following faulted steps are traced again, so an overflow that moves
    on to the next module is healed there too, until steps run clean, ``max_healed`` modules are kept, or the fault
    stays where it was or is the whole model's: then healing stops, with a warning. ``"backward"``, ``"input"`` and
    ``"loss"`` heal nothing (their warnings say what to do). A run that skips ``give_up_after`` steps in a row raises
    :class:`HealError` on every rank. Under torch.distributed every rank keeps the union of the modules the ranks'
    traces name.

    Bound: a fault that overflows every step fires at most ``patience`` steps after it begins when training had a
    clean step before, else after at most ``initial_limit`` steps (or as soon as the scale is down to 1, at the
    earliest after ``patience``); a loss that is non-finite every step fires at its second; the trace is the step
    after the next. Never fires: the search down from the initial scale while a clean step comes before the scale
    reaches 1 or ``initial_limit`` steps pass; overflow runs shorter than ``patience``; an isolated non-finite loss.
    Host reads on a healthy step: none (the flags are read from host memory, no sync; on other devices than CPU and
    CUDA, one blocking copy per step).

    Args:
        model: The module whose calls the traced step records (and whose modules healing keeps in float32).
        patience: Overflowing steps in a row that mean a collapse (default 16: 2**16 of scale lost).
        initial_limit: Overflowing steps in a row from the start that mean a collapse even while the scale is still
            above 1 (default 128).
        heal: False (diagnose only), True (heal in float32) or ``torch.float32``/``torch.bfloat16`` (the precision
            healed modules run in; bfloat16 where the model's device runs it natively: the CPU, CUDA from compute
            capability 8.0).
        max_healed: Modules healing keeps at most, for the whole run (default 8).
        give_up_after: Skipped steps in a row after which a healing run raises :class:`HealError` (default 100);
            None: go on skipping, with a warning every 100.

    Example:
        >>> import torch
        >>> from lossscale.addons import StepOutcome
        >>> diagnosis = OverflowDiagnosis(torch.nn.Linear(2, 2), patience=2)
        >>> clean = StepOutcome(torch.tensor(True), torch.tensor(False), torch.tensor(8.0), torch.tensor(8.0), 0)
        >>> diagnosis.after_step(clean)  # the fields it adds to the step's result
        {'overflow_kind': None, 'overflow_module': None}
        >>> diagnosis.tracing, diagnosis.log_fields
        (False, {'overflow_kind': None, 'overflow_module': None})
    """

    key = "diagnosis"
    label = "an overflow diagnosis"

    def __init__(
        self,
        model: nn.Module,
        *,
        patience: int = 16,
        initial_limit: int = 128,
        heal: bool | torch.dtype = False,
        max_healed: int = 8,
        give_up_after: int | None = 100,
    ) -> None:
        call = (
            f"OverflowDiagnosis(model={type(model).__name__}, patience={patience!r}, initial_limit={initial_limit!r}, "
            f"heal={heal!r}, max_healed={max_healed!r}, give_up_after={give_up_after!r})"
        )
        if not isinstance(model, nn.Module):
            raise ArgumentTypeError(
                f"OverflowDiagnosis(model={model!r:.60}): model must be the torch.nn.Module "
                f"being trained; got {type(model).__name__}."
            )
        validate_int_at_least(call, "patience", patience, 1)
        validate_int_at_least(call, "initial_limit", initial_limit, patience)
        validate_int_at_least(call, "max_healed", max_healed, 1)
        if give_up_after is not None:
            validate_int_at_least(call, "give_up_after", give_up_after, 1)
        self.model = model
        self.patience = patience
        self.initial_limit = initial_limit
        #: The precision healed modules run in, or None where this diagnosis does not heal.
        self.heal_precision = healing_precision(call, heal, model)
        self.finds_forward_faults = self.heal_precision is not None
        self.max_healed = max_healed
        self.give_up_after = give_up_after
        self.front_end: FrontEnd | None = None
        #: The last traced step's report (None until one was traced).
        self.last_report: OverflowReport | None = None
        #: Every report the traces made, in order.
        self.reports: list[OverflowReport] = []
        #: Each (kind, module) already warned about.
        self.reported: set[tuple[str, str | None]] = set()
        #: The modules healing kept, by name, and the precision each now runs in.
        self.healed: dict[str, torch.dtype] = {}
        #: False once healing stopped (it could not fix this run); :meth:`undo_heal` starts it again.
        self.healing = self.heal_precision is not None
        self._handles: dict[str, Float32Forward] = {}
        self._state: TriggerState | None = None
        self._tracer: Tracer | None = None
        self._cause = 0  # what fired the trace under way
        self._published: tuple[torch.Tensor, Any] | None = None  # (host buffer, CUDA event) of the last step's flags
        self._loss_finite: torch.Tensor | None = None  # the losses seen since the last step (where no verdict comes)
        self._warned_at = 0  # skipped steps in a row at the last warning of give_up_after=None

    # the add-on interface ---------------------------------------------------------------------------------------

    def attach(self, front_end: FrontEnd) -> None:
        self.front_end = front_end

    def on_loss(self, loss: torch.Tensor | None, opens_window: bool) -> bool:
        """The end of a traced forward pass (its loss); where the front end finds no forward faults, whether the loss
        was finite (a device op)."""
        if self._tracer is not None:
            self._tracer.end_forward(loss)
        if loss is not None and not self.finds_forward_faults:
            finite = torch.isfinite(loss.detach()).all()
            self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        return True

    def after_step(self, outcome: StepOutcome) -> dict[str, Any]:
        """The trigger; the trace it asked for, and healing; ``overflow_kind`` and ``overflow_module`` of the report
        a trace made and, with ``heal``, ``healed_modules`` (None in every other step)."""
        fields: dict[str, Any] = {"overflow_kind": None, "overflow_module": None}
        if self.heal_precision is not None:
            fields["healed_modules"] = None
            if capturing(outcome.found_inf):
                raise RuntimeError(
                    "OverflowDiagnosis(heal=...) under CUDA graph capture: healing replaces a module's forward, which "
                    "a captured graph cannot follow (it replays the kernels it recorded). Capture without heal=, or "
                    "heal the model before capturing: lossscale.heal(model, closure)."
                )
        fault = outcome.forward_fault
        if fault is None and self._loss_finite is not None:
            fault = ~self._loss_finite
        self._loss_finite = None
        tracing = self._tracer is not None
        published = None if tracing else self._take_published()
        if self._state is None:
            self._state = TriggerState.init(outcome.found_inf.device)
        self._state = advance_trigger(  # the traced step counts too (it was skipped, or not)
            self._state,
            outcome.found_inf,
            outcome.next_scale,
            patience=self.patience,
            initial_limit=self.initial_limit,
            forward_fault=fault,
            scale=outcome.scale,
        )
        if tracing:
            saved = self._state.saved_scale
            report = self._finish_trace(outcome)
            fields.update(report.log_fields())
            if self.heal_precision is not None:
                fields.update(self._heal(report, outcome, saved))
        self._publish()
        if published is not None:
            self._act(published, outcome)
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

    def undo_heal(self) -> None:
        """Return every healed module to autocast (its forward as before) and let healing start again."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self.healed.clear()
        self.healing = self.heal_precision is not None

    # the flags' way to the host ---------------------------------------------------------------------------------

    def _publish(self) -> None:
        """Copy the latched flags and the skip streak towards host memory without blocking; :meth:`_take_published`
        reads them at the next step."""
        assert self._state is not None  # after_step moved it first
        flags = torch.stack([self._state.fired.to(torch.int32), self._state.cause, self._state.skip_streak])
        if flags.device.type == "cuda":
            buffer = torch.empty(3, dtype=torch.int32, pin_memory=True)
            buffer.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._published = (buffer, event)
        else:  # the CPU: a memory copy; another device: a blocking one
            self._published = (flags.to("cpu", copy=True), None)

    def _take_published(self) -> tuple[int, int, int] | None:
        """The flags the previous step published, as (fired, cause, skipped steps in a row); waits for their copy on
        CUDA (issued a step ago, so done). None where no step published since the trigger started again."""
        if self._published is None:
            return None
        buffer, event = self._published
        self._published = None
        if event is not None:
            event.synchronize()
        fired, cause, skipped = (int(v) for v in buffer.numpy())
        return fired, cause, skipped

    def _act(self, published: tuple[int, int, int], outcome: StepOutcome) -> None:
        """What the previous step's flags ask for: a trace where the trigger fired; with ``heal``, giving up (or a
        warning) after ``give_up_after`` skipped steps in a row."""
        fired, cause, skipped = published
        if self.heal_precision is not None:
            if self.give_up_after is not None and skipped >= self.give_up_after:
                self._give_up(skipped, outcome)
            if self.give_up_after is None and skipped >= self._warned_at + WARN_EVERY:
                self._warned_at = skipped
                warnings.warn(
                    OverflowWarning(
                        f"{_where()}{skipped} steps in a row were skipped (give_up_after=None keeps the run going); "
                        f"the last report:\n{self.last_report}",
                        self.last_report or _empty_report(),
                    ),
                    stacklevel=outside_caller(),
                )
            if not skipped:
                self._warned_at = 0
        if fired:
            self._cause = cause
            self._tracer = Tracer(self.model)

    def _give_up(self, skipped: int, outcome: StepOutcome) -> None:
        why = (
            "healing stopped (it could not fix this run)"
            if self.heal_precision is not None and not self.healing
            else "nothing healed it: the loss or the data stays non-finite, or the gradients overflow at every scale"
        )
        raise HealError(
            f"{_where()}OverflowDiagnosis(heal=..., give_up_after={self.give_up_after}): {skipped} steps in a row "
            f"were skipped up to step {outcome.step} and {why}; a run that skips every step only looks alive. Fix what "
            f"the reports name (.reports; the last one below), or pass give_up_after=None to keep skipping.\n"
            f"{self.last_report if self.last_report is not None else 'No step was traced.'}",
            self.reports,
        )

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
        self.reports.append(report)
        state = self._state
        if state is not None:  # the overflow streak starts again from zero
            zero = TriggerState.init(state.streak.device)
            self._state = state._replace(streak=zero.streak, fired=zero.fired, cause=zero.cause)
        healing_it = self.healing and report.kind == "forward"
        cause = (report.kind, report.module)
        if healing_it or cause in self.reported:
            return report
        self.reported.add(cause)
        warnings.warn(
            OverflowWarning(
                f"{_where()}{self._fired_by(outcome)}; the traced step {outcome.step} found:\n{report}"
                f"{self._what_healing_does(report)}",
                report,
            ),
            stacklevel=outside_caller(),
        )
        return report

    def _fired_by(self, outcome: StepOutcome) -> str:
        if self._cause == 2:
            return f"the loss was non-finite {FAULT_PATIENCE} steps in a row"
        now = _num(float(outcome.next_scale))
        return f"{self.patience} or more steps in a row overflowed (the loss scale is now {now})"

    def _what_healing_does(self, report: OverflowReport) -> str:
        """For a healing run: what happens to the steps of a fault healing leaves alone."""
        if self.heal_precision is None:
            return ""
        if report.kind in ("input", "loss"):
            return (
                "\nHealing heals no data and no loss computation: such steps are skipped without lowering the scale "
                "(counted as forward faults), and the run goes on."
            )
        if report.kind == "backward":
            return (
                "\nHealing heals no backward overflow: gradients past float16's range even at this scale usually mean "
                "the run diverges."
            )
        return ""

    # healing ----------------------------------------------------------------------------------------------------

    def _heal(self, report: OverflowReport, outcome: StepOutcome, saved: torch.Tensor | None) -> dict[str, Any]:
        """Keep the module a forward fault names in the healing precision (the union over ranks), restore the scale;
        or stop healing where that cannot help. Returns the step's ``healed_modules`` (and ``rerun``: a front end
        with the step's closure runs it again)."""
        if not self.healing:
            return {}
        mine = [report.module] if report.kind == "forward" and report.module is not None else []
        wanted = _union(mine)  # every rank calls it at this step: the trigger is the same on every rank
        if not wanted:
            return {}
        new = [name for name in wanted if name not in self.healed]
        why = None
        if "" in wanted:
            why = "the fault is in the model's own code: keeping the whole model in float32 is no heal"
        elif not new:
            why = f"keeping {', '.join(repr(n) for n in wanted)} in {self._precision_name} did not fix the fault"
        elif len(self.healed) + len(new) > self.max_healed:
            why = f"it would keep more than max_healed={self.max_healed} modules"
        if why is not None:
            self.healing = False
            warnings.warn(
                HealWarning(
                    f"{_where()}healing stops at step {outcome.step}: {why}; healing cannot fix this run. Kept so far: "
                    f"{self._kept()}.\n{report}",
                    report,
                    self.healed,
                ),
                stacklevel=outside_caller(),
            )
            return {}
        for name in new:
            self._keep(name)
        restored = self._restore(saved)
        if self._state is not None:  # healed: the following steps are its check, counted from here
            zero = TriggerState.init(self._state.streak.device)
            self._state = self._state._replace(
                fault_streak=zero.fault_streak, skip_streak=zero.skip_streak, saved_scale=zero.saved_scale
            )
        warnings.warn(
            HealWarning(
                f"{_where()}healed at step {outcome.step}: {', '.join(repr(n) for n in new)} now "
                f"{'runs' if len(new) == 1 else 'run'} in "
                f"{self._precision_name}, outputs in float32 ({_fault(report)}){restored}. Kept so far: {self._kept()}."
                f"\n{report}",
                report,
                self.healed,
            ),
            stacklevel=outside_caller(),
        )
        return {"healed_modules": ", ".join(new), "rerun": True}

    @property
    def _precision_name(self) -> str:
        return _PRECISIONS.get(self.heal_precision, "float32") if self.heal_precision is not None else "float32"

    def _keep(self, name: str) -> None:
        assert self.heal_precision is not None  # only a healing diagnosis keeps modules
        module = self.model.get_submodule(name)
        self._handles[name] = keep_float32(module, outputs="float32", precision=self.heal_precision)
        self.healed[name] = self.heal_precision

    def _restore(self, saved: torch.Tensor | None) -> str:
        """Set the scale back to the one the run had when the skipped steps began (one host read); what it says."""
        if saved is None or self.front_end is None:
            return ""
        value = float(saved)
        loss_scale = self.front_end.loss_scale
        if not (value > 0 and math.isfinite(value)) or value == float(loss_scale.scale):
            return ""
        loss_scale.set_scale(value, "OverflowDiagnosis(heal=...): the scale before the fault")
        return f"; the loss scale is restored to {_num(value)}, its value when the fault began"

    def _kept(self) -> str:
        return ", ".join(f"{n!r} ({_PRECISIONS[d]})" for n, d in self.healed.items()) or "none"

    # checkpoints ------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The healed modules (name to precision), whether healing goes on, the trigger's state, the flags published
        and not yet acted on, whether a trace is due, and the causes already reported. Host reads: the trigger."""
        published = None
        if self._published is not None:
            buffer, event = self._published
            if event is not None:
                event.synchronize()
            published = [int(v) for v in buffer.numpy()]
        return {
            "healed": {name: _PRECISIONS[dtype] for name, dtype in self.healed.items()},
            "healing": self.healing,
            "trigger": None if self._state is None else {k: v.tolist() for k, v in self._state._asdict().items()},
            "published": published,
            "tracing": self._tracer is not None,
            "cause": self._cause,
            "reported": sorted([kind, module] for kind, module in self.reported),
        }

    def validate_state_dict(self, state: object) -> None:
        """Raise (naming what is wrong) unless ``state`` is what :meth:`state_dict` saved, for this model: every healed
        module must exist in it. Changes nothing."""
        call = f"OverflowDiagnosis(model={type(self.model).__name__}).load_state_dict"
        keys = ("healed", "healing", "trigger", "published", "tracing", "cause", "reported")
        if not isinstance(state, dict) or not set(keys) <= state.keys():
            raise ValueError(
                f"{call}(state={state!r:.80}): state must be the dict OverflowDiagnosis.state_dict() returned "
                f"(keys {', '.join(keys)})."
            )
        healed = state["healed"]
        if not isinstance(healed, dict):
            raise ValueError(f"{call}: healed must be a dict of module name to precision; got {healed!r:.80}.")
        for name, precision in healed.items():
            try:
                self.model.get_submodule(name)
            except AttributeError:
                raise ValueError(
                    f"{call}: the checkpoint healed the module {name!r}, which the model given as diagnose= "
                    f"({type(self.model).__name__}) does not have; load it into the model it was saved from. "
                    f"Nothing was loaded."
                ) from None
            validate_choice(call, f"healed[{name!r}]", precision, tuple(_PRECISIONS.values()))
        trigger = state["trigger"]
        if trigger is not None and (not isinstance(trigger, dict) or set(trigger) != set(TriggerState._fields)):
            raise ValueError(
                f"{call}: trigger must be None or a dict of the fields {list(TriggerState._fields)}; got "
                f"{trigger!r:.80}."
            )
        published = state["published"]
        if published is not None and (not isinstance(published, list) or len(published) != 3):
            raise ValueError(f"{call}: published must be None or [fired, cause, skipped]; got {published!r:.80}.")
        validate_choice(call, "healing", state["healing"], (True, False))
        validate_choice(call, "tracing", state["tracing"], (True, False))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (checked whole first): the healed modules kept again in this model, the trigger,
        a trace that was due."""
        self.validate_state_dict(state)
        self.undo_heal()
        for name, precision in state["healed"].items():
            dtype = next(d for d, n in _PRECISIONS.items() if n == precision)
            self._handles[name] = keep_float32(self.model.get_submodule(name), outputs="float32", precision=dtype)
            self.healed[name] = dtype
        self.healing = state["healing"]
        device = None if self.front_end is None else self.front_end.loss_scale.device
        trigger = state["trigger"]
        if trigger is None:
            self._state = None
        else:
            template = TriggerState.init(device)
            self._state = TriggerState(
                *(
                    torch.tensor(trigger[f], dtype=getattr(template, f).dtype, device=device)
                    for f in TriggerState._fields
                )
            )
        published = state["published"]
        self._published = None if published is None else (torch.tensor(published, dtype=torch.int32), None)
        self.remove()
        if state["tracing"]:
            self._tracer = Tracer(self.model)
        self._cause = int(state["cause"])
        self.reported = {(kind, module) for kind, module in state["reported"]}


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


def healing_precision(call: str, heal: object, model: nn.Module | None = None) -> torch.dtype | None:
    """The precision ``heal=`` asks healed modules to run in (None: no healing): False or None none; True float32;
    ``torch.float32``; ``torch.bfloat16`` where ``model``'s device runs it natively (the CPU; CUDA from compute
    capability 8.0).

    Raises:
        ValueError: another value, or bfloat16 on a device without it.
    """
    if heal is None or heal is False:
        return None
    if heal is True:
        return torch.float32
    validate_choice(call, "heal", heal, (False, True, torch.float32, torch.bfloat16))
    dtype = heal if isinstance(heal, torch.dtype) else torch.float32
    if dtype == torch.bfloat16 and model is not None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
            name = torch.cuda.get_device_name(device)
            raise ValueError(
                f"{call}: heal=torch.bfloat16 needs a device that runs bfloat16 natively (CUDA from compute "
                f"capability 8.0, the CPU); the model is on {name} (capability "
                f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}). Pass heal=True (float32)."
            )
        if device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"{call}: heal=torch.bfloat16 is known to run natively on the CPU and on CUDA from compute capability "
                f"8.0; the model is on {device.type}. Pass heal=True (float32)."
            )
    return dtype


def _union(names: list[str]) -> list[str]:
    """The names every rank's trace gave, in one sorted list (``names`` itself outside torch.distributed). One
    all-gather of Python objects, where ranks agree."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return names
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    return sorted({n for part in gathered if part for n in part})


def _fault(report: OverflowReport) -> str:
    if report.nan:
        return f"a NaN at {report.where}"
    return f"a forward overflow at {report.where}"


def _where() -> str:
    rank = _rank()
    return f"rank {rank}: " if rank is not None else ""


def _num(x: float) -> str:
    if x > 0 and math.isfinite(x) and x == 2.0 ** round(math.log2(x)):
        return f"2**{round(math.log2(x))}"
    return f"{x:.4g}"


def _empty_report() -> OverflowReport:
    return OverflowReport("none", None, None, None, False, 1.0, None, "No step was traced.")


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


def validate_heal(call: str, diagnose: object, heal: object, true_means: str | None = None) -> None:
    """The one check of ``heal=`` beside ``diagnose=`` (:func:`validate_diagnose` first): healing needs a model to
    trace, and a diagnosis passed whole says its own ``heal``."""
    validate_diagnose(call, diagnose, true_means)
    precision = healing_precision(call, heal)
    if precision is None:
        return
    if diagnose is None or diagnose is False:
        what = "diagnose=True (the model being trained)" if true_means else "diagnose=model"
        raise ValueError(
            f"{call}(heal={heal!r}): healing traces and heals the model, so it needs one: pass {what} beside "
            f"heal={heal!r} (or diagnose=OverflowDiagnosis(model, heal={heal!r})); got diagnose={diagnose!r}."
        )
    if isinstance(diagnose, OverflowDiagnosis) and diagnose.heal_precision != precision:
        raise ValueError(
            f"{call}(diagnose=OverflowDiagnosis(..., heal={diagnose.heal_precision}), heal={heal!r}): say heal once: "
            f"pass it to the OverflowDiagnosis, or pass a model as diagnose=; got both, and they differ."
        )


def diagnosis_from(
    call: str,
    diagnose: object,
    model: nn.Module | None = None,
    true_means: str = "the model being trained",
    heal: object = False,
) -> OverflowDiagnosis | None:
    """The diagnosis ``diagnose=`` and ``heal=`` ask for (checked by :func:`validate_heal`): None for None and False,
    an :class:`OverflowDiagnosis` as it is, ``OverflowDiagnosis(diagnose, heal=heal)`` for a module, and for True
    ``OverflowDiagnosis(model, heal=heal)``, the framework's own model (``true_means`` says which, for the error where
    there is none; a framework that meets it later builds it then)."""
    validate_heal(call, diagnose, heal, None if model is None else true_means)
    if diagnose is None or diagnose is False:
        return None
    if isinstance(diagnose, OverflowDiagnosis):
        return diagnose
    target = model if diagnose is True else diagnose
    assert isinstance(target, nn.Module)  # validated above
    return OverflowDiagnosis(target, heal=heal if heal is not None else False)  # type: ignore[arg-type]  # checked above
