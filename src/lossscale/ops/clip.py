"""Gradient norms, computed on scaled gradients in one read pass, and the per-tensor clip.

The unscaled global norm is ``norm(scaled) / scale``, so clipping folds into the unscale coefficient
(``inv_scale * clip``; the coefficient itself is :func:`lossscale.stages.clip_norm`). Sharded gradients (FSDP2's
DTensor ``Shard(0)``): each rank reads its shard and the squared norms of shards are summed over the ranks (one
all-reduce); replicated gradients count once.

Per-tensor norms come as one vector with no host op per tensor (:func:`norms`): ``torch._foreach_norm`` returns
one 0-d tensor per gradient, each its own allocation, and ``torch.stack`` of n of them dispatches 2n ops on the host
(an unsqueeze and an as_strided per tensor): for 2,000 gradients on a GPU, milliseconds of host time that the device
waits for. :func:`norms` copies them instead with one multi-tensor copy (``torch._foreach_copy_``) into views of a
kept buffer, then clones it: a constant number of host ops. On the CPU, where torch's multi-tensor copy is a loop of
copies, ``torch.stack`` is faster and is kept.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from lossscale.ops import distributed as _dist
from lossscale.validation import capturing

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# torch.nn.utils.clip_grad_norm_'s guard against division by zero.
EPS = 1e-6

#: Below this many values ``torch.stack`` is as cheap as the kept buffer.
MIN_COUNT = 16
#: Device types where ``torch.stack`` is kept (the CPU's multi-tensor copy is a loop of copies).
STACK_ON = frozenset({"cpu"})
#: Per thread, (device, dtype, count, CUDA stream) -> (buffer, its 0-d views). Kept for the process's life: a
#: handful of sizes in practice (one per set of gradients a step reads), each a vector of floats and its views. One
#: buffer per thread and stream, so that a copy into it is never reordered before another's read of it.
_KEPT = threading.local()


def norms(tensors: Sequence[torch.Tensor], ord: float = 2.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The per-tensor norms of ``tensors`` (one device, dense) as one 1-D tensor, in their dtype or ``dtype``
    (``torch.stack(torch._foreach_norm(tensors, ord, dtype=dtype))``, equal value for value; NaN propagated). One
    read of every tensor; no host read. Host ops: a constant number whatever ``len(tensors)`` (one multi-tensor copy
    into a kept buffer and one clone), except on :data:`STACK_ON` devices (the CPU), below :data:`MIN_COUNT` tensors
    and under CUDA graph capture (where host time is spent once, at capture), where ``torch.stack`` is used."""
    values = torch._foreach_norm(list(tensors), ord, dtype=dtype)
    n, first = len(values), values[0]
    if n < MIN_COUNT or first.device.type in STACK_ON or capturing(first):
        return torch.stack(values)
    stream = torch.cuda.current_stream(first.device).cuda_stream if first.is_cuda else None
    key = (first.device, first.dtype, n, stream)
    buffers = _KEPT.__dict__.setdefault("buffers", {})
    kept = buffers.get(key)
    if kept is None:
        buffer = torch.empty(n, dtype=first.dtype, device=first.device)
        kept = buffers[key] = (buffer, list(buffer.unbind()))
    buffer, views = kept
    torch._foreach_copy_(views, list(values))
    return buffer.clone()


def squared_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-tensor squared L2 norms of the local parts (a DTensor's shard) of ``grads`` (one device and dtype) as a
    float32 vector. One read of every gradient; no host read."""
    if not grads:
        return torch.zeros(0)
    return norms([_dist.local_shard(g) for g in grads]).float().square()


def grouped_norm_squared(
    groups: Mapping[tuple[torch.device, torch.dtype], list[torch.Tensor]], device: torch.device | str
) -> torch.Tensor:
    """Squared L2 norm of plain (local, dense) gradients already grouped by device and dtype, as 0-d
    float32 on ``device``. One read of every gradient; no all-reduce, no host read."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group in groups.values():
        if group:
            total += norms(group).float().square().sum().to(device, non_blocking=True)
    return total


def _sum_of_squares(grads: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """Squared L2 norm of the local parts of ``grads`` (a sparse gradient's values), as 0-d float32."""
    local: list[torch.Tensor | None] = [_local_values(g) for g in grads]
    groups = torch._C._group_tensors_by_device_and_dtype([local], False) if local else {}
    return grouped_norm_squared(
        {key: [t for t in lists[0] if t is not None] for key, (lists, _) in groups.items()}, device
    )


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
