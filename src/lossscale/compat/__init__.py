"""Facades: other frameworks' loss-scaling APIs as translation tables onto the lossscale core.

Import each from its module; none is re-exported from ``lossscale``:

- ``lossscale.compat.ascend``: ``ExponentialUpdateLossScaleManager``, ``FixedLossScaleManager``,
  ``NPULossScaleOptimizer``, ``ExperimentalConfig``, ``TellMeStepOrLossHook``.
- ``lossscale.compat.mindspore``: ``DynamicLossScaleUpdateCell``, ``FixedLossScaleUpdateCell``,
  ``DynamicLossScaleManager``, ``FixedLossScaleManager``, ``TrainOneStepWithLossScaleCell``.
- ``lossscale.compat.nnabla``: ``DynamicLossScalingUpdater``.
- ``lossscale.compat.keras``: ``LossScaleOptimizer``.

Each module's docstring is its translation table (foreign name and default -> core knob); the rules
are the presets (:mod:`lossscale.policies.presets`, also ``lossscale.presets``); ``docs/compat.md`` lists
every table and every deviation. No facade keeps a copy of the scale: each reads and writes the
:class:`~lossscale.LossScale` it holds or shares with its optimizer.
"""
