"""Every peer's loss-scale rule as a core policy, under the peer's own argument names and defaults.

Each returns a :class:`~lossscale.DynamicScale` whose scale trajectory equals the peer's, step for step
(``tests/golden``), with the arguments checked under the peer's names (``call``: the name errors give)::

    scaler = lossscale.GradScaler(policy=lossscale.presets.deepspeed())

How the peers differ (W = window, n = bad steps per backoff):

=============  ==========================  =====================  ==============  ===========  ============
preset         grows on                    bad steps counted      backoff         floor        at the cap
=============  ==========================  =====================  ==============  ===========  ============
torch_amp      W-th clean step             every one              S * b (f64)     none (*)     refused
keras          W-th clean step             every one              S / 2           none (*)     inf (*)
tf_keras2      W-th clean step             every one              S / 2           1            refused
tf_v1          W-th clean step             every one              S / m (f32)     1            refused
mindspore      W-th clean step             every one              S * f32(1/f)    1            inf (*)
nnabla         (N+2)-th, then every N+1    every attempt, retry   S / f (f64)     none (*)     none (*)
deepspeed      (W+1)-th, then every W      delayed_shift, no      S / f (f64)     min_scale,   none (*)
                                           refill after backoff                   may raise
megatron       W-th clean step             hysteresis,            S * b (f32)     min_scale    inf (*)
                                           cumulative, no refill
paddle         W-th clean step             n consecutive          S * b (f32)     none (*)     inf (*)
ascend         W-th clean step             n cumulative (a clean  S * d (f32)     1            refused when
                                           step keeps the count)                               S >= 3.4e38/r
=============  ==========================  =====================  ==============  ===========  ============

(*) Where a peer breaks, ours matches every decision up to that point and then stays finite and normal: a
growth into inf (or past float32's range) is refused, a backoff into subnormals stops at the floor 2**-126.
Peers that keep the scale in Python float64 (nnabla, DeepSpeed, MindSpore's manager) are matched exactly
for power-of-two factors; with other factors ours rounds to float32 at every step.
"""

from __future__ import annotations

from typing import Any

from lossscale.policies.dynamic import DynamicScale, validate_dynamic_args
from lossscale.validation import validate_choice, validate_factor_above_one, validate_int_at_least

__all__ = [
    "torch_amp",
    "keras",
    "tf_keras2",
    "tf_v1",
    "mindspore",
    "nnabla",
    "deepspeed",
    "megatron",
    "paddle",
    "ascend",
    "PRESETS",
]

#: Ascend's growth test: the scale grows only while ``S < ASCEND_LIMIT / incr_ratio``.
ASCEND_LIMIT = 3.4e38


def _dynamic(call: str, names: dict[str, str], **fields: Any) -> DynamicScale:
    """``DynamicScale(**fields)``, checked first under the peer's names (``names``: field -> peer's argument)."""
    validate_dynamic_args(call, fields, names)
    return DynamicScale(**fields)


def torch_amp(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    *,
    call: str = "presets.torch_amp",
) -> DynamicScale:
    """``torch.amp.GradScaler``: grow on the ``growth_interval``-th clean step, ``S * backoff`` in float64.

    Rule: overflow -> ``S *= backoff_factor``, count = 0; clean -> count += 1, and at
    ``growth_interval``: ``S *= growth_factor`` unless that is inf, count = 0.

    Args:
        init_scale: The first scale, default 2**16; a number in [2**-126, float32's largest finite value].
        growth_factor: > 1, default 2.0; multiplies the scale at the ``growth_interval``-th clean step in a row.
        backoff_factor: In (0, 1), default 0.5; multiplies the scale at every overflowing step.
        growth_interval: An int >= 1, default 2000; the clean steps in a row between growths.
        call: The name errors use for this call (default ``"presets.torch_amp"``; a facade passes its own class name).

    Example:
        >>> from lossscale import presets
        >>> presets.torch_amp().growth_interval
        2000
    """
    return _dynamic(
        call,
        {},
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )


def keras(
    initial_scale: float = 2.0**15, dynamic_growth_steps: int = 2000, *, call: str = "presets.keras"
) -> DynamicScale:
    """Keras 3 ``LossScaleOptimizer``: factor 2, no floor, no cap.

    Rule: overflow -> ``S = S / 2``, count = 0; clean -> if count == W - 1: ``S = S * 2``, count = 0,
    else count += 1 (float32 ops).

    Args:
        initial_scale: The first scale, default 2**15; a number in [2**-126, float32's largest finite value].
        dynamic_growth_steps: Keras's W, an int >= 1, default 2000: the scale doubles at the W-th clean step in a
            row.
        call: The name errors use for this call (default ``"presets.keras"``; a facade passes its own class name).

    Example:
        >>> from lossscale import presets
        >>> presets.keras(dynamic_growth_steps=3).growth_interval
        3
    """
    return _dynamic(
        call,
        {"init_scale": "initial_scale", "growth_interval": "dynamic_growth_steps"},
        init_scale=initial_scale,
        growth_factor=2.0,
        backoff_divisor=2.0,
        growth_interval=dynamic_growth_steps,
        arithmetic="float32",
    )


def tf_keras2(
    initial_scale: float = 2.0**15, dynamic_growth_steps: int = 2000, *, call: str = "presets.tf_keras2"
) -> DynamicScale:
    """Keras 2 (``tf_keras`` / TF <= 2.15) ``mixed_precision.LossScaleOptimizer``: floor 1, no inf.

    Rule: overflow -> ``S = max(S / 2, 1)``, count = 0; clean -> count + 1 >= W: ``S * 2`` if finite
    (else unchanged), count = 0; else count += 1 (float32 ops).

    Args:
        initial_scale: The first scale, default 2**15; a number in [1 (the floor), float32's largest finite value].
        dynamic_growth_steps: W, an int >= 1, default 2000: the scale doubles at the W-th clean step in a row.
        call: The name errors use for this call (default ``"presets.tf_keras2"``; a facade passes its own class name).

    Example:
        >>> from lossscale import presets
        >>> presets.tf_keras2().min_scale
        1.0
    """
    return _dynamic(
        call,
        {"init_scale": "initial_scale", "growth_interval": "dynamic_growth_steps"},
        init_scale=initial_scale,
        growth_factor=2.0,
        backoff_divisor=2.0,
        growth_interval=dynamic_growth_steps,
        min_scale=1.0,
        arithmetic="float32",
    )


def tf_v1(
    initial_loss_scale: float = 2.0**15,
    increment_period: int = 2000,
    multiplier: float = 2.0,
    *,
    call: str = "presets.tf_v1",
) -> DynamicScale:
    """``tf.compat.v1.mixed_precision.DynamicLossScale`` (TF 2.x): divides by the multiplier, floor 1.

    Rule: overflow -> ``S = max(S / multiplier, 1)``, count = 0; clean -> count + 1 >= period:
    ``S * multiplier`` if finite, count = 0; else count += 1 (float32 ops).

    Args:
        initial_loss_scale: The first scale, default 2**15; a number in [1 (the floor), float32's largest finite
            value].
        increment_period: An int >= 1, default 2000: the scale grows at this many clean steps in a row.
        multiplier: > 1, default 2.0: a growth multiplies the scale by it, a backoff divides by it.
        call: The name errors use for this call (default ``"presets.tf_v1"``; a facade passes its own class name).

    Example:
        >>> from lossscale import presets
        >>> presets.tf_v1(multiplier=3.0).backoff_divisor
        3.0
    """
    names = {
        "init_scale": "initial_loss_scale",
        "growth_interval": "increment_period",
        "growth_factor": "multiplier",
        "backoff_divisor": "multiplier",
    }
    return _dynamic(
        call,
        names,
        init_scale=initial_loss_scale,
        growth_factor=multiplier,
        backoff_divisor=multiplier,
        growth_interval=increment_period,
        min_scale=1.0,
        arithmetic="float32",
    )


def mindspore(
    init_loss_scale: float = 2.0**24,
    scale_factor: float = 2,
    scale_window: int = 2000,
    *,
    call: str = "presets.mindspore",
) -> DynamicScale:
    """MindSpore ``nn.DynamicLossScaleUpdateCell`` (defaults of ``DynamicLossScaleManager``).

    Rule (float32 tensors; ``cur_iter`` starts at 1, ``last_overflow_iter`` at 0)::

        overflow: S = max(S * reciprocal(f), 1); last_overflow_iter = cur_iter
        clean:    if cur_iter - last_overflow_iter >= W: S = S * f; last_overflow_iter = cur_iter
        cur_iter += 1

    Args:
        init_loss_scale: The first scale, default 2**24; a number in [1 (the floor), float32's largest finite
            value].
        scale_factor: > 1, default 2: a growth multiplies the scale by it, a backoff by its reciprocal rounded to
            float32.
        scale_window: W, an int >= 1, default 2000: the scale grows at the W-th step after the last overflow or
            growth (the W-th clean step in a row).
        call: The name errors use for this call (default ``"presets.mindspore"``; a facade passes its own class name).

    Example:
        >>> from lossscale import presets
        >>> presets.mindspore(scale_factor=4).backoff_factor
        0.25
    """
    validate_factor_above_one(call, "scale_factor", scale_factor, "the scale is multiplied and divided by it")
    names = {"init_scale": "init_loss_scale", "growth_interval": "scale_window"}
    return _dynamic(
        call,
        names,
        init_scale=init_loss_scale,
        growth_factor=float(scale_factor),
        backoff_factor=1.0 / scale_factor,
        growth_interval=scale_window,
        min_scale=1.0,
        arithmetic="float32",
    )


def nnabla(
    scale: float = 8.0,
    scaling_factor: float = 2.0,
    N: int = 2000,  # noqa: N803  # nnabla names it N
    *,
    call: str = "presets.nnabla",
) -> DynamicScale:
    """nnabla ``DynamicLossScalingUpdater``, one forward/backward attempt per ``update``.

    Rule (Python floats; ``counter`` starts at 0)::

        overflow: S /= scaling_factor; counter = 0          (and the updater re-runs the step)
        clean:    if counter > N: S *= scaling_factor; counter = 0
                  counter += 1

    The re-run belongs to :class:`lossscale.compat.nnabla.DynamicLossScalingUpdater`.

    Args:
        scale: The first scale, default 8.0; a number in [2**-126, float32's largest finite value].
        scaling_factor: > 1, default 2.0: a growth multiplies the scale by it, a backoff divides by it.
        N: An int >= 0, default 2000: the scale grows at the (N+2)-th clean step after the start or an overflow,
            then every N+1 clean steps.
        call: The name errors use for this call (default ``"presets.nnabla"``; a facade passes its own class name).

    Example:
        >>> from lossscale import presets
        >>> p = presets.nnabla(N=3)
        >>> (p.growth_interval, p.growth_delay)
        (4, 1)
    """
    validate_int_at_least(call, "N", N, 0)  # N + 1 is the growth interval
    names = {"init_scale": "scale", "growth_factor": "scaling_factor", "backoff_divisor": "scaling_factor"}
    return _dynamic(
        call,
        names,
        init_scale=scale,
        growth_factor=scaling_factor,
        backoff_divisor=scaling_factor,
        growth_interval=N + 1,
        growth_delay=1,
    )


def deepspeed(
    init_scale: float = 2.0**16,
    scale_factor: float = 2.0,
    scale_window: int = 1000,
    min_scale: float = 1.0,
    delayed_shift: int = 2,
    consecutive_hysteresis: bool = False,
    raise_error_at_min_scale: bool = True,
    *,
    call: str = "presets.deepspeed",
) -> DynamicScale:
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

    Raising at the floor is ``at_floor="raise"`` (:class:`~lossscale.FloorError`; the raising step changes
    no state). DeepSpeed 0.19 fixes ``scale_factor`` at 2; other values follow the same rule.

    Args:
        init_scale: The first scale, default 2**16 (DeepSpeed's ``2**initial_scale_power``); at least
            ``min_scale``.
        scale_factor: > 1, default 2.0: a growth multiplies the scale by it, a backoff divides by it.
        scale_window: W, an int >= 1, default 1000: the scale grows at the (W+1)-th clean step after the start or
            an overflow, then every W clean steps.
        min_scale: The floor of the scale, default 1.0; a number >= 2**-126.
        delayed_shift: DeepSpeed's hysteresis, an int >= 1, default 2: the overflowing steps that make a backoff
            (1: every overflow backs off). A backoff does not refill the count; a growth does.
        consecutive_hysteresis: False (default): overflows count until a growth refills the count; True: a clean
            step refills it too, so only overflows in a row add up.
        raise_error_at_min_scale: True (default): an overflow that must back off while the scale is at
            ``min_scale`` raises :class:`~lossscale.FloorError` (DeepSpeed raises); False: the scale stays at the
            floor and such steps are skipped.
        call: The name errors use for this call (default ``"presets.deepspeed"``; a facade passes its own class name).

    Example:
        >>> from lossscale import presets
        >>> p = presets.deepspeed()
        >>> (p.hysteresis, p.hysteresis_mode, p.refill_after_backoff, p.at_floor)
        (2, 'cumulative', False, 'raise')
    """
    validate_choice(call, "consecutive_hysteresis", consecutive_hysteresis, (True, False))
    validate_choice(call, "raise_error_at_min_scale", raise_error_at_min_scale, (True, False))
    names = {
        "growth_factor": "scale_factor",
        "backoff_divisor": "scale_factor",
        "growth_interval": "scale_window",
        "hysteresis": "delayed_shift",
    }
    return _dynamic(
        call,
        names,
        init_scale=init_scale,
        growth_factor=scale_factor,
        backoff_divisor=scale_factor,
        growth_interval=scale_window,
        hysteresis=delayed_shift,
        hysteresis_mode="consecutive" if consecutive_hysteresis else "cumulative",
        refill_after_backoff=False,
        min_scale=min_scale,
        growth_delay=1,
        at_floor="raise" if raise_error_at_min_scale else "skip",
    )


def megatron(
    initial_scale: float = 2.0**32,
    min_scale: float = 1.0,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 1000,
    hysteresis: int = 2,
    *,
    call: str = "presets.megatron",
) -> DynamicScale:
    """Megatron-core ``DynamicGradScaler`` (defaults of its optimizer config).

    Rule (float32 tensors)::

        overflow: growth_tracker = 0; h -= 1
                  if h <= 0: S = max(S * backoff_factor, min_scale)     # h is not refilled
        clean:    growth_tracker += 1
                  if growth_tracker == growth_interval:
                      growth_tracker = 0; h = hysteresis; S = S * growth_factor

    Args:
        initial_scale: The first scale, default 2**32; at least ``min_scale``.
        min_scale: The floor of the scale, default 1.0; a number >= 2**-126.
        growth_factor: > 1, default 2.0; multiplies the scale at the ``growth_interval``-th clean step in a row.
        backoff_factor: In (0, 1), default 0.5; multiplies the scale at a backoff.
        growth_interval: An int >= 1, default 1000; the clean steps in a row between growths.
        hysteresis: An int >= 1, default 2: the overflowing steps that make a backoff; a backoff does not refill
            the count (only the ``growth_interval``-th clean step in a row does), so until then every further
            overflow backs off.
        call: The name errors use for this call (default ``"presets.megatron"``; a facade passes its own class name).

    Example:
        >>> from lossscale import presets
        >>> presets.megatron().hysteresis_mode
        'cumulative'
    """
    return _dynamic(
        call,
        {"init_scale": "initial_scale"},
        init_scale=initial_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        hysteresis_mode="cumulative",
        refill_after_backoff=False,
        min_scale=min_scale,
        arithmetic="float32",
    )


def paddle(
    init_loss_scaling: float = 2.0**16,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.5,
    incr_every_n_steps: int = 2000,
    decr_every_n_nan_or_inf: int = 1,
    *,
    call: str = "presets.paddle",
) -> DynamicScale:
    """PaddlePaddle's dygraph ``paddle.amp.GradScaler`` (Paddle 3.3).

    Rule (float32 tensors)::

        overflow: good = 0; bad += 1
                  if bad == decr_every_n_nan_or_inf: S = S * decr_ratio; bad = 0
        clean:    bad = 0; good += 1
                  if good == incr_every_n_steps: S = S * incr_ratio; good = 0

    Args:
        init_loss_scaling: The first scale, default 2**16; a number in [2**-126, float32's largest finite value].
        incr_ratio: > 1, default 2.0; multiplies the scale at the ``incr_every_n_steps``-th clean step in a row.
        decr_ratio: In (0, 1), default 0.5; multiplies the scale at a backoff.
        incr_every_n_steps: An int >= 1, default 2000; the clean steps in a row between growths.
        decr_every_n_nan_or_inf: An int >= 1, default 1; the overflowing steps in a row that make a backoff.
        call: The name errors use for this call (default ``"presets.paddle"``; a facade passes its own class name).

    Example:
        >>> from lossscale import presets
        >>> presets.paddle(decr_every_n_nan_or_inf=2).hysteresis
        2
    """
    names = {
        "init_scale": "init_loss_scaling",
        "growth_factor": "incr_ratio",
        "backoff_factor": "decr_ratio",
        "growth_interval": "incr_every_n_steps",
        "hysteresis": "decr_every_n_nan_or_inf",
    }
    return _dynamic(
        call,
        names,
        init_scale=init_loss_scaling,
        growth_factor=incr_ratio,
        backoff_factor=decr_ratio,
        growth_interval=incr_every_n_steps,
        hysteresis=decr_every_n_nan_or_inf,
        hysteresis_mode="consecutive",
        arithmetic="float32",
    )


def ascend(
    init_loss_scale: float,
    incr_every_n_steps: int,
    decr_every_n_nan_or_inf: int = 2,
    incr_ratio: float = 2,
    decr_ratio: float = 0.8,
    *,
    call: str = "presets.ascend",
) -> DynamicScale:
    """Ascend's ``ExponentialUpdateLossScaleManager`` (npu_bridge), TF1 contrib's manager reproduced.

    Rule (float32 variables; ``good`` and ``bad`` start at 0)::

        overflow: if bad + 1 >= decr_every_n_nan_or_inf: S = max(1, S * decr_ratio); good = bad = 0
                  else: bad += 1; good = 0                 # a clean step does not reset bad
        clean:    if good + 1 >= incr_every_n_steps:
                      if S < 3.4e38 / incr_ratio: S = S * incr_ratio   # TF1 contrib: if finite
                      good = bad = 0
                  else: good += 1

    The growth guard is read from Ascend's source and checked against the pure-Python oracle only.

    Args:
        init_loss_scale: The first scale (no default, as in Ascend); a finite number in [1, 3.4e38].
        incr_every_n_steps: An int >= 1 (no default); the clean steps in a row between growths.
        decr_every_n_nan_or_inf: An int >= 1, default 2: the overflowing steps that make a backoff, counted since
            the last backoff or growth (a clean step between them keeps the count).
        incr_ratio: > 1, default 2; multiplies the scale at a growth, which happens only while the scale is below
            ``3.4e38 / incr_ratio``.
        decr_ratio: In (0, 1), default 0.8; multiplies the scale at a backoff (the scale stays >= 1).
        call: The name errors use for this call (default ``"presets.ascend"``; a facade passes its own class name).

    Example:
        >>> from lossscale import presets
        >>> p = presets.ascend(2.0**32, 1000)
        >>> (p.hysteresis, p.hysteresis_mode, p.min_scale, p.arithmetic)
        (2, 'cumulative', 1.0, 'float32')
    """
    validate_factor_above_one(call, "incr_ratio", incr_ratio, "it multiplies the scale on growth")
    names = {
        "init_scale": "init_loss_scale",
        "growth_interval": "incr_every_n_steps",
        "hysteresis": "decr_every_n_nan_or_inf",
        "growth_factor": "incr_ratio",
        "backoff_factor": "decr_ratio",
    }
    return _dynamic(
        call,
        names,
        init_scale=init_loss_scale,
        growth_factor=float(incr_ratio),
        backoff_factor=decr_ratio,
        growth_interval=incr_every_n_steps,
        hysteresis=decr_every_n_nan_or_inf,
        hysteresis_mode="cumulative",
        min_scale=1.0,
        max_scale=ASCEND_LIMIT,
        growth_guard="operand",
        arithmetic="float32",
    )


#: Every preset by name (the peers of ``tests/golden``).
PRESETS = {
    f.__name__: f for f in (torch_amp, keras, tf_keras2, tf_v1, mindspore, nnabla, deepspeed, megatron, paddle, ascend)
}
