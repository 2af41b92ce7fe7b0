"""Optional parts of a LossScaleOptimizer: EMA weights, a precision schedule, per-layer scales."""
