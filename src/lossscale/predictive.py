"""PredictiveScale: set the loss scale from the gradients' observed maximum, not by trial and error.

Every dynamic scaler in use grows blindly every N steps until a step overflows, throws that step
away and backs off. This policy instead reads the largest scaled-gradient magnitude that the overflow
pass already measures (``amax``), keeps the unscaled maxima of the last ``history`` steps, and picks
the largest power of two that keeps the window's maximum ``margin`` powers of two below the format's
largest finite value, as FP8 delayed scaling does with its amax history. Overflows still back off
at once (the trial-and-error rule stays as a safety net) and are remembered for ``history`` steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from lossscale._validate import check_choice, check_int_at_least, check_scale
from lossscale.policy import FLOAT32_MAX, SMALLEST_NORMAL_FLOAT32, Policy, _as_flag

__all__ = ["PredictiveScale", "PredictiveState"]


@dataclass(frozen=True)
class PredictiveState:
    """Scale and amax history, all 0-d/1-d tensors on the gradients' device.

    Attributes:
        scale: float32, the loss scale (always a power of two).
        history: float32 [history], unscaled gradient maxima of the last steps (0 = no observation).
        position: int32, where the next observation goes in the ring.
        extra_margin: int32, powers of two learned from overflows the history did not predict.
        clean_run: int32, clean steps since the last overflow (to forget learned margin slowly).
    """

    scale: torch.Tensor
    history: torch.Tensor
    position: torch.Tensor
    extra_margin: torch.Tensor
    clean_run: torch.Tensor

    def to(self, device: torch.device | str) -> "PredictiveState":
        return PredictiveState(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def _pow2_floor(x: float) -> float:
    return 2.0 ** math.floor(math.log2(x))


@dataclass(frozen=True)
class PredictiveScale(Policy):
    """Loss scale predicted from the observed gradient maximum over a history window.

    The rule, per call of ``update(state, found_inf, amax)`` (amax: max |scaled gradient| this step)::

        observed = limit / scale if found_inf else amax / scale     # unscaled; an overflow says
                                                                    # "at least limit / scale"
        history[position] = observed; position += 1 (mod history)
        A = max(history)
        if learn_margin:
            first overflow after a clean step: extra_margin += 1
            forget_interval clean steps in a row: extra_margin -= 1 (not below 0)
        if A > 0: scale = 2 ** floor(log2(limit / A) - margin - extra_margin)
        if found_inf: scale = min(scale, old_scale * backoff_factor)  # the safety net, at once
        scale = clamp(2 ** floor(log2(scale)), min_scale, max_scale)   # powers of two inside the bounds

    ``limit`` is ``torch.finfo(dtype).max`` (65504 for float16). The scale is always a power of two,
    so unscaling is exact. Cost: about 25 element-wise ops on tensors of ``history`` elements; no host
    read. The amax itself comes from the overflow pass (``aminmax``), at no extra pass where the
    scaler already reads the gradients once.

    Args:
        init_scale: First scale (rounded down to a power of two).
        margin: Powers of two of headroom between the window's maximum and ``limit`` (>= 0).
        history: Steps remembered (>= 1); a spike lowers the scale for this many steps.
        backoff_factor: Applied at once on an overflow, in (0, 1).
        learn_margin: Add one power of two of headroom after each overflow (for models whose overflow
            happens in backward intermediates larger than the parameter gradients), and give it back
            after ``forget_interval`` clean steps in a row.
        forget_interval: >= 1 clean steps before one learned power of two is forgotten.
        dtype: The low-precision format whose largest finite value is ``limit``.
        min_scale, max_scale: Bounds (powers of two are taken inside them).

    Example:
        >>> import torch
        >>> policy = PredictiveScale(init_scale=2.0**10, margin=1, history=4)
        >>> state = policy.init()
        >>> state = policy.update(state, torch.tensor(False), amax=torch.tensor(1.0 * 2**10))
        >>> float(state.scale)  # largest power of two with 1.0 * scale <= 65504 / 2
        16384.0
    """

    init_scale: float = 2.0**16
    margin: int = 2
    history: int = 16
    backoff_factor: float = 0.5
    learn_margin: bool = True
    forget_interval: int = 1000
    dtype: torch.dtype = torch.float16
    min_scale: float = SMALLEST_NORMAL_FLOAT32
    max_scale: float = FLOAT32_MAX

    observes_amax: ClassVar[bool] = True  # the pipeline passes amax= to update()

    def __post_init__(self) -> None:
        call = type(self).__name__
        check_scale(call, "min_scale", self.min_scale, low=SMALLEST_NORMAL_FLOAT32, high=FLOAT32_MAX)
        check_scale(call, "max_scale", self.max_scale, low=SMALLEST_NORMAL_FLOAT32, high=FLOAT32_MAX)
        if self.min_scale > self.max_scale:
            raise ValueError(f"{call}(min_scale={self.min_scale!r}, max_scale={self.max_scale!r}): min_scale must "
                             f"be <= max_scale; got min_scale > max_scale.")
        check_scale(call, "init_scale", self.init_scale, low=self.min_scale, high=self.max_scale)
        check_int_at_least(call, "margin", self.margin, 0)
        check_int_at_least(call, "history", self.history, 1)
        check_int_at_least(call, "forget_interval", self.forget_interval, 1)
        check_choice(call, "learn_margin", self.learn_margin, (True, False))
        b = self.backoff_factor
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (0.0 < b < 1.0):
            raise ValueError(f"{call}(backoff_factor={b!r}): backoff_factor must be in (0, 1); got {b!r}.")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"{call}(dtype={self.dtype!r}): dtype must be a floating-point torch.dtype such as "
                             f"torch.float16; got {self.dtype!r}.")
        if _pow2_floor(self.max_scale) < self.min_scale:
            raise ValueError(f"{call}(min_scale={self.min_scale!r}, max_scale={self.max_scale!r}): no power of two "
                             f"lies in [min_scale, max_scale].")

    @property
    def limit(self) -> float:
        """The largest finite value of ``dtype``: a scaled gradient at or above it has overflowed."""
        return float(torch.finfo(self.dtype).max)

    def init(self, device: torch.device | str | None = None) -> PredictiveState:
        """A fresh state on ``device``: the initial scale (as a power of two) and an empty history."""
        zero = torch.zeros((), dtype=torch.int32, device=device)
        start = min(max(_pow2_floor(self.init_scale), self._floor_pow2()), self._cap_pow2())
        return PredictiveState(
            scale=torch.full((), start, dtype=torch.float32, device=device),
            history=torch.zeros(self.history, dtype=torch.float32, device=device),
            position=zero,
            extra_margin=zero.clone(),
            clean_run=zero.clone(),
        )

    def _cap_pow2(self) -> float:
        return _pow2_floor(self.max_scale)

    def _floor_pow2(self) -> float:
        low = _pow2_floor(self.min_scale)
        return low if low >= self.min_scale else low * 2

    def update(self, state: PredictiveState, found_inf: torch.Tensor, amax: torch.Tensor | None = None) -> PredictiveState:
        """The next state from this step's overflow flag and scaled-gradient maximum (no host read)."""
        bad = _as_flag(found_inf, state.scale.device)
        scale = state.scale.double()
        if amax is None:
            amax = torch.zeros((), dtype=torch.float64, device=scale.device)
        amax = amax.to(scale.device, torch.float64)
        finite = torch.isfinite(amax)
        clean_obs = torch.where(finite, amax, torch.zeros_like(amax)) / scale
        observed = torch.where(bad, self.limit / scale, clean_obs).clamp_max(FLOAT32_MAX).float()

        history = state.history.clone()
        history.index_put_((state.position.long().reshape(1),), observed.reshape(1))
        position = (state.position + 1) % self.history
        window = history.max().double()

        extra = state.extra_margin
        run = torch.where(bad, torch.zeros_like(state.clean_run), (state.clean_run + 1).clamp_max(2**30))
        if self.learn_margin:
            surprise = bad & (state.clean_run > 0)  # the first overflow of a run; NaN data does not inflate it
            forget = run >= self.forget_interval
            extra = torch.where(surprise, (extra + 1).clamp_max(126),
                                torch.where(forget, (extra - 1).clamp_min(0), extra))
            run = torch.where(forget, torch.zeros_like(run), run)

        exponent = torch.floor(torch.log2(self.limit / window.clamp_min(1e-300))) - self.margin - extra.double()
        predicted = torch.exp2(exponent.clamp(-126.0, 127.0))
        predicted = torch.where(window > 0, predicted, scale)
        predicted = torch.where(bad, torch.minimum(predicted, scale * self.backoff_factor), predicted)
        # keep it a power of two inside the bounds (the backoff factor need not be one)
        predicted = torch.exp2(torch.floor(torch.log2(predicted)))
        new_scale = predicted.clamp(self._floor_pow2(), self._cap_pow2()).float()
        return PredictiveState(new_scale, history, position.to(torch.int32), extra.to(torch.int32), run.to(torch.int32))

    def check_floor(self, state: PredictiveState) -> None:
        """A predictive scale keeps skipping at its floor; it never raises."""
