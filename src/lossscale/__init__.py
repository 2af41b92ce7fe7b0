"""lossscale: dynamic loss scaling for PyTorch mixed precision, on one sync-free policy engine."""

from lossscale.addons.ema import EMA
from lossscale.addons.schedule import PrecisionSchedule
from lossscale.diagnosis import (
    HealError,
    HealReport,
    HealWarning,
    OverflowDiagnosis,
    OverflowReport,
    OverflowWarning,
    find_overflow,
    heal,
    keep_float32,
)
from lossscale.optimizer import LossScaleOptimizer
from lossscale.policies import presets
from lossscale.policies.base import FixedScale, FloorError, Policy, ScaleState
from lossscale.policies.dynamic import DynamicScale
from lossscale.policies.predictive import PredictiveScale
from lossscale.reporting import ScalerStep, StepLogger, StepResult
from lossscale.scaler import GradScaler
from lossscale.state import LossScale

__all__ = [
    "DynamicScale",
    "EMA",
    "FixedScale",
    "FloorError",
    "GradScaler",
    "HealError",
    "HealReport",
    "HealWarning",
    "LossScale",
    "LossScaleOptimizer",
    "OverflowDiagnosis",
    "OverflowReport",
    "OverflowWarning",
    "Policy",
    "PrecisionSchedule",
    "PredictiveScale",
    "ScaleState",
    "ScalerStep",
    "StepLogger",
    "StepResult",
    "find_overflow",
    "heal",
    "keep_float32",
    "presets",
]

__version__ = "0.1.0"
