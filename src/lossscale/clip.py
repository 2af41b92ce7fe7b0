"""Gradient norms and clipping coefficients, computed on scaled gradients in one read pass.

The global norm of the unscaled gradients is ``norm(scaled) / scale``; for power-of-two scales that
equals the norm of the unscaled gradients exactly, so clipping can be folded into the unscale
coefficient (``inv_scale * clip``) and applied once, by a ``_foreach_mul_`` or inside a fused optimizer.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lossscale import distributed as _dist

__all__ = ["squared_norms", "global_clip_coefficient", "clip_per_tensor_"]

# torch.nn.utils.clip_grad_norm_'s guard against division by zero.
EPS = 1e-6


def _local(t: torch.Tensor) -> torch.Tensor:
    """The shard a rank holds, for DTensor gradients (FSDP2); the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def squared_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-tensor squared L2 norms as a float32 vector. One read of every gradient, no write.

    On CPU, contiguous float32 gradients use ``torch.dot`` (BLAS, about twice the bandwidth of
    ``torch._foreach_norm`` here); everything else uses ``torch._foreach_norm`` squared.
    """
    locals_ = [_local(g) for g in grads]
    if locals_ and all(g.device.type == "cpu" and g.dtype == torch.float32 and g.is_contiguous() for g in locals_):
        flat = [g.view(-1) for g in locals_]
        return torch.stack([torch.dot(f, f) for f in flat]) if flat else torch.zeros(0)
    norms = torch._foreach_norm(locals_, 2.0) if locals_ else []
    return torch.stack([n.float() for n in norms]).square() if norms else torch.zeros(0)


def global_norm_squared(grads: Sequence[torch.Tensor], process_group=None, sharded: bool = False) -> torch.Tensor:
    """Sum of squares of every gradient (0-d float32); summed over ranks when the gradients are shards."""
    total = squared_norms(grads).sum() if grads else torch.zeros(())
    if sharded:
        _dist.all_reduce_sum_(total, process_group)
    return total


def global_clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))``, torch's ``clip_grad_norm_`` rule, as a 0-d tensor."""
    return (max_norm / (norm + EPS)).clamp(max=1.0)


def clip_per_tensor_(grads: Sequence[torch.Tensor], max_norm: float) -> None:
    """Keras's ``clipnorm``: each gradient ``g * max_norm / max(||g||, max_norm)``. One read + one write pass."""
    if not grads:
        return
    norms = squared_norms(grads).sqrt()
    coefs = max_norm / norms.clamp(min=max_norm)
    torch._foreach_mul_(list(grads), list(coefs.unbind()))
