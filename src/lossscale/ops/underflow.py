"""The underflow meter: how much of the gradient would round to zero in float16 at the current scale."""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Magnitudes at or below this round to zero in float16 (half the smallest subnormal, 2**-24).
FLUSH_TO_ZERO_FLOAT16 = 2.0**-25


def underflow_share(
    grads: Sequence[torch.Tensor],
    stride: int = 64,
    flush_below: float = FLUSH_TO_ZERO_FLOAT16,
    carried_scale: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """Share (0-d float32) of sampled nonzero values (every ``stride``-th) with ``|g * carried_scale| <= flush_below``.

    ``carried_scale``: what takes the gradients to the units float16 would hold (1 for the scaled gradients).
    Reads ``1/stride`` of the gradients; no host read.
    """
    if stride < 1:
        raise ValueError(f"underflow_share(stride={stride!r}): stride must be an integer >= 1; got {stride!r}.")
    tiny = []
    nonzero = []
    for g in grads:
        if not g.numel():
            continue
        sample = g.detach().reshape(-1)[::stride].abs().float()
        if not isinstance(carried_scale, float) or carried_scale != 1.0:
            sample = sample * carried_scale
        nz = sample != 0
        tiny.append((nz & (sample <= flush_below)).sum())
        nonzero.append(nz.sum())
    if not tiny:
        return torch.zeros(())
    total = torch.stack(nonzero).sum().float()
    return torch.stack(tiny).sum().float() / total.clamp_min(1.0)
