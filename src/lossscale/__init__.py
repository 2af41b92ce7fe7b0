"""lossscale: dynamic loss scaling for PyTorch mixed precision, on one sync-free policy engine."""

from lossscale.diagnostics import HostReadCounter
from lossscale.policy import DynamicScale, FixedScale, FloorError, ScaleState
from lossscale.scaler import GradScaler, ScalerStep

__all__ = [
    "DynamicScale",
    "FixedScale",
    "FloorError",
    "GradScaler",
    "HostReadCounter",
    "ScaleState",
    "ScalerStep",
]

__version__ = "0.1.0"
