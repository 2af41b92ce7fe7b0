"""GradScaler: a drop-in for ``torch.amp.GradScaler`` composed from the step stages.

With torch's arguments: the same calls, scale trajectory and parameter updates, bit for bit. Beyond torch:
``policy=``, ``overflow_mode="saturation"``, ``step()`` returning its decision, overflow attribution, and
found_inf agreed over ``torch.distributed``. Unlike torch, the scale never goes below the policy's floor
(2**-126 by default) and every scale set from outside is checked (:func:`~lossscale.validation.validated_scale`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import abc, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch.amp.grad_scaler import OptState

from lossscale import stages
from lossscale.addons.base import AddOn, FrontEnd, parts_of, warn_unmatched_parts
from lossscale.keywords import add_ons_from, validate_add_ons
from lossscale.ops import distributed as _dist
from lossscale.ops.overflow import OverflowMode, check_, check_with_amax_, saturation_threshold, validate_mode
from lossscale.policies.base import Policy, validate_policy
from lossscale.policies.dynamic import DynamicScale, validate_dynamic_args
from lossscale.reporting import ScalerStep, StepOutcome
from lossscale.state import LossScale
from lossscale.validation import (
    ArgumentTypeError,
    StateDictError,
    validate_choice,
    validate_optimizer,
    validate_process_group,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_TORCH_DEFAULTS = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
_TORCH_COPIES = {"scale": "scale", "_growth_tracker": "growth_tracker"}  # torch's key -> policy_state's field


def _fresh_record() -> dict[str, Any]:
    """torch's ``_refresh_per_optimizer_state()``: equal to it, so code comparing with it still works."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}


@dataclass
class _Iteration:
    """What lives from one ``update()`` to the next: torch's record per optimizer (``_per_optimizer_states``), the
    gradient maxima (a policy that reads them), whether the losses scaled were finite (where they are watched) and the
    iteration's forward fault once agreed."""

    records: defaultdict[int, dict[str, Any]] = dataclasses.field(default_factory=lambda: defaultdict(_fresh_record))
    amax_seen: list[torch.Tensor] = dataclasses.field(default_factory=list)
    loss_finite: torch.Tensor | None = None
    fault: torch.Tensor | None = None
    losses: int = 0  # the losses scaled, counted where add-ons see them


class GradScaler:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s calls, on a sync-free policy.

    Usage is torch's::

        scaler.scale(loss).backward()
        scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(params, 1.0)   # optional
        scaler.step(opt)
        scaler.update()

    Host reads: none in ``scale``, ``unscale_`` and ``update`` (one with ``at_floor="raise"``); in ``step``,
    none with optimizers that take ``grad_scale``/``found_inf`` (fused Adam/AdamW/SGD), else one, as torch.

    Args:
        device: Accepted for torch compatibility; the state lives on the device of the first scaled output.
        init_scale: torch's argument: the first scale, default 2**16; a number in [2**-126, float32's largest
            finite value]. This and the next three build a :class:`~lossscale.DynamicScale` with torch's rule; leave all
            four at their defaults when passing ``policy`` (a ValueError otherwise).
        growth_factor: torch's argument: > 1, default 2.0; multiplies the scale after ``growth_interval`` clean
            steps in a row.
        backoff_factor: torch's argument: in (0, 1), default 0.5; multiplies the scale at each overflowing step.
        growth_interval: torch's argument: an int >= 1, default 2000; the clean steps in a row between growths.
        enabled: False makes every call a no-op (``step`` still steps). Arguments are validated anyway.
        policy: Any :class:`~lossscale.Policy`, e.g. ``DynamicScale(hysteresis=2)`` or a preset.
        overflow_mode: ``"inf_nan"`` (default) or ``"saturation"`` (``scaled |g| >= finfo(saturation_dtype).max``).
        saturation_dtype: The low-precision format whose max defines saturation (default float16).
        process_group: Where found_inf is reduced when torch.distributed is initialized (default: world).
        skip_mode: ``"auto"`` (torch's): an optimizer that takes ``grad_scale``/``found_inf`` skips an overflowing
            step in its kernel (``optimizer.step`` is called), others are skipped on the host. ``"host"``: every
            step is decided on the host (one read of found_inf) and an overflowing step never calls
            ``optimizer.step``, fused optimizers included, for code that watches whether it was called (HF
            Accelerate's ``optimizer_step_was_skipped``, which holds the Trainer's LR schedule).
        diagnose: The model to trace when the loss scale collapses or the loss stays non-finite
            (:mod:`lossscale.diagnosis`), or an :class:`~lossscale.OverflowDiagnosis`; None or False: none.
        heal: True (or ``torch.bfloat16``), with ``diagnose``: heal the run (docs/diagnosis.md, "Healing"): a step
            whose loss is non-finite is skipped without lowering the scale, and a forward fault's module runs in
            float32 (bfloat16) from then on, the scale restored; the following steps check it.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        policy: Policy[Any] | None = None,
        overflow_mode: OverflowMode = "inf_nan",
        saturation_dtype: torch.dtype = torch.float16,
        process_group: ProcessGroup | None = None,
        skip_mode: Literal["auto", "host"] = "auto",
        diagnose: torch.nn.Module | AddOn | Literal[False] | None = None,
        heal: bool | torch.dtype = False,
    ) -> None:
        policy = _policy_from_args(
            policy,
            dict(
                init_scale=init_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
            ),
        )
        validate_mode("GradScaler", overflow_mode)
        validate_choice("GradScaler", "skip_mode", skip_mode, ("auto", "host"))
        self.skip_mode = skip_mode
        if not isinstance(enabled, bool):
            raise ValueError(f"GradScaler(enabled={enabled!r}): enabled must be True or False; got {enabled!r}.")
        self._device = device
        self._enabled = enabled
        self.overflow_mode = overflow_mode
        self._threshold = saturation_threshold(saturation_dtype, "GradScaler")
        validate_process_group("GradScaler", process_group)
        self.process_group = process_group
        self._loss_scale = LossScale(policy)
        # what the policy reads besides found_inf (fixed with its class, which a LossScale keeps)
        self._reads_amax, self._reads_loss_finite = policy.observes_amax, policy.observes_loss_finite
        self._placed = False  # whether the state has moved to the device of the first scaled output
        self._replicas: dict[torch.device, torch.Tensor] = {}
        self._updates = 0  # update() calls that updated the policy
        self._iteration = _Iteration()
        self._add_ons: list[AddOn] = []
        self._finds_forward_faults = False
        #: The fields the add-ons added at the last ``update()`` (a diagnosis's ``overflow_kind``, ...): what a
        #: LossScaleOptimizer puts in its StepResult, for the loggers of a GradScaler's steps.
        self.last_fields: dict[str, Any] = {}
        self.attach_add_ons(add_ons_from("GradScaler", diagnose=diagnose, heal=heal))

    # --- state -------------------------------------------------------------------------------

    @property
    def loss_scale(self) -> LossScale[Any]:
        """The object that holds the policy and its state (scale, counters)."""
        return self._loss_scale

    @property
    def policy(self) -> Policy[Any]:
        """The frozen rule."""
        return self._loss_scale.policy

    @property
    def add_ons(self) -> tuple[AddOn, ...]:
        """The add-ons (``diagnose=``'s), in the order their hooks run."""
        return tuple(self._add_ons)

    def attach_add_ons(self, add_ons: Sequence[AddOn]) -> None:
        """Take more add-ons (built by :func:`lossscale.keywords.add_ons_from`, as an integration does when it meets
        the model), checked with the ones already here; they attach at once."""
        validate_add_ons("GradScaler", [*self._add_ons, *add_ons])
        self._add_ons = [*self._add_ons, *add_ons]
        self._finds_forward_faults = any(a.finds_forward_faults for a in self._add_ons)
        self._watches_losses = self._finds_forward_faults or self._reads_loss_finite
        self._attach_add_ons()

    @property
    def _per_optimizer_states(self) -> defaultdict[int, dict[str, Any]]:
        """torch's record per optimizer for this iteration (stage, found_inf per device)."""
        return self._iteration.records

    @_per_optimizer_states.setter
    def _per_optimizer_states(self, value: defaultdict[int, dict[str, Any]]) -> None:
        self._iteration.records = value

    def _place(self, device: torch.device) -> None:
        """Move the scale to the first scaled output's device, and tell the add-ons."""
        self._loss_scale.to(device)
        self._placed = True
        self._attach_add_ons()

    def _attach_add_ons(self) -> None:
        """Tell the add-ons about this scaler (again once its scale moved to the first scaled output's device)."""
        front_end = FrontEnd(call="GradScaler", loss_scale=self._loss_scale, process_group=self.process_group)
        for add_on in self._add_ons:
            add_on.attach(front_end)

    @staticmethod
    def _before_scale(call: str) -> RuntimeError:
        return RuntimeError(
            f"{call} was called before scale(): call scaler.scale(loss).backward() earlier in "
            f"the iteration so the scaler knows the scale and its device."
        )

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        """The scale on another device than its own, copied once per device and value (its value may change)."""
        scale = self._loss_scale.scale
        if self._replicas.get(scale.device) is not scale:
            self._replicas = {scale.device: scale}
        if device not in self._replicas:
            self._replicas[device] = scale.to(device, non_blocking=True)
        return self._replicas[device]

    # --- torch's calls -----------------------------------------------------------------------

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply a tensor (or nested lists/tuples of tensors) by the current scale. No host read."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if not self._placed:
                self._place(outputs.device)
            iteration = self._iteration
            if self._add_ons:  # every add-on sees the loss (a GradScaler scales every loss)
                iteration.losses += 1
                for add_on in self._add_ons:
                    add_on.on_loss(outputs, iteration.losses == 1)
            if self._watches_losses:
                finite = torch.isfinite(outputs.detach()).all().to(self._loss_scale.device)
                iteration.loss_finite = finite if iteration.loss_finite is None else iteration.loss_finite & finite
            scale = self._loss_scale.scale
            return stages.scale_loss(
                outputs, scale if outputs.device == scale.device else self._scale_on(outputs.device)
            )
        if isinstance(outputs, abc.Iterable) and not isinstance(outputs, (str, bytes)):
            mapped = map(self.scale, outputs)
            return type(outputs)(mapped) if isinstance(outputs, (list, tuple)) else mapped
        raise ArgumentTypeError(
            f"GradScaler.scale(outputs): outputs must be a Tensor or an iterable of "
            f"Tensors (the loss); got {type(outputs).__name__} {outputs!r}."
        )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record whether they overflowed.
        One read+write pass (saturation: one read more); no host read."""
        if not self._enabled:
            return
        validate_optimizer("GradScaler.unscale_", optimizer)
        if not self._placed:
            raise self._before_scale("unscale_()")
        loss_scale = self._loss_scale
        record = self._iteration.records[id(optimizer)]
        if record["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() was already called for this optimizer since the last update(); "
                "call unscale_() at most once per optimizer between two update() calls."
            )
        if record["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "unscale_() was called after step() for this optimizer; step() already unscaled the "
                "gradients, so call unscale_() before step(), then update()."
            )
        found_inf = stages.guarded_found(loss_scale.scale)
        inv_scale = stages.inverse(loss_scale.scale, found_inf)
        found = self._unscale_grads_(optimizer, inv_scale, found_inf, False)  # starts from the guard's verdict
        record["found_inf_per_device"] = self._agreed(found)
        record["stage"] = OptState.UNSCALED

    def _agreed(self, found: dict[torch.device, torch.Tensor]) -> dict[torch.device, torch.Tensor]:
        """found_inf per device, summed onto the scale's device and reduced over ranks when distributed, in one
        reduction with the iteration's forward fault (where forward faults are found)."""
        if not found or not _dist.active(self.process_group):
            return found
        device = self._loss_scale.device
        total = torch.zeros((), dtype=torch.float32, device=device)
        for t in found.values():
            total += t.to(device, non_blocking=True)
        local_fault = self._local_fault() if self._finds_forward_faults else None
        total, self._iteration.fault = stages.agree_(total, local_fault, self.process_group, is_flag=False)
        return {device: total}

    def _local_fault(self) -> torch.Tensor:
        """This process's forward fault: 1 where a loss scaled this iteration was non-finite (0-d float32)."""
        finite = self._iteration.loss_finite
        device = self._loss_scale.device
        return torch.zeros((), device=device) if finite is None else (~finite).float()

    def _fault(self) -> torch.Tensor:
        """The iteration's forward fault (where forward faults are found), agreed over ranks where they agree."""
        if self._iteration.fault is None:
            self._iteration.fault = self._local_fault()
        return self._iteration.fault

    def _found_inf(self, records: Iterable[dict[str, Any]], call: str) -> torch.Tensor:
        """Every recorded found_inf as the core's one form: a 0-d float32 0/1 flag on the scale's device."""
        device = self._loss_scale.device
        values = [t.to(device, non_blocking=True) for r in records for t in r["found_inf_per_device"].values()]
        if not values:
            raise stages.NoGradientsError(
                f"{call}: No inf checks were recorded for this optimizer: no gradient "
                f"was unscaled or checked since the last update(). Call backward on the "
                f"scaled loss, then step(optimizer), before update()."
            )
        return values[0] if len(values) == 1 else torch.stack(values).amax()  # one device: the record's own flag

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> ScalerStep:
        """Unscale (unless done), then apply ``optimizer.step(*args, **kwargs)`` only if nothing overflowed (and,
        where forward faults are found, every loss was finite). Host reads: none for a fused optimizer
        (``skip_mode="auto"``), else one (found_inf)."""
        if not self._enabled:
            return ScalerStep(found_inf=torch.zeros((), dtype=torch.bool), value=optimizer.step(*args, **kwargs))
        if "closure" in kwargs:
            raise RuntimeError(
                "Closure use is not currently supported if GradScaler is enabled: "
                "GradScaler.step(optimizer, closure=...) cannot scale the closure's loss."
            )
        validate_optimizer("GradScaler.step", optimizer)
        if not self._placed:
            raise self._before_scale("step()")
        record = self._iteration.records[id(optimizer)]
        if record["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "step() was already called for this optimizer since the last update(); call "
                "update() after step() before stepping again."
            )
        if stages.fused_scaling(optimizer) is not None and self.skip_mode == "auto":
            return self._fused_step(optimizer, record, *args, **kwargs)
        if record["stage"] is OptState.READY:
            self.unscale_(optimizer)
        found_inf = self._found_inf([record], "GradScaler.step(optimizer)").bool()
        fault = self._fault() if self._finds_forward_faults else None
        skip = found_inf if fault is None else found_inf | fault.bool()
        applies = stages.applies_on_host(skip, "GradScaler.step(optimizer)")  # one host read
        value = optimizer.step(*args, **kwargs) if applies else None
        record["stage"] = OptState.STEPPED
        return ScalerStep(found_inf=found_inf, value=value, forward_fault=None if fault is None else fault.bool())

    def _fused_step(
        self, optimizer: torch.optim.Optimizer, record: dict[str, Any], *args: Any, **kwargs: Any
    ) -> ScalerStep:
        """The optimizer unscales and skips in its kernel: a check first unless unscale_() ran."""
        if stages.fused_scaling(optimizer) == "scaler":
            stages.warn_grad_scaler_deprecated()
            value = optimizer.step(*args, **dict(kwargs, grad_scaler=self))  # it unscales and skips itself
            record["stage"] = OptState.STEPPED
            found = list(record["found_inf_per_device"].values())
            found_inf = (
                (sum(f.to(self._loss_scale.device) for f in found) > 0)
                if found
                else torch.zeros((), dtype=torch.bool, device=self._loss_scale.device)
            )
            return ScalerStep(found_inf=found_inf, value=value)
        if record["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)  # guards the scale the kernel divides by, too
            # a copy: the optimizer never holds the LossScale's tensor
            grad_scale = self._loss_scale.scale * getattr(optimizer, "grad_scale", 1)
        else:
            grad_scale = None  # unscale_() already divided the gradients
        found_inf = self._found_inf([record], "GradScaler.step(optimizer)")
        fault = self._fault() if self._finds_forward_faults else None
        skip = found_inf if fault is None else torch.maximum(found_inf, fault)
        value = stages.fused_step_(optimizer, grad_scale, skip, *args, **kwargs)
        record["stage"] = OptState.STEPPED
        # the kernel reads found_inf, never writes it
        return ScalerStep(
            found_inf=found_inf.bool(), value=value, forward_fault=None if fault is None else fault.bool()
        )

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Move the policy by this iteration's overflow (its state kept as it was on a forward fault), then show the
        add-ons the step; or set ``new_scale`` (checked; one host read for a tensor on an accelerator). No host read
        otherwise, unless the policy raises at its floor."""
        if not self._enabled:
            return
        if not self._placed:
            raise self._before_scale("update()")
        loss_scale, iteration = self._loss_scale, self._iteration
        if new_scale is not None:
            loss_scale.set_scale(new_scale, f"GradScaler.update(new_scale={new_scale!r})", "new_scale")
            self._iteration = _Iteration()
            return
        seen = [r for r in iteration.records.values() if r["stage"] is not OptState.READY]
        if not seen:
            raise RuntimeError(
                "update() was called without unscale_() or step() since the last update(); call "
                "scaler.step(optimizer) (which unscales) before update()."
            )
        found_inf = self._found_inf(seen, "GradScaler.update()")
        amax = None
        if self._reads_amax:
            maxima = [a.to(loss_scale.device) for a in iteration.amax_seen]
            amax = torch.stack(maxima).max() if maxima else torch.zeros((), device=loss_scale.device)
            stages.agree_amax_(amax, self.process_group)
        fault = self._fault() if self._finds_forward_faults else None
        scale = loss_scale.update(found_inf, amax, iteration.loss_finite, skip=fault)
        self._updates += 1
        self._iteration = _Iteration()
        if self._add_ons:
            flag = found_inf.bool()
            outcome = StepOutcome(
                stepped=~flag if fault is None else ~(flag | fault.bool()),
                found_inf=flag,
                scale=scale,
                next_scale=loss_scale.scale,
                step=self._updates - 1,
                forward_fault=None if fault is None else fault.bool(),
            )
            fields: dict[str, Any] = {}
            for add_on in self._add_ons:
                fields.update(add_on.after_step(outcome) or {})
            fields.pop("rerun", None)  # a GradScaler has no closure to run the step again
            self.last_fields = fields

    def get_scale(self) -> float:
        """The current scale as a Python float (a host read); 1.0 when disabled."""
        return float(self._loss_scale.scale) if self._enabled else 1.0

    def get_scale_tensor(self) -> torch.Tensor | None:
        """The current scale as a 0-d tensor on its device (no host read); None before the first scale()."""
        return self._loss_scale.scale if self._placed else None

    def is_enabled(self) -> bool:
        """Whether scaling is on."""
        return self._enabled

    # --- torch's knobs of the dynamic rule, and checkpoints --------------------------------------

    def _dynamic(self, call: str) -> DynamicScale:
        if not isinstance(self.policy, DynamicScale):
            raise TypeError(
                f"GradScaler.{call}: only a DynamicScale policy has this knob; "
                f"the policy is {type(self.policy).__name__}."
            )
        return self.policy

    def get_growth_factor(self) -> float:
        return self._dynamic("get_growth_factor()").growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._set_knob("set_growth_factor", "growth_factor", "new_factor", new_factor)

    def get_backoff_factor(self) -> float:
        return self._dynamic("get_backoff_factor()").backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._set_knob("set_backoff_factor", "backoff_factor", "new_factor", new_factor)

    def get_growth_interval(self) -> int:
        return self._dynamic("get_growth_interval()").growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._set_knob("set_growth_interval", "growth_interval", "new_interval", new_interval)

    def _set_knob(self, method: str, field: str, argument: str, value: Any) -> None:
        """torch's setter of one DynamicScale field, checked under torch's argument name."""
        policy = self._dynamic(f"{method}()")
        self._loss_scale.set_policy(policy.replaced(f"GradScaler.{method}", {field: argument}, **{field: value}))

    def state_dict(self) -> dict[str, Any]:
        """torch's keys where the policy has them, plus ``policy_state`` (every state field); empty when
        disabled. Host reads: the state."""
        if not self._enabled:
            return {}
        values = self._loss_scale.state_dict()
        out: dict[str, Any] = {"scale": float(cast(float, values["scale"]))}
        if isinstance(self.policy, DynamicScale):
            out.update(
                growth_factor=self.policy.growth_factor,
                backoff_factor=self.policy.backoff_factor,
                growth_interval=self.policy.growth_interval,
            )
        if "growth_tracker" in values:
            out["_growth_tracker"] = int(cast(int, values["growth_tracker"]))
        out["policy_state"] = values
        for key, part in parts_of(self._add_ons):  # an add-on that saves state (the diagnosis's healed modules)
            out[key] = part.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore our ``state_dict()`` or torch's; the whole dict is checked before anything changes. An add-on's
        entry (``diagnosis``) that only one side has is named in a UserWarning."""
        if not self._enabled:
            return
        call = "GradScaler.load_state_dict(state_dict)"
        if not isinstance(state_dict, dict):
            raise TypeError(f"{call}: state_dict must be a dict; got {type(state_dict).__name__}.")
        if not state_dict:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled "
                "instance of GradScaler: GradScaler.load_state_dict({}) has nothing to restore."
            )
        policy = self._policy_from(state_dict, call)
        if "policy_state" in state_dict:  # ours: the whole record
            values = state_dict["policy_state"]
            _validate_copies_agree(state_dict, call)
        else:  # torch's format
            if "scale" not in state_dict:
                raise StateDictError(
                    f"{call}: the state dict has neither 'policy_state' nor torch's 'scale'; got "
                    f"keys {sorted(state_dict)}."
                )
            values = self._loss_scale.state_dict()
            values["scale"] = state_dict["scale"]
            if "_growth_tracker" in state_dict and "growth_tracker" in values:
                values["growth_tracker"] = state_dict["_growth_tracker"]
        parts = [(key, part) for key, part in parts_of(self._add_ons) if key in state_dict]
        for key, part in parts:
            part.validate_state_dict(state_dict[key])
        self._loss_scale.load_state_dict(values, call)
        self._loss_scale.set_policy(policy)
        self._replicas = {}
        for key, part in parts:
            part.load_state_dict(state_dict[key])
        if "policy_state" in state_dict:  # torch's format holds no add-on: nothing to say
            warn_unmatched_parts(call, "GradScaler", parts_of(self._add_ons), state_dict)

    def _policy_from(self, state_dict: dict[str, Any], call: str) -> Any:
        """The policy with torch's three knobs from ``state_dict`` (a DynamicScale; validated), else unchanged."""
        policy = self._loss_scale.policy
        knobs = ("growth_factor", "backoff_factor", "growth_interval")
        if not isinstance(policy, DynamicScale) or not any(k in state_dict for k in knobs):
            return policy
        missing = [k for k in knobs if k not in state_dict]
        missing += ["scale"] if "scale" not in state_dict and "policy_state" not in state_dict else []
        if missing:
            raise StateDictError(
                f"{call}: torch's format holds scale, growth_factor, backoff_factor and "
                f"growth_interval together; missing {missing} (got keys {sorted(state_dict)})."
            )
        knob_values = {k: state_dict[k] for k in knobs}
        return policy.replaced(call, **knob_values)

    # --- torch's private surface ----------------------------------------------------------------

    @property
    def _scale(self) -> torch.Tensor | None:
        return self._loss_scale.scale if self._placed else None

    @_scale.setter
    def _scale(self, value: Any) -> None:
        if value is None:
            raise ValueError(
                "GradScaler._scale = None: the scale cannot be unset; assign a float or a one-element "
                "tensor, or use update(new_scale=...)."
            )
        if isinstance(value, torch.Tensor) and not self._placed:
            self._lazy_init_scale_growth_tracker(value.device)
        self._loss_scale.set_scale(value, f"GradScaler._scale = {value!r}", "_scale")

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        state = self._loss_scale.state
        return state.growth_tracker if self._placed and hasattr(state, "growth_tracker") else None

    @property
    def _init_scale(self) -> float:
        return float(self._loss_scale.scale)

    @_init_scale.setter
    def _init_scale(self, value: Any) -> None:
        self._loss_scale.set_scale(value, f"GradScaler._init_scale = {value!r}", "_init_scale")

    @property
    def _init_growth_tracker(self) -> int:
        return int(getattr(self._loss_scale.state, "growth_tracker", 0))

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: Any) -> None:
        values = self._loss_scale.state_dict()
        if "growth_tracker" not in values:
            raise AttributeError(
                f"GradScaler._init_growth_tracker = {value!r}: the policy "
                f"{type(self._loss_scale.policy).__name__} keeps no growth tracker."
            )
        values["growth_tracker"] = value
        self._loss_scale.load_state_dict(values, f"GradScaler._init_growth_tracker = {value!r}")

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        """Place the state on ``dev`` (torch creates its tensors here; ours exist from the start)."""
        self._loss_scale.to(dev)
        self._placed = True

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def _get_growth_tracker(self) -> int:
        return self._init_growth_tracker if self._enabled else 0

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale ``optimizer``'s gradients by ``inv_scale`` in place; return found_inf per device (a copy of
        ``found_inf``, set to 1.0 on overflow). One read+write pass (saturation, amax: one read more each)."""
        groups = stages.grouped_gradients(
            optimizer, "GradScaler.unscale_(optimizer)", allow_fp16=allow_fp16, required=False
        )
        found: dict[torch.device, torch.Tensor] = {}
        for (device, _), group in groups.items():
            if device not in found:
                found[device] = found_inf.to(device, copy=True)
            if self._reads_amax:
                amax = check_with_amax_(group, found[device], self.overflow_mode, self._threshold)
                self._iteration.amax_seen.append(amax)
            stages.unscale_(group, found[device], inv_scale, self.overflow_mode, self._threshold)
        return found

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """Check ``optimizer``'s gradients for a fused step, starting from the scale's guard; record found_inf
        per device. One pass; no host read."""
        record = self._iteration.records[id(optimizer)]
        groups = stages.grouped_gradients(optimizer, "GradScaler.step(optimizer)", required=False)
        found: dict[torch.device, torch.Tensor] = {}
        for (device, _), group in groups.items():
            if not found:  # the first flag starts from the scale's verdict
                found[device] = stages.guarded_found(self._loss_scale.scale, device)
            elif device not in found:
                found[device] = torch.zeros((), dtype=torch.float32, device=device)
            if self._reads_amax:
                self._iteration.amax_seen.append(
                    check_with_amax_(group, found[device], self.overflow_mode, self._threshold)
                )
            else:
                check_(group, found[device], self.overflow_mode, self._threshold)
        record["found_inf_per_device"] = self._agreed(found)
        return record["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    # --- attribution -------------------------------------------------------------------------

    def overflowing_parameters(
        self, optimizer: torch.optim.Optimizer, module: torch.nn.Module | None = None
    ) -> list[str]:
        """Which of ``optimizer``'s parameters have overflowing gradients now (names from ``module``, else
        ``"param_groups[i][j]"``). One read of the gradients and one host read."""
        names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        record = self._per_optimizer_states.get(id(optimizer))
        unscaled = (
            record is not None and record["stage"] is not OptState.READY and stages.fused_scaling(optimizer) is None
        )
        divided = self.get_scale() if (unscaled and self._enabled) else 1.0
        return stages.overflowing_names(optimizer, names, self.overflow_mode, self._threshold, divided)

    def __getstate__(self) -> dict[str, Any]:
        if self._enabled and self._iteration.records:
            raise RuntimeError(
                "GradScaler can be pickled only between iterations (before scale() or after "
                "update()); an unscale_()/step() is in flight."
            )
        state = self.__dict__.copy()
        state["_replicas"] = {}
        state["process_group"] = None
        return state  # restored by default (the instance's __dict__ updated with it)


def _policy_from_args(policy: Policy[Any] | None, torch_args: dict[str, Any]) -> Policy[Any]:
    """torch's four arguments as a DynamicScale, or ``policy`` (then those arguments must be left alone)."""
    if policy is None:
        validate_dynamic_args("GradScaler", torch_args)
        return DynamicScale(**torch_args)
    changed = {k: v for k, v in torch_args.items() if v != _TORCH_DEFAULTS[k]}
    if changed:
        raise ValueError(
            f"GradScaler(policy=..., {', '.join(f'{k}={v!r}' for k, v in changed.items())}): pass "
            f"either policy= or torch's scale arguments, not both; got both."
        )
    validate_policy("GradScaler", policy)
    return policy


def _validate_copies_agree(state_dict: dict[str, Any], call: str) -> None:
    """Raise where torch's keys and ``policy_state`` hold different values of the same field."""
    record = state_dict["policy_state"]
    if not isinstance(record, dict):
        return  # the record's own validation names it
    for key, field in _TORCH_COPIES.items():
        if key in state_dict and field in record and _differ(state_dict[key], record[field]):
            raise StateDictError(
                f"{call}: state_dict[{key!r}] = {state_dict[key]!r} and state_dict['policy_state'][{field!r}] = "
                f"{record[field]!r} disagree (state_dict() writes both); set both to the value you mean, or "
                f"remove 'policy_state' to load torch's keys alone."
            )


def _differ(torch_value: Any, recorded: Any) -> bool:
    """Whether torch's copy differs from the record's finite number (other values: the record's check)."""
    if not isinstance(recorded, (int, float)) or isinstance(recorded, bool) or not math.isfinite(recorded):
        return False
    return not isinstance(torch_value, (int, float)) or float(torch_value) != float(recorded)
