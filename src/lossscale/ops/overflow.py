"""Overflow detection over lists of gradients, fused, in two modes.

``"inf_nan"``: a gradient overflowed if any value is inf or NaN. ``"saturation"`` (Ascend's saturation mode):
also if a *scaled* gradient's magnitude reaches the format's largest finite value (``torch.finfo(dtype).max``).

Every function here sets a caller-owned ``found_inf`` (0-d float32) to 1.0 on an overflow and never lowers it,
so a 0/1 flag stays one; none reads it on the host. The inf/NaN check is torch's fused
``torch._amp_foreach_non_finite_check_and_unscale_`` (by 1.0 where only a check is wanted).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Literal

import torch

from lossscale.ops.clip import norms
from lossscale.validation import ArgumentTypeError, validate_choice

OverflowMode = Literal["inf_nan", "saturation"]
OVERFLOW_MODES: tuple[str, ...] = ("inf_nan", "saturation")


def validate_mode(call: str, mode: str) -> None:
    """Check an ``overflow_mode`` argument."""
    validate_choice(call, "overflow_mode", mode, OVERFLOW_MODES)


def saturation_threshold(dtype: torch.dtype = torch.float16, call: str = "saturation_threshold") -> float:
    """The magnitude at which a scaled gradient counts as saturated: the format's largest finite value."""
    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(
            f"{call}(saturation_dtype={dtype!r}): saturation_dtype must be a floating-point "
            f"torch.dtype such as torch.float16; got {type(dtype).__name__} {dtype!r}."
        )
    if not dtype.is_floating_point:
        raise ValueError(
            f"{call}(saturation_dtype={dtype}): saturation_dtype must be a floating-point torch.dtype "
            f"such as torch.float16; got {dtype}."
        )
    return float(torch.finfo(dtype).max)


def largest_magnitude(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """``max |g|`` over ``grads`` (one device and dtype) as a 0-d float32; inf or NaN when a value is not finite; 0 when
    every tensor is empty.

    One read pass, no host read. On a CUDA device with ``triton``: one kernel with one small output
    (:mod:`lossscale.ops.amax_kernel`, where it takes the tensors; off with the environment variable
    ``LOSSSCALE_TRITON=0``). Otherwise on an accelerator: torch's multi-tensor inf-norm (``_foreach_norm(ord=inf)``,
    one kernel per chunk of tensors on CUDA, NaN propagated), its results gathered with no host op per tensor. On the
    CPU, where launches cost nothing and torch's inf-norm writes ``|g|`` before its maximum, ``aminmax`` per
    tensor."""
    present = [g for g in grads if g.numel()]  # the inf-norm of an empty tensor is undefined
    if not present:
        return torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    kernel = amax_kernel_module() if present[0].is_cuda else None
    result = kernel.amax(present) if kernel is not None else None
    if result is not None:
        return result
    if present[0].device.type != "cpu":
        return norms(present, math.inf).max().float()
    lows, highs = zip(*(torch.aminmax(g) for g in present))
    return torch.maximum(torch.stack(highs).max(), -torch.stack(lows).min()).float()


@functools.cache
def amax_kernel_module() -> ModuleType | None:
    """:mod:`lossscale.ops.amax_kernel` where ``triton`` is installed and ``LOSSSCALE_TRITON`` is not ``0``, else
    None; decided once, at the first CUDA read.

    Raises:
        ValueError: ``LOSSSCALE_TRITON`` set to something other than ``0`` or ``1``.
        RuntimeError: ``triton`` installed but failing to import (the message says how to turn the kernel off)."""
    setting = os.environ.get("LOSSSCALE_TRITON", "1")
    if setting not in ("0", "1"):
        raise ValueError(
            f"LOSSSCALE_TRITON={setting!r}: the environment variable LOSSSCALE_TRITON must be '0' "
            f"(torch's multi-tensor inf-norm for the largest gradient magnitude on CUDA) or '1' "
            f"(lossscale's Triton kernel where triton is installed, the default); got {setting!r}."
        )
    if setting == "0" or importlib.util.find_spec("triton") is None:
        return None
    try:
        from lossscale.ops import amax_kernel
    except Exception as err:  # a triton that does not match this torch or machine
        raise RuntimeError(
            f"lossscale.ops.amax_kernel: triton is installed but its import failed "
            f"({type(err).__name__}: {err}). Set LOSSSCALE_TRITON=0 to read the largest "
            f"gradient magnitude with torch's multi-tensor inf-norm instead."
        ) from err
    return amax_kernel


def _saturated(grads: Sequence[torch.Tensor], threshold: float) -> torch.Tensor:
    """0-d bool: some value has magnitude >= threshold or is not finite. One read pass."""
    # "not below the threshold", so that NaN, which fails every comparison, counts
    return ~(largest_magnitude(grads) < threshold)


def check_with_amax_(
    grads: Sequence[torch.Tensor], found_inf: torch.Tensor, mode: OverflowMode = "inf_nan", threshold: float = 65504.0
) -> torch.Tensor:
    """Like :func:`check_`, and also return the largest magnitude (0-d float32; inf/NaN on overflow).
    One read pass (the check is the largest magnitude: not finite, or in saturation mode >= threshold); no host
    read."""
    amax = largest_magnitude(grads) if grads else torch.zeros((), dtype=torch.float32, device=found_inf.device)
    bad = ~(amax < (threshold if mode == "saturation" else math.inf))
    found_inf.logical_or_(bad.to(found_inf.device))
    return amax


_ONES: dict[torch.device, torch.Tensor] = {}


def one(device: torch.device) -> torch.Tensor:
    """A 0-d float32 1.0 on ``device``, made once and only ever read (a multiplier, a default)."""
    if device not in _ONES:
        _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return _ONES[device]


def check_(
    grads: Sequence[torch.Tensor], found_inf: torch.Tensor, mode: OverflowMode = "inf_nan", threshold: float = 65504.0
) -> torch.Tensor:
    """Set ``found_inf`` to 1.0 if ``grads`` (one device and dtype) overflowed.
    Passes: inf_nan, one read+write (by 1.0); saturation, one read. No host read."""
    if not grads:
        return found_inf
    if mode == "saturation":
        flag = _saturated(grads, threshold)
    elif found_inf.dtype == torch.float32 and found_inf.device == grads[0].device:
        torch._amp_foreach_non_finite_check_and_unscale_(list(grads), found_inf, one(found_inf.device))
        return found_inf
    else:
        flag = torch.zeros((), dtype=torch.float32, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(list(grads), flag, one(flag.device))
    if flag.device != found_inf.device or flag.dtype not in (torch.bool, found_inf.dtype):
        flag = flag.to(device=found_inf.device, dtype=found_inf.dtype)
    return found_inf.logical_or_(flag)


def unscale_and_check_(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    mode: OverflowMode = "inf_nan",
    threshold: float = 65504.0,
) -> torch.Tensor:
    """Multiply ``grads`` (one device and dtype) in place by ``inv_scale`` and record overflow in ``found_inf``.
    Passes: one fused read+write (saturation: one read of the scaled values first). No host read."""
    if not grads:
        return found_inf
    if mode == "saturation":
        check_(grads, found_inf, "saturation", threshold)
    torch._amp_foreach_non_finite_check_and_unscale_(list(grads), found_inf, inv_scale)
    return found_inf


def overflowing(
    named_grads: Iterable[tuple[str, torch.Tensor | None]],
    mode: OverflowMode = "inf_nan",
    threshold: float = 65504.0,
    unscaled_by: float = 1.0,
) -> list[str]:
    """Names of the gradients that overflowed. ``unscaled_by``: the scale already divided out of them
    (saturation is judged against ``threshold / unscaled_by``). One read of every gradient and one host read."""
    names, flags = [], []
    limit = threshold / unscaled_by
    for name, g in named_grads:
        if g is None:
            continue
        if g.is_sparse:
            g = g.coalesce()._values()
        if g.numel() == 0:
            continue
        bad = ~torch.isfinite(g).all()
        if mode == "saturation":
            bad = bad | (g.abs().amax().float() >= limit)
        names.append(name)
        flags.append(bad.to("cpu", non_blocking=False) if g.device.type != "cpu" else bad)
    if not flags:
        return []
    hits = torch.stack(flags).tolist()
    return [n for n, hit in zip(names, hits) if hit]
