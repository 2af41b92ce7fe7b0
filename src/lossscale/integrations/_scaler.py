"""What Lightning's and Fabric's ``MixedPrecision`` plugins share: the scaler, and a step's StepResult."""

from __future__ import annotations

from typing import Any

import torch

from lossscale.reporting import ScalerStep, StepResult
from lossscale.scaler import GradScaler

__all__ = ["make_scaler", "scaler_result"]


def make_scaler(
    call: str, precision: object, device: object, scaler: object, scaler_kwargs: dict[str, Any]
) -> GradScaler:
    """``scaler``, or ``GradScaler(device=device, **scaler_kwargs)`` when it is None.

    Raises:
        ValueError: a precision other than ``"16-mixed"``, or both ``scaler`` and ``scaler_kwargs``.
        TypeError: ``device`` is not a string, or ``scaler`` not a :class:`~lossscale.GradScaler`.
    """
    if precision != "16-mixed":
        raise ValueError(
            f"{call}(precision={precision!r}): precision must be '16-mixed' (float16 autocast with "
            f"loss scaling); got {precision!r}. For 'bf16-mixed' use the framework's own MixedPrecision "
            f"plugin: bfloat16 needs no loss scaling."
        )
    if not isinstance(device, str):
        raise TypeError(
            f"{call}(device={device!r}): device must be a device type string such as 'cuda' or 'cpu'; "
            f"got {type(device).__name__}."
        )
    if scaler is None:
        return GradScaler(device=device, **scaler_kwargs)
    if not isinstance(scaler, GradScaler):
        raise TypeError(
            f"{call}(scaler={type(scaler).__name__}(...)): scaler must be a lossscale.GradScaler; got "
            f"{type(scaler).__module__}.{type(scaler).__qualname__}. For torch's scaler use the "
            f"framework's own MixedPrecision plugin."
        )
    if scaler_kwargs:
        names = ", ".join(f"{k}=..." for k in scaler_kwargs)
        raise ValueError(
            f"{call}(scaler=..., {names}): pass either a scaler or the arguments to build one "
            f"(GradScaler(**scaler_kwargs)), not both; got both."
        )
    return scaler


def scaler_result(
    decision: ScalerStep,
    scale: torch.Tensor | None,
    scaler: GradScaler,
    step: int,
    grad_norm: torch.Tensor | None = None,
) -> StepResult:
    """The StepResult of one ``scaler.step(opt); scaler.update()`` whose gradients carried ``scale`` (no host
    read); a disabled scaler, or one that never scaled, reports a scale of 1."""
    after = scaler.get_scale_tensor()
    if scale is None or after is None or not scaler.is_enabled():
        scale = after = torch.ones((), dtype=torch.float32, device=decision.stepped.device)
    return StepResult(
        stepped=decision.stepped,
        found_inf=decision.found_inf,
        scale=scale,
        next_scale=after,
        grad_norm=grad_norm,
        step=step,
    )
