"""lossscale inside the HF Transformers ``Trainer``: :class:`lossscale.GradScaler` in its accelerator's scaler slot.

=================================  ===============================================================
Trainer behaviour                  with :func:`use_lossscale` (and :class:`LossScaleCallback`)
=================================  ===============================================================
``fp16=True`` forward/backward     Accelerate's autocast, ``scaler.scale(loss).backward()``
``max_grad_norm``, grad norm log   ``scaler.unscale_`` first, as with torch's scaler
gradient accumulation              one ``scaler.step`` + ``update`` per optimizer step
LR schedule on a skipped step      held, for fused optimizers too (torch's scaler: non-fused only)
``checkpoint-N/scaler.pt``         torch's keys + ``policy_state`` + ``skipped_steps``; resumes
logs (``log_history``, report_to)  ``loss_scale`` and ``skipped_steps`` added to every log
a collapsing scale (``diagnose``)  the next step traced; ``overflow_kind``/``overflow_module`` logged
=================================  ===============================================================

Built on :mod:`lossscale.integrations.accelerate`: its checks and installation, with the Trainer's names.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from lossscale.integrations import require
from lossscale.validation import StateDictError

require("transformers", "transformers", "transformers")
require("accelerate", "transformers", "transformers")

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from lossscale.diagnosis.addon import OverflowDiagnosis, diagnosis_from
from lossscale.integrations.accelerate import install, prepared
from lossscale.policies.base import Policy
from lossscale.reporting import EventFields, ScalerStep, read_scalars
from lossscale.scaler import GradScaler

__all__ = ["LossScaleCallback", "use_lossscale"]


class _TrainerScaler(GradScaler):
    """The GradScaler that :func:`use_lossscale` installs: ``skip_mode="host"`` by default, and a count of the
    skipped steps.

    Accelerate reports a step as skipped (``optimizer_step_was_skipped``, which gates the Trainer's LR scheduler)
    only when ``optimizer.step`` was never called; with ``skip_mode="host"`` an overflowing step never calls it,
    fused optimizers included (one host read of found_inf per step, which a non-fused step makes anyway).
    ``skipped_steps`` is counted on the device, saved in ``state_dict()`` and restored by ``load_state_dict`` (a
    checkpoint of torch's scaler, without it, starts the count at 0).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"skip_mode": "host", **kwargs})
        self._skipped: torch.Tensor | int = 0
        self._faults: torch.Tensor | int = 0
        #: The fields the add-ons added at each update, kept until the Trainer logs (LossScaleCallback takes them).
        self.unlogged = EventFields()

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """GradScaler.update, keeping the fields its add-ons added for the next log."""
        super().update(new_scale)
        if new_scale is None:
            self.unlogged.add(self.last_fields)

    @property
    def skipped_steps(self) -> torch.Tensor | int:
        """Steps skipped so far: a 0-d int64 tensor on the scale's device after the first step (no host read)."""
        return self._skipped

    @property
    def forward_faults(self) -> torch.Tensor | int | None:
        """Of them, the forward faults (a non-finite loss; counted where the scaler finds them: ``heal=True``), else
        None."""
        return self._faults if self._finds_forward_faults else None

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> ScalerStep:
        """GradScaler.step, counting a skipped step (and a forward fault)."""
        decision = super().step(optimizer, *args, **kwargs)
        if self.is_enabled():
            self._skipped = (~decision.stepped).to(torch.int64) + self._skipped
            if decision.forward_fault is not None:
                self._faults = decision.forward_fault.to(torch.int64) + self._faults
        return decision

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's state dict plus ``skipped_steps`` (an int); empty when disabled."""
        out = super().state_dict()
        if out:
            out["skipped_steps"] = int(self._skipped)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """GradScaler's loader, plus ``skipped_steps`` when the dict has it (else the count restarts at 0)."""
        skipped = state_dict.get("skipped_steps", 0) if isinstance(state_dict, dict) else 0
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise StateDictError(
                f"GradScaler.load_state_dict(state_dict): state_dict['skipped_steps'] must be an "
                f"int >= 0 (the steps skipped so far); got {skipped!r}."
            )
        super().load_state_dict(state_dict)
        if self.is_enabled():
            self._skipped = skipped


class LossScaleCallback(TrainerCallback):
    """Adds ``loss_scale`` and ``skipped_steps`` to every log the Trainer writes: its ``log_history`` (and so
    ``trainer_state.json``), the ``report_to`` integrations and the progress printer.

    Register it, then call :func:`use_lossscale`, which hands it the scaler and puts it first among the callbacks::

        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[LossScaleCallback()])
        use_lossscale(trainer)

    Values: ``loss_scale``, the current scale (a float: the one the next step's gradients carry);
    ``skipped_steps``, the steps skipped since training began (an int, restored on resume). One host read per log.
    With ``use_lossscale(trainer, diagnose=True)``, the first log after the diagnosis made a report (at the step it
    traced, or the next log) also has ``overflow_kind`` (a string: ``"forward"``, ``"loss"``, ...) and, where the
    report names one, ``overflow_module`` (the module's qualified name, a string). Strings are what the Trainer's
    logs take: ``log_history`` keeps them, TensorBoard gets them as text, MLflow drops them with a warning.

    Where it hooks in: ``Trainer.log(logs)`` appends a copy of ``logs`` to ``state.log_history``, then calls each
    callback's ``on_log`` in list order, the report_to integrations before the callbacks given to the Trainer.
    Running first, this ``on_log`` adds the values to ``logs`` (which every later callback receives) and to the
    record just appended to ``log_history``; it uses only the Trainer's callback list and state, where wrapping
    ``Trainer.log`` would replace a method on the user's Trainer.
    """

    def __init__(self) -> None:
        self._scaler: _TrainerScaler | None = None

    def _attach(self, scaler: _TrainerScaler) -> None:
        self._scaler = scaler

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Refuse to train without the scaler :func:`use_lossscale` installed in this Trainer."""
        if self._scaler is None:
            raise RuntimeError(
                "LossScaleCallback was not given a scaler: register it first (Trainer(callbacks="
                "[LossScaleCallback()]) or trainer.add_callback(LossScaleCallback())), then call "
                "use_lossscale(trainer) before trainer.train(); got a LossScaleCallback added after "
                "use_lossscale(trainer), or no use_lossscale call."
            )
        _check_stepping("LossScaleCallback", kwargs.get("optimizer"), self._scaler)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Add the values to ``logs`` and to the ``log_history`` record of this log."""
        if self._scaler is None or logs is None:
            return
        scale = self._scaler.loss_scale.scale if self._scaler.is_enabled() else 1.0
        counts: dict[str, Any] = {"loss_scale": scale, "skipped_steps": self._scaler.skipped_steps}
        if self._scaler.forward_faults is not None:
            counts["forward_faults"] = self._scaler.forward_faults
        values = read_scalars(counts)
        values.update(self._scaler.unlogged.take())
        record = state.log_history[-1] if state.log_history else None
        if record is not None and record.keys() == logs.keys() | {"step"}:  # Trainer.log's copy of these logs
            record.update(values)
        logs.update(values)


class _ScalerCheck(TrainerCallback):
    """What :func:`use_lossscale` registers where the Trainer has no :class:`LossScaleCallback` (which checks the
    same): at ``on_train_begin``, refuse to train with another scaler than the one installed. Without it a Trainer
    whose accelerator was rebuilt (``hyperparameter_search`` rebuilds it for every trial) would train with torch's
    scaler, or with none on CPU, without a word."""

    def __init__(self, scaler: _TrainerScaler) -> None:
        self._scaler = scaler

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        _check_stepping("use_lossscale(trainer)", kwargs.get("optimizer"), self._scaler)


def _check_stepping(who: str, optimizer: object, scaler: _TrainerScaler) -> None:
    """Raise unless the Trainer's (prepared) optimizer steps with ``scaler``."""
    stepping = getattr(optimizer, "scaler", None)
    if stepping is not scaler:
        raise RuntimeError(
            f"{who}: the Trainer's optimizer steps with {type(stepping).__name__}, not the scaler "
            f"use_lossscale(trainer) installed. Its accelerator was rebuilt after use_lossscale "
            f"(Trainer.hyperparameter_search rebuilds it for every trial, where lossscale cannot "
            f"follow), or use_lossscale was called on another Trainer. Call use_lossscale(trainer) "
            f"on this Trainer right before trainer.train()."
        )


def _check(trainer: object) -> None:
    if not isinstance(trainer, Trainer):
        raise TypeError(
            f"use_lossscale(trainer={type(trainer).__name__}(...)): trainer must be a "
            f"transformers.Trainer; got {type(trainer).__module__}.{type(trainer).__qualname__}. For a "
            f"bare Accelerator use lossscale.integrations.accelerate.use_lossscale."
        )
    args = trainer.args
    if args.fp16 is not True:
        other = ", bf16=True" if args.bf16 else ""
        raise ValueError(
            f"use_lossscale(trainer, ...): the Trainer was built with TrainingArguments(fp16="
            f"{args.fp16!r}{other}); loss scaling needs fp16=True (float16 autocast; bfloat16 and "
            f"float32 need none). Build it with TrainingArguments(fp16=True, ...)."
        )
    if prepared(trainer.accelerator):
        raise RuntimeError(
            "use_lossscale(trainer, ...) was called after the Trainer prepared its model "
            "(trainer.train(), evaluate() or predict() already ran), which keeps the scaler and "
            "autocast it was prepared with. Call use_lossscale(trainer) right after Trainer(...), "
            "before train()."
        )


def use_lossscale(
    trainer: Trainer,
    *,
    policy: Policy[Any] | None = None,
    fp16_on_cpu: bool = False,
    diagnose: bool | torch.nn.Module | OverflowDiagnosis | None = None,
    heal: bool | torch.dtype = False,
    **scaler_kwargs: Any,
) -> GradScaler:
    """Install lossscale's GradScaler in ``trainer``'s accelerator and hand it to the Trainer's
    :class:`LossScaleCallback`, if it has one; return the scaler.

    Call it after ``Trainer(args=TrainingArguments(fp16=True, ...))`` and before ``train()``; ``train()`` loads a
    checkpoint's ``scaler.pt`` into it when resuming::

        scaler = use_lossscale(trainer, policy=PredictiveScale())   # or GradScaler's arguments

    Where the Trainer has no :class:`LossScaleCallback`, a small callback of lossscale's checks at the start of
    ``train()`` that the Trainer steps with this scaler: a Trainer whose accelerator was rebuilt since
    (``hyperparameter_search`` rebuilds it for every trial) raises a RuntimeError rather than train with another.

    The scaler is a :class:`~lossscale.GradScaler` with ``skip_mode="host"``, so that its skipped steps hold the LR
    schedule for fused optimizers too (one host read of found_inf per step; ``skip_mode="auto"`` is torch's
    behaviour, with no read for a fused optimizer), and which counts them (``skipped_steps``, saved in
    ``scaler.pt``).

    ``diagnose=True`` gives the scaler an overflow diagnosis of ``trainer.model`` (:mod:`lossscale.diagnosis`): when
    the loss scale collapses, the next training step is traced and a :class:`~lossscale.OverflowWarning` names the
    module where the first inf or NaN appeared; :class:`LossScaleCallback` writes the finding into the logs.

    Args:
        trainer: A ``transformers.Trainer`` with ``fp16=True`` that has not prepared its model yet.
        policy: Any :class:`~lossscale.Policy` (a preset, ``PredictiveScale()``); default torch's rule.
        fp16_on_cpu: True turns float16 autocast on when the Trainer runs on CPU, where it drops fp16.
        diagnose: True (the Trainer's own model), a module to trace, an :class:`~lossscale.OverflowDiagnosis` (its
            ``patience``), or None or False (no diagnosis).
        heal: True (or ``torch.bfloat16``): with ``diagnose``, a forward overflow keeps the faulting modules in
            float32 (or bfloat16) at once, skips the step without lowering the scale and warns with a
            :class:`~lossscale.HealWarning` (:ref:`healing`); False (default): diagnosis only.
        **scaler_kwargs: Other arguments of ``GradScaler`` (``init_scale``, ``growth_interval``, ``skip_mode``).

    Raises:
        TypeError: ``trainer`` is not a Trainer, ``fp16_on_cpu`` not a bool, or ``diagnose`` none of the values
            above.
        RuntimeError: the Trainer already prepared its model (``train()``, ``evaluate()`` or ``predict()`` ran).
        ValueError: ``fp16`` is not True; CPU without ``fp16_on_cpu``, or ``fp16_on_cpu`` on another device;
            DeepSpeed (it keeps its own scaler); GradScaler's own refusals.
    """
    _check(trainer)
    diagnosis = diagnosis_from(
        "use_lossscale", diagnose, trainer.model, "the Trainer's own model, trainer.model", heal=heal
    )
    kwargs = scaler_kwargs if policy is None else {"policy": policy, **scaler_kwargs}
    scaler = cast(
        _TrainerScaler,
        install(
            trainer.accelerator, fp16_on_cpu, kwargs, name="trainer", scaler_type=_TrainerScaler, diagnose=diagnosis
        ),
    )
    callbacks = trainer.callback_handler.callbacks
    for old in [c for c in callbacks if isinstance(c, _ScalerCheck)]:  # an earlier call's
        callbacks.remove(old)
    attached = [c for c in callbacks if isinstance(c, LossScaleCallback)]
    for callback in attached:
        callbacks.remove(callback)
        callbacks.insert(0, callback)  # ahead of the report_to integrations
        callback._attach(scaler)
    if not attached:
        callbacks.append(_ScalerCheck(scaler))
    return scaler
