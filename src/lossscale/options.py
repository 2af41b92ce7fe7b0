"""The validated, frozen options of a :class:`~lossscale.LossScaleOptimizer`, and its old spellings.

``LossScaleOptimizer(inner, *, ...)`` takes everything after the optimizer by keyword. The positional
order of version 0.1 (``policy, overflow_mode, clip_grad_norm, clip_grad_value, accumulation_steps, ema,
weight_decay, skip_mode``) and the Keras-only ``clip_grad_norm_per_param=`` still work for one release,
with a ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import torch

from lossscale._validate import check_choice, check_int_at_least, check_positive_or_none
from lossscale.ema import EMA
from lossscale.overflow import OverflowMode, check_mode, saturation_threshold

__all__ = ["SkipMode", "StepOptions", "OLD_POSITIONAL", "upgrade_old_spellings", "refuse_float16_params"]

SkipMode = Literal["auto", "fused", "host", "masked"]
GradTransform = Callable[[list[torch.Tensor]], None]

#: The positional order of version 0.1, after the optimizer.
OLD_POSITIONAL = ("policy", "overflow_mode", "clip_grad_norm", "clip_grad_value", "accumulation_steps", "ema",
                  "weight_decay", "skip_mode")


def upgrade_old_spellings(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Map 0.1's positional arguments and ``clip_grad_norm_per_param`` onto keywords, with a DeprecationWarning."""
    call = "LossScaleOptimizer"
    if len(args) > len(OLD_POSITIONAL):
        raise TypeError(f"{call}(inner, ...): takes the optimizer and keyword arguments; got {len(args) + 1} "
                        f"positional arguments.")
    out = dict(kwargs)
    if args:
        names = OLD_POSITIONAL[: len(args)]
        twice = [n for n in names if n in kwargs]
        if twice:
            raise TypeError(f"{call}(...): got {twice[0]!r} both by position and by keyword.")
        warnings.warn(f"{call}(inner, {', '.join(names)}) by position is deprecated; pass them by keyword: "
                      f"{call}(inner, {', '.join(f'{n}=...' for n in names)}).", DeprecationWarning, stacklevel=3)
        out.update(zip(names, args))
    if out.get("clip_grad_norm_per_param") is not None:
        limit = out.pop("clip_grad_norm_per_param")
        check_positive_or_none(call, "clip_grad_norm_per_param", limit)
        warnings.warn(f"{call}(clip_grad_norm_per_param=...) is deprecated: it is Keras's clipnorm, now in "
                      f"lossscale.compat.keras.LossScaleOptimizer(clipnorm=...); or pass "
                      f"transform_unscaled=lossscale.clip.per_tensor_clipper({limit!r}).", DeprecationWarning,
                      stacklevel=3)
        from lossscale.clip import per_tensor_clipper

        out["transform_unscaled"] = per_tensor_clipper(limit)
    else:
        out.pop("clip_grad_norm_per_param", None)
    return out


@dataclass(frozen=True)
class StepOptions:
    """How a boundary step runs; validated once (see :class:`~lossscale.LossScaleOptimizer` for each)."""

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

    def __post_init__(self) -> None:
        call = "LossScaleOptimizer"
        check_mode(call, self.overflow_mode)
        check_positive_or_none(call, "clip_grad_norm", self.clip_grad_norm)
        check_positive_or_none(call, "clip_grad_value", self.clip_grad_value)
        clips = [n for n in ("clip_grad_norm", "clip_grad_value", "transform_unscaled") if getattr(self, n) is not None]
        if len(clips) > 1:
            raise ValueError(f"{call}({', '.join(clips)}): set at most one way of clipping (as Keras requires); "
                             f"got {len(clips)}.")
        check_int_at_least(call, "accumulation_steps", self.accumulation_steps, 1)
        if self.ema is not None and not isinstance(self.ema, EMA):
            raise TypeError(f"{call}(ema={self.ema!r}): ema must be a lossscale.EMA or None.")
        wd = self.weight_decay
        if wd is not None and (isinstance(wd, bool) or not isinstance(wd, (int, float)) or not 0 <= wd < float("inf")):
            raise ValueError(f"{call}(weight_decay={wd!r}): weight_decay must be None or a finite number >= 0; "
                             f"got {wd!r}.")
        check_choice(call, "skip_mode", self.skip_mode, ("auto", "fused", "host", "masked"))
        check_choice(call, "check_when_unscaled", self.check_when_unscaled, (True, False))
        check_choice(call, "sharded_grads", self.sharded_grads, (None, True, False))
        saturation_threshold(self.saturation_dtype)
        if self.underflow_stride is not None:
            check_int_at_least(call, "underflow_stride", self.underflow_stride, 1)
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


def refuse_float16_params(inner: torch.optim.Optimizer) -> None:
    """A ValueError naming the first float16 parameter: its unscaled gradients would underflow."""
    for i, group in enumerate(inner.param_groups):
        for j, p in enumerate(group["params"]):
            if p.dtype == torch.float16:
                raise ValueError(
                    f"LossScaleOptimizer(inner): param_groups[{i}][{j}] is a float16 parameter; its unscaled "
                    f"gradients (scaled values / scale) would underflow in float16 and its updates round away. "
                    f"Keep the parameters in float32 and run the forward pass under torch.autocast(dtype="
                    f"torch.float16) (mixed precision), or keep float32 master copies for the optimizer.")
