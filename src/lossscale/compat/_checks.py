"""Argument checks the facades share: each error echoes the call, states the rule and shows the value."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["check_optimizer", "checked_state_dict", "checked_tensors"]


def check_optimizer(call: str, name: str, value: Any) -> None:
    """``value`` is a ``torch.optim.Optimizer`` (the facade wraps it), else a TypeError naming ``name``."""
    if not isinstance(value, torch.optim.Optimizer):
        raise TypeError(f"{call}({name}={value!r}): {name} must be a torch.optim.Optimizer; got "
                        f"{type(value).__name__}.")


def checked_state_dict(call: str, state_dict: Any, keys: Iterable[str]) -> dict[str, Any]:
    """``state_dict`` if it is a dict holding ``keys`` (what the facade's ``state_dict()`` saves).

    Raises:
        TypeError: not a dict. ValueError: a key is missing (e.g. another object's state dict).
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"{call}(state_dict={state_dict!r}): state_dict must be the dict that state_dict() "
                        f"returned; got {type(state_dict).__name__}.")
    missing = [k for k in keys if k not in state_dict]
    if missing:
        raise ValueError(f"{call}(state_dict with keys {sorted(state_dict)}): missing {missing}; pass the dict "
                         f"that state_dict() returned.")
    return state_dict


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
