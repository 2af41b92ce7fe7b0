"""lossscale inside Lightning ``Fabric``: Fabric's own float16 AMP plugin with :class:`lossscale.GradScaler`."""

from __future__ import annotations

from typing import Any, cast

import torch

from lossscale.integrations import require

require("lightning.fabric", "lightning", "fabric")

from lightning.fabric.plugins.precision import MixedPrecision as _FabricMixedPrecision  # noqa: E402
from lightning.fabric.utilities.types import Optimizable  # noqa: E402

from lossscale.integrations._scaler import make_scaler, scaler_result  # noqa: E402
from lossscale.reporting import StepResult  # noqa: E402
from lossscale.scaler import GradScaler  # noqa: E402

__all__ = ["MixedPrecision"]


class MixedPrecision(_FabricMixedPrecision):
    """Fabric's float16 AMP plugin driving a :class:`lossscale.GradScaler`: ``Fabric(plugins=[MixedPrecision()])``.

    Adds ``last_result``, the :class:`~lossscale.StepResult` of the last optimizer step (no host read). Put
    the plugin (or its ``scaler``) in the state given to ``fabric.save``/``fabric.load``, and pass
    ``fabric.clip_gradients(..., error_if_nonfinite=False)`` so that an overflowing step is skipped, not raised.

    Args:
        precision: ``"16-mixed"``.
        device: The autocast device type (``"cuda"``, ``"cpu"``, ...).
        scaler: An existing :class:`~lossscale.GradScaler`; or leave it out and pass ``scaler_kwargs``.
        **scaler_kwargs: Arguments of ``GradScaler`` (``init_scale``, ``growth_interval``, ``policy``, ...).
    """

    def __init__(
        self, precision: str = "16-mixed", device: str = "cuda", scaler: GradScaler | None = None, **scaler_kwargs: Any
    ) -> None:
        scaler = make_scaler("MixedPrecision", precision, device, scaler, scaler_kwargs)  # precision: "16-mixed"
        super().__init__("16-mixed", device, scaler=scaler)  # type: ignore[arg-type]  # Fabric types the slot as torch's GradScaler; lossscale's has its surface
        self.last_result: StepResult | None = None
        self._steps = 0

    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """``scaler.step(optimizer)`` and ``update()``; returns what the optimizer returned."""
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("AMP and the LBFGS optimizer are not compatible.")
        scaler = cast(GradScaler, self.scaler)  # the lossscale GradScaler built above (Fabric types it as torch's)
        carried = scaler.get_scale_tensor()
        decision = scaler.step(cast(torch.optim.Optimizer, optimizer), **kwargs)  # Fabric steps torch optimizers
        scaler.update()
        self.last_result = scaler_result(decision, carried, scaler, self._steps)
        self._steps += 1
        return decision.value
