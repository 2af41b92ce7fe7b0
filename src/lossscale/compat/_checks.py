"""Argument checks that several facades share: each error echoes the call, states the rule and shows the value."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lossscale.checks import check_int_in_range, checked_state_dict

__all__ = ["COUNTER_MAX", "check_optimizer", "checked_counters", "checked_tensors"]

#: The largest saved step counter a facade loads: far beyond any run, and exact in int64.
COUNTER_MAX = 2**62


def checked_counters(call: str, state_dict: Any, keys: Iterable[str], counters: Iterable[str]) -> dict[str, Any]:
    """``state_dict`` if it is a dict holding ``keys`` and each of ``counters`` is an int in [0, 2**62].

    A bool or a float is refused (2.5 steps is refused, never truncated). Checked before anything is loaded.

    Raises:
        TypeError: not a dict, or a counter that is not an int.
        ValueError: a key is missing, or a counter is out of range.
    """
    checked_state_dict(call, state_dict, keys)
    for name in counters:
        check_int_in_range(call, f"state_dict[{name!r}]", state_dict[name], 0, COUNTER_MAX)
    return state_dict


def check_optimizer(call: str, name: str, value: Any) -> None:
    """Raise a TypeError naming ``name`` unless ``value`` is a ``torch.optim.Optimizer`` (the facade wraps it)."""
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
