"""Skipping an optimizer step without a host read: snapshot, step, restore where found_inf.

Two ways, chosen per step:

- **chunked** (exactly the classes in :data:`SEPARABLE`, with no step hooks): the step runs on a few
  parameters at a time (``param_groups`` narrowed for the call); each chunk's parameters and state are copied
  into one reusable pool of at most ``budget`` x the parameters' bytes (a larger parameter: a chunk of its own)
  and put back where found_inf. Bit-identical to one whole step.
- **whole** (any other optimizer, or one with step hooks): a snapshot of every parameter and state tensor,
  kept between steps: (1 + state tensors per parameter) x the parameters' bytes (3x for Adam).

Cost per step, either way: one copy of the parameters and state before the step and one masked select (two
reads + one write) after it; no host read. Host ops per step: one ``where`` per parameter and state tensor (torch
has no multi-tensor select), the pool's views made once and reused while the layout holds.

Where the tensors live: found_inf stays where it was computed; it is copied once per step to each other device
that holds a parameter or state tensor, never to the host. A tensor in host memory (a torch optimizer's
``step`` counter unless ``capturable=True`` or ``fused=True``) beside a found_inf on an accelerator is refused
with a ValueError: restoring it would read found_inf on the host, a synchronisation per tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim import optimizer as _optim_module

from lossscale.ops.distributed import local_shard

#: Optimizers whose step is separable over parameters (exact classes, not subclasses).
SEPARABLE = tuple(
    getattr(torch.optim, name)
    for name in ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta")
    if hasattr(torch.optim, name)
)
_ALIGN = 64  # bytes: every snapshot view in the pool starts on a cache line

Layout = tuple[tuple[torch.Size, torch.dtype, torch.device], ...]


class MaskedSkip:
    """Runs a step that is undone where found_inf; keeps its snapshot pool between steps.

    Args:
        budget: The pool's size as a fraction of the parameters' bytes for separable optimizers
            (None: always snapshot everything at once, the whole-step way).
    """

    def __init__(self, budget: float | None = 0.25) -> None:
        self.budget = budget
        self._pool = torch.empty(0, dtype=torch.uint8)
        self._views: list[tuple[Layout, list[torch.Tensor]]] = []  # per chunk: its layout and the pool's views
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
            for g in optimizer.param_groups
            for p in g["params"]
            if p.grad is not None
        ) or not _has_stateful_defaults(optimizer)

    @torch.no_grad()
    def step(
        self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, *args: Any, **kwargs: Any
    ) -> float | None:
        """Run ``optimizer.step()``, then put back every parameter and state tensor where ``found_inf``.

        Raises:
            ValueError: a parameter or state tensor is in host memory while ``found_inf`` is on an accelerator
                (before anything is stepped or copied).
        """
        bad = found_inf if found_inf.dtype == torch.bool else found_inf.to(torch.bool)
        if self.budget is None or args or kwargs or not _separable(optimizer):
            return self._whole(optimizer, bad, *args, **kwargs)
        self._buffers = []
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        targets = [_targets_of(optimizer, p, bad.device) for p in params]
        chunks = _chunks(targets, self.budget)
        if not chunks:
            return optimizer.step()
        device = targets[0][0].device
        self._reserve(max(_pool_bytes(ts, device) for _, ts in chunks), device)
        flags: dict[torch.device, torch.Tensor] = {}
        for i, (members, chunk_targets) in enumerate(chunks):
            saved = self._chunk_views(i, chunk_targets)
            torch._foreach_copy_(saved, chunk_targets)
            with _narrowed(optimizer, {id(params[k]) for k in members}):
                optimizer.step()
            _restore(bad, flags, saved, chunk_targets)
        return None

    def _whole(self, optimizer: torch.optim.Optimizer, bad: torch.Tensor, *args: Any, **kwargs: Any) -> float | None:
        """Snapshot everything, step once, restore where ``bad``."""
        self._pool = torch.empty(0, dtype=torch.uint8)
        self._views = []
        targets = [
            t for g in optimizer.param_groups for p in g["params"] for t in _targets_of(optimizer, p, bad.device)
        ]
        if len(self._buffers) != len(targets) or any(
            b.shape != t.shape or b.dtype != t.dtype or b.device != t.device for b, t in zip(self._buffers, targets)
        ):
            self._buffers = [torch.empty_like(t) for t in targets]
        torch._foreach_copy_(self._buffers, targets)
        value = optimizer.step(*args, **kwargs)
        _restore(bad, {}, self._buffers, targets)
        return value

    def _reserve(self, nbytes: int, device: torch.device) -> None:
        if self._pool.numel() < nbytes or self._pool.device != device:
            self._pool = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._views = []

    def _chunk_views(self, index: int, targets: list[torch.Tensor]) -> list[torch.Tensor]:
        """Chunk ``index``'s snapshot buffers: the ones made for it before while its layout is the same."""
        layout = tuple((t.shape, t.dtype, t.device) for t in targets)
        if index < len(self._views) and self._views[index][0] == layout:
            return self._views[index][1]
        views = self._views_of(targets)
        del self._views[index:]
        self._views.append((layout, views))
        return views

    def _views_of(self, targets: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of the pool shaped like ``targets``, or buffers of their own for tensors on another device."""
        out, offset = [], 0
        for t in targets:
            if t.device != self._pool.device:
                out.append(torch.empty_like(t))
                continue
            nbytes = t.numel() * t.element_size()
            out.append(self._pool[offset : offset + nbytes].view(t.dtype).view(t.shape))
            offset += _aligned(nbytes)
        return out


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _restore(
    bad: torch.Tensor, flags: dict[torch.device, torch.Tensor], saved: list[torch.Tensor], targets: list[torch.Tensor]
) -> None:
    """``t = saved where bad else t`` for every target (NaN-safe, unlike a lerp). Two reads + one write.

    ``flags``: ``bad`` on each device, copied there once per step (device to device; :func:`_targets_of` has
    refused host memory beside an accelerator's flag)."""
    for s, t in zip(saved, targets):
        flag = bad if t.device == bad.device else flags.get(t.device)
        if flag is None:
            flag = flags[t.device] = bad.to(t.device, non_blocking=True)
        torch.where(flag, s, t, out=t)


def _targets_of(optimizer: torch.optim.Optimizer, p: torch.Tensor, flag_device: torch.device) -> list[torch.Tensor]:
    """``p`` and its state tensors, as the local tensors to copy and restore (a DTensor's shard); each checked
    to be where found_inf (on ``flag_device``) reaches it without the host."""
    named: list[tuple[str | None, torch.Tensor]] = [(None, local_shard(p))]
    for key, value in optimizer.state.get(p, {}).items():
        if isinstance(value, torch.Tensor):
            named.append((key, local_shard(value)))
        elif value is not None:
            raise TypeError(
                f"LossScaleOptimizer(skip_mode='masked'): {type(optimizer).__name__} keeps state {key!r} as "
                f"{type(value).__name__}, which cannot be restored without a host read; use skip_mode='host'."
            )
    if flag_device.type != "cpu":
        for key, t in named:
            if t.device.type == "cpu":
                _refuse_host_state(optimizer, p, key, flag_device)
    return [t for _, t in named]


def _refuse_host_state(
    optimizer: torch.optim.Optimizer, p: torch.Tensor, key: str | None, flag_device: torch.device
) -> None:
    where = next(
        (
            f"param_groups[{i}][{j}]"
            for i, g in enumerate(optimizer.param_groups)
            for j, q in enumerate(g["params"])
            if q is p
        ),
        "a parameter",
    )
    what = f"state {key!r} of {where}" if key is not None else f"the parameter {where} itself"
    if any("capturable" in g for g in optimizer.param_groups):
        fix = (
            "Build the optimizer with capturable=True (its step counters then live on the parameters' device), "
            "or use skip_mode='host' (one host read per step, as torch's scaler)."
        )
    else:
        fix = "Use skip_mode='host' (one host read per step, as torch's scaler)."
    raise ValueError(
        f"LossScaleOptimizer(skip_mode='masked'): {type(optimizer).__name__} keeps {what} in host memory (cpu) "
        f"while found_inf is on {flag_device}; restoring it where found_inf would copy found_inf to the host, "
        f"a synchronisation with the device for every such tensor. {fix}"
    )


def _pool_bytes(targets: list[torch.Tensor], device: torch.device) -> int:
    """Pool bytes a chunk's snapshot takes (its tensors on the pool's ``device``)."""
    return sum(_aligned(t.numel() * t.element_size()) for t in targets if t.device == device)


def _chunks(targets: list[list[torch.Tensor]], budget: float) -> list[tuple[list[int], list[torch.Tensor]]]:
    """The parameters (by index; ``targets[k][0]`` is the k-th) packed in order into chunks whose snapshot fits
    ``budget`` x their bytes: (indices, the chunk's targets) per chunk."""
    limit = budget * sum(ts[0].numel() * ts[0].element_size() for ts in targets)
    chunks: list[tuple[list[int], list[torch.Tensor]]] = []
    size = 0
    for k, ts in enumerate(targets):
        cost = sum(t.numel() * t.element_size() for t in ts)
        if not chunks or size + cost > limit:
            chunks.append(([], []))
            size = 0
        chunks[-1][0].append(k)
        chunks[-1][1].extend(ts)
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
    return (
        type(optimizer) in SEPARABLE
        and not optimizer._optimizer_step_pre_hooks
        and not optimizer._optimizer_step_post_hooks
        and not _optim_module._global_optimizer_pre_hooks
        and not _optim_module._global_optimizer_post_hooks
    )


def _has_stateful_defaults(optimizer: torch.optim.Optimizer) -> bool:
    # Plain SGD without momentum keeps no state worth restoring; everything else does.
    if isinstance(optimizer, torch.optim.SGD):
        return any(g.get("momentum", 0) for g in optimizer.param_groups)
    return True
