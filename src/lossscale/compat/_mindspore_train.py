"""MindSpore's ``TrainOneStepWithLossScaleCell`` on :class:`~lossscale.LossScaleOptimizer` (see :mod:`lossscale.compat.mindspore`)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from lossscale.compat._checks import check_optimizer
from lossscale.optimizer import LossScaleOptimizer
from lossscale.policy import FixedScale, ScaleState
from lossscale.result import StepResult
from lossscale.scale_value import checked_scale
from lossscale.state import LossScale
from lossscale.compat._mindspore_cells import DynamicLossScaleUpdateCell, FixedLossScaleUpdateCell


class TrainOneStepWithLossScaleCell:
    """One training step with loss scaling: ``train_cell(*inputs) -> (loss, overflow, loss_scale)``.

    Runs ``network(*inputs)`` (which returns the loss), the backward pass of ``loss * scale``, unscales,
    checks for overflow, steps ``optimizer`` unless it overflowed, and updates the scale through the update
    cell. The returned ``overflow`` and ``loss_scale`` are tensors (no host read): ``loss_scale`` is the
    scale this step's gradients carried; :attr:`scale_sense` is the live one.

    Args:
        network: A module (or callable) returning the loss (MindSpore's ``WithLossCell``).
        optimizer: A torch optimizer over the network's parameters.
        scale_sense: A :class:`DynamicLossScaleUpdateCell`/:class:`FixedLossScaleUpdateCell`, or a tensor of
            shape () or (1,) holding a fixed scale.
        **kwargs: Further :class:`~lossscale.LossScaleOptimizer` arguments (``skip_mode``, clipping, ...).
    """

    def __init__(self, network: Callable[..., torch.Tensor], optimizer: torch.optim.Optimizer,
                 scale_sense: Any, **kwargs: Any) -> None:
        call = "TrainOneStepWithLossScaleCell"
        if not callable(network):
            raise TypeError(f"{call}(network={network!r}): network must be a callable returning the loss.")
        check_optimizer(call, "optimizer", optimizer)
        self.network = network
        self.optimizer = optimizer
        self.loss_scaling_manager = None
        if isinstance(scale_sense, (DynamicLossScaleUpdateCell, FixedLossScaleUpdateCell)):
            self.loss_scaling_manager = scale_sense
            owner = scale_sense.loss_scale  # one owner: the cell's scale is the optimizer's
        elif isinstance(scale_sense, torch.Tensor):
            if tuple(scale_sense.shape) not in ((), (1,)):
                raise ValueError(f"{call}(scale_sense=tensor of shape {tuple(scale_sense.shape)}): the shape of "
                                 f"scale_sense must be (1,) or (); got {tuple(scale_sense.shape)}.")
            owner = LossScale(FixedScale(checked_scale(f"{call}(scale_sense={scale_sense!r})", scale_sense)))
        else:
            raise TypeError(f"{call}(scale_sense={scale_sense!r}): scale_sense must be an update cell "
                            f"(DynamicLossScaleUpdateCell, FixedLossScaleUpdateCell) or a tensor; got "
                            f"{type(scale_sense).__name__}.")
        self._opt = LossScaleOptimizer(optimizer, policy=owner, **kwargs)

    @property
    def scale_sense(self) -> torch.Tensor:
        """The current loss scale, a 0-d float32 tensor (no host read)."""
        return self._opt.scale

    @property
    def scale_state(self) -> ScaleState:
        """The whole state record (scale and counters)."""
        return self._opt.scale_state

    def set_sense_scale(self, sens: torch.Tensor) -> None:
        """Set the loss scale to ``sens`` (a 1-element tensor, validated: one host read); the counters carry on."""
        if not isinstance(sens, torch.Tensor) or sens.numel() != 1:
            error = ValueError if isinstance(sens, torch.Tensor) else TypeError
            raise error(f"TrainOneStepWithLossScaleCell.set_sense_scale(sens={sens!r}): sens must be a "
                        f"1-element tensor; got {type(sens).__name__} of shape {tuple(getattr(sens, 'shape', ()))}.")
        self._opt.loss_scale.set_scale(sens, f"TrainOneStepWithLossScaleCell.set_sense_scale({sens!r})")

    def __call__(self, *inputs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        result = self.step(*inputs)
        return self._last_loss, result.found_inf, result.scale

    def step(self, *inputs: Any) -> StepResult:
        """Like calling the cell, returning the whole :class:`~lossscale.StepResult`."""
        self._opt.zero_grad()
        loss = self.network(*inputs)
        self._opt.backward(loss)
        self._last_loss = loss.detach()
        return self._opt.step()

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's and the scale's state (see :meth:`lossscale.LossScaleOptimizer.state_dict`)."""
        return self._opt.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self._opt.load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("TrainOneStepWithLossScaleCell is not pickled directly; save train_cell.state_dict() with "
                        "torch.save.")
