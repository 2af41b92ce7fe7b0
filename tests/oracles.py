"""Pure-Python references of the loss-scale rules, written from their specifications, not from the code.

``DynamicOracle`` (every knob of DynamicScale, hence every preset), ``TorchOracle`` (torch.amp.GradScaler's
documented rule) and ``PredictiveOracle`` (PredictiveScale). Floats are Python doubles rounded to float32 where
the real implementations store float32.
"""

from __future__ import annotations

import math
import struct

FLOAT32_MAX = 3.4028234663852886e38
SMALLEST_NORMAL = 2.0**-126


def f32(x: float) -> float:
    """Round a double to the nearest float32 (inf where it overflows), as a float32 store does."""
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


class DynamicOracle:
    """The DynamicScale rule, one overflow flag at a time.

    ``arithmetic="float32"`` rounds the factor to float32 before the operation; a product or quotient of
    two float32 values taken in double and rounded once equals the float32 operation (53 >= 2*24 + 2).
    """

    def __init__(
        self,
        init_scale=2.0**16,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2000,
        hysteresis=1,
        hysteresis_mode="consecutive",
        refill_after_backoff=True,
        min_scale=SMALLEST_NORMAL,
        max_scale=FLOAT32_MAX,
        at_floor="skip",
        arithmetic="float64",
        backoff_divisor=None,
        growth_guard="result",
        growth_delay=0,
    ):
        self.scale = f32(init_scale)
        self.growth_factor, self.backoff_factor, self.divisor = growth_factor, backoff_factor, backoff_divisor
        self.interval, self.H = growth_interval, hysteresis
        self.mode, self.refill_after_backoff = hysteresis_mode, refill_after_backoff
        self.min, self.max = min_scale, max_scale
        self.f32_ops, self.guard, self.delay = arithmetic == "float32", growth_guard, growth_delay
        self.raise_at_floor = at_floor == "raise"
        self.tracker, self.left, self.floor_hits = -growth_delay, hysteresis, 0

    def _factor(self, x):
        return f32(x) if self.f32_ops else x

    def step(self, overflow: bool) -> float:
        if overflow:
            if self.left - 1 <= 0 and self.scale <= self.min and self.raise_at_floor:
                self.floor_hits += 1  # this step raises: nothing else changes
                return self.scale
            self.tracker = -self.delay
            self.left -= 1
            if self.left <= 0:
                if self.scale <= self.min:
                    self.floor_hits += 1
                if self.divisor is None:
                    shrunk = f32(self.scale * self._factor(self.backoff_factor))
                else:
                    shrunk = f32(self.scale / self._factor(self.divisor))
                self.scale = max(shrunk, self.min)
                self.left = self.H if self.refill_after_backoff else 0
        else:
            self.floor_hits = 0
            self.tracker += 1
            if self.mode == "consecutive":
                self.left = self.H
            if self.tracker == self.interval:
                self.tracker = 0
                self.left = self.H
                grown = f32(self.scale * self._factor(self.growth_factor))
                if self.guard == "result":
                    ok = grown <= self.max
                else:
                    ok = self.scale < f32(self.max / self.growth_factor) and grown <= FLOAT32_MAX
                if ok:
                    self.scale = grown
        return self.scale


class TorchOracle:
    """torch.amp.GradScaler's documented rule (no floor; growth refused only if the result is inf)."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale, self.g = f32(init_scale), 0
        self.gf, self.bf, self.interval = growth_factor, backoff_factor, growth_interval

    def step(self, overflow: bool) -> float:
        if overflow:
            self.scale = f32(self.scale * self.bf)
            self.g = 0
        else:
            self.g += 1
            if self.g == self.interval:
                grown = f32(self.scale * self.gf)
                if math.isfinite(grown):
                    self.scale = grown
                self.g = 0
        return self.scale


class PredictiveOracle:
    """PredictiveScale's documented rule in plain Python floats (float64; the policy keeps float32).

    ``tie`` says the last step's residual equalled the threshold (float32 and float64 may take different
    branches there); ``pre`` is log2 of the last forecast before the floor (a value near an integer may round
    either way)."""

    def __init__(self, policy):
        self.p = policy
        self.limit = float(policy.limit)
        self.scale = 2.0 ** math.floor(math.log2(policy.init_scale))
        self.level = self.threshold = self.excess = self.extra = 0.0
        self.observed = self.run = 0
        self.pre = None
        self.tie = False

    def step(self, overflow: bool, amax: float, loss_finite: bool | None = None) -> float:
        p = self.p
        fault = overflow and (
            loss_finite is False or (math.isfinite(amax) and amax < self.limit * 2.0**-p.fault_gap and self.run > 0)
        )
        evidence = overflow and not fault
        missed = evidence and self.observed > 0
        if not overflow and math.isfinite(amax) and amax > 0:
            x = math.log2(amax) - math.log2(self.scale)
            if self.observed == 0:
                self.level = x
            else:
                r = x - self.level
                self.tie = abs(r - self.threshold) < 1e-5
                self.level += r / p.history
                self.excess += (max(r - self.threshold, 0.0) - self.excess) / p.tail_history
                self.threshold += 0.05 * ((1.0 if r > self.threshold else 0.0) - 0.1)
            self.observed += 1
        self.extra = max(self.extra - 1.0 / p.forget_interval, 0.0) + (1.0 if missed and p.learn_margin else 0.0)
        w = self.observed / (self.observed + 50)
        width = w * self.excess / 0.1 + (1 - w) * 0.3
        self.pre = (
            math.log2(self.limit)
            - self.level
            - (self.threshold + width * math.log(0.1 * p.target_interval) + self.extra + p.margin)
        )
        forecast = 2.0 ** min(max(math.floor(self.pre), -126), 127)
        if fault:
            new = self.scale
        elif evidence:
            new = min(forecast, self.scale * p.backoff_factor) if self.observed else self.scale * 2.0**-8
        else:
            new = forecast if self.observed else self.scale
        self.scale = 2.0 ** math.floor(math.log2(new))
        self.run = 0 if overflow else self.run + 1
        return self.scale

    def near_a_tie(self) -> bool:
        """Whether float32 and float64 may disagree about the last step."""
        return self.tie or (self.pre is not None and abs(self.pre - round(self.pre)) < 1e-3)
