"""``keep_float32``: the standard fix for a forward overflow, one module run in float32 (or bfloat16) inside an autocast
model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from lossscale.ops.kept import mark_kept, unmark_kept
from lossscale.ops.nested import map_tensors, tensors_in
from lossscale.validation import ArgumentTypeError, validate_choice

_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")
_LOW = (torch.float16, torch.bfloat16)


class Float32Forward:
    """The handle :func:`keep_float32` returns: :meth:`remove` undoes it (also as a context manager).

    Constructing it wraps ``module.forward`` at once. Build it through :func:`keep_float32`, which checks the
    arguments; the constructor takes them as given.

    Args:
        module: The module whose forward runs in float32 (or ``precision``) from now on.
        outputs: ``"autocast"`` (each float32 output cast back to autocast's dtype on its device) or ``"float32"``
            (every floating-point output as float32), as :func:`keep_float32` describes.
        precision: ``torch.float32`` (default: autocast off, inputs cast to float32) or ``torch.bfloat16``
            (autocast to bfloat16 instead, inputs as they come).
    """

    def __init__(self, module: nn.Module, outputs: str, precision: torch.dtype = torch.float32) -> None:
        self.module = module
        self.outputs = outputs
        self.precision = precision
        self.removed = False
        self._had_own = "forward" in module.__dict__
        self._previous = module.__dict__.get("forward")
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.removed:
                return inner(*args, **kwargs)
            return self._run(inner, args, kwargs)

        self._forward = forward
        module.forward = forward
        mark_kept(module)

    def _run(self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        enabled = [d for d in _DEVICE_TYPES if autocast_on(d)]
        first = next((t.dtype for t in tensors_in((args, kwargs)) if t.is_floating_point()), None)
        if self.precision == torch.float32:
            args, kwargs = map_tensors(to_float32, args), map_tensors(to_float32, kwargs)
        out = self._call(inner, enabled, args, kwargs)
        if self.outputs == "float32":
            return map_tensors(to_float32, out)
        targets = {d: torch.get_autocast_dtype(d) for d in enabled}

        def back(t: torch.Tensor) -> torch.Tensor:
            if t.dtype != torch.float32:
                return t
            target = targets.get(t.device.type, None if enabled else first)
            return t if target is None or target == torch.float32 else t.to(target)

        return map_tensors(back, out)

    def _call(
        self, inner: Callable[..., Any], devices: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``inner`` with autocast off (or in bfloat16) on each of ``devices``: one plain ``with`` per device, which
        torch.compile traces without a graph break."""
        if not devices:
            return inner(*args, **kwargs)
        if self.precision == torch.float32:
            with torch.autocast(devices[0], enabled=False):
                return self._call(inner, devices[1:], args, kwargs)
        with torch.autocast(devices[0], dtype=self.precision):  # bfloat16: float32's range at half the width
            return self._call(inner, devices[1:], args, kwargs)

    def remove(self) -> None:
        """Undo: the module's forward runs as before (idempotent)."""
        if self.removed:
            return
        self.removed = True
        unmark_kept(self.module)
        if self.module.__dict__.get("forward") is self._forward:
            if self._had_own:
                self.module.forward = self._previous  # type: ignore[assignment]  # what was there
            else:
                del self.module.forward
        # else something wrapped the forward after us: our wrapper stays in its chain and now passes calls through

    def __enter__(self) -> Float32Forward:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else "active"
        precision = "" if self.precision == torch.float32 else f", precision={self.precision}"
        return f"Float32Forward({type(self.module).__name__}, outputs={self.outputs!r}{precision}, {state})"


def keep_float32(
    module: nn.Module,
    *,
    outputs: Literal["autocast", "float32"] = "autocast",
    precision: torch.dtype = torch.float32,
) -> Float32Forward:
    """Run ``module``'s forward outside autocast on float32 inputs; returns a handle whose ``remove()`` undoes it.

    The rule, at each call::

        inputs:  every float16/bfloat16 tensor in args and kwargs -> float32
        forward: with autocast disabled on every device type where it was enabled
                 (precision=torch.bfloat16: autocast to bfloat16 there instead, inputs as they come)
        outputs: "autocast": each float32 output -> autocast's dtype on its device (float16 on CUDA under
                 torch.autocast("cuda")), what autocast gives a matmul-like op; without autocast, the dtype
                 of the first floating-point input
                 "float32": every floating-point output as float32 (for a module whose output itself passes
                 65504: cast back to float16 it would overflow again)

    The module's parameters are not touched (under autocast they are float32 already). Host reads: none.

    Args:
        module: The module to run in float32 (e.g. the one :func:`find_overflow` names).
        outputs: ``"autocast"`` or ``"float32"``, as above.
        precision: ``torch.float32`` (default) or ``torch.bfloat16`` (float32's range, where the device runs it
            natively).

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> handle = keep_float32(layer)
        >>> with torch.autocast("cpu", dtype=torch.float16):
        ...     layer(torch.ones(1, 2)).dtype
        torch.float16
        >>> handle.remove()
    """
    call = f"keep_float32(module={type(module).__name__}, outputs={outputs!r})"
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(
            f"keep_float32(module={module!r:.60}): module must be a torch.nn.Module (e.g. "
            f"model.get_submodule(report.module)); got {type(module).__name__}."
        )
    validate_choice(call, "outputs", outputs, ("autocast", "float32"))
    validate_choice(call, "precision", precision, (torch.float32, torch.bfloat16))
    return Float32Forward(module, outputs, precision)


def autocast_on(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` now (False for a device type autocast does not know)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except (RuntimeError, ValueError):
        return False


def to_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float32 where it is float16 or bfloat16; any other tensor as it is."""
    return t.float() if t.dtype in _LOW else t
