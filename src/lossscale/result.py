"""What one step decided, as frozen records: ``LossScaleOptimizer.step()``'s StepResult and
``GradScaler.step()``'s ScalerStep."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from lossscale._host import read_scalars

__all__ = ["ScalerStep", "StepResult"]


@dataclass(frozen=True)
class StepResult:
    """The decision of one ``step()``; tensors stay on the device until the caller reads them.

    Attributes:
        stepped: 0-d bool, True where the inner optimizer's update was applied.
        found_inf: 0-d bool, True where the gradients overflowed (and the step was skipped).
        scale: 0-d float32, the loss scale the gradients of this step carried.
        next_scale: 0-d float32, the scale after the policy's update.
        grad_norm: 0-d float32, the unscaled global gradient norm when it was computed, else None.
        accumulating: True between accumulation boundaries (nothing was applied or checked).
        step: Index of this accumulation boundary (optimizer step attempts so far, skipped included).
        precision: ``"float16"``, ``"bfloat16"`` or ``"float32"``: what the schedule ran this step in
            (``None`` without a schedule).
        switched: True on the boundary where a precision schedule switched back to full precision.
        underflow: 0-d float32 share of gradient values that would flush to zero in float16 at this
            scale, when the underflow meter is on; else None.
        loss: What the closure passed to ``step(closure)`` returned (None without a closure). Not a
            column of :class:`~lossscale.StepLogger` (pass ``loss=`` there, or it is taken from here).
        layer_scales: Per-layer scales by module name when per-layer scaling is on; else None.
    """

    stepped: torch.Tensor
    found_inf: torch.Tensor
    scale: torch.Tensor
    next_scale: torch.Tensor
    grad_norm: torch.Tensor | None = None
    accumulating: bool = False
    step: int = 0
    precision: str | None = None
    switched: bool = False
    underflow: torch.Tensor | None = None
    loss: Any = dataclasses.field(default=None, metadata={"column": False})
    layer_scales: dict[str, torch.Tensor] | None = dataclasses.field(default=None, metadata={"column": False})

    @property
    def skipped(self) -> torch.Tensor:
        """0-d bool, True where the step was skipped at a boundary (never while accumulating)."""
        return ~self.stepped if not self.accumulating else torch.zeros_like(self.stepped)

    def as_dict(self) -> dict[str, Any]:
        """Every column field (and ``loss``) as plain Python values (reads the tensors on the host: one sync)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("column", True)}
        if isinstance(self.loss, torch.Tensor) and self.loss.numel() == 1:
            values["loss"] = self.loss.detach()
        return read_scalars(values)


@dataclass(frozen=True)
class ScalerStep:
    """What ``GradScaler.step`` decided.

    Attributes:
        found_inf: 0-d bool tensor, True where the gradients overflowed.
        stepped: 0-d bool tensor, True where the optimizer's update was applied (``~found_inf``).
        value: What ``optimizer.step()`` returned (None when it was skipped without calling it).

    Both flags are formed from ``overflow`` (the step's count of overflows, its 0/1 flag, or a bool) when
    read: one 0-d op each then, none in the step. Reading their values is a host read.
    """

    overflow: torch.Tensor
    value: Any = None

    @property
    def found_inf(self) -> torch.Tensor:
        return self.overflow if self.overflow.dtype == torch.bool else self.overflow > 0

    @property
    def stepped(self) -> torch.Tensor:
        return self.overflow == 0 if self.overflow.dtype != torch.bool else ~self.overflow
