"""LossScaleOptimizer, its step options and its checkpoint checks."""

from lossscale.optimizer.optimizer import LossScaleOptimizer

__all__ = ["LossScaleOptimizer"]
