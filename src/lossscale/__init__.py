"""lossscale: dynamic loss scaling for PyTorch mixed precision, on one sync-free policy engine."""

from lossscale import presets
from lossscale.diagnostics import HostReadCounter
from lossscale.ema import EMA
from lossscale.metrics import StepLogger
from lossscale.optimizer import LossScaleOptimizer
from lossscale.policy import DynamicScale, FixedScale, FloorError, Policy, ScaleState
from lossscale.predictive import PredictiveScale
from lossscale.result import StepResult
from lossscale.schedule import PrecisionSchedule
from lossscale.scaler import GradScaler, ScalerStep
from lossscale.state import LossScale

__all__ = [
    "DynamicScale",
    "EMA",
    "LossScaleOptimizer",
    "StepResult",
    "FixedScale",
    "FloorError",
    "GradScaler",
    "HostReadCounter",
    "LossScale",
    "Policy",
    "PrecisionSchedule",
    "PredictiveScale",
    "ScaleState",
    "ScalerStep",
    "StepLogger",
]

__version__ = "0.1.0"
