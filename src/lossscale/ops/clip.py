"""Gradient norms and clipping coefficients, computed on scaled gradients in one read pass.

The unscaled global norm is ``norm(scaled) / scale``, so clipping folds into the unscale coefficient
(``inv_scale * clip``). Sharded gradients (FSDP2's DTensor ``Shard(0)``): each rank reads its shard and the
squared norms of shards are summed over the ranks (one all-reduce); replicated gradients count once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from lossscale.ops import distributed as _dist
from lossscale.ops.gather import gathered
from lossscale.ops.overflow import group_by_device_and_dtype

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "squared_norms",
    "global_norm_squared",
    "grouped_norm_squared",
    "global_clip_coefficient",
    "clip_per_tensor_",
]

# torch.nn.utils.clip_grad_norm_'s guard against division by zero.
EPS = 1e-6


def squared_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-tensor squared L2 norms of the local parts (a DTensor's shard) as a float32 vector.
    One read of every gradient (``torch._foreach_norm``); no host read, no host op per tensor (:func:`gathered`)."""
    return _local_squared_norms([_dist.local_shard(g) for g in grads])


def _local_squared_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`squared_norms` of tensors that are already local and dense (one device)."""
    if not tensors:
        return torch.zeros(0)
    return gathered(torch._foreach_norm(list(tensors))).float().square()


def grouped_norm_squared(
    groups: Mapping[tuple[torch.device, torch.dtype], list[torch.Tensor]], device: torch.device | str
) -> torch.Tensor:
    """Squared L2 norm of plain (local, dense) gradients already grouped by device and dtype, as 0-d
    float32 on ``device``. One read of every gradient; no all-reduce, no host read."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group in groups.values():
        if group:
            total += _local_squared_norms(group).sum().to(device, non_blocking=True)
    return total


def _sum_of_squares(grads: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """Squared L2 norm of the local parts of ``grads`` (a sparse gradient's values), as 0-d float32."""
    return grouped_norm_squared(group_by_device_and_dtype(_dist.local_shard(g) for g in grads), device)


def _split(grads: Sequence[torch.Tensor], sharded: bool | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(shards, replicated): by ``sharded`` when given, else by each gradient's DTensor placement."""
    if sharded is not None:
        return (list(grads), []) if sharded else ([], list(grads))
    shards: list[torch.Tensor] = []
    replicated: list[torch.Tensor] = []
    for g in grads:
        (shards if _dist.is_shard(g) else replicated).append(g)
    return shards, replicated


def global_norm_squared(
    grads: Sequence[torch.Tensor],
    process_group: ProcessGroup | None = None,
    sharded: bool | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Squared L2 norm of all the gradients together (0-d float32), across ranks where they are shards.

    Rule: ``sum over shards (all-reduced over process_group) + sum over replicated gradients``.
    ``sharded``: None decides per gradient (a DTensor ``Shard`` placement); True: every gradient is a shard
    (a hand-written ZeRO); False: none (DDP, one process). Non-finite gradients give a non-finite result.
    Cost: one read of every gradient; one all-reduce of one float when there are shards; no host read.
    """
    if device is None:
        device = _dist.local_shard(grads[0]).device if grads else torch.device("cpu")
    shards, replicated = _split(grads, sharded)
    total = _sum_of_squares(replicated, device)
    if shards or sharded:
        total += _dist.all_reduce_sum_(_sum_of_squares(shards, device), process_group)
    return total


def global_clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))``, torch's ``clip_grad_norm_`` rule, as a 0-d tensor."""
    return (max_norm / (norm + EPS)).clamp(max=1.0)


def clip_per_tensor_(
    grads: Sequence[torch.Tensor],
    max_norm: float,
    process_group: ProcessGroup | None = None,
    sharded: bool | None = None,
) -> None:
    """Each gradient clipped by its own norm: ``g * max_norm / max(||g||, max_norm)``, ``||g||`` over the
    whole tensor (a shard's squared norm is summed over ranks; ``sharded`` as in
    :func:`global_norm_squared`). One read + one write pass; one all-reduce of a vector when sharded."""
    if not grads:
        return
    shards, replicated = _split(grads, sharded)
    ordered = [_local_values(g) for g in shards + replicated]
    squares = _per_tensor_squares(ordered)
    if shards or sharded:
        shard_squares = _dist.all_reduce_sum_(squares[: len(shards)].clone(), process_group)
        squares = torch.cat([shard_squares, squares[len(shards) :]])
    coefs = max_norm / squares.sqrt().clamp(min=max_norm)
    torch._foreach_mul_(ordered, [c.to(t.device, non_blocking=True) for c, t in zip(coefs.unbind(), ordered)])


def _local_values(g: torch.Tensor) -> torch.Tensor:
    """What a rank reads and writes of a gradient: a DTensor's shard, a sparse tensor's values."""
    g = _dist.local_shard(g)
    return g.coalesce()._values() if g.is_sparse else g


def _per_tensor_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`squared_norms` in the order given, for tensors on several devices or of several dtypes."""
    device = tensors[0].device
    if all(t.device == device and t.dtype == tensors[0].dtype for t in tensors):
        return squared_norms(tensors)
    out = torch.empty(len(tensors), dtype=torch.float32, device=device)
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.device, t.dtype), []).append(i)
    for index in buckets.values():
        out[index] = squared_norms([tensors[i] for i in index]).to(device)
    return out
