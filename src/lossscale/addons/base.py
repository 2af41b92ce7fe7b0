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

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lossscale.reporting import StepOutcome
from lossscale.state import LossScale
from lossscale.validation import outside_caller

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


#: What each add-on's checkpoint entry is called in messages, by key: the add-ons a front end may lack (an add-on's
#: own ``label`` wins where the front end holds it).
PART_LABELS = {
    "ema": "an EMA",
    "layerwise": "per-layer scales",
    "schedule": "a precision schedule",
    "diagnosis": "an overflow diagnosis",
}


def parts_of(add_ons: list[AddOn]) -> list[tuple[str, AddOn]]:
    """(checkpoint key, add-on) of each add-on that saves state (a ``key``), in order."""
    return [(add_on.key, add_on) for add_on in add_ons if add_on.key is not None]


def warn_unmatched_parts(call: str, front_end: str, parts: list[tuple[str, Any]], state_dict: dict[str, Any]) -> None:
    """A UserWarning for each part that only one side has: the front end (the part keeps its state) or the
    checkpoint (its entry is ignored)."""
    have = {key for key, _ in parts}
    keywords = {"diagnosis": "diagnose"}
    labels = {**PART_LABELS, **{key: part.label for key, part in parts}}
    for key, what in labels.items():
        if key in have and key not in state_dict:
            warnings.warn(
                f"{call}: this {front_end} has {what} ({keywords.get(key, key)}=) and the checkpoint has no {key!r} "
                f"entry; the {key} part keeps its current state, not the saved run's. Save the checkpoint from a "
                f"{front_end} with the same parts to resume it.",
                UserWarning,
                stacklevel=outside_caller(),
            )
        elif key in state_dict and key not in have:
            warnings.warn(
                f"{call}: the checkpoint holds a {key!r} entry and this {front_end} has no {what}; the entry is "
                f"ignored. Pass {keywords.get(key, key)}=... when building the {front_end} to resume it.",
                UserWarning,
                stacklevel=outside_caller(),
            )
