"""The one interface through which a front end meets its add-ons (EMA, precision schedule, per-layer scales,
overflow diagnosis, a facade's extras).

A front end calls these hooks, in this order, on every add-on it was given; each default does nothing::

    attach(host)                      once, when the front end takes the add-on
    on_scale_loss(loss, scaled)       after the loss is scaled, before its backward
    unscale(scale, found_inf)         per-layer scales only: unscale and check the gradients itself
    on_unscaled(grads, stepped)       explicit unscaling only: the unscaled gradients, before the inner step
    advance(found_inf, scale)         before the policy's update: the found_inf the policy sees
    after_step(outcome)               after the inner step (applied or skipped) and the policy's update

No hook may read a device value on the host on a healthy step (one whose ``found_inf`` is 0): every argument is a
tensor still on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

__all__ = ["AddOn", "Host", "StepOutcome", "Unscaled"]


def _always_scaled() -> bool:
    return True


@dataclass(frozen=True)
class Host:
    """What a front end tells an add-on about itself when it attaches it.

    Attributes:
        call: The front end's name, for messages (``"LossScaleOptimizer"``, ``"GradScaler"``).
        params: The parameters the front end's optimizer updates (empty for a GradScaler, which has none of its own).
        device: Where the loss scale lives.
        process_group: The group found_inf is agreed over under torch.distributed (None: the world).
        is_scaled: Whether the losses now being backpropagated are scaled (False in a precision schedule's
            bfloat16 or float32 phase).
    """

    call: str
    params: tuple[torch.Tensor, ...] = ()
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    process_group: Any = None
    is_scaled: Callable[[], bool] = _always_scaled


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step decided, as device tensors (no host read).

    Attributes:
        stepped: 0-d bool, True where the inner step was applied.
        found_inf: 0-d bool, True where the gradients overflowed (the step was skipped).
        scale: The loss scale the step's gradients were scaled by (1 while scaling is off).
        next_scale: The scale after the policy's update.
        step: The number of optimizer steps before this one (0 for the first).
        scaled: Whether this step's losses were scaled.
    """

    stepped: torch.Tensor
    found_inf: torch.Tensor
    scale: torch.Tensor
    next_scale: torch.Tensor
    step: int
    scaled: bool = True


@dataclass(frozen=True)
class Unscaled:
    """What an add-on that unscales the gradients itself measured: found_inf and amax (0-d, agreed over ranks),
    and the factor left to apply to every gradient (1 where it unscaled them all)."""

    found_inf: torch.Tensor
    amax: torch.Tensor


class AddOn:
    """Base of every add-on: hooks a front end calls in a step's order (see the module docstring); each does
    nothing unless overridden. ``key`` names the add-on's entry in a checkpoint (None: it saves nothing)."""

    key: ClassVar[str | None] = None
    #: What the add-on is called in messages ("an EMA", "per-layer scales").
    label: ClassVar[str] = "an add-on"

    def attach(self, host: Host) -> None:
        """Called once when a front end takes the add-on."""

    def on_scale_loss(self, loss: torch.Tensor, scaled: torch.Tensor) -> None:
        """After ``loss`` was multiplied into ``scaled``, before its backward."""

    def unscale(self, scale: torch.Tensor, found_inf: torch.Tensor) -> Unscaled | None:
        """Unscale and check the gradients in place by a rule of the add-on's own (per-layer scales); None: the
        step's own unscale runs. At most one add-on of a front end may unscale."""
        return None

    @property
    def unscales(self) -> bool:
        """Whether :meth:`unscale` replaces the step's own unscale."""
        return type(self).unscale is not AddOn.unscale

    def on_unscaled(self, grads: list[torch.Tensor], stepped: torch.Tensor) -> None:
        """The unscaled gradients (explicit unscaling only), after the overflow check, before the inner step;
        ``stepped`` is True where the step will be applied."""

    def advance(self, found_inf: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Before the policy's update: the found_inf the policy sees (default: ``found_inf``)."""
        return found_inf

    def after_step(self, outcome: StepOutcome) -> None:
        """After the inner step (applied or skipped) and the policy's update."""

    def step_fields(self, scale: torch.Tensor) -> dict[str, Any]:
        """Fields the add-on adds to the step's result (e.g. ``layer_scales``)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The add-on's state for a checkpoint (only when ``key`` is set)."""
        return {}

    def check_state_dict(self, state: Any) -> None:
        """Raise (naming the key) unless ``state`` is one :meth:`load_state_dict` accepts; change nothing."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (checked by :meth:`check_state_dict` first)."""
