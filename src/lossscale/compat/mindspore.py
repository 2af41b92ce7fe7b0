"""MindSpore loss scaling for PyTorch: update cells, managers and ``TrainOneStepWithLossScaleCell``.

A translation table onto the core; the rule is :func:`lossscale.presets.mindspore`.

=========================================================  ======================================================
MindSpore                                                   lossscale
=========================================================  ======================================================
``nn.DynamicLossScaleUpdateCell(loss_scale_value,           ``presets.mindspore(loss_scale_value, scale_factor,
scale_factor, scale_window)``                               scale_window)``: growth on the W-th clean step,
                                                            ``S * float32(1/f)``, floor 1, float32 products
``cell(loss_scale, overflow)``: updates the Parameter in     same, on a 0-d (or shape (1,)) float32 tensor, in
place, returns ``overflow``                                 place (another dtype is refused); no host read
``cell.get_loss_scale()``                                   ``loss_scale_value``, the value it was built with (as
                                                            MindSpore: the live scale is the tensor passed in)
``nn.FixedLossScaleUpdateCell(loss_scale_value)``           ``FixedScale``; the call returns ``overflow``
``amp.DynamicLossScaleManager(init_loss_scale=2**24,        the same rule in float64 products (MindSpore keeps a
scale_factor=2, scale_window=2000)``                        Python float), state in float32
``manager.get_loss_scale()``                                a Python float (reads the scale on the host)
``manager.update_loss_scale(overflow)``                     ``policy.update``; RuntimeError after 1000 overflows
                                                            in a row, as MindSpore's ``bad_step_max``
``manager.get_update_cell()``                               ``DynamicLossScaleUpdateCell(current scale, f, W)``
``amp.FixedLossScaleManager(loss_scale=128.0,               ``FixedScale(loss_scale)``; ``get_update_cell()`` is
drop_overflow_update=True)``                                ``None`` when ``drop_overflow_update`` is False
``nn.TrainOneStepWithLossScaleCell(network, optimizer,      ``LossScaleOptimizer(optimizer, policy=<the cell>)``;
scale_sense)``; ``scale_sense`` a cell or a Tensor          a Tensor gives ``FixedScale``
``train_cell(*inputs) -> (loss, overflow, loss_scale)``     forward, scaled backward, unscale, check, step unless
                                                            overflow; ``loss_scale`` is the scale this step used
``train_cell.set_sense_scale(sens)``                        sets the scale (one host read)
=========================================================  ======================================================

Deviations: a scale that MindSpore's cell would grow into float32 inf (and keep: ``max(inf / f, 1)``)
stays at its last finite value here; the manager's Python-float scale grows past float32's range
where ours stops, and with a factor that is not a power of two ours rounds to float32 at each step.
``TrainOneStepWithLossScaleCell`` does not average gradients over devices (wrap the network in
``DistributedDataParallel``); overflow is agreed across ranks under torch.distributed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lossscale import presets
from lossscale._validate import check_choice, check_scale
from lossscale.policy import FLOAT32_MAX, FixedScale
from lossscale.state import LossScale
from lossscale.compat._mindspore_cells import (
    DynamicLossScaleUpdateCell,
    FixedLossScaleUpdateCell,
    _check_rule,
    _flag,
    _StatefulRule,
)
from lossscale.compat._checks import checked_counters
from lossscale.compat._mindspore_train import TrainOneStepWithLossScaleCell

__all__ = [
    "DynamicLossScaleUpdateCell",
    "FixedLossScaleUpdateCell",
    "DynamicLossScaleManager",
    "FixedLossScaleManager",
    "TrainOneStepWithLossScaleCell",
]

#: MindSpore's ``DynamicLossScaleManager.bad_step_max``: more overflows in a row than this raise.
BAD_STEP_MAX = 1000


class DynamicLossScaleManager(_StatefulRule):
    """MindSpore's host-side dynamic manager: ``get_loss_scale()``, ``update_loss_scale(overflow)``.

    The rule of :func:`lossscale.presets.mindspore` with float64 products, as MindSpore computes it on
    Python floats. More than 1000 overflows in a row raise ``RuntimeError`` (after the scale was updated,
    as MindSpore does); MindSpore then does not advance its step counter, so the next clean step grows the
    scale at once, and so does this manager.

    Example:
        >>> m = DynamicLossScaleManager(init_loss_scale=2**10, scale_window=2)
        >>> for overflow in [True, False, False]:
        ...     m.update_loss_scale(overflow)
        >>> m.get_loss_scale()
        1024.0
    """

    def __init__(self, init_loss_scale: float = 2.0**24, scale_factor: float = 2, scale_window: int = 2000) -> None:
        _check_rule("DynamicLossScaleManager", "init_loss_scale", init_loss_scale, scale_factor, scale_window)
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.loss_scale = LossScale(dataclasses.replace(
            presets.mindspore(init_loss_scale, scale_factor, scale_window), arithmetic="float64"))
        self.bad_steps = 0

    def get_loss_scale(self) -> float:
        """The current loss scale as a Python float (reads it on the host)."""
        return float(self.loss_scale.scale)

    def update_loss_scale(self, overflow: Any) -> None:
        """Advance the rule with one step's ``overflow`` (a bool: MindSpore's manager runs on the host).

        Raises:
            RuntimeError: on the 1001st overflow in a row and every one after it.
        """
        if isinstance(overflow, torch.Tensor):  # the consecutive-overflow limit is counted on the host
            overflow = bool(_flag(overflow, overflow.device, "DynamicLossScaleManager.update_loss_scale"))
        if not isinstance(overflow, bool):
            raise TypeError(f"DynamicLossScaleManager.update_loss_scale(overflow={overflow!r}): overflow must be "
                            f"a bool; got {type(overflow).__name__}.")
        self.loss_scale.update(torch.tensor(overflow, device=self.loss_scale.device))
        self.bad_steps = self.bad_steps + 1 if overflow else 0
        if self.bad_steps > BAD_STEP_MAX:
            # MindSpore raises before advancing cur_iter, so its next clean step grows: count as if ready to.
            ready = dict(self.loss_scale.state_dict(), growth_tracker=self.scale_window - 1)
            self.loss_scale.load_state_dict(ready, "DynamicLossScaleManager.update_loss_scale")
            raise RuntimeError(
                f"DynamicLossScaleManager.update_loss_scale(overflow=True): {self.bad_steps} overflows in a row "
                f"exceed MindSpore's limit of {BAD_STEP_MAX} (the scale is {self.get_loss_scale()!r}). The "
                f"gradients overflow at any scale: look for inf or NaN in the data, the loss or the model.")

    def get_drop_overflow_update(self) -> bool:
        """True: overflowing steps are dropped."""
        return True

    def get_update_cell(self) -> DynamicLossScaleUpdateCell:
        """A :class:`DynamicLossScaleUpdateCell` starting at the current scale."""
        return DynamicLossScaleUpdateCell(self.get_loss_scale(), self.scale_factor, self.scale_window)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "bad_steps": self.bad_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        checked_counters("DynamicLossScaleManager.load_state_dict", state_dict, ("policy_state", "bad_steps"),
                         ("bad_steps",))
        super().load_state_dict(state_dict)
        self.bad_steps = state_dict["bad_steps"]


class FixedLossScaleManager(_StatefulRule):
    """A constant scale (>= 1); ``drop_overflow_update`` says whether overflowing steps are skipped."""

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True) -> None:
        check_scale("FixedLossScaleManager", "loss_scale", loss_scale, low=1.0, high=FLOAT32_MAX)
        check_choice("FixedLossScaleManager", "drop_overflow_update", drop_overflow_update, (True, False))
        self.drop_overflow_update = drop_overflow_update
        self.loss_scale = LossScale(FixedScale(float(loss_scale)))

    def get_loss_scale(self) -> float:
        """``loss_scale``, the fixed value."""
        return float(self.loss_scale.scale)

    def update_loss_scale(self, overflow: Any) -> None:
        """Nothing: the scale is fixed."""

    def get_drop_overflow_update(self) -> bool:
        """``drop_overflow_update``."""
        return self.drop_overflow_update

    def get_update_cell(self) -> FixedLossScaleUpdateCell | None:
        """A :class:`FixedLossScaleUpdateCell`, or None when overflowing steps are not dropped."""
        return FixedLossScaleUpdateCell(self.get_loss_scale()) if self.drop_overflow_update else None
