"""Count passes over the gradients structurally: which aten ops read or write gradient memory.

A ``TorchDispatchMode`` looks at every aten call; an argument whose storage is a gradient's storage
counts as a read of that gradient (once per call, however often it appears: ``dot(g, g)`` is one
read) and, where the op's schema marks it written (``Tensor(a!)``, ``out=``), as a write; the
destination of ``copy_``/``zero_``/``fill_`` is written, not read. Views read nothing. Passes are
elements touched / gradient elements. Used by the benchmarks (the "passes" column) and the tests
(no pass between accumulation boundaries); far too slow to time anything under it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["GradTouches", "count_passes"]

_WRITE_ONLY = {"copy_", "zero_", "fill_"}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@dataclass
class GradTouches(TorchDispatchMode):
    """Elements of the gradients read and written, and the ops that touched them."""

    grads: dict[int, int] = field(default_factory=dict)  # storage pointer -> numel
    read: int = 0
    written: int = 0
    ops: list[str] = field(default_factory=list)
    calls: int = 0  # every op dispatched, gradients or not (fixed per-step cost, noise-free)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.calls += 1
        schema = func._schema
        is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        if not is_view:
            self._account(func, schema, args, kwargs)
        return func(*args, **kwargs)

    def _account(self, func: Any, schema: Any, args: tuple, kwargs: dict) -> None:
        write_only = schema.name.split("::")[-1] in _WRITE_ONLY
        reads: set[int] = set()
        writes: set[int] = set()
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written = arg.alias_info is not None and arg.alias_info.is_write
            for t in _tensors(value):
                ptr = _storage(t)
                if ptr not in self.grads:
                    continue
                if written:
                    writes.add(ptr)
                if not (written and (write_only or arg.is_out)):
                    reads.add(ptr)
        if reads or writes:
            self.read += sum(self.grads[p] for p in reads)
            self.written += sum(self.grads[p] for p in writes)
            self.ops.append(str(func))


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v


def count_passes(params: list[torch.Tensor], fn: Callable[[], Any]) -> GradTouches:
    """Run ``fn`` under a :class:`GradTouches` over ``params``' current gradients; returns the counter.
    ``counter.read / total`` and ``counter.written / total`` are the read and write passes."""
    grads = {_storage(p.grad): p.grad.numel() for p in params if p.grad is not None}
    with GradTouches(grads=grads) as counter:
        fn()
    return counter


def passes_text(counter: GradTouches, total: int, minus: GradTouches | None = None) -> str:
    """``"1R+1W"``: read and write passes of ``counter`` beyond ``minus`` (the bare step), rounded to 0.1."""
    r = (counter.read - (minus.read if minus else 0)) / total
    w = (counter.written - (minus.written if minus else 0)) / total
    return f"{r:.3g}R+{w:.3g}W" if round(w, 2) else f"{r:.3g}R"
