"""A read over many CUDA tensors replayed from a CUDA graph, keyed by the tensors' memory.

torch's multi-tensor reductions (``torch._foreach_norm``) return one tensor per input, each its own allocation, so
their host time grows with the number of tensors, where torch's fused overflow check writes one flag. A CUDA graph
of the same read launches the same kernels in one call. A graph reads the addresses it was captured with, so
:class:`ReplayedRead` keys each graph by the tensors' addresses and sizes: the gradients of a training loop land at
the same addresses step after step (torch's caching allocator answers the same sequence of requests with the same
blocks), and where they do not the read runs eagerly.

The rule, per call ``replayed(tensors)`` (per thread, CUDA stream and read)::

    if the tensors are not all contiguous plain torch.Tensors on a CUDA device, or a capture is under way:
        read(tensors), eagerly
    key = (device, dtype, every tensor's address, every tensor's size)
    if key has a graph:            replay it (one launch); return a copy of its output
    elif key is among the last max_graphs keys read eagerly
            and fewer than max_captures captures were made since the last replay:
        read(tensors) eagerly (its result is returned), then capture the read in a new graph for key
        (on a side stream; the least recently used graph beyond max_graphs is dropped)
    else:                          read(tensors), eagerly; remember key

So a loop that reads a few sets of tensors in turn (two models, two optimizers) replays each, and a loop whose
tensors move at every step stops capturing after max_captures. A replay returns what ``read`` returns for the same
values bit for bit (the same kernels on the same memory). A tensor returned is never written again. Host reads and
synchronisations: none.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Sequence

import torch

__all__ = ["ReplayedRead"]

_PLAIN_ONLY = {torch.Tensor}
_ADDRESS = torch.Tensor.data_ptr
_SIZE = torch.Tensor.numel
_CONTIGUOUS = torch.Tensor.is_contiguous


def _cuda_capture(read: Callable[[list[torch.Tensor]], torch.Tensor], tensors: list[torch.Tensor]
                  ) -> tuple[Callable[[], None], torch.Tensor]:
    """``read`` captured in a CUDA graph on a side stream that waits for the current one (no synchronisation);
    the graph keeps its own memory pool. Returns (replay, the graph's output tensor)."""
    device = tensors[0].device
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(device), torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            output = read(tensors)
        finally:
            graph.capture_end()
    current.wait_stream(side)
    return graph.replay, output


class _Slot:
    """One thread's and stream's graphs of one read."""

    def __init__(self) -> None:
        self.graphs: OrderedDict[tuple, tuple[Callable[[], None], torch.Tensor]] = OrderedDict()
        self.seen: OrderedDict[tuple, None] = OrderedDict()  # the last keys read eagerly, oldest first
        self.captures = 0  # since the last replay


class ReplayedRead:
    """``read(tensors)`` (a pure function of the values of tensors of one device and dtype, returning one tensor),
    replayed from CUDA graphs keyed by the tensors' memory; see the module's docstring for the rule.

    Args:
        read: The read, eager; it must run under CUDA graph capture (no host read, no synchronisation).
        max_graphs: Graphs kept, and keys remembered, per thread and stream (>= 1); the least recently used
            beyond it is dropped.
        max_captures: Captures in a row with no replay between them, per thread and stream (>= 0); after that,
            reads whose key has no graph run eagerly until a graph is replayed (a loop whose tensors move at every
            step does not pay for a capture per step).
        capture: How a read is captured (the CUDA graph by default; the CPU tests pass a stand-in and
            ``devices=("cpu",)``).
        devices: The device types whose reads are replayed.

    ``counts``: how many calls ran eagerly, captured and replayed, over all threads.
    """

    def __init__(self, read: Callable[[list[torch.Tensor]], torch.Tensor], *, max_graphs: int = 8,
                 max_captures: int = 8, capture: Callable[..., tuple[Callable[[], None], torch.Tensor]] = _cuda_capture,
                 devices: Sequence[str] = ("cuda",)) -> None:
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"ReplayedRead(max_graphs={max_graphs!r}): max_graphs must be an int >= 1; "
                             f"got {max_graphs!r}.")
        if isinstance(max_captures, bool) or not isinstance(max_captures, int) or max_captures < 0:
            raise ValueError(f"ReplayedRead(max_captures={max_captures!r}): max_captures must be an int >= 0; "
                             f"got {max_captures!r}.")
        self.read, self.max_graphs, self.max_captures = read, max_graphs, max_captures
        self._capture, self._devices = capture, frozenset(devices)
        self._local = threading.local()
        self.counts = {"eager": 0, "captured": 0, "replayed": 0}

    def __call__(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        tensors = list(tensors)
        first = tensors[0] if tensors else None
        if (first is None or first.device.type not in self._devices
                or (first.is_cuda and torch.cuda.is_current_stream_capturing())
                or set(map(type, tensors)) != _PLAIN_ONLY or not all(map(_CONTIGUOUS, tensors))):
            return self._eager(tensors)
        slot = self._slot(first.device)
        key = (first.device, first.dtype, tuple(map(_ADDRESS, tensors)), tuple(map(_SIZE, tensors)))
        entry = slot.graphs.get(key)
        if entry is not None:
            slot.graphs.move_to_end(key)
            replay, output = entry
            replay()
            slot.captures = 0
            self.counts["replayed"] += 1
            return output.clone()
        if key in slot.seen and slot.captures < self.max_captures:
            del slot.seen[key]
            result = self.read(tensors)  # this call's result; the kernels are loaded before the capture
            slot.graphs[key] = self._capture(self.read, tensors)
            slot.captures += 1
            self.counts["captured"] += 1
            if len(slot.graphs) > self.max_graphs:
                slot.graphs.popitem(last=False)
            return result
        slot.seen[key] = None
        slot.seen.move_to_end(key)
        if len(slot.seen) > self.max_graphs:
            slot.seen.popitem(last=False)
        return self._eager(tensors)

    def _eager(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        self.counts["eager"] += 1
        return self.read(tensors)

    def _slot(self, device: torch.device) -> _Slot:
        local = self._local
        if not hasattr(local, "slots"):
            local.slots = {}
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
        slot = local.slots.get((device, stream))
        if slot is None:
            slot = local.slots[(device, stream)] = _Slot()
        return slot

    def __repr__(self) -> str:
        return (f"ReplayedRead({getattr(self.read, '__name__', self.read)!r}, max_graphs={self.max_graphs}, "
                f"max_captures={self.max_captures}, counts={self.counts})")
