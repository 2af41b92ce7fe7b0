"""Pure-Python references of the loss-scale rules, written from their specifications, not from the code.

Floats are Python doubles rounded to float32 where the real implementations store float32.
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
    """The DynamicScale rule, one overflow flag at a time."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 hysteresis=1, hysteresis_mode="consecutive", refill_after_backoff=True,
                 min_scale=SMALLEST_NORMAL, max_scale=FLOAT32_MAX):
        self.scale = f32(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.interval, self.H = growth_interval, hysteresis
        self.mode, self.refill_after_backoff = hysteresis_mode, refill_after_backoff
        self.min, self.max = min_scale, max_scale
        self.tracker, self.left, self.floor_hits = 0, hysteresis, 0

    def step(self, overflow: bool) -> float:
        if overflow:
            self.tracker = 0
            self.left -= 1
            if self.left <= 0:
                if self.scale <= self.min:
                    self.floor_hits += 1
                self.scale = max(f32(self.scale * self.backoff_factor), self.min)
                self.left = self.H if self.refill_after_backoff else 0
        else:
            self.floor_hits = 0
            self.tracker += 1
            if self.mode == "consecutive":
                self.left = self.H
            if self.tracker == self.interval:
                self.tracker = 0
                self.left = self.H
                grown = f32(self.scale * self.growth_factor)
                if grown <= self.max:
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
