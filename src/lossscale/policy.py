"""Loss-scale policies: frozen configs whose whole rule is one sync-free transition.

A policy is validated once at construction. Its state (:class:`ScaleState`) is a small record of
0-d tensors that lives on the gradients' device; ``update(state, found_inf)`` returns the next state
using tensor ops only (no ``.item()``, no ``bool(tensor)``, no Python branch on data), so advancing
the scale never waits for the device.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from lossscale._validate import check_choice, check_factor_above_one, check_int_at_least, check_scale

__all__ = [
    "DynamicScale",
    "FixedScale",
    "FloorError",
    "Policy",
    "ScaleState",
    "FLOAT32_MAX",
    "SMALLEST_NORMAL_FLOAT32",
]

#: The largest finite float32: growth that would pass it is refused, so the scale never becomes inf.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
#: 2**-126, the smallest normal float32 (a power of two): the default floor, never flushed to zero.
SMALLEST_NORMAL_FLOAT32 = 2.0**-126

_SATURATE = 2**30  # counters stop here instead of wrapping


class FloorError(RuntimeError):
    """Raised when a policy with ``at_floor="raise"`` must back off below ``min_scale``."""


@dataclass(frozen=True)
class ScaleState:
    """The mutable half of a policy, as 0-d tensors on one device.

    Attributes:
        scale: float32, the factor the loss is multiplied by.
        growth_tracker: int32, clean steps since the scale last changed or overflowed.
        hysteresis_left: int32, overflows still absorbed before the next backoff.
        floor_hits: int32, consecutive overflowing steps that found the scale already at its floor.
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_left: torch.Tensor
    floor_hits: torch.Tensor

    def to(self, device: torch.device | str) -> ScaleState:
        """The same state on ``device`` (a copy only where it moves)."""
        return dataclasses.replace(
            self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)}
        )


def state_to_dict(state: Any) -> dict[str, float | int | list]:
    """Plain Python numbers for every field of a state record (reads them on the host: one sync)."""
    return {f.name: getattr(state, f.name).tolist() for f in dataclasses.fields(state)}


def state_from_dict(template: Any, values: dict[str, Any]) -> Any:
    """A state shaped like ``template`` (dtype, device) holding ``values``; every field is required."""
    names = [f.name for f in dataclasses.fields(template)]
    missing = [n for n in names if n not in values]
    if missing:
        raise KeyError(f"loss-scale state is missing {missing}; expected the fields {names}")
    return dataclasses.replace(
        template,
        **{
            n: torch.as_tensor(values[n], dtype=getattr(template, n).dtype).to(getattr(template, n).device)
            for n in names
        },
    )


@runtime_checkable
class Policy(Protocol):
    """What the scalers need from a policy."""

    def init(self, device: torch.device | str | None = None) -> Any: ...

    def update(self, state: Any, found_inf: torch.Tensor) -> Any: ...


def _as_flag(found_inf: torch.Tensor, device: torch.device) -> torch.Tensor:
    """found_inf (bool, or a float/int count as torch's scaler keeps it) as a 0-d bool on ``device``."""
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(
            f"update(state, found_inf): found_inf must be a tensor (bool or a count of overflows); "
            f"got {type(found_inf).__name__}"
        )
    flag = found_inf.to(device=device, non_blocking=True)
    return flag if flag.dtype == torch.bool else flag != 0


@dataclass(frozen=True)
class DynamicScale:
    """Dynamic loss scaling: back off on overflow, grow after a run of clean steps.

    The rule, per call of ``update(state, found_inf)``::

        if found_inf:
            growth_tracker = 0
            hysteresis_left -= 1
            if hysteresis_left <= 0:                       # out of patience: back off
                scale = max(scale * backoff_factor, min_scale)
                if refill_after_backoff: hysteresis_left = hysteresis
        else:
            growth_tracker += 1
            if hysteresis_mode == "consecutive": hysteresis_left = hysteresis
            if growth_tracker == growth_interval:
                growth_tracker = 0; hysteresis_left = hysteresis
                if scale * growth_factor <= max_scale: scale *= growth_factor   # finite guard

    Products are taken in float64 and rounded once to float32, as torch's ``_amp_update_scale_``
    does; with the defaults below the trajectory equals ``torch.amp.GradScaler``'s bit for bit.
    ``floor_hits`` counts consecutive overflowing steps that found the scale already at
    ``min_scale``; with ``at_floor="raise"`` the scalers turn the first one into a :class:`FloorError`.

    Cost: about twenty element-wise ops on 0-d tensors; no host read.

    Args:
        init_scale: First scale; finite, within ``[min_scale, max_scale]``.
        growth_factor: > 1; multiplies the scale after ``growth_interval`` clean steps.
        backoff_factor: in (0, 1); multiplies the scale on a backoff.
        growth_interval: >= 1 clean steps between growths.
        hysteresis: >= 1 overflows absorbed per backoff (1: back off at every overflow).
        hysteresis_mode: ``"consecutive"`` (any clean step refills the count) or ``"cumulative"``
            (only a change of scale refills it).
        refill_after_backoff: Whether a backoff refills the count (False: later overflows back off
            at once until the next growth, as DeepSpeed and Megatron do).
        min_scale: Floor of the scale; default 2**-126, the smallest normal float32.
        max_scale: Cap of the scale; default the largest finite float32 (growth never reaches inf).
        at_floor: ``"skip"`` (stay at the floor and keep skipping) or ``"raise"``.

    Example:
        >>> import torch
        >>> policy = DynamicScale(init_scale=8.0, growth_interval=2)
        >>> state = policy.init()
        >>> for overflow in [False, False, True]:
        ...     state = policy.update(state, torch.tensor(overflow))
        >>> float(state.scale)
        8.0
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    hysteresis_mode: Literal["consecutive", "cumulative"] = "consecutive"
    refill_after_backoff: bool = True
    min_scale: float = SMALLEST_NORMAL_FLOAT32
    max_scale: float = FLOAT32_MAX
    at_floor: Literal["skip", "raise"] = "skip"

    def __post_init__(self) -> None:
        call = type(self).__name__
        check_scale(call, "min_scale", self.min_scale, low=SMALLEST_NORMAL_FLOAT32, high=FLOAT32_MAX)
        check_scale(call, "max_scale", self.max_scale, low=SMALLEST_NORMAL_FLOAT32, high=FLOAT32_MAX)
        if self.min_scale > self.max_scale:
            raise ValueError(
                f"{call}(min_scale={self.min_scale!r}, max_scale={self.max_scale!r}): min_scale must be "
                f"<= max_scale; got min_scale > max_scale."
            )
        check_scale(call, "init_scale", self.init_scale, low=self.min_scale, high=self.max_scale)
        check_factor_above_one(call, "growth_factor", self.growth_factor,
                               "it multiplies the scale after growth_interval clean steps")
        b = self.backoff_factor
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (0.0 < b < 1.0):
            raise ValueError(
                f"{call}(backoff_factor={b!r}): backoff_factor must be in (0, 1) "
                f"(it multiplies the scale when it backs off); got {b!r}."
            )
        check_int_at_least(call, "growth_interval", self.growth_interval, 1)
        check_int_at_least(call, "hysteresis", self.hysteresis, 1)
        check_choice(call, "hysteresis_mode", self.hysteresis_mode, ("consecutive", "cumulative"))
        check_choice(call, "refill_after_backoff", self.refill_after_backoff, (True, False))
        check_choice(call, "at_floor", self.at_floor, ("skip", "raise"))

    def init(self, device: torch.device | str | None = None) -> ScaleState:
        """A fresh state on ``device`` (default: CPU)."""
        return ScaleState(
            scale=torch.full((), self.init_scale, dtype=torch.float32, device=device),
            growth_tracker=torch.zeros((), dtype=torch.int32, device=device),
            hysteresis_left=torch.full((), self.hysteresis, dtype=torch.int32, device=device),
            floor_hits=torch.zeros((), dtype=torch.int32, device=device),
        )

    def update(self, state: ScaleState, found_inf: torch.Tensor) -> ScaleState:
        """The next state after a step whose gradients did (``found_inf``) or did not overflow."""
        bad = _as_flag(found_inf, state.scale.device)
        clean = ~bad
        scale, tracker, left = state.scale, state.growth_tracker, state.hysteresis_left
        full = torch.full_like(left, self.hysteresis)

        # Growth: the growth_interval-th clean step in a row, refused if it would pass max_scale.
        counted = torch.where(bad, torch.zeros_like(tracker), tracker + 1)
        grow = clean & (counted >= self.growth_interval)
        grown = (scale.double() * self.growth_factor).float()
        grow_ok = grow & (grown <= self.max_scale)  # also False for inf/NaN products

        # Backoff: an overflow that exhausts the hysteresis, clamped at the floor.
        spent = left - 1
        backoff = bad & (spent <= 0)
        at_floor = scale <= self.min_scale
        shrunk = (scale.double() * self.backoff_factor).float().clamp_min(self.min_scale)

        new_scale = torch.where(grow_ok, grown, torch.where(backoff, shrunk, scale))
        refill = grow | (backoff if self.refill_after_backoff else torch.zeros_like(grow))
        if self.hysteresis_mode == "consecutive":
            refill = refill | clean
        new_left = torch.where(refill, full, torch.where(bad, spent.clamp_min(0), left))
        new_tracker = torch.where(grow, torch.zeros_like(counted), counted)
        floor_hits = torch.where(
            backoff & at_floor, (state.floor_hits + 1).clamp_max(_SATURATE), torch.where(bad, state.floor_hits, 0)
        ).to(torch.int32)
        return ScaleState(new_scale, new_tracker.to(torch.int32), new_left.to(torch.int32), floor_hits)

    def check_floor(self, state: ScaleState) -> None:
        """Raise :class:`FloorError` if ``at_floor="raise"`` and the scale hit its floor.

        Cost: one host read of ``floor_hits`` when ``at_floor="raise"``; nothing otherwise.
        """
        if self.at_floor != "raise":
            return
        hits = int(state.floor_hits)
        if hits:
            raise FloorError(
                f"the loss scale is at its floor min_scale={self.min_scale!r} and the gradients still "
                f"overflow ({hits} step(s) in a row at the floor). A scale this small does not bring "
                f"float16 back into range: the cause is most likely NaN or inf in the data, the loss or "
                f"the model (check the inputs and the loss before backward), not float16's range. "
                f"Pass at_floor='skip' to keep skipping instead."
            )


@dataclass(frozen=True)
class FixedScale:
    """A constant loss scale: overflowing steps are still detected and skipped, the scale never moves.

    Cost: none; ``update`` returns the state unchanged.

    Example:
        >>> import torch
        >>> policy = FixedScale(128.0)
        >>> float(policy.update(policy.init(), torch.tensor(True)).scale)
        128.0
    """

    scale: float = 2.0**16

    def __post_init__(self) -> None:
        check_scale(type(self).__name__, "scale", self.scale, low=SMALLEST_NORMAL_FLOAT32, high=FLOAT32_MAX)

    def init(self, device: torch.device | str | None = None) -> ScaleState:
        """A state holding the fixed scale on ``device`` (default: CPU)."""
        zero = torch.zeros((), dtype=torch.int32, device=device)
        return ScaleState(
            scale=torch.full((), self.scale, dtype=torch.float32, device=device),
            growth_tracker=zero,
            hysteresis_left=torch.ones((), dtype=torch.int32, device=device),
            floor_hits=zero.clone(),
        )

    def update(self, state: ScaleState, found_inf: torch.Tensor) -> ScaleState:
        """The same state: a fixed scale ignores overflow."""
        _as_flag(found_inf, state.scale.device)
        return state

    def check_floor(self, state: ScaleState) -> None:
        """A fixed scale has no floor to hit."""


def check_floor(policy: Any, state: Any) -> None:
    """Ask ``policy`` to raise at its floor, if it knows how (third-party policies may not)."""
    checker = getattr(policy, "check_floor", None)
    if checker is not None:
        checker(state)


def is_power_of_two(x: float) -> bool:
    """Whether ``x`` is an exact power of two (then multiplying by it or its inverse is exact)."""
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5
