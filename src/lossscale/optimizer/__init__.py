"""LossScaleOptimizer (its step options, its checkpoint checks) and LayerwiseOptimizer, the front end of per-layer
scales that ``LossScaleOptimizer(..., layerwise=...)`` builds."""

from lossscale.optimizer.layerwise import LayerwiseOptimizer
from lossscale.optimizer.optimizer import LossScaleOptimizer

__all__ = ["LayerwiseOptimizer", "LossScaleOptimizer"]
