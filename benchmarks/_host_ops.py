"""Count the host-side ops of a call: the aten ops the host dispatches, outside torch's multi-tensor kernels.

``torch.profiler`` records every aten op, nested ones included (the ``unsqueeze`` of each input inside
``stack``). An op nested inside a multi-tensor kernel (``_foreach_*``, ``_fused_*``, ``_amp_foreach_*``) is not
counted: on CPU those kernels loop over their tensors op by op, on CUDA each is one launch, and either way that
cost is the kernel's, the same for every caller. What is left is what the caller's own code asks of the host: on
CUDA each of these ops is host time (a view) or a kernel launch. Counted, not timed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["MULTI_TENSOR_KERNELS", "host_ops", "dispatched_ops", "kernel_tensors", "growth_per_tensor"]

MULTI_TENSOR_KERNELS = ("aten::_foreach_", "aten::_fused_", "aten::_amp_foreach_")


def host_ops(fn: Callable[[], Any]) -> Counter:
    """aten op name -> calls while ``fn()`` runs once, those nested in a multi-tensor kernel left out."""
    with profile(activities=[ProfilerActivity.CPU], acc_events=True) as prof:
        fn()
    counts: Counter = Counter()
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(MULTI_TENSOR_KERNELS):
            parent = parent.cpu_parent
        if parent is None:
            counts[event.name] += 1
    return counts


class _Dispatched(TorchDispatchMode):
    """Counts each top-level aten op's calls and the tensors it is handed (the ops a kernel runs inside itself are
    not seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()
        self.tensors: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        self.calls[name] += 1
        self.tensors[name] += sum(isinstance(a, torch.Tensor) for a in tree_leaves((args, kwargs)))
        return func(*args, **kwargs)


def dispatched_ops(fn: Callable[[], Any]) -> Counter:
    """aten op name -> calls while ``fn()`` runs once, top-level ops only: on a GPU, each call on a small tensor is a
    kernel launch."""
    with _Dispatched() as mode:
        fn()
    return mode.calls


def kernel_tensors(fn: Callable[[], Any]) -> Counter:
    """aten op name -> tensors handed to it while ``fn()`` runs once: what a multi-tensor kernel's host side walks
    (on CUDA: per-tensor metadata, and for ``_foreach_norm`` one result tensor per input), ops nested inside a kernel
    left out."""
    with _Dispatched() as mode:
        fn()
    return mode.tensors


def growth_per_tensor(small: Counter, large: Counter, n_small: int, n_large: int) -> dict[str, float]:
    """Ops whose count grows with the number of tensors: name -> extra calls per extra tensor."""
    names = set(small) | set(large)
    return {
        name: (large[name] - small[name]) / (n_large - n_small) for name in sorted(names) if large[name] != small[name]
    }
