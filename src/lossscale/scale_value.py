"""The one validation of a loss-scale value, used by every door that sets one.

A scale multiplies the loss and its inverse multiplies every gradient, so both must be finite and
non-zero in float32: the value, rounded to float32, must be a *normal* number (>= 2**-126; a subnormal
scale has an infinite inverse) that is finite and inside the policy's ``[min_scale, max_scale]``.
Constructors, ``set_scale``, ``update(new_scale=...)``, ``load_state_dict`` and every facade attribute
call :func:`checked_scale`; the error names the door, states the rule and shows the value.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

from lossscale._validate import ArgumentTypeError

__all__ = ["checked_scale", "to_float32", "SMALLEST_NORMAL_FLOAT32", "FLOAT32_MAX"]

#: 2**-126, the smallest normal float32: the lowest scale whose inverse is finite.
SMALLEST_NORMAL_FLOAT32 = 2.0**-126
#: The largest finite float32.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def to_float32(x: float) -> float:
    """``x`` rounded to the nearest float32 (inf where it overflows), as a Python float; no tensor."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _as_number(door: str, name: str, value: Any) -> float:
    """The Python number a float, int or one-element tensor holds.

    A CPU tensor is read without a device sync (``numpy()``); a tensor on an accelerator costs one sync.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.requires_grad or value.is_complex() or value.dtype == torch.bool:
            raise ArgumentTypeError(f"{door}: {name} must be a float or a 1-element tensor (real, without grad); got a "
                                 f"{value.dtype} tensor of shape {tuple(value.shape)}"
                                 f"{' that requires grad' if value.requires_grad else ''}.")
        flat = value.detach().reshape(())
        if flat.device.type == "meta":
            raise ValueError(f"{door}: {name} is a tensor on the meta device, which holds no value; pass a float or "
                             f"a tensor on a real device; got {value!r}.")
        if flat.device.type == "cpu":
            return float(flat.to(torch.float64).numpy())
        return float(flat.to("cpu", torch.float64).numpy())  # one device sync
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{door}: {name} must be a float or a 1-element tensor; got {type(value).__name__} "
                             f"{value!r}.")
    return float(value)


def checked_scale(door: str, value: Any, low: float = SMALLEST_NORMAL_FLOAT32, high: float = FLOAT32_MAX,
                  name: str = "the scale") -> float:
    """``value`` as a float32-exact Python float, or an error that names ``door``, the rule and the value.

    Rule: ``value`` is a finite number > 0 whose float32 rounding is a normal number (>= 2**-126: a
    subnormal scale has an infinite inverse) inside the policy's ``[low, high]``. Cost: none for a float
    or a CPU tensor; one device sync for a tensor on an accelerator.

    Example:
        >>> checked_scale("set_scale(new_scale=1024)", 1024, name="new_scale")
        1024.0
        >>> checked_scale("set_scale(new_scale=1e-46)", 1e-46, name="new_scale")
        Traceback (most recent call last):
        ...
        ValueError: set_scale(new_scale=1e-46): new_scale must be a finite number > 0 whose float32 value is a normal number in [1.1754943508222875e-38, 3.4028234663852886e+38] (its inverse multiplies every gradient); got 1e-46, which is 0.0 in float32.
    """
    number = _as_number(door, name, value)
    rounded = to_float32(number) if math.isfinite(number) else number
    low = max(low, SMALLEST_NORMAL_FLOAT32)
    if not (math.isfinite(rounded) and low <= rounded <= high):
        shown = f"{value!r}" if rounded == number else f"{value!r}, which is {rounded!r} in float32"
        raise ValueError(f"{door}: {name} must be a finite number > 0 whose float32 value is a normal number in "
                         f"[{low!r}, {high!r}] (its inverse multiplies every gradient); got {shown}.")
    return rounded
