"""Argument and value checks: each error echoes the call, states the rule and shows the value.

:func:`validated_scale` is the one check of a loss-scale value; every setter and loader of a scale calls it.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Iterable
from types import FrameType
from typing import Any, TypeGuard

import torch


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a TypeError that ``except ValueError`` also catches."""


class StateDictError(KeyError, ValueError):
    """A state dict that lacks what it must hold (or is another object's): a ValueError and a KeyError."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _is_real(x: object) -> TypeGuard[int | float]:
    return not isinstance(x, bool) and isinstance(x, (int, float))


def _finite(x: int | float) -> bool:
    """Whether a real number is finite (an int past float's range counts as infinite)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def validate_optimizer(call: str, value: object, name: str = "optimizer") -> None:
    """An :class:`ArgumentTypeError` naming ``call`` and ``name`` unless ``value`` is a torch optimizer: an object with
    ``param_groups`` and a ``step()``, as torch's own scaler accepts."""
    if not hasattr(value, "param_groups") or not callable(getattr(value, "step", None)):
        raise ArgumentTypeError(
            f"{call}({name}={value!r}): {name} must be a torch.optim.Optimizer (param_groups "
            f"and step()); got {type(value).__name__}."
        )


def validate_real(call: str, name: str, value: object, rule: str) -> None:
    _real(call, name, value, rule)


def _real(call: str, name: str, value: object, rule: str) -> int | float:
    """``value`` if it is an int or float (not a bool), else an :class:`ArgumentTypeError`."""
    if not _is_real(value):
        raise ArgumentTypeError(
            f"{call}({name}={value!r}): {name} must be {rule}; got {value!r} ({type(value).__name__})."
        )
    return value


def validate_scale(call: str, name: str, value: object, *, low: float, high: float) -> None:
    """A finite positive number in ``[low, high]``."""
    _scale_in(call, name, value, low, high)


def _scale_in(call: str, name: str, value: object, low: float, high: float) -> int | float:
    """``value`` if it is a finite number in ``[low, high]``, else the error :func:`validate_scale` raises."""
    number = _real(call, name, value, f"a finite number in [{low!r}, {high!r}]")
    if not _finite(number) or not (low <= number <= high):
        raise ValueError(
            f"{call}({name}={value!r}): {name} must be a finite number in [{low!r}, {high!r}]; got {value!r}."
        )
    return number


def validate_factor_above_one(call: str, name: str, value: object, why: str) -> None:
    """A finite number > 1."""
    number = _real(call, name, value, f"a finite number > 1 ({why})")
    if not _finite(number) or number <= 1.0:
        raise ValueError(f"{call}({name}={value!r}): {name} must be a finite number > 1 ({why}); got {value!r}.")


def validate_int_at_least(call: str, name: str, value: object, low: int) -> None:
    """An int (not a bool) >= ``low``."""
    _int_at_least(call, name, value, low)


def _int_at_least(call: str, name: str, value: object, low: int) -> int:
    """``value`` if it is an int (not a bool) >= ``low``, else the error :func:`validate_int_at_least` raises."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(
            f"{call}({name}={value!r}): {name} must be an integer >= {low}; got {value!r} ({type(value).__name__})."
        )
    if value < low:
        raise ValueError(f"{call}({name}={value!r}): {name} must be an integer >= {low}; got {value!r}.")
    return value


def validate_choice(call: str, name: str, value: object, allowed: Iterable[object]) -> None:
    """One of ``allowed`` (compared with ``is`` for bools, ``==`` otherwise)."""
    allowed = tuple(allowed)
    ok = any((value is a) if isinstance(a, bool) else (not isinstance(value, bool) and value == a) for a in allowed)
    if not ok:
        shown = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{call}({name}={value!r}): {name} must be one of {shown}; got {value!r}.")


#: The largest value an int32 counter holds: every counter's limit is refused above it.
INT32_MAX = 2**31 - 1


def validate_int_in_range(call: str, name: str, value: object, low: int, high: int = INT32_MAX) -> None:
    """An int (not a bool) in ``[low, high]`` (default high: the largest int32, what the counters hold)."""
    if _int_at_least(call, name, value, low) > high:
        why = " (it is counted in an int32 tensor)" if high == INT32_MAX else ""
        raise ValueError(f"{call}({name}={value!r}): {name} must be an integer <= {high}{why}; got {value!r}.")


def validate_fraction(call: str, name: str, value: object, why: str) -> None:
    """A number in (0, 1)."""
    if not (0.0 < _real(call, name, value, f"in (0, 1) ({why})") < 1.0):
        raise ValueError(f"{call}({name}={value!r}): {name} must be in (0, 1) ({why}); got {value!r}.")


def validate_process_group(call: str, group: object) -> None:
    """None (the world) or a ``torch.distributed.ProcessGroup``."""
    if group is None:
        return
    kind = getattr(torch.distributed, "ProcessGroup", None)
    if kind is None or not isinstance(group, kind):
        raise ArgumentTypeError(
            f"{call}(process_group={group!r}): process_group must be None (the world) or a "
            f"torch.distributed.ProcessGroup (e.g. torch.distributed.new_group(...)); got "
            f"{type(group).__name__}."
        )


def validate_positive_or_none(call: str, name: str, value: object) -> None:
    """None, or a finite number > 0."""
    if value is None:
        return
    if not (0 < _real(call, name, value, "None or a finite number > 0") < math.inf):
        raise ValueError(f"{call}({name}={value!r}): {name} must be None or a finite number > 0; got {value!r}.")


def unlike_tensor(value: object, like: torch.Tensor, *, finite: bool = False) -> str | None:
    """None where ``value`` is a tensor like ``like`` (shape, dtype; all finite with ``finite``: one host read);
    else what it is, for an error message ("str", "a torch.float64 tensor of shape (5,)", ...)."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    bad = finite and value.is_floating_point() and not bool(torch.isfinite(value).all())
    if value.shape == like.shape and value.dtype == like.dtype and not bad:
        return None
    return f"a {'non-finite ' if bad else ''}{value.dtype} tensor of shape {tuple(value.shape)}"


def validated_state_dict(call: str, state_dict: object, keys: Iterable[str], hint: str = "") -> dict[str, Any]:
    """``state_dict`` if it is a dict holding ``keys``, else a TypeError or :class:`StateDictError` (+ ``hint``)."""
    if not isinstance(state_dict, dict):
        raise TypeError(
            f"{call}(state_dict={state_dict!r}): state_dict must be the dict that state_dict() "
            f"returned; got {type(state_dict).__name__}."
        )
    missing = [k for k in keys if k not in state_dict]
    if missing:
        raise StateDictError(
            f"{call}(state_dict with keys {sorted(state_dict)}): missing {missing}; pass the dict "
            f"that state_dict() returned.{hint}"
        )
    return state_dict


#: 2**-126, the smallest normal float32: the lowest scale whose inverse is finite.
SMALLEST_NORMAL_FLOAT32 = 2.0**-126
#: The largest finite float32.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def to_float32(x: float) -> float:
    """``x`` rounded to the nearest float32 (inf where it overflows), as a Python float."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _as_number(call: str, name: str, value: object) -> float:
    """The Python number a float, int or one-element tensor holds (one sync for a tensor off the CPU)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.requires_grad or value.is_complex() or value.dtype == torch.bool:
            raise ArgumentTypeError(
                f"{call}: {name} must be a float or a 1-element tensor (real, without grad); got a "
                f"{value.dtype} tensor of shape {tuple(value.shape)}"
                f"{' that requires grad' if value.requires_grad else ''}."
            )
        flat = value.detach().reshape(())
        if flat.device.type == "meta":
            raise ValueError(
                f"{call}: {name} is a tensor on the meta device, which holds no value; pass a float or "
                f"a tensor on a real device; got {value!r}."
            )
        return float(flat.to("cpu", torch.float64).numpy())  # off the CPU: one device sync
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(
            f"{call}: {name} must be a float or a 1-element tensor; got {type(value).__name__} {value!r}."
        )
    return float(value) if _finite(value) else (math.inf if value > 0 else -math.inf)


def validated_scale(
    call: str, value: object, low: float = SMALLEST_NORMAL_FLOAT32, high: float = FLOAT32_MAX, name: str = "the scale"
) -> float:
    """``value`` as a float32-exact Python float, or an error that names ``call``, the rule and the value.

    Rule: ``value`` is a finite number > 0 whose float32 rounding is a normal number (>= 2**-126) in
    ``[low, high]``. Host reads: one for a tensor on an accelerator, else none.

    Example:
        >>> validated_scale("set_scale(new_scale=1024)", 1024, name="new_scale")
        1024.0
        >>> validated_scale("set_scale(new_scale=1e-46)", 1e-46, name="new_scale")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: set_scale(new_scale=1e-46): new_scale must be a finite number > 0 whose float32 value is a ...
    """
    number = _as_number(call, name, value)
    rounded = to_float32(number) if math.isfinite(number) else number
    low = max(low, SMALLEST_NORMAL_FLOAT32)
    if not (math.isfinite(rounded) and low <= rounded <= high):
        exact = value if isinstance(value, int) else number  # an int compared exactly, not through float64
        shown = f"{value!r}" if rounded == exact else f"{value!r}, which is {rounded!r} in float32"
        raise ValueError(
            f"{call}: {name} must be a finite number > 0 whose float32 value is a normal number in "
            f"[{low!r}, {high!r}] (its inverse multiplies every gradient); got {shown}."
        )
    return rounded


def validate_scale_bounds(
    call: str,
    min_scale: object,
    max_scale: object,
    init_scale: object,
    names: tuple[str, str, str] = ("min_scale", "max_scale", "init_scale"),
) -> None:
    """``min_scale <= init_scale <= max_scale``, each a finite number in [2**-126, float32 max]."""
    lo, hi, init = names
    low = _scale_in(call, lo, min_scale, SMALLEST_NORMAL_FLOAT32, FLOAT32_MAX)
    high = _scale_in(call, hi, max_scale, SMALLEST_NORMAL_FLOAT32, FLOAT32_MAX)
    if low > high:
        raise ValueError(f"{call}({lo}={min_scale!r}, {hi}={max_scale!r}): {lo} must be <= {hi}; got {lo} > {hi}.")
    validate_scale(call, init, init_scale, low=low, high=high)


def capturing(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is on a CUDA device whose current stream is capturing a CUDA graph. No host read."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def in_backward() -> bool:
    """Whether this thread is inside a backward pass (where a module's forward is a recomputation)."""
    return bool(torch._C._current_graph_task_id() != -1)


def outside_caller() -> int:
    """The ``stacklevel`` that points a warning raised by the caller at the first frame outside lossscale and torch
    (the user's line, however many of lossscale's calls and torch's wrappers are between)."""
    level, frame = 2, sys._getframe(2)  # 1 is the caller itself
    frame_or_none: FrameType | None = frame
    while frame_or_none is not None and frame_or_none.f_globals.get("__name__", "").partition(".")[0] in (
        "lossscale",
        "torch",
    ):
        level, frame_or_none = level + 1, frame_or_none.f_back
    return level


def found_flag(found_inf: object, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A policy's ``found_inf`` argument (a bool flag, or a count of overflows of any dtype) on ``device``: as it is
    where it already has ``dtype`` (the core's float32 0/1 flag, torch's float32 count: nonzero is an overflow either
    way), else ``found_inf != 0`` in ``dtype``. No host read.

    Raises:
        TypeError: ``found_inf`` is not a tensor.
    """
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(
            f"update(state, found_inf): found_inf must be a tensor (bool or a count of overflows); "
            f"got {type(found_inf).__name__}"
        )
    flag = found_inf.to(device=device, non_blocking=True)
    if flag.dtype == dtype:
        return flag
    flag = flag != 0
    return flag if dtype == torch.bool else flag.to(dtype)
