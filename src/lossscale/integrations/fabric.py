"""lossscale inside Lightning ``Fabric``: Fabric's own AMP plugin with :class:`lossscale.GradScaler` (float16)."""

from __future__ import annotations

from typing import Any, Literal, cast

import torch

from lossscale.integrations import require

require("lightning.fabric", "lightning", "fabric")

from lightning.fabric.plugins.precision import MixedPrecision as _FabricMixedPrecision
from lightning.fabric.utilities.types import Optimizable

from lossscale.diagnosis.addon import OverflowDiagnosis, validate_diagnose
from lossscale.integrations._scaler import carried, diagnose_later, diagnose_model, make_scaler, scaler_result
from lossscale.reporting import StepResult
from lossscale.scaler import GradScaler

__all__ = ["MixedPrecision"]

_SET_UP = "the module given to fabric.setup"


class MixedPrecision(_FabricMixedPrecision):
    """Fabric's AMP plugin driving a :class:`lossscale.GradScaler`: ``Fabric(plugins=[MixedPrecision()])``.

    Adds ``last_result``, the :class:`~lossscale.StepResult` of the last optimizer step (no host read). Put
    the plugin (or its ``scaler``) in the state given to ``fabric.save``/``fabric.load``, and pass
    ``fabric.clip_gradients(..., error_if_nonfinite=False)`` so that an overflowing step is skipped, not raised.
    ``"bf16-mixed"`` is Fabric's own path: bfloat16 autocast, ``scaler`` None, ``last_result`` None.

    ``diagnose=True`` traces the module given to ``fabric.setup`` when the loss scale collapses and warns with a
    :class:`~lossscale.OverflowWarning` naming the module (:mod:`lossscale.diagnosis`); the plugin feeds it the
    losses ``fabric.backward`` scales and each step's result. With several modules set up, pass the one to trace.

    Args:
        precision: ``"16-mixed"`` (float16 autocast, loss scaling) or ``"bf16-mixed"`` (bfloat16 autocast).
        device: The autocast device type (``"cuda"``, ``"cpu"``, ...).
        scaler: An existing :class:`~lossscale.GradScaler`; or leave it out and pass ``scaler_kwargs``.
        diagnose: True (the module given to ``fabric.setup``), a module to trace, an
            :class:`~lossscale.OverflowDiagnosis` (its ``patience``), or None or False (no diagnosis).
        heal: True (or ``torch.bfloat16``): with ``diagnose``, a forward overflow keeps the faulting modules in
            float32 (or bfloat16) at once, skips the step without lowering the scale and warns with a
            :class:`~lossscale.HealWarning` (:ref:`healing`); False (default): diagnosis only.
        **scaler_kwargs: Arguments of ``GradScaler`` (``init_scale``, ``growth_interval``, ``policy``, ...).

    Raises:
        ValueError: another precision (Fabric's message), or both ``scaler`` and ``scaler_kwargs``; ``diagnose``
            and a ``scaler`` built with ``diagnose=``; with ``"bf16-mixed"``, a ``scaler``, ``scaler_kwargs`` or a
            ``diagnose`` that asks for a diagnosis (there is no scale to collapse); at ``fabric.setup``, a second
            module with ``diagnose=True``.
        TypeError: with ``"16-mixed"``, ``device`` is not a string or ``scaler`` not a
            :class:`~lossscale.GradScaler`; ``diagnose`` none of the values above.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed",
        device: str = "cuda",
        scaler: GradScaler | None = None,
        *,
        diagnose: bool | torch.nn.Module | OverflowDiagnosis | None = None,
        heal: bool | torch.dtype = False,
        **scaler_kwargs: Any,
    ) -> None:
        validate_diagnose("MixedPrecision", diagnose, _SET_UP)
        scaler = make_scaler("MixedPrecision", precision, device, scaler, scaler_kwargs, diagnose, heal)  # None: bf16
        self._diagnose_module = scaler is not None and diagnose_later(
            "MixedPrecision", diagnose, _SET_UP, scaler, "GradScaler", heal
        )
        self._heal = heal
        super().__init__(precision, device, scaler=scaler)  # type: ignore[arg-type]  # Fabric types the slot as torch's GradScaler; lossscale's has its surface
        self.last_result: StepResult | None = None
        self._steps = 0

    @property
    def _grad_scaler(self) -> GradScaler | None:
        """``scaler``, the lossscale GradScaler the plugin was built with (Fabric types it as torch's); None under
        ``"bf16-mixed"``."""
        return cast("GradScaler | None", self.scaler)

    @property
    def diagnosis(self) -> OverflowDiagnosis | None:
        """The overflow diagnosis (``diagnose=``'s, or the scaler's own), or None; with ``diagnose=True`` it exists
        once a module was set up."""
        scaler = self._grad_scaler
        return None if scaler is None else carried(scaler.add_ons)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Fabric's conversion (none for mixed precision); with ``diagnose=True``, ``module`` becomes the one traced."""
        if self._diagnose_module:
            diagnose_model("MixedPrecision", cast(GradScaler, self.scaler), module, "given to fabric.setup", self._heal)
        return super().convert_module(module)

    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """``scaler.step(optimizer)`` and ``update()``; returns what the optimizer returned (``"bf16-mixed"``:
        Fabric's ``optimizer.step()``)."""
        scaler = self._grad_scaler
        if scaler is None:
            return super().optimizer_step(optimizer, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("AMP and the LBFGS optimizer are not compatible.")
        scale = scaler.get_scale_tensor()  # the scale the gradients carry
        decision = scaler.step(cast(torch.optim.Optimizer, optimizer), **kwargs)  # Fabric steps torch optimizers
        scaler.update()
        self.last_result = scaler_result(decision, scale, scaler, self._steps)
        self._steps += 1
        return decision.value
