"""Skipping an optimizer step without a host read: snapshot, step, restore where found_inf.

Two ways, chosen per step:

- **chunked** (exactly the classes in :data:`SEPARABLE`, with no step hooks): the step runs on a few
  parameters at a time (``param_groups`` narrowed for the call); each chunk's parameters and state are copied
  into one reusable pool of at most ``budget`` x the parameters' bytes (a larger parameter: a chunk of its own)
  and put back where found_inf. Bit-identical to one whole step.
- **whole** (any other optimizer, or one with step hooks): a snapshot of every parameter and state tensor,
  kept between steps: (1 + state tensors per parameter) x the parameters' bytes (3x for Adam).

Cost per step, either way: one copy of the parameters and state before the step and one masked select (two
reads + one write) after it; no host read.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.optim import optimizer as _optim_module

from lossscale.ops.distributed import local_shard

__all__ = ["MaskedSkip"]

# Optimizers whose step is separable over parameters (exact classes, not subclasses).
SEPARABLE = tuple(getattr(torch.optim, name) for name in (
    "Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta")
    if hasattr(torch.optim, name))
_ALIGN = 64  # bytes: every snapshot view in the pool starts on a cache line


class MaskedSkip:
    """Runs a step that is undone where found_inf; keeps its snapshot pool between steps.

    Args:
        budget: The pool's size as a fraction of the parameters' bytes for separable optimizers
            (None: always snapshot everything at once, the whole-step way).
    """

    def __init__(self, budget: float | None = 0.25) -> None:
        self.budget = budget
        self._pool = torch.empty(0, dtype=torch.uint8)
        self._buffers: list[torch.Tensor] = []  # the whole-step way's snapshot

    @property
    def extra_bytes(self) -> int:
        """Bytes of snapshot memory held now (pool or whole snapshot)."""
        return self._pool.numel() + sum(b.numel() * b.element_size() for b in self._buffers)

    @staticmethod
    def ready(optimizer: torch.optim.Optimizer) -> bool:
        """True once every parameter with a gradient has its optimizer state (the first step creates it)."""
        return all(
            p in optimizer.state and len(optimizer.state[p]) > 0
            for g in optimizer.param_groups for p in g["params"] if p.grad is not None
        ) or not _has_stateful_defaults(optimizer)

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Run ``optimizer.step()``, then put back every parameter and state tensor where ``found_inf``."""
        bad = found_inf.to(torch.bool)
        if self.budget is None or args or kwargs or not _separable(optimizer):
            return self._whole(optimizer, bad, *args, **kwargs)
        self._buffers = []
        chunks = _chunks(optimizer, self.budget)
        if not chunks:
            return optimizer.step()
        device = local_shard(chunks[0][0]).device
        self._reserve(max(_chunk_bytes(optimizer, c, device) for c in chunks), device)
        for chunk in chunks:
            targets = [t for p in chunk for t in _targets_of(optimizer, p)]
            saved = self._views(targets)
            torch._foreach_copy_(saved, targets)
            with _narrowed(optimizer, {id(p) for p in chunk}):
                optimizer.step()
            _restore(bad, saved, targets)
        return None

    def _whole(self, optimizer: torch.optim.Optimizer, bad: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Snapshot everything, step once, restore where ``bad``."""
        self._pool = torch.empty(0, dtype=torch.uint8)
        targets = [t for g in optimizer.param_groups for p in g["params"] for t in _targets_of(optimizer, p)]
        if len(self._buffers) != len(targets) or any(
            b.shape != t.shape or b.dtype != t.dtype for b, t in zip(self._buffers, targets)
        ):
            self._buffers = [torch.empty_like(t) for t in targets]
        torch._foreach_copy_(self._buffers, targets)
        value = optimizer.step(*args, **kwargs)
        _restore(bad, self._buffers, targets)
        return value

    def _reserve(self, nbytes: int, device: torch.device) -> None:
        if self._pool.numel() < nbytes or self._pool.device != device:
            self._pool = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _views(self, targets: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of the pool shaped like ``targets``, or fresh buffers for tensors on another device."""
        out, offset = [], 0
        for t in targets:
            if t.device != self._pool.device:
                out.append(torch.empty_like(t))
                continue
            nbytes = t.numel() * t.element_size()
            out.append(self._pool[offset:offset + nbytes].view(t.dtype).view(t.shape))
            offset += _aligned(nbytes)
        return out


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _restore(bad: torch.Tensor, saved: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    """``t = saved where bad else t`` for every target (NaN-safe, unlike a lerp). Two reads + one write."""
    for s, t in zip(saved, targets):
        torch.where(bad.to(t.device), s, t, out=t)


def _targets_of(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> list[torch.Tensor]:
    """``p`` and its state tensors, as the local tensors to copy and restore (a DTensor's shard)."""
    out = [local_shard(p).detach()]
    for key, value in optimizer.state.get(p, {}).items():
        if isinstance(value, torch.Tensor):
            out.append(local_shard(value).detach())
        elif value is not None:
            raise TypeError(
                f"LossScaleOptimizer(skip_mode='masked'): {type(optimizer).__name__} keeps state {key!r} as "
                f"{type(value).__name__}, which cannot be restored without a host read; use skip_mode='host'.")
    return out


def _chunk_bytes(optimizer: torch.optim.Optimizer, chunk: list[torch.Tensor], device: torch.device) -> int:
    """Pool bytes a chunk's snapshot takes (its tensors on the pool's ``device``)."""
    return sum(_aligned(t.numel() * t.element_size()) for p in chunk for t in _targets_of(optimizer, p)
               if t.device == device)


def _chunks(optimizer: torch.optim.Optimizer, budget: float) -> list[list[torch.Tensor]]:
    """Parameters with a gradient, packed in order into chunks whose snapshot fits ``budget`` x their bytes."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    limit = budget * sum(p.numel() * p.element_size() for p in params)
    chunks: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        cost = sum(t.numel() * t.element_size() for t in _targets_of(optimizer, p))
        if not chunks or size + cost > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += cost
    return chunks


@contextmanager
def _narrowed(optimizer: torch.optim.Optimizer, keep: set[int]) -> Iterator[None]:
    """``optimizer.param_groups`` restricted to the parameters whose ids are in ``keep``, for the duration."""
    saved = [g["params"] for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            g["params"] = [p for p in g["params"] if id(p) in keep]
        yield
    finally:
        for g, params in zip(optimizer.param_groups, saved):
            g["params"] = params


def _separable(optimizer: torch.optim.Optimizer) -> bool:
    """A torch optimizer class known to update each parameter on its own, with no step hook to fire."""
    return (type(optimizer) in SEPARABLE and not optimizer._optimizer_step_pre_hooks
            and not optimizer._optimizer_step_post_hooks
            and not _optim_module._global_optimizer_pre_hooks and not _optim_module._global_optimizer_post_hooks)


def _has_stateful_defaults(optimizer: torch.optim.Optimizer) -> bool:
    # Plain SGD without momentum keeps no state worth restoring; everything else does.
    if isinstance(optimizer, torch.optim.SGD):
        return any(g.get("momentum", 0) for g in optimizer.param_groups)
    return True
