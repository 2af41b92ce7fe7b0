"""Loss-scale policies: frozen configs whose whole rule is one sync-free transition.

A policy is validated once at construction. Its state (e.g. :class:`ScaleState`) is a small record of
0-d tensors on the gradients' device; ``update(state, found_inf, amax=None)`` returns the next state
with tensor ops only (no ``.item()``, no Python branch on data), so advancing the scale never waits for
the device. :class:`Policy` names every method and attribute the step pipeline uses, with defaults;
a new policy subclasses it and overrides what it needs. The state itself is owned by
:class:`~lossscale.state.LossScale`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lossscale.scale_value import FLOAT32_MAX, SMALLEST_NORMAL_FLOAT32, checked_scale, to_float32
from lossscale.state import ScaleState, state_from_dict, state_to_dict

__all__ = [
    "DynamicScale",
    "FixedScale",
    "FloorError",
    "Policy",
    "ScaleState",
    "FLOAT32_MAX",
    "SMALLEST_NORMAL_FLOAT32",
    "check_policy",
    "state_from_dict",
    "state_to_dict",
]

_SATURATE = 2**30  # counters stop here instead of wrapping
_f32 = to_float32


class FloorError(RuntimeError):
    """Raised when a policy with ``at_floor="raise"`` must back off below ``min_scale``."""


class Policy:
    """The protocol of a loss-scale policy: everything the step pipeline calls, with its defaults.

    Required: ``init(device) -> state`` (a frozen dataclass of tensors with a ``scale`` field) and
    ``update(state, found_inf, amax=None) -> state`` (tensor ops only). Optional, with defaults here:

    ``observes_amax`` (False): True asks the pipeline for ``amax``, the largest scaled-gradient magnitude
        of the step, taken in the overflow pass (``aminmax``: one read pass instead of a plain check).
    ``check_floor(state)`` (nothing): the floor rule, run after every update; may raise
        :class:`FloorError` (and may read the state on the host: say so in its docstring).
    ``observes_loss_finite`` (False): True asks for ``update(..., loss_finite=...)``, whether every loss of
        the step was finite (0-d bool; an overflow with a non-finite loss is not evidence about the scale).
    ``min_scale`` / ``max_scale`` (2**-126 / float32 max): the bounds every scale set from outside is
        validated against.
    """

    observes_amax: ClassVar[bool] = False
    observes_loss_finite: ClassVar[bool] = False
    min_scale: float = SMALLEST_NORMAL_FLOAT32
    max_scale: float = FLOAT32_MAX

    def init(self, device: torch.device | str | None = None) -> Any:
        """A fresh state on ``device`` (default CPU)."""
        raise NotImplementedError(f"{type(self).__name__}.init(device) is required by the Policy protocol")

    def update(self, state: Any, found_inf: torch.Tensor, amax: torch.Tensor | None = None) -> Any:
        """The next state after a step whose gradients did (``found_inf``) or did not overflow."""
        raise NotImplementedError(f"{type(self).__name__}.update(state, found_inf, amax) is required by the Policy "
                                  f"protocol")

    def check_floor(self, state: Any) -> None:
        """The floor rule after an update: by default none (the scale stays at its floor and steps skip)."""


def check_policy(call: str, policy: Any) -> None:
    """A TypeError unless ``policy`` is a :class:`Policy` (the pipeline calls only its protocol)."""
    if not isinstance(policy, Policy):
        raise TypeError(f"{call}(policy={policy!r}): policy must have init(device) and update(state, found_inf, "
                        f"amax=None): pass a lossscale.policy.Policy (DynamicScale, FixedScale, PredictiveScale, a "
                        f"preset, or your own subclass of Policy); got {type(policy).__name__}.")


def _check_flag(found_inf: Any) -> None:
    """A TypeError unless found_inf is a tensor (bool, or a float/int count as torch's scaler keeps it)."""
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(
            f"update(state, found_inf): found_inf must be a tensor (bool or a count of overflows); "
            f"got {type(found_inf).__name__}"
        )


def _as_flag(found_inf: torch.Tensor, device: torch.device) -> torch.Tensor:
    """found_inf (bool, or a float/int count as torch's scaler keeps it) as a 0-d bool on ``device``."""
    _check_flag(found_inf)
    flag = found_inf.to(device=device, non_blocking=True)
    return flag if flag.dtype == torch.bool else flag != 0


@dataclass(frozen=True)
class FixedScale(Policy):
    """A constant loss scale: overflowing steps are still detected and skipped, the scale never moves.

    Cost: none; ``update`` returns the state unchanged.

    Example:
        >>> import torch
        >>> policy = FixedScale(128.0)
        >>> float(policy.update(policy.init(), torch.tensor(True)).scale)
        128.0
    """

    scale: float = 2.0**16

    def __post_init__(self) -> None:
        checked_scale(f"{type(self).__name__}(scale={self.scale!r})", self.scale, name="scale")

    def init(self, device: torch.device | str | None = None) -> ScaleState:
        """A state holding the fixed scale on ``device`` (default: CPU)."""
        zero = torch.zeros((), dtype=torch.int32, device=device)
        return ScaleState(
            scale=torch.full((), self.scale, dtype=torch.float32, device=device),
            growth_tracker=zero,
            hysteresis_left=torch.ones((), dtype=torch.int32, device=device),
            floor_hits=zero.clone(),
        )

    def update(self, state: ScaleState, found_inf: torch.Tensor, amax: torch.Tensor | None = None) -> ScaleState:
        """The same state: a fixed scale ignores overflow (found_inf's type is still checked). No op."""
        _check_flag(found_inf)
        return state


def is_power_of_two(x: float) -> bool:
    """Whether ``x`` is an exact power of two (then multiplying by it or its inverse is exact)."""
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


from lossscale.dynamic import DynamicScale  # noqa: E402  (DynamicScale subclasses Policy)
