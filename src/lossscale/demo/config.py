"""The demo's configuration: one frozen record, and the two presets the README quotes (``QUICK``, ``DEFAULT``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["DemoConfig", "QUICK", "DEFAULT"]


@dataclass(frozen=True)
class DemoConfig:
    """Everything that decides a run's numbers (the run's name aside).

    Attributes:
        steps: Optimizer steps.
        accumulation: Micro-batches per step; each micro-batch's loss is its mean over its own characters
            divided by ``accumulation`` (and by the number of ranks), i.e. the sum over the global
            batch's characters divided by their count.
        sequences: Sequences per micro-batch.
        context: Characters per sequence.
        d_model, layers, heads: The transformer's size.
        files: Standard-library files read (a tenth of them held out).
        lr: Peak AdamW learning rate (linear warm-up over the first 10% of steps, cosine decay to 10%).
        clip_grad_norm: Clip the unscaled global gradient norm to this (None: no clipping).
        eval_tokens: Held-out characters the reported loss is measured on.
        eval_every: Steps between held-out evaluations (the last step is always evaluated).
        measure_every: Steps between underflow measurements (the first and last step always measured).
        seed: Seeds the model's initialisation, the choice of files and every batch.
    """

    steps: int = 200
    accumulation: int = 16
    sequences: int = 32
    context: int = 64
    d_model: int = 32
    layers: int = 1
    heads: int = 2
    files: int = 60
    lr: float = 1e-2
    clip_grad_norm: float | None = None
    eval_tokens: int = 32_768
    eval_every: int = 20
    measure_every: int = 10
    seed: int = 0

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.sequences * self.context

    def tokens_per_step(self, world_size: int = 1) -> int:
        return self.tokens_per_micro_batch * self.accumulation * world_size

    def describe(self, world_size: int = 1) -> str:
        """One line, quoted verbatim by the README for ``--quick`` and the default."""
        ranks = f" x {world_size} ranks" if world_size > 1 else ""
        return (f"{self.steps} steps x {self.accumulation} micro-batches{ranks} x {self.sequences} sequences x "
                f"{self.context} characters ({self.tokens_per_step(world_size):,} characters per step); "
                f"{self.layers} layer{'s' if self.layers != 1 else ''}, d_model {self.d_model}, "
                f"{self.heads} heads; {self.files} stdlib files; AdamW lr {self.lr:g}"
                f"{f', clip {self.clip_grad_norm:g}' if self.clip_grad_norm else ''}; seed {self.seed}")

    def replace(self, **changes: Any) -> DemoConfig:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: ``lossscale demo``: longer, and more convincing.
DEFAULT = DemoConfig()
#: ``lossscale demo --quick``: under two minutes on two CPU cores, and already shows both effects.
QUICK = DEFAULT.replace(steps=60, eval_every=10, measure_every=5)
