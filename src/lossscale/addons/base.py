"""The contract between a front end and its add-ons (EMA, precision schedule, overflow diagnosis and healing, your
own): three hooks and one flag, each used by both front ends.

A front end (:class:`~lossscale.GradScaler`, :class:`~lossscale.LossScaleOptimizer`) calls the hooks on every add-on
it holds, in the order it was given them; each default does nothing::

    attach(front_end)             when the front end takes the add-on (again when its options change)
    on_loss(loss, opens_window)   each loss the front end is given, before it is scaled; returns whether the
                                  losses of the window it opens are scaled (read where opens_window is True)
    after_step(outcome)           after the step (applied or skipped) and the policy's update; returns the fields
                                  it adds to the step's result (and so to the loggers' rows), or None
    finds_forward_faults          read at attach: True asks the front end to find forward faults (a non-finite loss
                                  skips the step and leaves the policy's state as it was)

A checkpoint holds an add-on's state under its ``key`` (``state_dict``, ``validate_state_dict``, ``load_state_dict``;
``label`` names it in messages). No hook may read a device value on the host on a healthy step: every tensor it is
given is still on the device.

A keyword of a front end (``ema=``, ``schedule=``, ``diagnose=``, ``heal=``) becomes add-ons in one table,
:mod:`lossscale.keywords`; past it, neither front end names an add-on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lossscale.reporting import StepOutcome
from lossscale.state import LossScale

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class FrontEnd:
    """What a front end tells an add-on about itself when it attaches it.

    Attributes:
        call: The front end's name, for messages (``"LossScaleOptimizer"``, ``"GradScaler"``).
        loss_scale: The :class:`~lossscale.LossScale` that holds the scale (read and set it through its methods).
        params: The parameters the front end's optimizer updates (empty for a GradScaler, which has none of its own).
        process_group: The group found_inf is agreed over under torch.distributed (None: the world).
    """

    call: str
    loss_scale: LossScale[Any]
    params: tuple[torch.Tensor, ...] = ()
    process_group: ProcessGroup | None = None


class AddOn:
    """Base of every add-on: the hooks of the module docstring, each doing nothing unless overridden. ``key`` names
    the add-on's entry in a checkpoint (None: it saves nothing)."""

    key: ClassVar[str | None] = None
    #: What the add-on is called in messages ("an EMA", "a precision schedule").
    label: ClassVar[str] = "an add-on"
    #: Whether the front end finds forward faults for this add-on (read when it attaches the add-on): a step one of
    #: whose losses is non-finite is skipped and the policy does not see it (``StepOutcome.forward_fault``).
    finds_forward_faults: bool = False

    def attach(self, front_end: FrontEnd) -> None:
        """Called when a front end takes the add-on, and again when its options change."""

    def on_loss(self, loss: torch.Tensor | None, opens_window: bool) -> bool:
        """Called with each loss before it is scaled and backpropagated (``opens_window``: the first loss since the
        last step; ``loss`` None where a step came with no loss, its gradients written by hand). Returns whether the
        losses of the window this loss opens are to be scaled; the front end reads the answer where ``opens_window``
        is True (a precision schedule's bfloat16 or float32 phase says False)."""
        return True

    def after_step(self, outcome: StepOutcome) -> dict[str, Any] | None:
        """Called after each step (applied or skipped) and the policy's update. Returns the fields to add to the
        step's result (``StepResult.fields``; a logger writes them as columns), or None."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """The add-on's state for a checkpoint (only when ``key`` is set)."""
        return {}

    def validate_state_dict(self, state: Any) -> Any:
        """Raise (naming the key) unless ``state`` is one :meth:`load_state_dict` accepts; change nothing."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (checked by :meth:`validate_state_dict` first)."""
