"""What Lightning's and Fabric's ``MixedPrecision`` plugins share: the scaler, its diagnosis, and a step's
StepResult."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lossscale.diagnosis.addon import OverflowDiagnosis, validate_diagnose
from lossscale.keywords import add_ons_from
from lossscale.reporting import ScalerStep, StepResult
from lossscale.scaler import GradScaler

__all__ = ["carried", "diagnose_later", "diagnose_model", "make_scaler", "scaler_result"]


def carried(add_ons: Iterable[object]) -> OverflowDiagnosis | None:
    """The OverflowDiagnosis among a front end's add-ons, or None."""
    return next((a for a in add_ons if isinstance(a, OverflowDiagnosis)), None)


def diagnose_later(call: str, diagnose: object, true_means: str, front_end: GradScaler | Any, where: str) -> bool:
    """A plugin's ``diagnose=``: checked; a module or an OverflowDiagnosis given to ``front_end`` (the scaler or
    optimizer the plugin drives) at once, through the keyword table. Returns whether ``diagnose`` is True: the
    plugin gives it the framework's model when it meets it (:func:`diagnose_model`).

    Raises:
        ValueError: ``front_end`` carries a diagnosis of its own too.
    """
    validate_diagnose(call, diagnose, true_means)
    if diagnose is None or diagnose is False:
        return False
    if carried(front_end.add_ons) is not None:
        raise ValueError(
            f"{call}(diagnose=...) and a {where} built with diagnose= of its own: give the diagnosis "
            f"once, in one of the two; got both."
        )
    if diagnose is True:
        return True
    front_end.attach_add_ons(add_ons_from(call, diagnose=diagnose))
    return False


def diagnose_model(call: str, front_end: GradScaler | Any, model: torch.nn.Module, where: str) -> None:
    """``diagnose=True``: give ``front_end`` a diagnosis of ``model`` (the framework's), once.

    Raises:
        ValueError: it already traces another module.
    """
    bound = carried(front_end.add_ons)
    if bound is None:
        front_end.attach_add_ons(add_ons_from(call, diagnose=True, model=model))
    elif bound.model is not model:
        raise ValueError(
            f"{call}(diagnose=True) traces the one module {where}, and another one ({type(model).__name__}) came after "
            f"{type(bound.model).__name__}; pass the module to trace: {call}(..., diagnose=model)."
        )


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
        forward_fault=decision.forward_fault,
        fields=dict(scaler.last_fields),
    )
