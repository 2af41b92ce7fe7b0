"""Argument checks the facades share: each error echoes the call, states the rule and shows the value."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lossscale._validate import check_int_in_range
from lossscale.state import checked_state_dict

__all__ = ["check_optimizer", "checked_counters", "checked_state_dict", "checked_tensors",
           "overflow_from_finite_grads"]

COUNTER_MAX = 2**62  # a saved step counter: far beyond any run, and exact in int64


def checked_counters(call: str, state_dict: Any, keys: Iterable[str], counters: Iterable[str]) -> dict[str, Any]:
    """``state_dict`` if it holds ``keys`` and each of ``counters`` is an int in [0, 2**62] (not a bool, not a
    float: 2.5 steps is refused, never truncated); checked before anything is loaded."""
    checked_state_dict(call, state_dict, keys)
    for name in counters:
        check_int_in_range(call, f"state_dict[{name!r}]", state_dict[name], 0, COUNTER_MAX)
    return state_dict


def check_optimizer(call: str, name: str, value: Any) -> None:
    """``value`` is a ``torch.optim.Optimizer`` (the facade wraps it), else a TypeError naming ``name``."""
    if not isinstance(value, torch.optim.Optimizer):
        raise TypeError(f"{call}({name}={value!r}): {name} must be a torch.optim.Optimizer; got "
                        f"{type(value).__name__}.")


def checked_tensors(call: str, name: str, value: Any, *, none_items: bool) -> list[Any]:
    """``value`` as a list of tensors (and None where ``none_items``), else a TypeError naming ``name``."""
    if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Iterable):
        raise TypeError(f"{call}({name}={value!r}): {name} must be a list of tensors; got {type(value).__name__}.")
    out = list(value)
    for i, item in enumerate(out):
        if not isinstance(item, torch.Tensor) and not (none_items and item is None):
            shown = repr(value) if len(repr(value)) <= 80 else "..."
            raise TypeError(f"{call}({name}={shown}): {name}[{i}] must be a tensor{' or None' if none_items else ''}"
                            f"; got {item!r} ({type(item).__name__}).")
    return out


def overflow_from_finite_grads(finite_grads: Any, scale: torch.Tensor) -> torch.Tensor:
    """Ascend/TF1: the overflow flag (0-d bool) of one step's ``finite_grads``; no host read.

    Rule: a Python bool or a one-value bool tensor is TF1's ``finite_grads`` (True: every gradient is
    finite); a one-value floating tensor is an NPU float status (0: no overflow; anything else, NaN
    included: overflow). A state loaded batched (a scale of shape (N,)) takes N verdicts. Anything else
    is refused rather than cast (a 2-value tensor would turn a scalar scale into a vector).
    """
    call = f"update_loss_scale(finite_grads={finite_grads!r})"
    device = scale.device
    if isinstance(finite_grads, bool):
        return torch.tensor(not finite_grads, device=device)
    if not isinstance(finite_grads, torch.Tensor) or not (finite_grads.dtype == torch.bool
                                                          or finite_grads.is_floating_point()):
        kind = type(finite_grads).__name__ if not isinstance(finite_grads, torch.Tensor) else finite_grads.dtype
        raise TypeError(f"{call}: finite_grads must be a bool, a bool tensor (True when every gradient is finite) "
                        f"or a floating NPU float status tensor (0 when nothing overflowed); got {kind}.")
    if finite_grads.numel() == 1:
        flag = finite_grads.reshape(scale.shape if scale.numel() == 1 else ()).to(device)
    elif finite_grads.shape == scale.shape:  # a batched state (one verdict per entry), as tests replay it
        flag = finite_grads.to(device)
    else:
        raise ValueError(f"{call}: finite_grads must hold one value (one step's verdict for all gradients); got "
                         f"shape {tuple(finite_grads.shape)}. Reduce it first, e.g. finite_grads.all().")
    return ~flag if flag.dtype == torch.bool else flag != 0
