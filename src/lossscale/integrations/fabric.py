"""lossscale inside Lightning ``Fabric``: Fabric's own float16 AMP plugin with :class:`lossscale.GradScaler`."""

from __future__ import annotations

from typing import Any, cast

import torch

from lossscale.integrations import require

require("lightning.fabric", "lightning", "fabric")

from lightning.fabric.plugins.precision import MixedPrecision as _FabricMixedPrecision
from lightning.fabric.utilities.types import Optimizable

from lossscale.diagnosis.addon import OverflowDiagnosis
from lossscale.integrations._scaler import carried, diagnose_later, diagnose_model, make_scaler, scaler_result
from lossscale.reporting import StepResult
from lossscale.scaler import GradScaler

__all__ = ["MixedPrecision"]


class MixedPrecision(_FabricMixedPrecision):
    """Fabric's float16 AMP plugin driving a :class:`lossscale.GradScaler`: ``Fabric(plugins=[MixedPrecision()])``.

    Adds ``last_result``, the :class:`~lossscale.StepResult` of the last optimizer step (no host read). Put
    the plugin (or its ``scaler``) in the state given to ``fabric.save``/``fabric.load``, and pass
    ``fabric.clip_gradients(..., error_if_nonfinite=False)`` so that an overflowing step is skipped, not raised.

    ``diagnose=True`` traces the module given to ``fabric.setup`` when the loss scale collapses and warns with a
    :class:`~lossscale.OverflowWarning` naming the module (:mod:`lossscale.diagnosis`); the plugin feeds it the
    losses ``fabric.backward`` scales and each step's result. With several modules set up, pass the one to trace.

    Args:
        precision: ``"16-mixed"``.
        device: The autocast device type (``"cuda"``, ``"cpu"``, ...).
        scaler: An existing :class:`~lossscale.GradScaler`; or leave it out and pass ``scaler_kwargs``.
        diagnose: True (the module given to ``fabric.setup``), a module to trace, an
            :class:`~lossscale.OverflowDiagnosis` (its ``patience``), or None or False (no diagnosis).
        **scaler_kwargs: Arguments of ``GradScaler`` (``init_scale``, ``growth_interval``, ``policy``, ...).

    Raises:
        ValueError: a precision other than ``"16-mixed"``, or both ``scaler`` and ``scaler_kwargs``; ``diagnose``
            and a ``scaler`` built with ``diagnose=``; at ``fabric.setup``, a second module with ``diagnose=True``.
        TypeError: ``device`` is not a string, ``scaler`` not a :class:`~lossscale.GradScaler`, or ``diagnose``
            none of the values above.
    """

    def __init__(
        self,
        precision: str = "16-mixed",
        device: str = "cuda",
        scaler: GradScaler | None = None,
        *,
        diagnose: bool | torch.nn.Module | OverflowDiagnosis | None = None,
        **scaler_kwargs: Any,
    ) -> None:
        scaler = make_scaler("MixedPrecision", precision, device, scaler, scaler_kwargs)  # precision: "16-mixed"
        self._diagnose_module = diagnose_later(
            "MixedPrecision", diagnose, "the module given to fabric.setup", scaler, "GradScaler"
        )
        super().__init__("16-mixed", device, scaler=scaler)  # type: ignore[arg-type]  # Fabric types the slot as torch's GradScaler; lossscale's has its surface
        self.last_result: StepResult | None = None
        self._steps = 0

    @property
    def diagnosis(self) -> OverflowDiagnosis | None:
        """The overflow diagnosis (``diagnose=``'s, or the scaler's own), or None; with ``diagnose=True`` it exists
        once a module was set up."""
        return carried(cast(GradScaler, self.scaler).add_ons)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Fabric's conversion (none for mixed precision); with ``diagnose=True``, ``module`` becomes the one traced."""
        if self._diagnose_module:
            diagnose_model("MixedPrecision", cast(GradScaler, self.scaler), module, "given to fabric.setup")
        return super().convert_module(module)

    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """``scaler.step(optimizer)`` and ``update()``; returns what the optimizer returned."""
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("AMP and the LBFGS optimizer are not compatible.")
        scaler = cast(GradScaler, self.scaler)  # the lossscale GradScaler built above (Fabric types it as torch's)
        scale = scaler.get_scale_tensor()  # the scale the gradients carry
        decision = scaler.step(cast(torch.optim.Optimizer, optimizer), **kwargs)  # Fabric steps torch optimizers
        scaler.update()
        self.last_result = scaler_result(decision, scale, scaler, self._steps)
        self._steps += 1
        return decision.value
