"""Which modules lossscale runs outside autocast's float16: :func:`~lossscale.keep_float32` (and healing, which calls
it) marks each module it wraps; per-layer scales read the marks, since a unit that computes in float32 needs no
factor of its own (a factor it carried would go with the gradient it hands on into the float16 ops before it)."""

from __future__ import annotations

import weakref

import torch

_KEPT: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()


def mark_kept(module: torch.nn.Module) -> None:
    """``module``'s forward now runs in float32 (or bfloat16): one more wrapper keeps it."""
    _KEPT[module] = _KEPT.get(module, 0) + 1


def unmark_kept(module: torch.nn.Module) -> None:
    """One wrapper that kept ``module`` was removed."""
    left = _KEPT.get(module, 0) - 1
    if left > 0:
        _KEPT[module] = left
    else:
        _KEPT.pop(module, None)


def is_kept(module: torch.nn.Module) -> bool:
    """Whether a wrapper keeps ``module``'s forward in float32 (or bfloat16) now."""
    return module in _KEPT
