"""Argument checks shared by every constructor: each error echoes the call, the rule and the value."""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type. A TypeError, and also a ValueError, which these checks raised for
    every bad argument before they told the two apart (code that catches ValueError keeps working)."""


def _is_real(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float))


def _require_real(call: str, name: str, value: Any, rule: str) -> None:
    if not _is_real(value):
        raise ArgumentTypeError(f"{call}({name}={value!r}): {name} must be {rule}; got {value!r} "
                                f"({type(value).__name__}).")


def check_scale(call: str, name: str, value: Any, *, low: float, high: float) -> None:
    """A finite positive number in ``[low, high]``."""
    _require_real(call, name, value, f"a finite number in [{low!r}, {high!r}]")
    if not math.isfinite(value) or not (low <= value <= high):
        raise ValueError(
            f"{call}({name}={value!r}): {name} must be a finite number in [{low!r}, {high!r}]; got {value!r}."
        )


def check_factor_above_one(call: str, name: str, value: Any, why: str) -> None:
    """A finite number > 1."""
    _require_real(call, name, value, f"a finite number > 1 ({why})")
    if not math.isfinite(value) or value <= 1.0:
        raise ValueError(f"{call}({name}={value!r}): {name} must be a finite number > 1 ({why}); got {value!r}.")


def check_int_at_least(call: str, name: str, value: Any, low: int) -> None:
    """An int (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{call}({name}={value!r}): {name} must be an integer >= {low}; got "
                                f"{value!r} ({type(value).__name__}).")
    if value < low:
        raise ValueError(f"{call}({name}={value!r}): {name} must be an integer >= {low}; got {value!r}.")


def check_choice(call: str, name: str, value: Any, allowed: Iterable[Any]) -> None:
    """One of ``allowed`` (compared with ``is`` for bools, ``==`` otherwise)."""
    allowed = tuple(allowed)
    ok = any((value is a) if isinstance(a, bool) else (not isinstance(value, bool) and value == a) for a in allowed)
    if not ok:
        shown = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{call}({name}={value!r}): {name} must be one of {shown}; got {value!r}.")


#: The largest value an int32 counter holds: every counter's limit is refused above it.
INT32_MAX = 2**31 - 1


def check_int_in_range(call: str, name: str, value: Any, low: int, high: int = INT32_MAX) -> None:
    """An int (not a bool) in ``[low, high]`` (default high: the largest int32, what the counters hold)."""
    check_int_at_least(call, name, value, low)
    if value > high:
        why = " (it is counted in an int32 tensor)" if high == INT32_MAX else ""
        raise ValueError(f"{call}({name}={value!r}): {name} must be an integer <= {high}{why}; got {value!r}.")


def check_positive_or_none(call: str, name: str, value: Any) -> None:
    """None, or a finite number > 0."""
    if value is None:
        return
    _require_real(call, name, value, "None or a finite number > 0")
    if not (0 < value < math.inf):
        raise ValueError(f"{call}({name}={value!r}): {name} must be None or a finite number > 0; got {value!r}.")


def unlike_tensor(value: Any, like: Any, *, finite: bool = False) -> str | None:
    """None where ``value`` is a tensor of ``like``'s shape and dtype (and all finite, with ``finite``: one host
    read); else what it is, for an error message ("str", "a torch.float64 tensor of shape (5,)", ...)."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    bad = finite and value.is_floating_point() and not bool(torch.isfinite(value).all())
    if value.shape == like.shape and value.dtype == like.dtype and not bad:
        return None
    return f"a {'non-finite ' if bad else ''}{value.dtype} tensor of shape {tuple(value.shape)}"
