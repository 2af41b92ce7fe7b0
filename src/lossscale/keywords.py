"""The one table from a front end's keywords to its add-ons: ``ema=``, ``schedule=``, ``diagnose=`` and ``add_ons=``.

Both front ends build their add-ons here at construction, and an integration that meets the model later (at the
framework's connect or setup) builds them here too; past this table, neither front end names an add-on::

    ema=EMA(...)                  the EMA, as it is
    schedule=PrecisionSchedule    the schedule, as it is (its parameters are checked when it attaches)
    diagnose=model                OverflowDiagnosis(model); an OverflowDiagnosis as it is; None or False: none
    heal=True (or a dtype)        with diagnose=: OverflowDiagnosis(model, heal=True); refused without diagnose=
    add_ons=[...]                 each AddOn as it is, after the ones above

At most one add-on per checkpoint key.
"""

from __future__ import annotations

from typing import Any

import torch

from lossscale.addons.base import AddOn
from lossscale.addons.ema import EMA
from lossscale.addons.schedule import PrecisionSchedule
from lossscale.diagnosis.addon import diagnosis_from


def add_ons_from(
    call: str,
    *,
    ema: Any = None,
    schedule: Any = None,
    diagnose: Any = None,
    heal: Any = False,
    add_ons: Any = (),
    model: torch.nn.Module | None = None,
) -> list[AddOn]:
    """The add-ons of ``call``'s keywords, in the order their hooks run: ``ema``, ``schedule``, ``diagnose`` (with
    ``heal``), then ``add_ons``; each keyword checked and named in its error. ``model``: the framework's own model,
    which ``diagnose=True`` traces (an integration's; a front end has none, so True is refused there)."""
    built: list[AddOn] = []
    if ema is not None:
        if not isinstance(ema, EMA):
            raise TypeError(f"{call}(ema={ema!r}): ema must be a lossscale.EMA or None; got {type(ema).__name__}.")
        built.append(ema)
    if schedule is not None:
        if not isinstance(schedule, PrecisionSchedule):
            raise TypeError(
                f"{call}(schedule={schedule!r}): schedule must be a lossscale.PrecisionSchedule or None; got "
                f"{type(schedule).__name__}."
            )
        built.append(schedule)
    diagnosis = diagnosis_from(call, diagnose, model, heal=heal)
    if diagnosis is not None:
        built.append(diagnosis)
    validate_add_ons(call, add_ons)
    built.extend(add_ons)
    return built


def validate_add_ons(call: str, add_ons: object) -> None:
    """A list or tuple of :class:`~lossscale.addons.AddOn`, at most one per checkpoint key."""
    if isinstance(add_ons, AddOn) or not isinstance(add_ons, (list, tuple)):
        raise TypeError(
            f"{call}(add_ons={add_ons!r}): add_ons must be a list of lossscale.addons.AddOn; got "
            f"{type(add_ons).__name__}."
        )
    for i, add_on in enumerate(add_ons):
        if not isinstance(add_on, AddOn):
            raise TypeError(
                f"{call}(add_ons=[...]): add_ons[{i}] must be a lossscale.addons.AddOn; got "
                f"{type(add_on).__name__} {add_on!r}."
            )
    keys = [a.key for a in add_ons if a.key is not None]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(
            f"{call}: {len(keys) - len(set(keys)) + 1} add-ons are saved under the key "
            f"{repeated[0]!r}; give each kind of add-on once."
        )
