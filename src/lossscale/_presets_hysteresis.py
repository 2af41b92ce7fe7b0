"""The presets of the peers whose rule has hysteresis: DeepSpeed and Megatron (see :mod:`lossscale.presets`)."""

from __future__ import annotations

from lossscale._validate import (
    check_choice,
    check_factor_above_one,
    check_int_at_least,
)
from lossscale.policy import DynamicScale
from lossscale._preset_args import _fraction, _scale

__all__ = ["deepspeed", "megatron"]


def deepspeed(init_scale: float = 2.0**16, scale_factor: float = 2.0, scale_window: int = 1000,
              min_scale: float = 1.0, delayed_shift: int = 2, consecutive_hysteresis: bool = False,
              raise_error_at_min_scale: bool = True) -> DynamicScale:
    """DeepSpeed's ZeRO ``DynamicLossScaler`` (``initial_scale_power`` 16, window 1000, hysteresis 2).

    Rule (Python floats; ``cur_iter`` starts at 0, ``last_overflow_iter`` at -1, ``h = delayed_shift``)::

        overflow: if delayed_shift == 1 or h == 1:
                      raise if S == min_scale and raise_error_at_min_scale
                      S = max(S / scale_factor, min_scale)
                  else: h -= 1
                  last_overflow_iter = cur_iter
        clean:    if consecutive_hysteresis: h = delayed_shift
                  stable = cur_iter - last_overflow_iter - 1
                  if stable > 0 and stable % W == 0:
                      if not consecutive_hysteresis: h = delayed_shift
                      S *= scale_factor
        cur_iter += 1

    so the first growth after the start or an overflow comes on the (W+1)-th clean step and later ones
    every W (``growth_delay=1``; DeepSpeed before ``stable_interval`` grew on the W-th). ``h`` is not
    refilled by a backoff, so once it reaches 1 every overflow backs off until a growth (or, with
    ``consecutive_hysteresis``, a clean step) refills it. Raising at the floor is ``at_floor="raise"``:
    the optimizers raise :class:`~lossscale.FloorError`, and the raising step changes no state, as in
    DeepSpeed. DeepSpeed 0.19 fixes ``scale_factor`` at 2; other values follow the same rule.
    Deviation: DeepSpeed's float64 scale has no cap; ours refuses growth past float32's range.

    Example:
        >>> from lossscale import presets
        >>> p = presets.deepspeed()
        >>> (p.hysteresis, p.hysteresis_mode, p.refill_after_backoff, p.at_floor)
        (2, 'cumulative', False, 'raise')
    """
    call = "presets.deepspeed"
    _scale(call, "min_scale", min_scale)
    _scale(call, "init_scale", init_scale, floor=min_scale)
    check_factor_above_one(call, "scale_factor", scale_factor, "the scale is multiplied and divided by it")
    check_int_at_least(call, "scale_window", scale_window, 1)
    check_int_at_least(call, "delayed_shift", delayed_shift, 1)
    check_choice(call, "consecutive_hysteresis", consecutive_hysteresis, (True, False))
    check_choice(call, "raise_error_at_min_scale", raise_error_at_min_scale, (True, False))
    return DynamicScale(init_scale=init_scale, growth_factor=scale_factor, backoff_divisor=scale_factor,
                        growth_interval=scale_window, hysteresis=delayed_shift,
                        hysteresis_mode="consecutive" if consecutive_hysteresis else "cumulative",
                        refill_after_backoff=False, min_scale=min_scale, growth_delay=1,
                        at_floor="raise" if raise_error_at_min_scale else "skip")


def megatron(initial_scale: float = 2.0**32, min_scale: float = 1.0, growth_factor: float = 2.0,
             backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2) -> DynamicScale:
    """Megatron-core ``DynamicGradScaler`` (defaults of its optimizer config).

    Rule (float32 tensors)::

        overflow: growth_tracker = 0; h -= 1
                  if h <= 0: S = max(S * backoff_factor, min_scale)     # h is not refilled
        clean:    growth_tracker += 1
                  if growth_tracker == growth_interval:
                      growth_tracker = 0; h = hysteresis; S = S * growth_factor

    Deviation: Megatron grows into float32 inf; ours refuses that growth.

    Example:
        >>> from lossscale import presets
        >>> presets.megatron().hysteresis_mode
        'cumulative'
    """
    call = "presets.megatron"
    _scale(call, "min_scale", min_scale)
    _scale(call, "initial_scale", initial_scale, floor=min_scale)
    check_factor_above_one(call, "growth_factor", growth_factor, "it multiplies the scale on growth")
    _fraction(call, "backoff_factor", backoff_factor, "it multiplies the scale on a backoff")
    check_int_at_least(call, "growth_interval", growth_interval, 1)
    check_int_at_least(call, "hysteresis", hysteresis, 1)
    return DynamicScale(init_scale=initial_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                        growth_interval=growth_interval, hysteresis=hysteresis, hysteresis_mode="cumulative",
                        refill_after_backoff=False, min_scale=min_scale, arithmetic="float32")
