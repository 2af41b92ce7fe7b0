"""What several facades share: argument checks (each error echoes the call, states the rule, shows the value),
:class:`LossScaleHolder` and :class:`OptimizerHolder`."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal, overload

import torch

from lossscale.optimizer import LossScaleOptimizer
from lossscale.policies.base import Policy, ScaleState
from lossscale.state import LossScale
from lossscale.validation import ArgumentTypeError, validate_int_in_range, validated_state_dict

#: The largest saved step counter a facade loads (exact in int64).
COUNTER_MAX = 2**62


def validated_counters(call: str, state_dict: object, keys: Iterable[str], counters: Iterable[str]) -> dict[str, Any]:
    """``state_dict`` if it is a dict holding ``keys`` and each of ``counters`` is an int (not a bool) in
    [0, 2**62]; else a TypeError or ValueError, before anything is loaded."""
    checked = validated_state_dict(call, state_dict, keys)
    for name in counters:
        validate_int_in_range(call, f"state_dict[{name!r}]", checked[name], 0, COUNTER_MAX)
    return checked


def validate_optional_number(call: str, name: str, value: object, low: float = 0.0, inclusive: bool = False) -> None:
    """None, or a finite number > ``low`` (>= with ``inclusive``)."""
    if value is None:
        return
    rule = f">= {low:g}" if inclusive else f"> {low:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(
            f"{call}({name}={value!r}): {name} must be None or a finite number {rule}; got {type(value).__name__}."
        )
    if not math.isfinite(value) or value < low or (value == low and not inclusive):
        raise ValueError(f"{call}({name}={value!r}): {name} must be None or a finite number {rule}; got {value!r}.")


@overload
def validated_tensors(call: str, name: str, value: object, *, none_items: Literal[False]) -> list[torch.Tensor]: ...
@overload
def validated_tensors(
    call: str, name: str, value: object, *, none_items: Literal[True]
) -> list[torch.Tensor | None]: ...
def validated_tensors(call: str, name: str, value: object, *, none_items: bool) -> list[Any]:
    """``value`` as a list of tensors (and None where ``none_items``), else a TypeError naming ``name``."""
    if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Iterable):
        raise TypeError(f"{call}({name}={value!r}): {name} must be a list of tensors; got {type(value).__name__}.")
    out = list(value)
    for i, item in enumerate(out):
        if not isinstance(item, torch.Tensor) and not (none_items and item is None):
            shown = repr(value) if len(repr(value)) <= 80 else "..."
            raise TypeError(
                f"{call}({name}={shown}): {name}[{i}] must be a tensor{' or None' if none_items else ''}"
                f"; got {item!r} ({type(item).__name__})."
            )
    return out


class LossScaleHolder:
    """A :class:`~lossscale.LossScale` of ``policy`` (``self.loss_scale``), saved as ``{"policy_state": ...}``."""

    def __init__(self, policy: Policy[ScaleState]) -> None:
        self.loss_scale = LossScale(policy)

    @property
    def policy(self) -> Policy[ScaleState]:
        """The rule (frozen)."""
        return self.loss_scale.policy

    @property
    def scale_state(self) -> ScaleState:
        """The whole state record (scale and counters)."""
        return self.loss_scale.state

    def state_dict(self) -> dict[str, Any]:
        """The scale and counters as plain numbers (reads them on the host)."""
        return {"policy_state": self.loss_scale.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the whole dict is checked before anything changes."""
        call = f"{type(self).__name__}.load_state_dict"
        validated_state_dict(call, state_dict, ("policy_state",))
        self.loss_scale.load_state_dict(state_dict["policy_state"], call=call)


class OptimizerHolder:
    """A facade around a core :class:`~lossscale.LossScaleOptimizer` (``self._opt``): saved with ``state_dict``,
    never pickled."""

    #: What the pickling error calls an instance.
    instance_name = "opt"

    def __init__(self, opt: LossScaleOptimizer) -> None:
        self._opt = opt

    @property
    def scale_state(self) -> ScaleState:
        """The whole state record (scale and counters)."""
        return self._opt.scale_state

    def state_dict(self) -> dict[str, Any]:
        """The core optimizer's state (see :meth:`lossscale.LossScaleOptimizer.state_dict`)."""
        return self._opt.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self._opt.load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, object]:
        raise TypeError(
            f"{type(self).__name__} is not pickled directly; save {self.instance_name}.state_dict() with torch.save."
        )
