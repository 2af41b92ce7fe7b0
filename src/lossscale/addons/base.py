"""The one interface through which a front end meets its add-ons (EMA, precision schedule, per-layer scales,
overflow diagnosis, a facade's extras).

A front end calls these hooks, in this order, on every add-on it was given; each default does nothing::

    attach(host)                      when the front end takes the add-on, and again when its options change
    on_scale_loss(loss, scaled)       after the loss is scaled, before its backward
    unscale(scale, found_inf)         per-layer scales only: unscale and check the gradients itself
    before_apply(stepped, grads)      after the skip decision, before the inner step
    advance(found_inf, scale)         before the policy's update: the found_inf the policy sees
    after_step(outcome)               after the inner step (applied or skipped) and the policy's update

No hook may read a device value on the host on a healthy step (one whose ``found_inf`` is 0): every argument is a
tensor still on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

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
        sharded_grads: Which gradients are shards of a larger tensor (None: detected per gradient).
        is_scaled: Whether the losses now being backpropagated are scaled (False in a precision schedule's
            bfloat16 or float32 phase).
    """

    call: str
    params: tuple[torch.Tensor, ...] = ()
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    process_group: ProcessGroup | None = None
    sharded_grads: bool | None = None
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

    def scales_losses(self) -> bool:
        """Whether losses are to be scaled now (False in a precision schedule's bfloat16 or float32 phase). Read
        at the first loss of each accumulation window."""
        return True

    def precision(self) -> str | None:
        """The precision the forward passes run in now (``"float16"``, ``"bfloat16"``, ``"float32"``), for
        an add-on that decides it; None for the others."""
        return None

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

    #: Whether :meth:`before_apply` writes the unscaled gradients: the step then unscales them in a pass of its
    #: own rather than in a fused optimizer's kernel.
    writes_grads: bool = False

    def before_apply(self, stepped: torch.Tensor, grads: list[torch.Tensor] | None) -> None:
        """After the overflow check, before the inner step is applied or skipped. ``stepped`` (0-d bool) is True
        where it will be applied; ``grads`` are the unscaled gradients where the step unscaled them in a pass of
        its own, else None (a fused kernel unscales them)."""

    def advance(self, found_inf: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Before the policy's update: the found_inf the policy sees (default: ``found_inf``)."""
        return found_inf

    def after_step(self, outcome: StepOutcome) -> None:
        """After the inner step (applied or skipped) and the policy's update."""

    def step_fields(self, scale: torch.Tensor) -> dict[str, Any]:
        """Fields the add-on adds to the step's result (e.g. ``layer_scales``), before :meth:`advance`."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The add-on's state for a checkpoint (only when ``key`` is set)."""
        return {}

    def validate_state_dict(self, state: Any) -> Any:
        """Raise (naming the key) unless ``state`` is one :meth:`load_state_dict` accepts; change nothing."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (checked by :meth:`validate_state_dict` first)."""
