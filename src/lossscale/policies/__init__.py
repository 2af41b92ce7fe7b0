"""Loss-scale policies: frozen configs whose whole rule is ``update(state, found_inf, amax=None) -> state``."""

from lossscale.policies import presets
from lossscale.policies.base import FixedScale, FloorError, Policy, ScaleState
from lossscale.policies.dynamic import DynamicScale
from lossscale.policies.predictive import PredictiveScale, PredictiveState

__all__ = [
    "DynamicScale",
    "FixedScale",
    "FloorError",
    "Policy",
    "PredictiveScale",
    "PredictiveState",
    "ScaleState",
    "presets",
]
