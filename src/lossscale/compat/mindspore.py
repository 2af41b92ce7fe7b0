"""MindSpore loss scaling for PyTorch: update cells, managers and ``TrainOneStepWithLossScaleCell``.
The rule is :func:`lossscale.presets.mindspore`.

+------------------------------------------------------+---------------------------------------------------------------+
| MindSpore                                            | lossscale                                                     |
+======================================================+===============================================================+
| ``nn.DynamicLossScaleUpdateCell(loss_scale_value,    | ``presets.mindspore(...)``: growth on the W-th clean step,    |
| scale_factor, scale_window)``                        | ``S * float32(1/f)``, floor 1, float32 products               |
+------------------------------------------------------+---------------------------------------------------------------+
| ``cell(loss_scale, overflow)`` updates the Parameter | same, on a float32 tensor of shape () or (1,); no host read   |
| in place, returns ``overflow``                       |                                                               |
+------------------------------------------------------+---------------------------------------------------------------+
| ``cell.get_loss_scale()``                            | ``loss_scale_value``, as built (as MindSpore)                 |
+------------------------------------------------------+---------------------------------------------------------------+
| ``nn.FixedLossScaleUpdateCell(loss_scale_value)``    | ``FixedScale``; the call returns ``overflow``                 |
+------------------------------------------------------+---------------------------------------------------------------+
| ``amp.DynamicLossScaleManager(init_loss_scale=2**24, | the same rule in float64 products, state in float32           |
| scale_factor=2, scale_window=2000)``                 |                                                               |
+------------------------------------------------------+---------------------------------------------------------------+
| ``manager.get_loss_scale()``                         | a Python float (a host read)                                  |
+------------------------------------------------------+---------------------------------------------------------------+
| ``manager.update_loss_scale(overflow)``              | ``LossScale.update``; RuntimeError after 1000 overflows in a  |
|                                                      | row (``bad_step_max``)                                        |
+------------------------------------------------------+---------------------------------------------------------------+
| ``manager.get_update_cell()``                        | ``DynamicLossScaleUpdateCell(current scale, f, W)``           |
+------------------------------------------------------+---------------------------------------------------------------+
| ``amp.FixedLossScaleManager(loss_scale=128.0,        | ``FixedScale(loss_scale)``; ``get_update_cell()`` is None     |
| drop_overflow_update=True)``                         | when ``drop_overflow_update`` is False                        |
+------------------------------------------------------+---------------------------------------------------------------+
| ``nn.TrainOneStepWithLossScaleCell(network,          | ``LossScaleOptimizer(optimizer, policy=<the cell's            |
| optimizer, scale_sense)``; ``scale_sense`` a cell or | LossScale>)``; a Tensor gives ``FixedScale``                  |
| a Tensor                                             |                                                               |
+------------------------------------------------------+---------------------------------------------------------------+
| ``train_cell(*inputs) -> (loss, overflow,            | one step; ``loss_scale`` is the scale it used                 |
| loss_scale)``                                        |                                                               |
+------------------------------------------------------+---------------------------------------------------------------+
| ``train_cell.set_sense_scale(sens)``                 | sets the scale (one host read)                                |
+------------------------------------------------------+---------------------------------------------------------------+

Deviations: the scale stops at float32's largest finite value, where MindSpore's cell grows into inf and its
manager's Python float grows on; a ``scale_factor`` that is not a power of two rounds to float32 each step.
``TrainOneStepWithLossScaleCell`` does not average gradients over devices (wrap the network in
``DistributedDataParallel``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from lossscale import presets
from lossscale.compat._common import LossScaleHolder, OptimizerHolder, validated_counters
from lossscale.optimizer import LossScaleOptimizer
from lossscale.policies.base import FixedScale
from lossscale.reporting import StepResult
from lossscale.state import LossScale
from lossscale.validation import FLOAT32_MAX, validate_choice, validate_optimizer, validate_scale, validated_scale

__all__ = [
    "DynamicLossScaleUpdateCell",
    "FixedLossScaleUpdateCell",
    "DynamicLossScaleManager",
    "FixedLossScaleManager",
    "TrainOneStepWithLossScaleCell",
]

#: MindSpore's ``DynamicLossScaleManager.bad_step_max``: more overflows in a row than this raise.
BAD_STEP_MAX = 1000


#: What an update cell returns: the ``overflow`` it was given (a bool or a one-value tensor).
OverflowT = TypeVar("OverflowT", torch.Tensor, bool)


def _flag(overflow: object, device: torch.device, call: str = "DynamicLossScaleUpdateCell") -> torch.Tensor:
    """One step's overflow verdict as a 0-d bool tensor: a bool or a one-value tensor (no host read)."""
    if isinstance(overflow, torch.Tensor):
        if overflow.numel() != 1:
            raise ValueError(
                f"{call}(overflow={overflow!r}): overflow must hold one value (one step's verdict); "
                f"got shape {tuple(overflow.shape)}."
            )
        return overflow.to(device=device, dtype=torch.bool).reshape(())
    if isinstance(overflow, bool):
        return torch.tensor(overflow, device=device)
    raise TypeError(
        f"{call}(overflow={overflow!r}): overflow must be a bool or a bool tensor; got {type(overflow).__name__}."
    )


def _check_loss_scale(call: str, loss_scale: object) -> None:
    """The cell's ``loss_scale``: a 1-element float32 tensor (MindSpore's Parameter, updated in place)."""
    rule = f"{call}(loss_scale, overflow): loss_scale must be a 1-element tensor (MindSpore's loss_scale Parameter)"
    if not isinstance(loss_scale, torch.Tensor):
        raise TypeError(f"{rule}; got {type(loss_scale).__name__}.")
    if loss_scale.numel() != 1:
        raise ValueError(f"{rule}; got shape {tuple(loss_scale.shape)}.")
    if loss_scale.dtype != torch.float32:
        raise TypeError(
            f"{call}(loss_scale, overflow): loss_scale must be a float32 tensor (MindSpore's "
            f"loss_scale Parameter is float32, and it is updated in place); got {loss_scale.dtype}. "
            f"Create it as torch.tensor(2.0**24) or convert it with .float()."
        )


class DynamicLossScaleUpdateCell(LossScaleHolder):
    """The update cell: ``cell(loss_scale, overflow)`` updates ``loss_scale`` in place and returns ``overflow``.

    Args:
        loss_scale_value: MindSpore's initial loss scale, a number in [1, float32's largest finite value]: where a
            :class:`TrainOneStepWithLossScaleCell` drives the cell, the scale starts from it; a call
            ``cell(loss_scale, overflow)`` updates the value of the tensor it is given. ``get_loss_scale()`` returns
            it as given (as MindSpore's cell does).
        scale_factor: > 1: a growth multiplies the scale by it, a backoff by its reciprocal rounded to float32
            (float32 products), down to 1.
        scale_window: An int >= 1: the scale grows at this many steps in a row without overflow, counted from the
            last overflow or growth.

    Example:
        >>> import torch
        >>> cell = DynamicLossScaleUpdateCell(loss_scale_value=2**12, scale_factor=2, scale_window=1000)
        >>> scale = torch.tensor(2.0**12)
        >>> cell(scale, torch.tensor(True))
        tensor(True)
        >>> float(scale)
        2048.0
    """

    def __init__(self, loss_scale_value: float, scale_factor: float, scale_window: int) -> None:
        call = "DynamicLossScaleUpdateCell"
        validate_scale(call, "loss_scale_value", loss_scale_value, low=1.0, high=FLOAT32_MAX)
        super().__init__(presets.mindspore(loss_scale_value, scale_factor, scale_window, call=call))
        self.loss_scale_value = loss_scale_value
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def get_loss_scale(self) -> float:
        """``loss_scale_value``, as MindSpore's cell returns it."""
        return self.loss_scale_value

    @torch.no_grad()
    def __call__(self, loss_scale: torch.Tensor, overflow: OverflowT) -> OverflowT:
        """Update ``loss_scale`` (float32, shape () or (1,)) in place from ``overflow``; return ``overflow``."""
        _check_loss_scale("DynamicLossScaleUpdateCell", loss_scale)
        if self.loss_scale.device != loss_scale.device:
            self.loss_scale.to(loss_scale.device)
        self.loss_scale.follow(loss_scale)
        self.loss_scale.update(_flag(overflow, loss_scale.device))
        loss_scale.copy_(self.loss_scale.scale.reshape(loss_scale.shape))
        return overflow

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaleUpdateCell(loss_scale_value={self.loss_scale_value!r}, "
            f"scale_factor={self.scale_factor!r}, scale_window={self.scale_window!r})"
        )


class FixedLossScaleUpdateCell(LossScaleHolder):
    """An update cell that keeps the scale: ``cell(loss_scale, overflow)`` returns ``overflow``.

    Args:
        loss_scale_value: MindSpore's fixed loss scale, a number in [1, float32's largest finite value];
            ``get_loss_scale()`` returns it as given.
    """

    def __init__(self, loss_scale_value: float) -> None:
        validate_scale("FixedLossScaleUpdateCell", "loss_scale_value", loss_scale_value, low=1.0, high=FLOAT32_MAX)
        super().__init__(FixedScale(float(loss_scale_value)))
        self.loss_scale_value = loss_scale_value

    def get_loss_scale(self) -> float:
        return self.loss_scale_value

    def __call__(self, loss_scale: torch.Tensor, overflow: OverflowT) -> OverflowT:
        _check_loss_scale("FixedLossScaleUpdateCell", loss_scale)
        return overflow

    def __repr__(self) -> str:
        return f"FixedLossScaleUpdateCell(loss_scale_value={self.loss_scale_value!r})"


class DynamicLossScaleManager(LossScaleHolder):
    """MindSpore's host-side dynamic manager. After more than 1000 overflows in a row each one raises
    ``RuntimeError`` (the scale is updated first) and the next clean step grows the scale, as in MindSpore.

    Args:
        init_loss_scale: The first loss scale, default 2**24; a number in [1, float32's largest finite value].
        scale_factor: > 1, default 2: a growth multiplies the scale by it, a backoff by its reciprocal, down to 1
            (products in float64, as MindSpore's Python float; the scale is kept in float32).
        scale_window: An int >= 1, default 2000: the scale grows at this many steps in a row without overflow,
            counted from the last overflow or growth.

    Example:
        >>> m = DynamicLossScaleManager(init_loss_scale=2**10, scale_window=2)
        >>> for overflow in [True, False, False]:
        ...     m.update_loss_scale(overflow)
        >>> m.get_loss_scale()
        1024.0
    """

    def __init__(self, init_loss_scale: float = 2.0**24, scale_factor: float = 2, scale_window: int = 2000) -> None:
        rule = presets.mindspore(init_loss_scale, scale_factor, scale_window, call="DynamicLossScaleManager")
        super().__init__(dataclasses.replace(rule, arithmetic="float64"))
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.bad_steps = 0

    def get_loss_scale(self) -> float:
        """The current loss scale as a Python float (reads it on the host)."""
        return float(self.loss_scale.scale)

    def update_loss_scale(self, overflow: bool | torch.Tensor) -> None:
        """Update the rule with one step's ``overflow``, a bool (a tensor is read on the host)."""
        if isinstance(overflow, torch.Tensor):
            overflow = bool(_flag(overflow, overflow.device, "DynamicLossScaleManager.update_loss_scale"))
        if not isinstance(overflow, bool):
            raise TypeError(
                f"DynamicLossScaleManager.update_loss_scale(overflow={overflow!r}): overflow must be "
                f"a bool; got {type(overflow).__name__}."
            )
        self.loss_scale.update(torch.tensor(overflow, device=self.loss_scale.device))
        self.bad_steps = self.bad_steps + 1 if overflow else 0
        if self.bad_steps > BAD_STEP_MAX:
            ready = dict(self.loss_scale.state_dict(), growth_tracker=self.scale_window - 1)
            self.loss_scale.load_state_dict(ready, call="DynamicLossScaleManager.update_loss_scale")
            raise RuntimeError(
                f"DynamicLossScaleManager.update_loss_scale(overflow=True): {self.bad_steps} overflows in a row "
                f"exceed MindSpore's limit of {BAD_STEP_MAX} (the scale is {self.get_loss_scale()!r}). The "
                f"gradients overflow at any scale: look for inf or NaN in the data, the loss or the model."
            )

    def get_drop_overflow_update(self) -> bool:
        return True

    def get_update_cell(self) -> DynamicLossScaleUpdateCell:
        """A :class:`DynamicLossScaleUpdateCell` starting at the current scale."""
        return DynamicLossScaleUpdateCell(self.get_loss_scale(), self.scale_factor, self.scale_window)

    def state_dict(self) -> dict[str, Any]:
        """The scale and counters, and the overflows in a row (``bad_steps``)."""
        return {**super().state_dict(), "bad_steps": self.bad_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        validated_counters(
            "DynamicLossScaleManager.load_state_dict", state_dict, ("policy_state", "bad_steps"), ("bad_steps",)
        )
        super().load_state_dict(state_dict)
        self.bad_steps = state_dict["bad_steps"]


class FixedLossScaleManager(LossScaleHolder):
    """A constant scale (>= 1); ``drop_overflow_update`` says whether overflowing steps are skipped.

    Args:
        loss_scale: The fixed loss scale, default 128.0; a number in [1, float32's largest finite value].
        drop_overflow_update: MindSpore's flag, default True: overflowing steps are skipped, and
            ``get_update_cell()`` gives the :class:`FixedLossScaleUpdateCell` that a
            :class:`TrainOneStepWithLossScaleCell` checks them with. False: ``get_update_cell()`` is None, as in
            MindSpore, where the steps are then applied unchecked; ``get_drop_overflow_update()`` returns it.
    """

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True) -> None:
        validate_scale("FixedLossScaleManager", "loss_scale", loss_scale, low=1.0, high=FLOAT32_MAX)
        validate_choice("FixedLossScaleManager", "drop_overflow_update", drop_overflow_update, (True, False))
        super().__init__(FixedScale(float(loss_scale)))
        self.drop_overflow_update = drop_overflow_update

    def get_loss_scale(self) -> float:
        return float(self.loss_scale.scale)

    def update_loss_scale(self, overflow: bool | torch.Tensor) -> None:
        """Nothing: the scale is fixed."""

    def get_drop_overflow_update(self) -> bool:
        return self.drop_overflow_update

    def get_update_cell(self) -> FixedLossScaleUpdateCell | None:
        """A :class:`FixedLossScaleUpdateCell`, or None when overflowing steps are not dropped."""
        return FixedLossScaleUpdateCell(self.get_loss_scale()) if self.drop_overflow_update else None


class TrainOneStepWithLossScaleCell(OptimizerHolder):
    """One training step with loss scaling: ``train_cell(*inputs) -> (loss, overflow, loss_scale)``.

    With an update cell the optimizer shares the cell's LossScale. No host read.

    Args:
        network: A module (or callable) returning the loss (MindSpore's ``WithLossCell``).
        optimizer: A torch optimizer over the network's parameters.
        scale_sense: A :class:`DynamicLossScaleUpdateCell`/:class:`FixedLossScaleUpdateCell`, or a tensor of
            shape () or (1,) holding a fixed scale.
        **kwargs: Further :class:`~lossscale.LossScaleOptimizer` arguments.

    Raises:
        TypeError: ``network`` is not callable, ``optimizer`` not a torch optimizer, or ``scale_sense`` neither
            an update cell nor a tensor.
        ValueError: ``scale_sense`` is a tensor of another shape, or not a valid scale.
    """

    instance_name = "train_cell"

    def __init__(
        self,
        network: Callable[..., torch.Tensor],
        optimizer: torch.optim.Optimizer,
        scale_sense: DynamicLossScaleUpdateCell | FixedLossScaleUpdateCell | torch.Tensor,
        **kwargs: Any,
    ) -> None:
        call = "TrainOneStepWithLossScaleCell"
        if not callable(network):
            raise TypeError(f"{call}(network={network!r}): network must be a callable returning the loss.")
        validate_optimizer(call, optimizer, "optimizer")
        self.network = network
        self.optimizer = optimizer
        self.loss_scaling_manager: DynamicLossScaleUpdateCell | FixedLossScaleUpdateCell | None = None
        if isinstance(scale_sense, (DynamicLossScaleUpdateCell, FixedLossScaleUpdateCell)):
            self.loss_scaling_manager = scale_sense
            loss_scale = scale_sense.loss_scale
        elif isinstance(scale_sense, torch.Tensor):
            if tuple(scale_sense.shape) not in ((), (1,)):
                raise ValueError(
                    f"{call}(scale_sense=tensor of shape {tuple(scale_sense.shape)}): the shape of "
                    f"scale_sense must be (1,) or (); got {tuple(scale_sense.shape)}."
                )
            loss_scale = LossScale(FixedScale(validated_scale(f"{call}(scale_sense={scale_sense!r})", scale_sense)))
        else:
            raise TypeError(
                f"{call}(scale_sense={scale_sense!r}): scale_sense must be an update cell "
                f"(DynamicLossScaleUpdateCell, FixedLossScaleUpdateCell) or a tensor; got "
                f"{type(scale_sense).__name__}."
            )
        super().__init__(LossScaleOptimizer(optimizer, policy=loss_scale, **kwargs))

    @property
    def scale_sense(self) -> torch.Tensor:
        """The current loss scale, a 0-d float32 tensor (no host read)."""
        return self._opt.scale

    def set_sense_scale(self, sens: torch.Tensor) -> None:
        """Set the loss scale to ``sens``, a 1-element tensor (one host read); the counters carry on."""
        if not isinstance(sens, torch.Tensor) or sens.numel() != 1:
            error = ValueError if isinstance(sens, torch.Tensor) else TypeError
            raise error(
                f"TrainOneStepWithLossScaleCell.set_sense_scale(sens={sens!r}): sens must be a "
                f"1-element tensor; got {type(sens).__name__} of shape {tuple(getattr(sens, 'shape', ()))}."
            )
        self._opt.loss_scale.set_scale(sens, call=f"TrainOneStepWithLossScaleCell.set_sense_scale({sens!r})")

    def __call__(self, *inputs: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        result = self.step(*inputs)
        return self._last_loss, result.found_inf, result.scale

    def step(self, *inputs: object) -> StepResult:
        """Like calling the cell, returning the whole :class:`~lossscale.StepResult`."""
        self._opt.zero_grad()
        loss = self.network(*inputs)
        self._opt.backward(loss)
        self._last_loss = loss.detach()
        return self._opt.step()
