"""Ascend (npu_bridge) loss scaling for PyTorch: the TF1 managers and ``NPULossScaleOptimizer``.

A translation table onto the core; the rule is :func:`lossscale.presets.ascend`.

==========================================================  =====================================================
Ascend / TF1 (npu_bridge)                                    lossscale
==========================================================  =====================================================
``ExponentialUpdateLossScaleManager(init_loss_scale,         ``presets.ascend(...)``: ``DynamicScale`` with
incr_every_n_steps, decr_every_n_nan_or_inf=2,               ``growth_interval=incr_every_n_steps``,
incr_ratio=2, decr_ratio=0.8)``                              ``hysteresis=decr_every_n_nan_or_inf`` counted
                                                             ``"cumulative"``, ``min_scale=1``, float32 products,
                                                             growth only while ``S < 3.4e38 / incr_ratio``
``FixedLossScaleManager(loss_scale)`` (>= 1)                 ``FixedScale(loss_scale)``
``manager.get_loss_scale()`` (a float32 variable)            the 0-d float32 scale tensor (no host read)
``manager.update_loss_scale(finite_grads)``                  ``policy.update(state, ~finite_grads)`` (no host read);
                                                             a float tensor is an NPU float status: 0 = finite
``NPULossScaleOptimizer(opt, loss_scale_manager,             ``LossScaleOptimizer(opt, policy=manager.loss_scale)``:
is_distributed=False)``                                      one owner of the scale, shared by both
``compute_gradients(loss)`` (scales the loss)                ``opt.backward(loss)`` (or ``opt.scale_loss(loss)``)
``apply_gradients(grads_and_vars)`` (unscale, skip on         ``opt.step()`` -> :class:`~lossscale.StepResult`
overflow, update the manager)
``is_distributed=True``: float status all-reduced (HCCL)     found_inf reduced over the torch.distributed world
NPU float status: Inf/NaN mode, or saturation mode            ``overflow_mode="inf_nan"`` (default) or
(results clamped to +-65504)                                 ``"saturation"`` (scaled ``|g| >= 65504`` overflows)
``ExperimentalConfig``, ``TellMeStepOrLossHook``              re-exported from ``lossscale.compat._ascend_precision``
==========================================================  =====================================================

Under torch.distributed every lossscale optimizer agrees on overflow across ranks, so
``is_distributed=False`` does not make ranks decide alone (they would drift apart); ``True`` asks
for a process group and fails clearly without one.

Example::

    manager = ExponentialUpdateLossScaleManager(init_loss_scale=2**32, incr_every_n_steps=1000,
                                                decr_every_n_nan_or_inf=2, decr_ratio=0.5)
    opt = NPULossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), manager)
    opt.backward(loss_fn(model(x), y))
    opt.step()                  # skipped on overflow; manager.get_loss_scale() follows
    opt.zero_grad()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lossscale import presets
from lossscale._validate import check_choice, check_scale
from lossscale.compat._checks import check_optimizer, checked_state_dict, overflow_from_finite_grads
from lossscale.optimizer import LossScaleOptimizer
from lossscale.overflow import OverflowMode
from lossscale.policy import FLOAT32_MAX, FixedScale, ScaleState
from lossscale.state import LossScale

__all__ = [
    "ExponentialUpdateLossScaleManager",
    "FixedLossScaleManager",
    "NPULossScaleOptimizer",
    "ExperimentalConfig",
    "TellMeStepOrLossHook",
]


class _LossScaleManager:
    """A policy's :class:`~lossscale.state.LossScale` with TF1's method names. The optimizer built on the
    manager shares that owner, so a scale set through either is what both read at once."""

    loss_scale: LossScale

    @property
    def policy(self) -> Any:
        """The rule (frozen)."""
        return self.loss_scale.policy

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale: a 0-d float32 tensor (no host read)."""
        return self.loss_scale.scale

    @property
    def scale_state(self) -> ScaleState:
        """The whole state record (scale and counters)."""
        return self.loss_scale.state

    def update_loss_scale(self, finite_grads: Any) -> None:
        """Advance the rule with one step's ``finite_grads`` (True: no overflow). No host read."""
        self.loss_scale.update(overflow_from_finite_grads(finite_grads, self.loss_scale.scale))

    def state_dict(self) -> dict[str, Any]:
        """The scale and counters as plain numbers (reads them on the host)."""
        return {"policy_state": self.loss_scale.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (validated first)."""
        checked_state_dict(f"{type(self).__name__}.load_state_dict", state_dict, ("policy_state",))
        self.loss_scale.load_state_dict(state_dict["policy_state"], f"{type(self).__name__}.load_state_dict")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.policy!r})"


class ExponentialUpdateLossScaleManager(_LossScaleManager):
    """Grows the scale by ``incr_ratio`` after ``incr_every_n_steps`` finite steps in a row and shrinks it by
    ``decr_ratio`` (floor 1) after ``decr_every_n_nan_or_inf`` non-finite steps since the last change.

    The rule is :func:`lossscale.presets.ascend`; the counters are not reset by a clean step, only by a
    change of scale (TF1's ``num_bad_steps``).

    Example:
        >>> import torch
        >>> m = ExponentialUpdateLossScaleManager(init_loss_scale=1024, incr_every_n_steps=2)
        >>> for finite in [False, True, False]:
        ...     m.update_loss_scale(finite)
        >>> float(m.get_loss_scale())   # the second non-finite step backs off: 1024 * 0.8
        819.2000122070312
    """

    def __init__(self, init_loss_scale: float, incr_every_n_steps: int, decr_every_n_nan_or_inf: int = 2,
                 incr_ratio: float = 2, decr_ratio: float = 0.8) -> None:
        self.loss_scale = LossScale(presets.build_as("ExponentialUpdateLossScaleManager", presets.ascend,
                                                     init_loss_scale, incr_every_n_steps, decr_every_n_nan_or_inf,
                                                     incr_ratio, decr_ratio))


class FixedLossScaleManager(_LossScaleManager):
    """A constant loss scale (>= 1, as TF1 requires); overflowing steps are still skipped by the optimizer.

    Example:
        >>> float(FixedLossScaleManager(128).get_loss_scale())
        128.0
    """

    def __init__(self, loss_scale: float) -> None:
        check_scale("FixedLossScaleManager", "loss_scale", loss_scale, low=1.0, high=FLOAT32_MAX)
        self.loss_scale = LossScale(FixedScale(float(loss_scale)))


class NPULossScaleOptimizer(LossScaleOptimizer):
    """A torch optimizer wrapped with an Ascend loss-scale manager: scale, unscale, skip on overflow.

    The core :class:`~lossscale.LossScaleOptimizer` with the manager as its policy: ``backward(loss)``
    scales by ``manager.get_loss_scale()``, ``step()`` unscales, checks, skips on overflow and updates
    the manager, and returns a :class:`~lossscale.StepResult`.

    Args:
        opt: The torch optimizer to wrap.
        loss_scale_manager: An :class:`ExponentialUpdateLossScaleManager` or :class:`FixedLossScaleManager`.
        is_distributed: True to agree on overflow across the torch.distributed world (requires an
            initialized process group).
        overflow_mode: ``"inf_nan"`` (default) or ``"saturation"`` (hardware that clamps to +-65504).
        **kwargs: Further :class:`~lossscale.LossScaleOptimizer` arguments (clipping, accumulation, ...).
    """

    def __init__(self, opt: torch.optim.Optimizer, loss_scale_manager: _LossScaleManager,
                 is_distributed: bool = False, overflow_mode: OverflowMode = "inf_nan", **kwargs: Any) -> None:
        call = "NPULossScaleOptimizer"
        check_optimizer(call, "opt", opt)
        if not isinstance(loss_scale_manager, _LossScaleManager):
            raise TypeError(f"{call}(loss_scale_manager={loss_scale_manager!r}): loss_scale_manager must be an "
                            f"ExponentialUpdateLossScaleManager or a FixedLossScaleManager from "
                            f"lossscale.compat.ascend; got {type(loss_scale_manager).__name__}.")
        check_choice(call, "is_distributed", is_distributed, (True, False))
        if is_distributed and not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"{call}(is_distributed=True): overflow is agreed over a torch.distributed process "
                             f"group, and none is initialized; call torch.distributed.init_process_group(...) "
                             f"first, or pass is_distributed=False.")
        self.loss_scale_manager = loss_scale_manager
        self.is_distributed = is_distributed
        super().__init__(opt, policy=loss_scale_manager.loss_scale, overflow_mode=overflow_mode, **kwargs)

    def get_loss_scale(self) -> torch.Tensor:
        """The manager's current loss scale (0-d float32 tensor; no host read)."""
        return self.loss_scale_manager.get_loss_scale()


from lossscale.compat._ascend_precision import ExperimentalConfig, TellMeStepOrLossHook  # noqa: E402
