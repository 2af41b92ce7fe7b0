"""The checked, frozen step options of a :class:`~lossscale.LossScaleOptimizer`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from lossscale.ops.overflow import OverflowMode, saturation_threshold, validate_mode
from lossscale.stages import fused_scaling
from lossscale.validation import (
    validate_choice,
    validate_int_at_least,
    validate_positive_or_none,
    validate_process_group,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

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

    def resolved_skip_mode(self, inner: torch.optim.Optimizer) -> ResolvedSkipMode:
        """``"auto"`` made concrete: ``"fused"`` for optimizers taking grad_scale/found_inf, unless a value clip
        writes the unscaled gradients before the step, else ``"host"``."""
        fusable = fused_scaling(inner) is not None
        if self.skip_mode == "fused" and not fusable:
            raise ValueError(
                f"LossScaleOptimizer(skip_mode='fused'): {type(inner).__name__} does not take "
                f"grad_scale/found_inf; use a fused optimizer (e.g. AdamW(fused=True)) or "
                f"skip_mode='host' or 'masked'."
            )
        if self.skip_mode == "fused":
            return "fused"
        if self.skip_mode == "auto":
            return "fused" if fusable and self.clip_grad_value is None else "host"
        return "masked" if self.skip_mode == "masked" else "host"
