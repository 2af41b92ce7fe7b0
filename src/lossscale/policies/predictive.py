"""PredictiveScale: set the loss scale from a forecast of the gradients' maximum, not by trial and error."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from lossscale.policies.base import Policy, move_state
from lossscale.validation import (
    FLOAT32_MAX,
    SMALLEST_NORMAL_FLOAT32,
    found_flag,
    validate_choice,
    validate_int_at_least,
    validate_scale_bounds,
)

#: The tail is measured above the level's 90th percentile and extrapolated as an exponential tail.
TAIL_SHARE = 0.1
#: Before ``PRIOR_STEPS`` observations the tail width leans on this prior (powers of two per e-fold of rarity:
#: 0.3 * ln(0.1 * 20,000) = 2.3 powers of headroom at the first observation with the default target).
PRIOR_WIDTH, PRIOR_STEPS = 0.3, 50
#: How fast the 90th-percentile threshold moves (powers of two per step).
THRESHOLD_RATE = 0.05
#: Before any clean observation an overflow says only "too large": back off this many powers of two.
BLIND_BACKOFF_POWERS = 8


@dataclass(frozen=True)
class PredictiveState:
    """Scale and forecast, all 0-d tensors on the gradients' device.

    Attributes:
        scale: float32, the loss scale (always a power of two).
        level: float32, moving average of log2(unscaled amax).
        threshold: float32, the 90th percentile of log2(amax) - level (stochastic approximation).
        excess: float32, moving average of how far log2(amax) - level passes the threshold.
        observed: int32, clean steps with a nonzero finite amax seen (saturates).
        extra: float32, powers of two of headroom learned from overflows the forecast missed.
        clean_run: int32, clean steps since the last overflow (saturates).
    """

    scale: torch.Tensor
    level: torch.Tensor
    threshold: torch.Tensor
    excess: torch.Tensor
    observed: torch.Tensor
    extra: torch.Tensor
    clean_run: torch.Tensor

    def to(self, device: torch.device | str) -> PredictiveState:
        """The same state on ``device`` (a copy only where it moves)."""
        return move_state(self, device)


def _pow2_floor(x: float) -> float:
    return 2.0 ** math.floor(math.log2(x))


@dataclass(frozen=True)
class PredictiveScale(Policy[PredictiveState]):
    """Loss scale from a forecast of ``log2(max |gradient|)``: level, tail, and a target overflow rate.

    The rule, per ``update(state, found_inf, amax, loss_finite=None)`` (amax: ``max |scaled gradient|``)::

        fault    = found_inf and (loss_finite is False
                                  or (amax finite and amax < limit * 2**-fault_gap and clean_run > 0))
        evidence = found_inf and not fault                  # an overflow the scale may have caused
        if clean and 0 < amax < inf:                        # an observation, unscaled, in log2
            x = log2(amax / scale); r = x - level
            level += r / history                            (level = x on the first observation)
            excess += (max(r - threshold, 0) - excess) / tail_history
            threshold += 0.05 * ((r > threshold) - 0.1)    # tracks the 90th percentile of r
        width = mean excess above the threshold / 0.1, blended with a prior 0.3 over the first 50
        extra = max(extra - 1 / forget_interval, 0) + (1 if evidence and learn_margin and observed before)
        headroom = threshold + width * ln(0.1 * target_interval) + extra + margin
        scale = 2 ** floor(log2(limit) - level - headroom)  # exponential tail: P(overflow) ~ 1/target
        if evidence: scale = min(scale, old * backoff_factor)   (old * 2**-8 before any observation)
        if fault: scale = old
        scale = clamp(power of two, min_scale, max_scale)

    ``limit`` is ``torch.finfo(dtype).max`` (65504 for float16); the scale is always a power of two.
    Cost: about 80 ops on 0-d tensors (state fields with a leading dimension update that many independent
    scales); no host read. On a CUDA device :class:`~lossscale.LossScale` replays them from a CUDA graph
    (``cuda_graph=True``): one launch and a few copies per step instead of about 80 kernel launches.

    Args:
        init_scale: First scale (rounded down to a power of two).
        target_interval: Mean steps between overflows the forecast aims for (>= 10).
        history: Steps the level averages over (>= 1): shorter follows drift faster, noisier.
        tail_history: Steps the tail width averages over (>= 1).
        margin: Powers of two of headroom on top of the forecast (>= 0).
        backoff_factor: At most this factor at once on an overflow that is evidence, in (0, 1).
        learn_margin: Add one power of two of headroom per overflow the forecast missed (see ``extra``).
        forget_interval: >= 1 steps to forget one learned power of two.
        fault_gap: >= 1 powers of two below ``limit`` that make an overflow a fault (see ``fault``).
        dtype: The low-precision format whose largest finite value is ``limit``.
        min_scale: Floor of the scale, default 2**-126 (the smallest normal float32): the scale never goes below
            the smallest power of two >= ``min_scale``. At most ``init_scale``.
        max_scale: Cap of the scale, default the largest finite float32: the scale never goes above the largest
            power of two <= ``max_scale``. At least ``init_scale``; a power of two must lie in
            ``[min_scale, max_scale]``.
        cuda_graph: On a CUDA device, replay the update from a CUDA graph captured at the first step (the same
            result bit for bit; False runs its ops one by one).

    Example:
        >>> import torch
        >>> policy = PredictiveScale(init_scale=2.0**10)
        >>> state = policy.update(policy.init(), torch.tensor(False), amax=torch.tensor(1.0 * 2**10))
        >>> float(state.scale)  # unscaled amax 1.0; headroom ~0.3 * ln(2000) = 2.3 powers of two
        8192.0
    """

    init_scale: float = 2.0**16
    target_interval: int = 20_000
    history: int = 32
    tail_history: int = 500
    margin: int = 0
    backoff_factor: float = 0.5
    learn_margin: bool = True
    forget_interval: int = 1000
    fault_gap: int = 8
    dtype: torch.dtype = torch.float16
    min_scale: float = SMALLEST_NORMAL_FLOAT32
    max_scale: float = FLOAT32_MAX
    cuda_graph: bool = True

    observes_amax: ClassVar[bool] = True  # the pipeline passes amax= to update()
    observes_loss_finite: ClassVar[bool] = True  # the pipeline may pass loss_finite= (isfinite(loss), ANDed)

    def __post_init__(self) -> None:
        call = type(self).__name__
        validate_scale_bounds(call, self.min_scale, self.max_scale, self.init_scale)
        validate_int_at_least(call, "target_interval", self.target_interval, 10)
        for name in ("history", "tail_history", "forget_interval", "fault_gap"):
            validate_int_at_least(call, name, getattr(self, name), 1)
        validate_int_at_least(call, "margin", self.margin, 0)
        validate_choice(call, "learn_margin", self.learn_margin, (True, False))
        validate_choice(call, "cuda_graph", self.cuda_graph, (True, False))
        b = self.backoff_factor
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (0.0 < b < 1.0):
            raise ValueError(f"{call}(backoff_factor={b!r}): backoff_factor must be in (0, 1); got {b!r}.")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(
                f"{call}(dtype={self.dtype!r}): dtype must be a floating-point torch.dtype such as "
                f"torch.float16; got {self.dtype!r}."
            )
        if _pow2_floor(self.max_scale) < self.min_scale:
            raise ValueError(
                f"{call}(min_scale={self.min_scale!r}, max_scale={self.max_scale!r}): no power of two "
                f"lies in [min_scale, max_scale]."
            )

    @property
    def limit(self) -> float:
        """The largest finite value of ``dtype``: a scaled gradient at or above it has overflowed."""
        return float(torch.finfo(self.dtype).max)

    def init(self, device: torch.device | str | None = None) -> PredictiveState:
        """A fresh state on ``device``: the initial scale (as a power of two) and no observation."""

        def zero(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros((), dtype=dtype, device=device)

        start = min(max(_pow2_floor(self.init_scale), self._floor_pow2()), self._cap_pow2())
        return PredictiveState(
            scale=torch.full((), start, dtype=torch.float32, device=device),
            level=zero(torch.float32),
            threshold=zero(torch.float32),
            excess=zero(torch.float32),
            observed=zero(torch.int32),
            extra=zero(torch.float32),
            clean_run=zero(torch.int32),
        )

    def _cap_pow2(self) -> float:
        return _pow2_floor(self.max_scale)

    def _floor_pow2(self) -> float:
        low = _pow2_floor(self.min_scale)
        return low if low >= self.min_scale else low * 2

    def update(
        self,
        state: PredictiveState,
        found_inf: torch.Tensor,
        amax: torch.Tensor | None = None,
        *,
        loss_finite: torch.Tensor | None = None,
    ) -> PredictiveState:
        """The next state from this step's found_inf, amax and (None: unknown) loss finiteness. No host read.

        Args:
            state: The current state (not changed: a new record is returned).
            found_inf: A tensor on any device, 0-d (or one value per state of a batch): a bool flag, or a count of
                overflows of any dtype (torch's scaler passes its float32 count, the core its 0/1 float32 flag);
                nonzero means the step overflowed.
            amax: The step's largest scaled-gradient magnitude (None: no observation).
            loss_finite: Whether every loss of the step was finite (0-d bool; None: unknown).
        """
        device = state.scale.device
        bad = found_flag(found_inf, device, torch.bool)
        amax = torch.zeros((), device=device) if amax is None else amax.to(device, torch.float32)
        fault = bad & self._is_fault(state, amax, loss_finite)
        evidence = bad & ~fault
        observed = self._observe(state, ~bad & (amax > 0) & (amax < math.inf), amax)  # NaN fails both
        extra = (state.extra - 1.0 / self.forget_interval).clamp_min(0.0)
        if self.learn_margin:  # a miss of the forecast (none exists before the first observation)
            extra = extra + (evidence & (state.observed > 0)).float()
        forecast = self._forecast(observed, extra)
        blind = state.scale * 2.0**-BLIND_BACKOFF_POWERS
        backed_off = torch.where(
            observed.observed > 0, torch.minimum(forecast, state.scale * self.backoff_factor), blind
        )
        new = torch.where(evidence, backed_off, torch.where(observed.observed > 0, forecast, state.scale))
        new = torch.where(fault, state.scale, new)
        new = torch.exp2(torch.floor(torch.log2(new))).clamp(self._floor_pow2(), self._cap_pow2())
        run = torch.where(bad, 0, (state.clean_run + 1).clamp_max(2**30))
        return PredictiveState(
            new.float(),
            observed.level,
            observed.threshold,
            observed.excess,
            observed.observed,
            extra.float(),
            run.to(torch.int32),
        )

    def _is_fault(self, state: PredictiveState, amax: torch.Tensor, loss_finite: torch.Tensor | None) -> torch.Tensor:
        """An overflow that says nothing about the scale (see the rule's ``fault``)."""
        far_below = (amax < self.limit * 2.0**-self.fault_gap) & (state.clean_run > 0)  # inf and NaN fail "<"
        if loss_finite is None:
            return far_below
        return far_below | ~loss_finite.to(device=state.scale.device, dtype=torch.bool, non_blocking=True)

    def _observe(self, state: PredictiveState, valid: torch.Tensor, amax: torch.Tensor) -> PredictiveState:
        """Level, threshold, excess and count after one (possibly absent) observation of log2 amax."""
        x = torch.log2(torch.where(valid, amax, 1.0)) - torch.log2(state.scale)
        first = valid & (state.observed == 0)
        r = x - state.level
        later = valid & ~first
        level = torch.where(first, x, torch.where(later, state.level + r / self.history, state.level))
        over = (r - state.threshold).clamp_min(0.0)
        excess = torch.where(later, state.excess + (over - state.excess) / self.tail_history, state.excess)
        step = THRESHOLD_RATE * ((r > state.threshold).float() - TAIL_SHARE)
        threshold = torch.where(later, state.threshold + step, state.threshold)
        count = (state.observed + valid.to(torch.int32)).clamp_max(2**30)
        return PredictiveState(
            state.scale, level.float(), threshold.float(), excess.float(), count, state.extra, state.clean_run
        )

    def _forecast(self, observed: PredictiveState, extra: torch.Tensor) -> torch.Tensor:
        """The largest power of two whose forecast overflow rate is about 1 / target_interval."""
        count = observed.observed.float()
        weight = count / (count + PRIOR_STEPS)
        width = weight * observed.excess / TAIL_SHARE + (1.0 - weight) * PRIOR_WIDTH
        headroom = observed.threshold + width * math.log(TAIL_SHARE * self.target_interval) + extra + self.margin
        exponent = torch.floor(math.log2(self.limit) - observed.level - headroom)
        return torch.exp2(exponent.clamp(-126.0, 127.0))

    def enforce_floor(self, state: PredictiveState) -> None:
        """A predictive scale keeps skipping at its floor; it never raises."""
