"""The base optimizer keyword arguments of the Keras facade: Keras's defaults, checked with Keras's rules."""

from __future__ import annotations

import math
from typing import Any

from lossscale._validate import ArgumentTypeError, check_choice, check_int_at_least
from lossscale.ema import EMA

__all__ = ["BASE_KWARGS", "KerasEMA", "validated"]

#: The base optimizer keyword arguments this facade accepts, with Keras's defaults.
BASE_KWARGS: dict[str, Any] = {
    "weight_decay": None,
    "clipnorm": None,
    "clipvalue": None,
    "global_clipnorm": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
    "name": None,
}

_CALL = "LossScaleOptimizer"


def _optional_positive(name: str, value: Any, low: float = 0.0, inclusive: bool = False) -> None:
    if value is None:
        return
    rule = f">= {low:g}" if inclusive else f"> {low:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{_CALL}({name}={value!r}): {name} must be None or a finite number {rule}; got "
                                f"{type(value).__name__}.")
    if not math.isfinite(value) or value < low or (value == low and not inclusive):
        raise ValueError(f"{_CALL}({name}={value!r}): {name} must be None or a finite number {rule}; got {value!r}.")


def validated(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``BASE_KWARGS`` updated with ``kwargs``, each checked (None, R's NULL, means Keras's default)."""
    unknown = sorted(set(kwargs) - set(BASE_KWARGS))
    if unknown:
        raise TypeError(f"{_CALL}({', '.join(f'{k}={kwargs[k]!r}' for k in unknown)}): unexpected keyword argument(s) "
                        f"{', '.join(unknown)}; the base optimizer arguments are {', '.join(BASE_KWARGS)}.")
    args = {**BASE_KWARGS, **kwargs}
    for name in ("clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor"):
        _optional_positive(name, args[name])
    _optional_positive("weight_decay", args["weight_decay"], inclusive=True)
    clips = [n for n in ("clipnorm", "clipvalue", "global_clipnorm") if args[n] is not None]
    if len(clips) > 1:
        raise ValueError(f"{_CALL}({', '.join(f'{n}={args[n]!r}' for n in clips)}): only one of clipnorm, clipvalue "
                         f"and global_clipnorm can be set; got {len(clips)}.")
    for name in ("use_ema", "ema_momentum"):  # R's NULL (None) means Keras's default
        if args[name] is None:
            args[name] = BASE_KWARGS[name]
    check_choice(_CALL, "use_ema", args["use_ema"], (True, False))
    m = args["ema_momentum"]
    rule = f"{_CALL}(ema_momentum={m!r}): ema_momentum must be None or a number in [0, 1]"
    if isinstance(m, bool) or not isinstance(m, (int, float)):
        raise TypeError(f"{rule}; got {type(m).__name__}.")
    if not 0.0 <= m <= 1.0:
        raise ValueError(f"{rule}; got {m!r}.")
    if args["name"] is not None and not isinstance(args["name"], str):
        raise TypeError(f"{_CALL}(name={args['name']!r}): name must be a str or None; got "
                        f"{type(args['name']).__name__}.")
    if args["ema_overwrite_frequency"] is not None:
        check_int_at_least(_CALL, "ema_overwrite_frequency", args["ema_overwrite_frequency"], 1)
    if args["gradient_accumulation_steps"] is not None:
        check_int_at_least(_CALL, "gradient_accumulation_steps", args["gradient_accumulation_steps"], 2)
    return args


class KerasEMA(EMA):
    """Keras's average with its momentum range [0, 1]: 1 keeps the average at the first applied step's
    weights (the facade copies them there); the core :class:`~lossscale.EMA` takes [0, 1)."""

    def __init__(self, momentum: float) -> None:
        super().__init__(0.0)
        self.momentum = float(momentum)
