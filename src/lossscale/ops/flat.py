"""Flat gradients: every parameter's ``.grad`` a view into one buffer per (device, dtype).

A pass over the gradients is then one kernel over one tensor per buffer, so the norm, the overflow check, the
largest magnitude and the unscale cost the host as much for 2,000 parameters as for one. Over separate gradients
torch's multi-tensor kernels do host work per tensor (``_foreach_norm`` makes one result tensor per gradient, which
a total then stacks). DDP's ``gradient_as_bucket_view=True`` and Megatron's contiguous gradient buffer keep
gradients the same way.

Autograd accumulates into an existing ``.grad`` in place, so a backward writes straight into the buffer while the
views stay attached. Zeroing the buffer (:meth:`FlatGrads.zero_`) keeps them attached; setting a ``.grad`` to None
(``model.zero_grad()``) or to another tensor detaches it, and :meth:`FlatGrads.attach` copies such gradients back
in (gradients set to None cost nothing to put back: they become zeroed views). Every parameter that takes part always
has a gradient: zeros where a backward gave it none, as after ``zero_grad(set_to_none=False)``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch


class FlatGrads:
    """One zero-initialised buffer per (device, dtype) holding the gradients of ``params``, each ``.grad`` a view.

    A parameter takes part when it requires a gradient or has one. ``attach`` puts the views in place, copying in
    the gradients present; ``attached`` says whether every ``.grad`` still is its view.

    Args:
        params: The parameters, in the optimizer's order (dense ``torch.Tensor`` parameters; DTensor ones are
            refused, their gradients are shards that FSDP2 places itself).
        call: Names the caller in errors.

    Raises:
        ValueError: a parameter is a DTensor, sparse, or not dense in memory (a view with gaps), naming it as
            ``param_groups``' index.

    Example::

        >>> w = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
        >>> flat = FlatGrads(w, "example")
        >>> (w[0] * 2).sum().backward()
        >>> flat.attached(w), flat.buffers[(torch.device("cpu"), torch.float32)].tolist()
        (True, [2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    """

    def __init__(self, params: Sequence[torch.Tensor], call: str, names: Sequence[str] | None = None) -> None:
        self.params = list(params)
        for i, p in enumerate(self.params):
            problem = _unflattenable(p)
            if problem is not None:
                where = names[i] if names is not None else f"parameter {i}"
                raise ValueError(
                    f"{call}(flat_grads=True): {where} {problem}; flat gradients need dense "
                    f"torch.Tensor parameters. Pass flat_grads=False for this optimizer."
                )
        self.views: list[torch.Tensor | None] = []
        self.buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.attach()

    def attach(self) -> int:
        """Put every taking-part parameter's view in its ``.grad``, copying in the gradient it holds (a buffer
        reallocated when the set of parameters taking part changed). Returns how many gradients were copied in:
        those that were not their view. One copy kernel per gradient copied; no host read."""
        taking_part = [p.requires_grad or p.grad is not None for p in self.params]
        old = [p.grad for p in self.params]
        if len(self.views) != len(self.params) or any(
            part != (view is not None) for part, view in zip(taking_part, self.views)
        ):
            self._allocate(taking_part)
        copied = 0
        released = all(grad is None for grad, view in zip(old, self.views) if view is not None)
        with torch.no_grad():
            if released:  # every gradient set to None (model.zero_grad()): one zero_ per buffer
                self.zero_()
            for p, view, grad in zip(self.params, self.views, old):
                if view is None or grad is view:
                    continue
                if grad is None:
                    if not released:
                        view.zero_()
                else:
                    if grad.is_sparse or type(grad) is not torch.Tensor:
                        raise ValueError(
                            f"flat_grads=True: a parameter of shape {tuple(p.shape)} got a "
                            f"{'sparse' if grad.is_sparse else type(grad).__name__} gradient, which "
                            f"cannot live in a dense buffer. Pass flat_grads=False for this optimizer."
                        )
                    view.copy_(grad)
                    copied += 1
                p.grad = view
        return copied

    def _allocate(self, taking_part: list[bool]) -> None:
        """New buffers and views for the parameters taking part, in order within each (device, dtype)."""
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        offsets: list[int] = []
        for p, part in zip(self.params, taking_part):
            key = (p.device, p.dtype)
            offsets.append(sizes.get(key, 0))
            if part:
                sizes[key] = offsets[-1] + p.numel()
        self.buffers = {key: torch.zeros(n, device=key[0], dtype=key[1]) for key, n in sizes.items()}
        self.views = [
            self.buffers[(p.device, p.dtype)].narrow(0, off, p.numel()).as_strided(p.shape, p.stride())
            if part
            else None
            for p, part, off in zip(self.params, taking_part, offsets)
        ]

    def holds(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether ``params`` are this buffer's parameters, in its order. One identity test per parameter."""
        return len(params) == len(self.params) and all(map(operator.is_, params, self.params))

    def attached(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether ``params`` are this buffer's parameters and each ``.grad`` is its view (None where a parameter
        does not take part). Two identity tests per parameter; no device op."""
        return self.holds(params) and all(map(operator.is_, [p.grad for p in params], self.views))

    def zero_(self) -> None:
        """Zero every buffer in place (one kernel per buffer); the views stay attached."""
        for buffer in self.buffers.values():
            buffer.zero_()


def _unflattenable(p: torch.Tensor) -> str | None:
    """Why ``p``'s gradient cannot be a view of a flat buffer, or None."""
    if type(p.data) is not torch.Tensor:
        return f"is a {type(p.data).__name__}"
    if p.layout is not torch.strided:
        return f"has layout {p.layout}"
    if torch.empty_like(p, device="meta").stride() != p.stride():
        return f"is not dense in memory (shape {tuple(p.shape)}, strides {p.stride()})"
    return None
