"""Reading several 0-d device tensors on the host in one sync."""

from __future__ import annotations

from typing import Any

import torch


def read_scalars(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with every one-element tensor replaced by a Python bool/int/float, read in one sync.

    The tensors are stacked as float64 on the first one's device and read with a single ``tolist()``.
    """
    tensors = [(k, v) for k, v in values.items() if isinstance(v, torch.Tensor)]
    out = dict(values)
    if tensors:
        device = tensors[0][1].device
        read = torch.stack([v.detach().reshape(()).to(device, torch.float64) for _, v in tensors]).tolist()
        for (k, v), x in zip(tensors, read):
            out[k] = bool(x) if v.dtype == torch.bool else (int(x) if not v.is_floating_point() else x)
    return out
