"""One decision for every rank: found_inf reduced over torch.distributed without a host read.

When ``torch.distributed`` is initialized with more than one rank, every scaler sums its found_inf
over a process group (default: the world) before deciding to skip, so all ranks skip or step together
and their scales stay identical. Cost: one all-reduce of one float per step; no host read.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["active", "reduce_found_inf", "all_reduce_sum_"]


def active(process_group: Any = None) -> bool:
    """Whether a reduction is needed: torch.distributed is initialized and the group has > 1 rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(process_group) > 1


def reduce_found_inf(found_inf: torch.Tensor, process_group: Any = None) -> torch.Tensor:
    """Sum ``found_inf`` (0-d float32 on the gradients' device) over the group, in place; no host read."""
    if active(process_group):
        dist.all_reduce(found_inf, op=dist.ReduceOp.SUM, group=process_group)
    return found_inf


def all_reduce_sum_(tensor: torch.Tensor, process_group: Any = None) -> torch.Tensor:
    """Sum ``tensor`` over the group in place (identity outside torch.distributed)."""
    if active(process_group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=process_group)
    return tensor
