"""One decision for every rank: found_inf reduced over torch.distributed without a host read.

Also here: the shard a rank holds of a DTensor gradient (FSDP2), a gradient all-reduce for facades whose API
takes a communicator, and the two lines a script needs to run under ``torchrun``.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.tensor import DTensor

__all__ = [
    "active",
    "reduce_found_inf",
    "all_reduce_sum_",
    "all_reduce_grads_",
    "local_shard",
    "is_shard",
    "init_from_env",
    "is_main_process",
    "shutdown",
]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def active(process_group: ProcessGroup | None = None) -> bool:
    """Whether a reduction is needed: torch.distributed is initialized and the group has > 1 rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(process_group) > 1


def reduce_found_inf(
    found_inf: torch.Tensor, process_group: ProcessGroup | None = None, *, is_flag: bool = False
) -> torch.Tensor:
    """Turn ``found_inf`` (0-d float32, a count of overflows) into the group's 0/1 flag, in place; no host read.

    Rule: ``found_inf = max over ranks of min(found_inf, 1)`` (no clamp with ``is_flag``: already 0 or 1).
    Cost: one all-reduce of one float under torch.distributed (every rank of the group must call it); outside
    it, one 0-d clamp.
    """
    if not is_flag:
        found_inf.clamp_(max=1.0)
    if active(process_group):
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=process_group)
    return found_inf


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


def init_from_env(backend: str = "gloo", timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the process group that ``torchrun`` describes in the environment; return ``(rank, world_size)``.

    Rule: already initialized -> that group's (rank, world_size); ``RANK`` and ``WORLD_SIZE`` set ->
    ``init_process_group(backend, init_method="env://")``; otherwise -> ``(0, 1)``, nothing initialized.
    ``backend``: ``"gloo"`` (CPU) by default, ``"nccl"`` on GPUs. Call :func:`shutdown` at exit.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return 0, 1
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_from_env(backend={backend!r}): torchrun sets {', '.join(_TORCHRUN_VARS)}; "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing. Launch with "
            f"`torchrun --nproc_per_node=N script.py`, or unset RANK and WORLD_SIZE to run alone."
        )
    if not dist.is_available():
        raise RuntimeError(
            f"init_from_env(backend={backend!r}): RANK is set but this torch build has no "
            f"torch.distributed; install a build with it, or unset RANK and WORLD_SIZE."
        )
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def is_main_process() -> bool:
    """True on rank 0, and in a single process: the rank that prints, plots and saves checkpoints."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def shutdown() -> None:
    """Destroy the default process group if one is initialized (the pair of :func:`init_from_env`)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
