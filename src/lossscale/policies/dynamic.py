"""DynamicScale: back off on overflow, grow after a run of clean steps; every peer's rule as knobs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from lossscale.policies.base import SATURATE, FloorError, Policy, ScaleState
from lossscale.validation import (
    FLOAT32_MAX,
    SMALLEST_NORMAL_FLOAT32,
    found_flag,
    to_float32,
    validate_choice,
    validate_factor_above_one,
    validate_fraction,
    validate_int_in_range,
    validate_scale_bounds,
)


@dataclass(frozen=True)
class DynamicScale(Policy[ScaleState]):
    """Dynamic loss scaling: back off on overflow, grow after a run of clean steps.

    The rule, per call of ``update(state, found_inf)`` (``growth_tracker`` starts at ``-growth_delay``)::

        if found_inf:
            growth_tracker = -growth_delay
            hysteresis_left -= 1
            if hysteresis_left <= 0:                       # out of patience: back off
                scale = max(scale / backoff_divisor if backoff_divisor else scale * backoff_factor, min_scale)
                if refill_after_backoff: hysteresis_left = hysteresis
        else:
            growth_tracker += 1
            if hysteresis_mode == "consecutive": hysteresis_left = hysteresis
            if growth_tracker == growth_interval:
                growth_tracker = 0; hysteresis_left = hysteresis
                if growth_guard == "result" and scale * growth_factor <= max_scale \
                        or growth_guard == "operand" and scale < max_scale / growth_factor:
                    scale *= growth_factor                 # refused growth still restarts the count

    ``arithmetic="float64"``: each product (or quotient) in float64 with the Python factor, rounded once to
    float32 (torch's ``_amp_update_scale_``; the defaults equal ``torch.amp.GradScaler`` bit for bit).
    ``"float32"``: the factor rounded to float32 and the operation done in float32 (TensorFlow, MindSpore,
    Megatron, Paddle). ``floor_hits`` counts consecutive overflowing steps that found the scale already at
    ``min_scale``; with ``at_floor="raise"`` the first one raises :class:`FloorError` and changes no other state.

    Cost: about twenty element-wise ops on 0-d tensors; no host read.

    Args:
        init_scale: First scale; finite, within ``[min_scale, max_scale]``.
        growth_factor: > 1; multiplies the scale after ``growth_interval`` clean steps.
        backoff_factor: in (0, 1); multiplies the scale on a backoff.
        growth_interval: >= 1 clean steps between growths.
        hysteresis: >= 1 overflows absorbed per backoff (1: back off at every overflow).
        hysteresis_mode: ``"consecutive"`` (a clean step refills the count) or ``"cumulative"`` (a new scale does).
        refill_after_backoff: Whether a backoff refills the count (False: DeepSpeed, Megatron).
        min_scale: Floor of the scale; default 2**-126, the smallest normal float32.
        max_scale: Cap of the scale; default the largest finite float32 (growth never reaches inf).
        at_floor: ``"skip"`` (stay at the floor and keep skipping) or ``"raise"``.
        arithmetic: ``"float64"`` (torch) or ``"float32"`` (see above).
        backoff_divisor: None, or a finite number > 1: a backoff divides by it instead of multiplying by
            ``backoff_factor``, which then reads ``1 / backoff_divisor``.
        growth_guard: ``"result"``: grow only if the grown scale is <= ``max_scale`` (torch, TF);
            ``"operand"``: only while ``scale < max_scale / growth_factor`` (rounded to float32; Ascend).
        growth_delay: >= 0 extra clean steps before the first growth after the start or an overflow.

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
    arithmetic: Literal["float64", "float32"] = "float64"
    backoff_divisor: float | None = None
    growth_guard: Literal["result", "operand"] = "result"
    growth_delay: int = 0

    def __post_init__(self) -> None:
        d = self.backoff_divisor
        if isinstance(d, (int, float)) and not isinstance(d, bool) and d > 1 and self.backoff_factor in (0.5, 1 / d):
            object.__setattr__(self, "backoff_factor", 1.0 / d)
        validate_dynamic_args(type(self).__name__, dataclasses.asdict(self))

    def replaced(self, call: str, names: Mapping[str, str] | None = None, **changes: Any) -> DynamicScale:
        """A copy with ``changes``, checked first as ``call`` under the caller's argument ``names`` (a field ->
        the caller's name for it), so the error names the call the user made (``GradScaler.set_growth_factor``)."""
        validate_dynamic_args(call, {**dataclasses.asdict(self), **changes}, names)
        return dataclasses.replace(self, **changes)

    def init(self, device: torch.device | str | None = None) -> ScaleState:
        """A fresh state on ``device`` (default CPU)."""
        return ScaleState(
            scale=torch.full((), self.init_scale, dtype=torch.float32, device=device),
            growth_tracker=torch.full((), -self.growth_delay, dtype=torch.int32, device=device),
            hysteresis_left=torch.full((), self.hysteresis, dtype=torch.int32, device=device),
            floor_hits=torch.zeros((), dtype=torch.int32, device=device),
        )

    def update(self, state: ScaleState, found_inf: torch.Tensor, amax: torch.Tensor | None = None) -> ScaleState:
        """The next state after a step whose gradients did (``found_inf``) or did not overflow.

        Args:
            state: The current state (not changed: a new record is returned).
            found_inf: A tensor on any device, 0-d (or one value per state of a batch): a bool flag, or a count of
                overflows of any dtype (torch's scaler passes its float32 count, the core its 0/1 float32 flag);
                nonzero means the step overflowed. Moved to the state's device without a host read.
            amax: Not read by this rule.
        """
        if self._torch_rule:
            return self._update_torch_rule(state, found_flag(found_inf, state.scale.device))
        bad = found_flag(found_inf, state.scale.device, torch.bool)
        clean = ~bad
        scale, tracker, left = state.scale, state.growth_tracker, state.hysteresis_left
        full = torch.full_like(left, self.hysteresis)

        # Growth: the growth_interval-th clean step in a row, refused if it would pass max_scale.
        counted = torch.where(bad, torch.full_like(tracker, -self.growth_delay), tracker + 1)
        grow = clean & (counted == self.growth_interval)
        grown = self._times(scale, self.growth_factor)
        if self.growth_guard == "result":
            grow_ok = grow & (grown <= self.max_scale)  # also False for inf/NaN products
        else:
            grow_ok = grow & (scale < to_float32(self.max_scale / self.growth_factor)) & (grown <= FLOAT32_MAX)

        # Backoff: an overflow that exhausts the hysteresis, clamped at the floor.
        spent = left - 1
        backoff = bad & (spent <= 0)
        at_floor = scale <= self.min_scale
        if self.backoff_divisor is None:
            shrunk = self._times(scale, self.backoff_factor)
        else:
            wide = torch.float64 if self.arithmetic == "float64" else torch.float32
            divisor = torch.full_like(scale, self.backoff_divisor, dtype=wide)  # a tensor: true division on CUDA
            shrunk = (scale.to(wide) / divisor).float()
        shrunk = shrunk.clamp_min(self.min_scale)

        new_scale = torch.where(grow_ok, grown, torch.where(backoff, shrunk, scale))
        refill = grow | (backoff if self.refill_after_backoff else torch.zeros_like(grow))
        if self.hysteresis_mode == "consecutive":
            refill = refill | clean
        new_left = torch.where(refill, full, torch.where(bad, spent.clamp_min(0), left))
        new_tracker = torch.where(grow, torch.zeros_like(counted), counted)
        if self.at_floor == "raise":  # the step that raises changes nothing but floor_hits
            frozen = backoff & at_floor
            new_left = torch.where(frozen, left, new_left)
            new_tracker = torch.where(frozen, tracker, new_tracker)
        floor_hits = torch.where(
            backoff & at_floor, (state.floor_hits + 1).clamp_max(SATURATE), torch.where(bad, state.floor_hits, 0)
        ).to(torch.int32)
        return ScaleState(new_scale, new_tracker.to(torch.int32), new_left.to(torch.int32), floor_hits)

    @functools.cached_property
    def _torch_rule(self) -> bool:
        """Whether the rule is torch's plus a floor (torch's own update kernel runs it)."""
        return (
            self.hysteresis == 1
            and self.refill_after_backoff
            and self.growth_delay == 0
            and self.arithmetic == "float64"
            and self.backoff_divisor is None
            and self.growth_guard == "result"
            and self.at_floor == "skip"
            and self.max_scale == FLOAT32_MAX
            and self.growth_interval < 2**31 - 1
        )

    def _update_torch_rule(self, state: ScaleState, found: torch.Tensor) -> ScaleState:
        """The same rule through torch's ``_amp_update_scale_`` (on copies; ``found``: its float32 flag, nonzero on an
        overflow), then the floor."""
        scale, tracker = state.scale.clone(), state.growth_tracker.clone()
        torch._amp_update_scale_(scale, tracker, found, self.growth_factor, self.backoff_factor, self.growth_interval)
        floor_hits = (state.floor_hits + (state.scale <= self.min_scale)).mul_(found.bool()).clamp_max_(SATURATE)
        return ScaleState(scale.clamp_min_(self.min_scale), tracker, state.hysteresis_left, floor_hits)

    def _times(self, scale: torch.Tensor, factor: float) -> torch.Tensor:
        """``scale * factor`` rounded once to float32, in the configured arithmetic."""
        if self.arithmetic == "float32":
            return scale * to_float32(factor)  # exact float32 operands: float32 product, rounded once
        return (scale.double() * factor).float()

    @property
    def floor_reads_host(self) -> bool:
        """True with ``at_floor="raise"``: :meth:`enforce_floor` reads the floor counter on the host."""
        return self.at_floor == "raise"

    def enforce_floor(self, state: ScaleState) -> None:
        """Raise :class:`FloorError` if ``at_floor="raise"`` and the scale hit its floor (then one host read)."""
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


def validate_dynamic_args(call: str, args: Mapping[str, object], names: Mapping[str, str] | None = None) -> None:
    """The one check of :class:`DynamicScale`'s arguments: ``args`` maps field names to values (absent fields take
    their defaults); ``names`` maps a field to the caller's name for it (a preset's), which errors then give."""
    names = names or {}
    defaults = {f.name: f.default for f in dataclasses.fields(DynamicScale)}
    v = {**defaults, **args}

    def n(field: str) -> str:
        return names.get(field, field)

    d = v["backoff_divisor"]
    if d is not None:
        validate_factor_above_one(call, n("backoff_divisor"), d, "a backoff divides the scale by it")
        if v["backoff_factor"] not in (0.5, 1.0 / cast(float, d)):  # d: a number, validated just above
            raise ValueError(
                f"{call}(backoff_factor={v['backoff_factor']!r}, backoff_divisor={d!r}): pass one of them; "
                f"a backoff either multiplies by backoff_factor or divides by backoff_divisor; got both."
            )
    validate_scale_bounds(
        call, v["min_scale"], v["max_scale"], v["init_scale"], (n("min_scale"), n("max_scale"), n("init_scale"))
    )
    validate_factor_above_one(call, n("growth_factor"), v["growth_factor"], "it multiplies the scale on growth")
    if d is None:
        validate_fraction(call, n("backoff_factor"), v["backoff_factor"], "it multiplies the scale when it backs off")
    validate_int_in_range(call, n("growth_interval"), v["growth_interval"], 1)
    validate_int_in_range(call, n("hysteresis"), v["hysteresis"], 1)
    validate_choice(call, n("hysteresis_mode"), v["hysteresis_mode"], ("consecutive", "cumulative"))
    validate_choice(call, n("refill_after_backoff"), v["refill_after_backoff"], (True, False))
    validate_choice(call, n("at_floor"), v["at_floor"], ("skip", "raise"))
    validate_choice(call, n("arithmetic"), v["arithmetic"], ("float64", "float32"))
    validate_choice(call, n("growth_guard"), v["growth_guard"], ("result", "operand"))
    validate_int_in_range(call, n("growth_delay"), v["growth_delay"], 0)
