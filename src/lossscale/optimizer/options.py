"""The checked, frozen step options of a :class:`~lossscale.LossScaleOptimizer`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from lossscale.addons.ema import EMA
from lossscale.validation import (validate_choice, validate_int_at_least, validate_positive_or_none, validate_process_group,
                              validate_real)
from lossscale.ops.overflow import OverflowMode, validate_mode, saturation_threshold

__all__ = ["SkipMode", "StepOptions"]

SkipMode = Literal["auto", "fused", "host", "masked"]
GradTransform = Callable[[list[torch.Tensor]], None]

@dataclass(frozen=True)
class StepOptions:
    """How a boundary step runs; checked once (see :class:`~lossscale.LossScaleOptimizer` for each option)."""

    overflow_mode: OverflowMode = "inf_nan"
    clip_grad_norm: float | None = None
    clip_grad_value: float | None = None
    accumulation_steps: int = 1
    ema: EMA | None = None
    weight_decay: float | None = None
    skip_mode: SkipMode = "auto"
    saturation_dtype: torch.dtype = torch.float16
    process_group: Any = None
    sharded_grads: bool | None = None
    check_when_unscaled: bool = True
    underflow_stride: int | None = None
    transform_unscaled: GradTransform | None = None
    flat_grads: bool = False

    def __post_init__(self) -> None:
        call = "LossScaleOptimizer"
        validate_mode(call, self.overflow_mode)
        validate_positive_or_none(call, "clip_grad_norm", self.clip_grad_norm)
        validate_positive_or_none(call, "clip_grad_value", self.clip_grad_value)
        clips = [n for n in ("clip_grad_norm", "clip_grad_value", "transform_unscaled") if getattr(self, n) is not None]
        if len(clips) > 1:
            raise ValueError(f"{call}({', '.join(clips)}): set at most one way of clipping (as Keras requires); "
                             f"got {len(clips)}.")
        validate_int_at_least(call, "accumulation_steps", self.accumulation_steps, 1)
        if self.ema is not None and not isinstance(self.ema, EMA):
            raise TypeError(f"{call}(ema={self.ema!r}): ema must be a lossscale.EMA or None.")
        wd = self.weight_decay
        if wd is not None:
            validate_real(call, "weight_decay", wd, "None or a finite number >= 0")
            if not 0 <= wd < float("inf"):
                raise ValueError(f"{call}(weight_decay={wd!r}): weight_decay must be None or a finite number >= 0; "
                                 f"got {wd!r}.")
        validate_process_group(call, self.process_group)
        validate_choice(call, "skip_mode", self.skip_mode, ("auto", "fused", "host", "masked"))
        validate_choice(call, "check_when_unscaled", self.check_when_unscaled, (True, False))
        validate_choice(call, "sharded_grads", self.sharded_grads, (None, True, False))
        validate_choice(call, "flat_grads", self.flat_grads, (True, False))
        saturation_threshold(self.saturation_dtype, call)
        if self.underflow_stride is not None:
            validate_int_at_least(call, "underflow_stride", self.underflow_stride, 1)
        if self.transform_unscaled is not None and not callable(self.transform_unscaled):
            raise TypeError(f"{call}(transform_unscaled={self.transform_unscaled!r}): transform_unscaled must be a "
                            f"callable taking the list of unscaled gradients, or None.")

    @property
    def threshold(self) -> float:
        """The magnitude at which a scaled gradient counts as saturated."""
        return saturation_threshold(self.saturation_dtype)

    @property
    def writes_unscaled(self) -> bool:
        """Whether a stage needs the unscaled gradients written into ``.grad`` (value clip, a transform)."""
        return self.clip_grad_value is not None or self.transform_unscaled is not None

    def resolved_skip_mode(self, inner: torch.optim.Optimizer) -> str:
        """``"auto"`` made concrete: ``"fused"`` for optimizers taking grad_scale/found_inf, else ``"host"``."""
        fusable = bool(getattr(inner, "_step_supports_amp_scaling", False))
        if self.skip_mode == "fused" and not fusable:
            raise ValueError(f"LossScaleOptimizer(skip_mode='fused'): {type(inner).__name__} does not take "
                             f"grad_scale/found_inf; use a fused optimizer (e.g. AdamW(fused=True)) or "
                             f"skip_mode='host' or 'masked'.")
        if self.skip_mode == "auto":
            return "fused" if fusable and not self.writes_unscaled else "host"
        return self.skip_mode
