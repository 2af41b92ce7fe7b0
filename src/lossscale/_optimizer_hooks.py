"""What a LossScaleOptimizer attaches: a precision schedule and per-layer scales (its run state holds both)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Attachments"]


class Attachments:
    """Mixin for :class:`~lossscale.LossScaleOptimizer`: the schedule hooks and the per-layer scales."""

    _run: Any
    inner: torch.optim.Optimizer
    schedule: Any

    def attach_schedule(self, schedule: Any) -> None:
        """Scale only while ``schedule`` is in float16; refuse parameters already in low precision."""
        from lossscale.schedule import check_attachable

        check_attachable(schedule, [p for g in self.inner.param_groups for p in g["params"]])
        self._run.schedule = schedule
        self._run.seen_switch = schedule.switched

    def _precision(self) -> str | None:
        if self.schedule is None:
            return None
        dtype = self.schedule.dtype
        return "float32" if dtype is None else str(dtype).replace("torch.", "")

    def _consume_switch(self, precision: str | None) -> bool:
        """True once: on the first boundary whose step ran in the original precision."""
        run = self._run
        if run.schedule is None or run.seen_switch or precision in ("float16", "bfloat16"):
            return False
        run.seen_switch = True
        return True

    def attach_layerwise(self, layerwise: Any) -> None:
        """Keep one scale per module of ``layerwise`` (a model, a list of modules, or a
        :class:`~lossscale.layerwise.LayerScales`) on top of the global one; every parameter of the inner
        optimizer must belong to one of its units. The gradients are then unscaled per unit (explicitly)."""
        from lossscale.layerwise import LayerScales

        device = next(p.device for g in self.inner.param_groups for p in g["params"])
        layers = layerwise if isinstance(layerwise, LayerScales) else LayerScales(layerwise, device=device)
        covered = {id(p) for p in layers.parameters()}
        stray = [f"param_groups[{i}][{j}]" for i, g in enumerate(self.inner.param_groups)
                 for j, p in enumerate(g["params"]) if id(p) not in covered]
        if stray:
            raise ValueError(f"LossScaleOptimizer(layerwise=...): {stray[0]} of the inner optimizer belongs to no "
                             f"unit of the per-layer scales ({len(stray)} such parameters); pass the model whose "
                             f"parameters the optimizer updates, or a list of modules that holds all of them.")
        self._run.layers = layers
