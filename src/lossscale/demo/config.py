"""The demo's configuration: one frozen record, and the two presets the README quotes (``QUICK``, ``DEFAULT``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["DemoConfig", "QUICK", "DEFAULT", "power_text"]


@dataclass(frozen=True)
class DemoConfig:
    """Everything that decides a run's numbers (the run's name aside).

    Attributes:
        steps: Updates a run applies (skipped steps come on top: see :mod:`lossscale.demo.train`).
        accumulation: Micro-batches per step.
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
        init_scale: The loss scale the float16 runs start from; the default, 2**32, is Megatron-LM's
            ``--initial-loss-scale`` and overflows this model's float16 gradients, so the plot shows the
            dynamic scaler backing off (one skipped step per halving) before it trains.
        growth_interval: ``DynamicScale(growth_interval=...)``: clean steps before the scale doubles again
            (torch's default is 2000; the demo's runs are short enough that 2000 would never show a growth).
        loss_normalizer: A step's summed cross-entropy is divided by this many characters (0: by the
            step's own characters, a plain mean). The presets use 2**20, a large language-model batch, so
            the backward passes carry gradients as small as such a run's (a plain mean over this small
            step's characters gives gradients 64x larger, which float16 holds without scaling); AdamW's
            ``eps`` is divided by the same factor, so float32 trains exactly as with a plain mean.
    """

    steps: int = 160
    accumulation: int = 6
    sequences: int = 64
    context: int = 32
    d_model: int = 16
    layers: int = 1
    heads: int = 2
    files: int = 60
    lr: float = 2e-2
    clip_grad_norm: float | None = None
    eval_tokens: int = 32_768
    eval_every: int = 20
    measure_every: int = 10
    seed: int = 0
    init_scale: float = 2.0**32
    growth_interval: int = 20
    loss_normalizer: int = 2**20

    def __post_init__(self) -> None:
        normalizer = self.loss_normalizer
        if isinstance(normalizer, bool) or not isinstance(normalizer, int) or normalizer < 0:
            raise ValueError(f"DemoConfig(loss_normalizer={normalizer!r}): loss_normalizer must be an int >= 0 (the "
                             f"characters a step's summed loss is divided by; 0 for the step's own count).")

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.sequences * self.context

    def tokens_per_step(self, world_size: int = 1) -> int:
        return self.tokens_per_micro_batch * self.accumulation * world_size

    def normalizer(self, world_size: int = 1) -> int:
        """The count a step's summed loss is divided by (``loss_normalizer``, or the step's characters)."""
        return self.loss_normalizer or self.tokens_per_step(world_size)

    def loss_factor(self, world_size: int = 1) -> float:
        """``tokens_per_step / normalizer``: what a plain mean's loss (and AdamW's ``eps``) is multiplied by."""
        return self.tokens_per_step(world_size) / self.normalizer(world_size)

    def describe(self, world_size: int = 1) -> str:
        """One line, quoted verbatim by the README for ``--quick`` and the default."""
        ranks = f" x {world_size} ranks" if world_size > 1 else ""
        return (f"{self.steps} updates x {self.accumulation} micro-batches{ranks} x {self.sequences} sequences x "
                f"{self.context} characters ({self.tokens_per_step(world_size):,} characters per step); "
                f"{self.layers} layer{'s' if self.layers != 1 else ''}, d_model {self.d_model}, "
                f"{self.heads} heads; {self.files} stdlib files; loss / {self.normalizer(world_size):,} characters; "
                f"AdamW lr {self.lr:g}"
                f"{f', clip {self.clip_grad_norm:g}' if self.clip_grad_norm else ''}; float16 loss scale from "
                f"{power_text(self.init_scale)}, x2 after {self.growth_interval} clean steps; seed {self.seed}")

    def replace(self, **changes: Any) -> DemoConfig:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def power_text(x: float) -> str:
    """``2^24`` for a power of two, else the number as ``%g`` prints it."""
    exponent = math.log2(x) if x > 0 else 0.5
    return f"2^{exponent:g}" if exponent == int(exponent) else f"{x:g}"


#: ``lossscale demo``: four times ``--quick``'s steps, with the precision schedule run as well.
DEFAULT = DemoConfig()
#: ``lossscale demo --quick``: the same model and batches, a quarter of the steps (see the README for its time).
QUICK = DEFAULT.replace(steps=40, eval_every=10, measure_every=5)
