"""Counting host reads: the syncs a training step pays to read device values on the CPU.

``aten._local_scalar_dense`` is the op behind ``.item()``, ``bool(tensor)``, ``float(tensor)`` and
``int(tensor)``; counting its calls under a ``TorchDispatchMode`` counts every host read of a scalar,
on any device (on CUDA each one waits for the device).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReadCounter"]


class HostReadCounter(TorchDispatchMode):
    """Context manager counting scalar host reads (``aten._local_scalar_dense``) while active.

    Example:
        >>> import torch
        >>> with HostReadCounter() as reads:
        ...     _ = torch.ones(()).item()
        >>> reads.count
        1
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))
