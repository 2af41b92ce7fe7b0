"""The add-ons a front end builds from its keyword arguments (``ema=``, ``schedule=``, ``layerwise=``,
``diagnose=``, ``add_ons=``), each argument checked and named in its error."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lossscale.addons.base import AddOn
from lossscale.addons.ema import EMA
from lossscale.addons.schedule import validate_attachable

__all__ = ["add_ons_from", "diagnosis_from", "layer_scales_from", "validate_add_ons"]


def add_ons_from(
    call: str,
    params: Sequence[torch.Tensor],
    device: torch.device,
    *,
    ema: Any = None,
    schedule: Any = None,
    layerwise: Any = None,
    diagnose: Any = None,
    add_ons: Any = (),
) -> list[AddOn]:
    """The add-ons of ``call``'s arguments, in the order their hooks run: ``ema``, ``schedule``, ``layerwise``,
    ``diagnose``, then ``add_ons``."""
    built: list[AddOn] = []
    if ema is not None:
        if not isinstance(ema, EMA):
            raise TypeError(f"{call}(ema={ema!r}): ema must be a lossscale.EMA or None.")
        built.append(ema)
    if schedule is not None:
        validate_attachable(schedule, params, call)
        built.append(schedule)
    if layerwise is not None:
        built.append(layer_scales_from(layerwise, device))
    if diagnose is not None:
        built.append(diagnosis_from(call, diagnose))
    if isinstance(add_ons, AddOn) or not isinstance(add_ons, (list, tuple)):
        raise TypeError(
            f"{call}(add_ons={add_ons!r}): add_ons must be a list of lossscale.addons.base.AddOn; got "
            f"{type(add_ons).__name__}."
        )
    for i, add_on in enumerate(add_ons):
        if not isinstance(add_on, AddOn):
            raise TypeError(
                f"{call}(add_ons=[...]): add_ons[{i}] must be a lossscale.addons.base.AddOn; got "
                f"{type(add_on).__name__} {add_on!r}."
            )
    built.extend(add_ons)
    validate_add_ons(call, built)
    return built


def validate_add_ons(call: str, add_ons: Sequence[AddOn]) -> None:
    """At most one add-on per checkpoint key and at most one that unscales the gradients itself."""
    keys = [a.key for a in add_ons if a.key is not None]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(
            f"{call}: {len(keys) - len(set(keys)) + 1} add-ons are saved under the key "
            f"{repeated[0]!r}; give each kind of add-on once."
        )
    unscaling = [type(a).__name__ for a in add_ons if a.unscales]
    if len(unscaling) > 1:
        raise ValueError(f"{call}: {unscaling} each unscale the gradients by a rule of their own; give one of them.")


def layer_scales_from(layerwise: Any, device: torch.device) -> AddOn:
    """``layerwise`` as per-layer scales: a :class:`~lossscale.addons.layerwise.LayerScales` as it is, or a model or
    list of modules, each module a unit."""
    from lossscale.addons.layerwise import LayerScales

    return layerwise if isinstance(layerwise, LayerScales) else LayerScales(layerwise, device=device)


def diagnosis_from(call: str, diagnose: Any) -> AddOn:
    """``diagnose`` (the model whose forward to trace when the scale collapses) as an overflow diagnosis; an
    :class:`AddOn` passed as it is."""
    if isinstance(diagnose, AddOn):
        return diagnose
    if not isinstance(diagnose, torch.nn.Module):
        raise TypeError(
            f"{call}(diagnose={diagnose!r}): diagnose must be the torch.nn.Module whose forward and "
            f"backward to trace when the loss scale collapses (or None); got {type(diagnose).__name__}."
        )
    from lossscale.diagnosis import OverflowDiagnosis

    return OverflowDiagnosis(diagnose)
