"""Argument checks the presets share (a scale above a floor, a fraction in (0, 1))."""

from __future__ import annotations

from typing import Any

from lossscale._validate import (
    ArgumentTypeError,
    check_scale,
)
from lossscale.policy import FLOAT32_MAX, SMALLEST_NORMAL_FLOAT32

__all__ = ["_scale", "_fraction"]


def _scale(call: str, name: str, value: Any, floor: float = SMALLEST_NORMAL_FLOAT32) -> None:
    check_scale(call, name, value, low=floor, high=FLOAT32_MAX)


def _fraction(call: str, name: str, value: Any, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{call}({name}={value!r}): {name} must be in (0, 1) ({why}); got "
                                f"{value!r} ({type(value).__name__}).")
    if not (0.0 < value < 1.0):
        raise ValueError(f"{call}({name}={value!r}): {name} must be in (0, 1) ({why}); got {value!r}.")
