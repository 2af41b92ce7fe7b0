"""MindSpore's loss-scale update cells over the one owner of the scale (see :mod:`lossscale.compat.mindspore`)."""

from __future__ import annotations

from typing import Any

import torch

from lossscale import presets
from lossscale._validate import check_factor_above_one, check_int_at_least, check_scale
from lossscale.compat._checks import checked_state_dict
from lossscale.policy import FLOAT32_MAX, FixedScale, ScaleState
from lossscale.state import LossScale


def _flag(overflow: Any, device: torch.device, call: str = "DynamicLossScaleUpdateCell") -> torch.Tensor:
    """One step's overflow verdict as a 0-d bool tensor: a bool or a one-value tensor (no host read)."""
    if isinstance(overflow, torch.Tensor):
        if overflow.numel() != 1:
            raise ValueError(f"{call}(overflow={overflow!r}): overflow must hold one value (one step's verdict); "
                             f"got shape {tuple(overflow.shape)}.")
        return overflow.to(device=device, dtype=torch.bool).reshape(())
    if isinstance(overflow, bool):
        return torch.tensor(overflow, device=device)
    raise TypeError(f"{call}(overflow={overflow!r}): overflow must be a bool or a bool tensor; got "
                    f"{type(overflow).__name__}.")


def _check_loss_scale(call: str, loss_scale: Any) -> None:
    """The cell's ``loss_scale`` is MindSpore's float32 Parameter: a 1-element float32 tensor, updated in
    place, so another dtype is refused rather than rounded (an int64 scale would truncate ``S / 3``)."""
    if not isinstance(loss_scale, torch.Tensor):
        raise TypeError(f"{call}(loss_scale, overflow): loss_scale must be a 1-element tensor (MindSpore's "
                        f"loss_scale Parameter); got {type(loss_scale).__name__}.")
    if loss_scale.numel() != 1:
        raise ValueError(f"{call}(loss_scale, overflow): loss_scale must be a 1-element tensor (MindSpore's "
                         f"loss_scale Parameter); got shape {tuple(loss_scale.shape)}.")
    if loss_scale.dtype != torch.float32:
        raise TypeError(f"{call}(loss_scale, overflow): loss_scale must be a float32 tensor (MindSpore's "
                        f"loss_scale Parameter is float32, and it is updated in place); got {loss_scale.dtype}. "
                        f"Create it as torch.tensor(2.0**24) or convert it with .float().")


def _check_rule(call: str, init_name: str, init: Any, scale_factor: Any, scale_window: Any) -> None:
    check_scale(call, init_name, init, low=1.0, high=FLOAT32_MAX)
    check_factor_above_one(call, "scale_factor", scale_factor, "the scale is multiplied and divided by it")
    check_int_at_least(call, "scale_window", scale_window, 1)


class _StatefulRule:
    """A policy's :class:`~lossscale.state.LossScale` (``loss_scale``), with ``state_dict``/``load_state_dict``."""

    loss_scale: LossScale

    @property
    def policy(self) -> Any:
        """The rule (frozen)."""
        return self.loss_scale.policy

    @property
    def scale_state(self) -> ScaleState:
        """The whole state record (for a cell: its counters; the live scale is the tensor it updates)."""
        return self.loss_scale.state

    def state_dict(self) -> dict[str, Any]:
        """The scale and counters as plain numbers (reads them on the host)."""
        return {"policy_state": self.loss_scale.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (validated first)."""
        checked_state_dict(f"{type(self).__name__}.load_state_dict", state_dict, ("policy_state",))
        self.loss_scale.load_state_dict(state_dict["policy_state"], f"{type(self).__name__}.load_state_dict")


class DynamicLossScaleUpdateCell(_StatefulRule):
    """The loss-scale update cell: ``cell(loss_scale, overflow)`` updates ``loss_scale`` in place.

    Rule: :func:`lossscale.presets.mindspore`. The cell keeps the counters; the scale is the tensor passed
    in, as MindSpore's cell reads and assigns the ``loss_scale`` Parameter. No host read.

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
        _check_rule("DynamicLossScaleUpdateCell", "loss_scale_value", loss_scale_value, scale_factor, scale_window)
        self.loss_scale_value = loss_scale_value
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.loss_scale = LossScale(presets.mindspore(loss_scale_value, scale_factor, scale_window))

    def get_loss_scale(self) -> float:
        """``loss_scale_value``, as MindSpore's cell returns it (the live scale is the tensor it updates)."""
        return self.loss_scale_value

    @torch.no_grad()
    def __call__(self, loss_scale: torch.Tensor, overflow: Any) -> Any:
        """Update ``loss_scale`` (float32, shape () or (1,)) in place from ``overflow``; return ``overflow``.
        No host read."""
        _check_loss_scale("DynamicLossScaleUpdateCell", loss_scale)
        owner = self.loss_scale
        if owner.device != loss_scale.device:
            owner.to(loss_scale.device)
        owner.follow(loss_scale)
        owner.update(_flag(overflow, loss_scale.device))
        loss_scale.copy_(owner.scale.reshape(loss_scale.shape))
        return overflow

    def __repr__(self) -> str:
        return (f"DynamicLossScaleUpdateCell(loss_scale_value={self.loss_scale_value!r}, "
                f"scale_factor={self.scale_factor!r}, scale_window={self.scale_window!r})")


class FixedLossScaleUpdateCell(_StatefulRule):
    """An update cell that keeps the scale: ``cell(loss_scale, overflow)`` returns ``overflow``."""

    def __init__(self, loss_scale_value: float) -> None:
        check_scale("FixedLossScaleUpdateCell", "loss_scale_value", loss_scale_value, low=1.0, high=FLOAT32_MAX)
        self.loss_scale_value = loss_scale_value
        self.loss_scale = LossScale(FixedScale(float(loss_scale_value)))

    def get_loss_scale(self) -> float:
        """``loss_scale_value``."""
        return self.loss_scale_value

    def __call__(self, loss_scale: torch.Tensor, overflow: Any) -> Any:
        """Return ``overflow``; the scale does not move."""
        _check_loss_scale("FixedLossScaleUpdateCell", loss_scale)
        return overflow

    def __repr__(self) -> str:
        return f"FixedLossScaleUpdateCell(loss_scale_value={self.loss_scale_value!r})"
