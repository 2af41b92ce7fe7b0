"""torch.distributed for the step: whether ranks must agree, sums over ranks, and the shard a rank holds of a
DTensor gradient (FSDP2). The agreement of found_inf itself is a stage (:func:`lossscale.stages.agree_`); the lines a
script needs to run under ``torchrun`` are in :mod:`lossscale.testing`.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.tensor import DTensor


def active(process_group: ProcessGroup | None = None) -> bool:
    """Whether a reduction is needed: torch.distributed is initialized and the group has > 1 rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(process_group) > 1


def all_reduce_sum_(tensor: torch.Tensor, process_group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the group in place (identity outside torch.distributed)."""
    if active(process_group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=process_group)
    return tensor


def _dtensor_type() -> type[DTensor] | None:
    # a DTensor exists only once torch.distributed.tensor is imported: never import it here
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (sharing its storage): ``t.to_local()`` for a DTensor, else ``t``."""
    if type(t) is torch.Tensor:
        return t
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        with torch.no_grad():  # the local tensor itself, not an autograd view of it
            return t.to_local()
    return t


def is_shard(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor sharded over some mesh dimension (FSDP2's ``Shard(0)``)."""
    if type(t) is torch.Tensor:
        return False
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(t, dtensor):
        return False
    from torch.distributed.tensor import Shard

    return any(isinstance(p, Shard) for p in t.placements)


def all_reduce_grads_(
    grads: Iterable[torch.Tensor | None], process_group: ProcessGroup | None = None, *, average: bool = False
) -> list[torch.Tensor]:
    """Sum the dense, plain gradients over the group in place (``average=True`` divides by the group size);
    ``None`` entries skipped; returns the rest. Identity outside torch.distributed. Call it before the overflow check.
    Cost: per (device, dtype), one flattening copy, one all-reduce and one copy back; no host read."""
    present = [g for g in grads if g is not None]
    for g in present:
        if g.is_sparse or local_shard(g) is not g:
            kind = "sparse" if g.is_sparse else "DTensor"
            raise TypeError(
                f"all_reduce_grads_(grads=[..., {kind} of shape {tuple(g.shape)}, ...]): the gradients "
                f"must be dense plain tensors; got a {kind}. Reduce sparse gradients yourself; "
                f"DTensor gradients (FSDP2) are already reduced."
            )
    if not present or not active(process_group):
        return present
    world = dist.get_world_size(process_group)
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in present:
        buckets[(g.device, g.dtype)].append(g)
    for bucket in buckets.values():
        alone = len(bucket) == 1 and bucket[0].is_contiguous()
        flat = bucket[0] if alone else torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=process_group)
        if average:
            flat.div_(world)
        if not alone:
            views = [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in bucket]), bucket)]
            torch._foreach_copy_(bucket, views)
    return present
