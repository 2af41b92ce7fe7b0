"""The integrations' ``diagnose=`` argument: its check, the diagnosis it names, and the one a precision plugin feeds
from its own steps."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lossscale.addons.base import AddOn, Host, StepOutcome
from lossscale.diagnosis.addon import OverflowDiagnosis
from lossscale.reporting import StepResult
from lossscale.validation import ArgumentTypeError

__all__ = ["PluginDiagnosis", "carried", "validate_diagnose", "diagnosis_for"]


def validate_diagnose(call: str, diagnose: object, true_means: str | None) -> None:
    """Raise unless ``diagnose`` is None, False, a ``torch.nn.Module``, an :class:`OverflowDiagnosis`, or True where
    ``true_means`` says which module True traces (None: True is refused, the framework has no model to offer)."""
    if diagnose is None or isinstance(diagnose, (nn.Module, OverflowDiagnosis)):
        return
    if diagnose is False or (diagnose is True and true_means is not None):
        return
    allowed = (f"True ({true_means}), " if true_means else "") + (
        "a torch.nn.Module (the model to trace when the loss scale collapses), a lossscale.OverflowDiagnosis, "
        "or None/False (no diagnosis)"
    )
    hint = " Pass the model itself: diagnose=model." if diagnose is True else ""
    raise ArgumentTypeError(
        f"{call}(diagnose={diagnose!r:.60}): diagnose must be {allowed}; got {type(diagnose).__name__}.{hint}"
    )


def diagnosis_for(diagnose: object, module: nn.Module | None = None) -> OverflowDiagnosis | None:
    """The diagnosis a checked ``diagnose`` names: None for None/False, ``OverflowDiagnosis(module)`` for True,
    ``OverflowDiagnosis(diagnose)`` for a module, an OverflowDiagnosis as it is."""
    if diagnose is None or diagnose is False:
        return None
    if isinstance(diagnose, OverflowDiagnosis):
        return diagnose
    target = module if diagnose is True else diagnose
    if not isinstance(target, nn.Module):
        raise ArgumentTypeError(f"diagnose={diagnose!r:.60}: no torch.nn.Module to trace; got {target!r:.60}.")
    return OverflowDiagnosis(target)


def carried(add_ons: Iterable[AddOn]) -> OverflowDiagnosis | None:
    """The OverflowDiagnosis among a front end's add-ons, or None."""
    return next((a for a in add_ons if isinstance(a, OverflowDiagnosis)), None)


class PluginDiagnosis:
    """A precision plugin's own overflow diagnosis (its ``diagnose=``). The plugin scales the loss and steps, so it
    calls the add-on's hooks itself, as a front end does: ``on_scale_loss`` after scaling, ``after_step`` with each
    step's :class:`~lossscale.StepResult` (accumulation micro-steps left out). ``diagnose=True`` traces the module
    the framework trains, given to :meth:`bind` when the plugin meets it. No host read."""

    def __init__(self, call: str, diagnose: object, true_means: str) -> None:
        validate_diagnose(call, diagnose, true_means)
        self.call = call
        self.follows_module = diagnose is True
        self.diagnosis: OverflowDiagnosis | None = None if diagnose is True else diagnosis_for(diagnose)
        self._attached = False

    @property
    def on(self) -> bool:
        """Whether ``diagnose=`` asked for a diagnosis (with True, before :meth:`bind` too)."""
        return self.follows_module or self.diagnosis is not None

    def refuse_another(self, add_ons: Iterable[AddOn], where: str) -> None:
        """Raise if ``where`` (the scaler or optimizer the plugin drives) carries a diagnosis of its own as well."""
        if self.on and carried(add_ons) is not None:
            raise ValueError(
                f"{self.call}(diagnose=...) and a {where} built with diagnose= of its own: give the diagnosis "
                f"once, in one of the two; got both."
            )

    def bind(self, module: nn.Module) -> None:
        """With ``diagnose=True``: trace ``module`` (a new diagnosis where it is another module than before)."""
        if self.follows_module and (self.diagnosis is None or self.diagnosis.model is not module):
            self.diagnosis = OverflowDiagnosis(module)
            self._attached = False

    def on_scale_loss(self, loss: torch.Tensor, scaled: torch.Tensor) -> None:
        diagnosis = self.diagnosis
        if diagnosis is None:
            return
        if not self._attached:
            diagnosis.attach(Host(call=self.call, device=scaled.device))
            self._attached = True
        diagnosis.on_scale_loss(loss, scaled)

    def after_step(self, result: StepResult | None) -> None:
        if self.diagnosis is None or result is None or result.accumulating:
            return
        outcome = StepOutcome(
            stepped=result.stepped,
            found_inf=result.found_inf,
            scale=result.scale,
            next_scale=result.next_scale,
            step=result.step,
            scaled=result.precision in (None, "float16"),
        )
        self.diagnosis.after_step(outcome)
