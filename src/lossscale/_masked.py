"""Skipping an optimizer step without a host read: snapshot, step, restore where found_inf.

Cost per step: one copy (read + write) of the parameters and of every optimizer state tensor before
the step, and one masked select (two reads + one write) of the same after it: for Adam, about
3 x (parameters + 2 state tensors) of traffic on top of the step itself.
"""

from __future__ import annotations

from typing import Any

import torch

from lossscale.distributed import local_shard

__all__ = ["MaskedSkip"]


class MaskedSkip:
    """Keeps snapshot buffers between steps (allocated once, reused)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    @staticmethod
    def ready(optimizer: torch.optim.Optimizer) -> bool:
        """True once every parameter with a gradient has its optimizer state (the first step creates it;
        a skipped first step must not leave state behind, so that one step is decided on the host)."""
        return all(
            p in optimizer.state and len(optimizer.state[p]) > 0
            for g in optimizer.param_groups for p in g["params"] if p.grad is not None
        ) or not _has_stateful_defaults(optimizer)

    @staticmethod
    def _targets(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                out.append(local_shard(p))  # a DTensor (FSDP2) is restored through its local shard
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        out.append(local_shard(value))
                    elif value is not None:
                        raise TypeError(
                            f"LossScaleOptimizer(skip_mode='masked'): {type(optimizer).__name__} keeps state "
                            f"{key!r} as {type(value).__name__}, which cannot be restored without a host read; "
                            f"use skip_mode='host'."
                        )
        return out

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Run ``optimizer.step()``, then put back every parameter and state tensor where ``found_inf``."""
        targets = self._targets(optimizer)
        if len(self._buffers) != len(targets) or any(
            b.shape != t.shape or b.dtype != t.dtype for b, t in zip(self._buffers, targets)
        ):
            self._buffers = [torch.empty_like(t) for t in targets]
        torch._foreach_copy_(self._buffers, [t.detach() for t in targets])
        value = optimizer.step(*args, **kwargs)
        bad = found_inf.to(torch.bool)
        for saved, t in zip(self._buffers, targets):
            torch.where(bad, saved, t.detach(), out=t.detach())
        return value


def _has_stateful_defaults(optimizer: torch.optim.Optimizer) -> bool:
    # Plain SGD without momentum keeps no state worth restoring; everything else does.
    if isinstance(optimizer, torch.optim.SGD):
        return any(g.get("momentum", 0) for g in optimizer.param_groups)
    return True
