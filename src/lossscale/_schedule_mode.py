"""The mode string of a :class:`~lossscale.PrecisionSchedule`: ``'type|trigger|ratio'``, parsed and checked."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Literal

import torch

__all__ = ["ALLOWED", "LOW_DTYPES", "RATIOS", "Trigger", "parse_mode"]

Trigger = Literal["step", "loss"]

LOW_DTYPES: dict[str, torch.dtype] = {"fast": torch.float16, "fast1": torch.bfloat16}
RATIOS: dict[str, tuple[str, str, str]] = {"step": ("0.2", "0.9", "0.9"), "loss": ("1.01", "1.5", "1.05")}
ALLOWED = ("mode is 'type|trigger|ratio' with type 'fast' (float16) or 'fast1' (bfloat16), trigger 'step' "
           "(ratio in [0.2, 0.9], default 0.9; needs total_steps) or 'loss' (ratio in [1.01, 1.5], default 1.05; "
           "needs target_loss), e.g. 'fast|step|0.9' or 'fast1|loss|1.05'")
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")


def parse_mode(call: str, mode: Any) -> tuple[torch.dtype, Trigger, Fraction]:
    """``'fast|step|0.9'`` -> ``(torch.float16, 'step', Fraction(9, 10))``; a ValueError naming the allowed values.

    The ratio is kept as an exact decimal, so ``10 * 0.3`` is 3, not 3.0000000000000004.
    """
    if not isinstance(mode, str):
        raise TypeError(f"{call}: mode must be a str; {ALLOWED}; got {type(mode).__name__} {mode!r}.")

    def bad(problem: str) -> ValueError:
        return ValueError(f"{call}: {ALLOWED}; got {problem}.")

    fields = mode.split("|")
    if len(fields) not in (2, 3):
        raise bad(f"{len(fields)} field{'s' if len(fields) != 1 else ''} in {mode!r}")
    if "" in fields:
        raise bad(f"an empty field in {mode!r}")
    kind, trigger = fields[0], fields[1]
    if kind not in LOW_DTYPES:
        raise bad(f"type {kind!r}")
    if trigger not in RATIOS:
        raise bad(f"trigger {trigger!r}")
    low, high, default = RATIOS[trigger]
    text = fields[2] if len(fields) == 3 else default
    if not _DECIMAL.fullmatch(text):
        raise bad(f"ratio {text!r}, which is not a plain decimal number")
    ratio = Fraction(text)
    if not Fraction(low) <= ratio <= Fraction(high):
        raise bad(f"ratio {text} for trigger {trigger!r}, outside [{low}, {high}]")
    return LOW_DTYPES[kind], trigger, ratio  # type: ignore[return-value]
