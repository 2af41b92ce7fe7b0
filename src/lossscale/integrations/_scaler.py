"""What Lightning's and Fabric's ``MixedPrecision`` plugins share: the scaler, its diagnosis, and a step's
StepResult."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lossscale.diagnosis.addon import OverflowDiagnosis, validate_heal
from lossscale.keywords import add_ons_from
from lossscale.reporting import ScalerStep, StepResult
from lossscale.scaler import GradScaler


def carried(add_ons: Iterable[object]) -> OverflowDiagnosis | None:
    """The OverflowDiagnosis among a front end's add-ons, or None."""
    return next((a for a in add_ons if isinstance(a, OverflowDiagnosis)), None)


def diagnose_later(
    call: str, diagnose: object, true_means: str, front_end: GradScaler | Any, where: str, heal: object = False
) -> bool:
    """A plugin's ``diagnose=`` and ``heal=``: checked; a module or an OverflowDiagnosis given to ``front_end`` (the
    scaler or optimizer the plugin drives) at once, through the keyword table. Returns whether ``diagnose`` is True:
    the plugin gives it the framework's model when it meets it (:func:`diagnose_model`).

    Raises:
        ValueError: ``front_end`` carries a diagnosis of its own too; ``heal`` without a diagnosis.
    """
    validate_heal(call, diagnose, heal, true_means)
    if diagnose is None or diagnose is False:
        return False
    if carried(front_end.add_ons) is not None:
        raise ValueError(
            f"{call}(diagnose=...) and a {where} built with diagnose= of its own: give the diagnosis "
            f"once, in one of the two; got both."
        )
    if diagnose is True:
        return True
    front_end.attach_add_ons(add_ons_from(call, diagnose=diagnose, heal=heal))
    return False


def diagnose_model(
    call: str, front_end: GradScaler | Any, model: torch.nn.Module, where: str, heal: object = False
) -> None:
    """``diagnose=True``: give ``front_end`` a diagnosis of ``model`` (the framework's), once (healing with ``heal``).

    Raises:
        ValueError: it already traces another module.
    """
    bound = carried(front_end.add_ons)
    if bound is None:
        front_end.attach_add_ons(add_ons_from(call, diagnose=True, model=model, heal=heal))
    elif bound.model is not model:
        raise ValueError(
            f"{call}(diagnose=True) traces the one module {where}, and another one ({type(model).__name__}) came after "
            f"{type(bound.model).__name__}; pass the module to trace: {call}(..., diagnose=model)."
        )


def make_scaler(
    call: str,
    precision: object,
    device: object,
    scaler: object,
    scaler_kwargs: dict[str, Any],
    diagnose: object = None,
    heal: object = False,
) -> GradScaler | None:
    """``scaler``, or ``GradScaler(device=device, **scaler_kwargs)`` when it is None; under ``"bf16-mixed"``, None
    (bfloat16 autocast without a scaler, as the framework's own plugin runs it). ``diagnose`` is the plugin's
    ``diagnose=``, already checked for its type.

    Raises:
        ValueError: a precision other than ``"16-mixed"`` or ``"bf16-mixed"``; both ``scaler`` and ``scaler_kwargs``;
            under ``"bf16-mixed"``, a ``scaler``, ``scaler_kwargs`` or a ``diagnose`` that asks for a diagnosis.
        TypeError: under ``"16-mixed"``, ``device`` is not a string or ``scaler`` not a :class:`~lossscale.GradScaler`.
    """
    if precision not in ("16-mixed", "bf16-mixed"):
        raise ValueError(  # Lightning's own text first, as its tests and users' code expect it
            f"Passed `{call}(precision={precision!r})`. Precision must be '16-mixed' or 'bf16-mixed' (float16 "
            f"autocast with lossscale's GradScaler, or bfloat16 autocast without a scaler)."
        )
    if precision == "bf16-mixed":
        _validate_bf16(call, scaler, scaler_kwargs, diagnose, heal)
        return None
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
        fields=scaler.last_fields,  # a new dict at each update()
    )


def _validate_bf16(call: str, scaler: object, scaler_kwargs: dict[str, Any], diagnose: object, heal: object) -> None:
    """Raise where ``precision="bf16-mixed"`` comes with something that needs a loss scale."""
    if scaler is not None:
        raise ValueError(  # Lightning's own text after the call, as its tests expect it
            f"{call}(precision='bf16-mixed', scaler=...): `precision='bf16-mixed'` does not use a scaler, found "
            f"{scaler!r:.80}. bfloat16 has float32's range, so no loss is scaled: leave scaler out, or use "
            f"precision='16-mixed'."
        )
    if scaler_kwargs:
        names = ", ".join(f"{k}=..." for k in scaler_kwargs)
        raise ValueError(
            f"{call}(precision='bf16-mixed', {names}): GradScaler's arguments need precision='16-mixed'; "
            f"'bf16-mixed' uses no scaler (bfloat16 has float32's range); got {', '.join(scaler_kwargs)}. Leave "
            f"them out, or use precision='16-mixed'."
        )
    if diagnose is not None and diagnose is not False:
        got = repr(diagnose) if isinstance(diagnose, bool) else f"{type(diagnose).__name__}(...)"
        raise ValueError(
            f"{call}(precision='bf16-mixed', diagnose={got}): diagnose must be None or False with 'bf16-mixed' "
            f"(bfloat16 has float32's range: there is no loss scale to collapse, and the diagnosis is triggered by "
            f"the scale's collapse); got {got}. Leave diagnose out, or use precision='16-mixed'."
        )
    if heal is not None and heal is not False:
        raise ValueError(
            f"{call}(precision='bf16-mixed', heal={heal!r}): heal must be False with 'bf16-mixed' (healing moves a "
            f"float16 module to float32 and keeps the loss scale; bfloat16 has float32's range and no loss scale); got "
            f"{heal!r}. Leave heal out, or use precision='16-mixed'."
        )
