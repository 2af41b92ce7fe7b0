"""lossscale inside Lightning's ``Trainer``: precision plugins and a monitoring callback.

==============================  ===================================================================
name                            what it is
==============================  ===================================================================
``MixedPrecision``              Lightning's own float16 AMP plugin with :class:`lossscale.GradScaler`
``LossScalePrecision``          a precision plugin for :class:`lossscale.LossScaleOptimizer`
``LossScaleMonitor``            a callback logging the scale, skipped steps and underflow
==============================  ===================================================================

Install with ``pip install 'lossscale[lightning]'``; see docs/integrations.md.
"""

from __future__ import annotations

from lossscale.integrations import require

require("lightning.pytorch", "lightning", "lightning")

from lossscale.integrations._lightning_amp import MixedPrecision  # noqa: E402
from lossscale.integrations._lightning_monitor import LossScaleMonitor  # noqa: E402
from lossscale.integrations._lightning_precision import LossScalePrecision  # noqa: E402

__all__ = ["LossScaleMonitor", "LossScalePrecision", "MixedPrecision"]
