"""The checked, frozen step options of a :class:`~lossscale.LossScaleOptimizer`, and the plan they resolve to.

The plan says how a boundary step runs, resolved once from the options, the inner optimizer and the add-ons: the
step reads the plan, never the options. Two plans are resolved: one for windows whose losses were scaled, one for
windows that ran unscaled (a precision schedule's bfloat16 or float32 phase).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from lossscale.addons.base import AddOn
from lossscale.ops.overflow import OverflowMode, saturation_threshold, validate_mode
from lossscale.stages import takes_fused_scaling
from lossscale.validation import (
    validate_choice,
    validate_int_at_least,
    validate_positive_or_none,
    validate_process_group,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "Measure",
    "OurPass",
    "Plans",
    "ResolvedSkipMode",
    "SkipMode",
    "StepOptions",
    "StepPlan",
    "Unscaler",
    "resolve",
]

SkipMode = Literal["auto", "fused", "host", "masked"]
ResolvedSkipMode = Literal["fused", "host", "masked"]


@dataclass(frozen=True)
class StepOptions:
    """How a boundary step runs; checked once (see :class:`~lossscale.LossScaleOptimizer` for each option)."""

    overflow_mode: OverflowMode = "inf_nan"
    clip_grad_norm: float | None = None
    clip_grad_value: float | None = None
    accumulation_steps: int = 1
    skip_mode: SkipMode = "auto"
    saturation_dtype: torch.dtype = torch.float16
    process_group: ProcessGroup | None = None
    sharded_grads: bool | None = None
    check_when_unscaled: bool = True
    underflow_stride: int | None = None
    flat_grads: bool = False

    def __post_init__(self) -> None:
        call = "LossScaleOptimizer"
        validate_mode(call, self.overflow_mode)
        validate_positive_or_none(call, "clip_grad_norm", self.clip_grad_norm)
        validate_positive_or_none(call, "clip_grad_value", self.clip_grad_value)
        clips = [n for n in ("clip_grad_norm", "clip_grad_value") if getattr(self, n) is not None]
        if len(clips) > 1:
            raise ValueError(
                f"{call}({', '.join(clips)}): set at most one way of clipping (which ran first would "
                f"change the result: a value clip changes the norm); got {len(clips)}."
            )
        validate_int_at_least(call, "accumulation_steps", self.accumulation_steps, 1)
        validate_process_group(call, self.process_group)
        validate_choice(call, "skip_mode", self.skip_mode, ("auto", "fused", "host", "masked"))
        validate_choice(call, "check_when_unscaled", self.check_when_unscaled, (True, False))
        validate_choice(call, "sharded_grads", self.sharded_grads, (None, True, False))
        validate_choice(call, "flat_grads", self.flat_grads, (True, False))
        saturation_threshold(self.saturation_dtype, call)
        if self.underflow_stride is not None:
            validate_int_at_least(call, "underflow_stride", self.underflow_stride, 1)

    @property
    def threshold(self) -> float:
        """The magnitude at which a scaled gradient counts as saturated."""
        return saturation_threshold(self.saturation_dtype)

    def resolved_skip_mode(self, inner: torch.optim.Optimizer, writes_grads: bool = False) -> ResolvedSkipMode:
        """``"auto"`` made concrete: ``"fused"`` for optimizers taking grad_scale/found_inf, unless the unscaled
        gradients are written before the step (a value clip, an add-on that ``writes_grads``), else ``"host"``."""
        fusable = takes_fused_scaling(inner)
        if self.skip_mode == "fused" and not fusable:
            raise ValueError(
                f"LossScaleOptimizer(skip_mode='fused'): {type(inner).__name__} does not take "
                f"grad_scale/found_inf; use a fused optimizer (e.g. AdamW(fused=True)) or "
                f"skip_mode='host' or 'masked'."
            )
        if self.skip_mode == "fused":
            return "fused"
        if self.skip_mode == "auto":
            return "fused" if fusable and self.clip_grad_value is None and not writes_grads else "host"
        return "masked" if self.skip_mode == "masked" else "host"


#: A read-only pass over the scaled gradients before anything writes them: ``"amax"`` checks in the overflow mode
#: and returns the largest magnitude (a policy that observes it); ``"saturation"`` or ``"inf_nan"`` only checks.
Measure = Literal["amax", "saturation", "inf_nan"]
#: Who unscales the gradients: a pass of ours, the fused optimizer's kernel, or an add-on (per-layer scales).
Unscaler = Literal["ours", "kernel", "add-on"]
#: What our read+write pass does: unscale and check in one pass, only check (an unscaled window), only multiply
#: (unscale and/or clip, the check was made elsewhere).
OurPass = Literal["unscale_and_check", "check", "multiply"]


@dataclass(frozen=True)
class StepPlan:
    """One kind of boundary step, in the order the step runs it.

    Attributes:
        scaled: The window's losses were scaled: the scale is guarded, the policy advances.
        measure: The read-only pass before unscaling, or None.
        measure_mode: The overflow mode of that pass.
        add_on_unscales: An add-on unscales and checks the gradients itself.
        clip_norm: The global gradient norm is computed (the clip's input); when ``checks``, a non-finite norm
            is the overflow check.
        checks: Overflow is detected in this step (always when scaled; otherwise ``check_when_unscaled``).
        unscaler: Who unscales the gradients.
        our_pass: What our pass over the gradients does, or None for no pass.
        clip_value: Clamp each unscaled gradient to [-v, v], or None.
        skip_mode: How an overflowing step is skipped.
        inverse_needed: The step computes ``1/scale``: our pass or the clip needs it (never with an add-on's
            unscale).
    """

    scaled: bool
    measure: Measure | None
    measure_mode: OverflowMode
    add_on_unscales: bool
    clip_norm: bool
    checks: bool
    unscaler: Unscaler
    our_pass: OurPass | None
    clip_value: float | None
    skip_mode: ResolvedSkipMode
    inverse_needed: bool


@dataclass(frozen=True)
class Plans:
    """The plan of a scaled window and of an unscaled one."""

    scaled: StepPlan
    unscaled: StepPlan


def resolve(options: StepOptions, inner: torch.optim.Optimizer, add_ons: list[AddOn], observes_amax: bool) -> Plans:
    """Both plans for ``options`` over ``inner`` with ``add_ons``, for a policy that does or does not observe the
    largest gradient magnitude (``observes_amax``)."""
    skip_mode = options.resolved_skip_mode(inner, writes_grads=any(a.writes_grads for a in add_ons))
    add_on_unscales = any(a.unscales for a in add_ons)
    explicit = (
        skip_mode != "fused"
        or options.clip_grad_value is not None
        or any(a.writes_grads for a in add_ons)
        or add_on_unscales
    )
    scaled_plan, unscaled_plan = (
        _plan(options, scaled, explicit, add_on_unscales and scaled, observes_amax, skip_mode)
        for scaled in (True, False)
    )
    return Plans(scaled_plan, unscaled_plan)


def _plan(
    options: StepOptions,
    scaled: bool,
    explicit: bool,
    add_on_unscales: bool,
    observes_amax: bool,
    skip_mode: ResolvedSkipMode,
) -> StepPlan:
    checks = scaled or options.check_when_unscaled
    clip_norm = options.clip_grad_norm is not None
    measure: Measure | None = None
    if add_on_unscales:
        pass  # the add-on checks every gradient as it unscales it
    elif scaled and observes_amax:
        measure = "amax"
    elif scaled and options.overflow_mode == "saturation":
        measure = "saturation"
    elif checks and not clip_norm and not explicit:
        measure = "inf_nan"  # the fused kernel unscales: a read-only check pass, unless the norm is the check
    checked_before = add_on_unscales or clip_norm or measure is not None
    our_pass: OurPass | None = None
    if explicit:
        if checks and not checked_before:
            our_pass = "unscale_and_check" if scaled else "check"
        elif (scaled and not add_on_unscales) or clip_norm:
            our_pass = "multiply"
    unscaler: Unscaler = "add-on" if add_on_unscales else ("ours" if explicit else "kernel")
    return StepPlan(
        scaled=scaled,
        measure=measure,
        measure_mode="inf_nan" if measure == "inf_nan" else options.overflow_mode,
        add_on_unscales=add_on_unscales,
        clip_norm=clip_norm,
        checks=checks,
        unscaler=unscaler,
        our_pass=our_pass,
        clip_value=options.clip_grad_value,
        skip_mode=skip_mode,
        inverse_needed=scaled and not add_on_unscales and (unscaler == "ours" or clip_norm),
    )
