"""The state of a loss scale and its one owner.

:class:`ScaleState` is the record a :class:`~lossscale.DynamicScale` keeps (other policies keep records
of their own shape). :class:`LossScale` owns a policy's record: the scale, the counters and the window
position live there and nowhere else. Every front end and facade holds the same ``LossScale`` object
and reads and writes it through its methods, so a value set through one object is what every other
reader sees at once, and a framework proxy that copies attribute dictionaries still shares it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from lossscale._validate import INT32_MAX
from lossscale.scale_value import checked_scale

__all__ = ["ScaleState", "LossScale", "StateDictError", "checked_state_dict", "state_to_dict", "state_from_dict"]


class StateDictError(KeyError, ValueError):
    """A state dict that lacks what it must hold (or is another object's). A ValueError, and a KeyError
    for code that caught the missing key before; printed as its plain message."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ScaleState:
    """The mutable half of a dynamic policy, as 0-d tensors on one device.

    Attributes:
        scale: float32, the factor the loss is multiplied by.
        growth_tracker: int32, clean steps since the scale last changed or overflowed.
        hysteresis_left: int32, overflows still absorbed before the next backoff.
        floor_hits: int32, consecutive overflowing steps that found the scale already at its floor.
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_left: torch.Tensor
    floor_hits: torch.Tensor

    def to(self, device: torch.device | str) -> ScaleState:
        """The same state on ``device`` (a copy only where it moves)."""
        return move_state(self, device)


def checked_state_dict(call: str, state_dict: Any, keys: Any, hint: str = "") -> dict[str, Any]:
    """``state_dict`` if it is a dict holding ``keys`` (what the owner's ``state_dict()`` saves).

    Raises:
        TypeError: not a dict. StateDictError (a ValueError and a KeyError): a key is missing, e.g. another
        object's state dict; ``hint`` says where such a dict goes instead.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"{call}(state_dict={state_dict!r}): state_dict must be the dict that state_dict() "
                        f"returned; got {type(state_dict).__name__}.")
    missing = [k for k in keys if k not in state_dict]
    if missing:
        raise StateDictError(f"{call}(state_dict with keys {sorted(state_dict)}): missing {missing}; pass the dict "
                             f"that state_dict() returned.{hint}")
    return state_dict


def move_state(state: Any, device: torch.device | str) -> Any:
    """Any state record with every field on ``device`` (a copy only where it moves)."""
    return dataclasses.replace(state, **{f.name: getattr(state, f.name).to(device) for f in dataclasses.fields(state)})


def state_to_dict(state: Any) -> dict[str, float | int | list]:
    """Plain Python numbers for every field of a state record (reads them on the host: one sync)."""
    return {f.name: getattr(state, f.name).tolist() for f in dataclasses.fields(state)}


def _field_tensor(door: str, name: str, value: Any, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a tensor shaped, typed and placed like ``like``; finite, and in int32 for counters."""
    try:
        raw = torch.as_tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{door}: state field {name!r} must be a number (or a list of numbers); got "
                        f"{type(value).__name__} {value!r}.") from None
    batched = like.dim() == 0 and raw.dim() == 1  # a batch of states: a rule evaluated over many at once
    if tuple(raw.shape) != tuple(like.shape) and not batched:
        raise ValueError(f"{door}: state field {name!r} must have shape {tuple(like.shape)} (or (n,) for a batch of "
                         f"n states); got {tuple(raw.shape)}.")
    values = raw.reshape(-1).tolist()
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{door}: state field {name!r} must be finite; got {value!r}.")
    if not like.is_floating_point() and not all(v == int(v) and -INT32_MAX - 1 <= v <= INT32_MAX for v in values):
        raise ValueError(f"{door}: state field {name!r} is a counter: it must hold integers in the int32 range; "
                         f"got {value!r}.")
    return raw.to(like.dtype).to(like.device)


def state_from_dict(template: Any, values: dict[str, Any], door: str = "load_state_dict") -> Any:
    """A state shaped like ``template`` (dtype, device) holding ``values``; every field is required, finite,
    and the right shape; counters are int32 integers. The scale itself is checked by :class:`LossScale`."""
    if not isinstance(values, dict):
        raise TypeError(f"{door}: the loss-scale state must be a dict of its fields; got {type(values).__name__}.")
    names = [f.name for f in dataclasses.fields(template)]
    missing = [n for n in names if n not in values]
    if missing:
        raise StateDictError(f"{door}: the loss-scale state is missing {missing}; expected the fields {names}")
    fields = {n: _field_tensor(door, n, values[n], getattr(template, n)) for n in names}
    batches = {tuple(t.shape) for n, t in fields.items() if getattr(template, n).dim() == 0}
    if len(batches) > 1:
        raise ValueError(f"{door}: the state's scalar fields must all be scalars or all batches of one length; got "
                         f"shapes { {n: tuple(t.shape) for n, t in fields.items()} }.")
    return dataclasses.replace(template, **fields)


def _versions(state: Any) -> tuple[int, ...] | None:
    """The in-place write counters of a state record's tensors (``scaler._scale.fill_(x)`` bumps one); None
    where a tensor keeps none (an inference tensor), which :meth:`LossScale.commit` reads as written."""
    try:
        return tuple(getattr(state, f.name)._version for f in dataclasses.fields(state))
    except RuntimeError:
        return None


class NextState(NamedTuple):
    """A state computed one step on from ``base`` under ``policy`` (see :meth:`LossScale.next_state`), the
    inputs that made it, and ``base``'s write counters then (``versions``)."""

    base: Any
    policy: Any
    state: Any
    inputs: tuple
    versions: tuple[int, ...] | None


class LossScale:
    """The one owner of a policy's state: scale, counters and window position.

    Every reader and writer goes through these methods; each value set here passes the one validation
    (:func:`~lossscale.scale_value.checked_scale`) against the policy's bounds.

    Args:
        policy: A :class:`~lossscale.policy.Policy`.
        device: Where the state lives (default CPU); :meth:`to` moves it.

    Example:
        >>> import torch
        >>> from lossscale import DynamicScale
        >>> owner = LossScale(DynamicScale(init_scale=1024.0))
        >>> owner.update(torch.tensor(True))
        >>> float(owner.scale)
        512.0
    """

    def __init__(self, policy: Any, device: torch.device | str | None = None) -> None:
        from lossscale.policy import check_policy

        check_policy("LossScale", policy)
        self._policy = policy
        self._state = policy.init(device)

    @staticmethod
    def shared_or_new(policy: Any, device: torch.device | str) -> LossScale:
        """``policy`` itself when it is a LossScale (moved to ``device``: shared with its other holders), else a
        new owner of ``policy`` (default :class:`~lossscale.DynamicScale`) on ``device``."""
        if isinstance(policy, LossScale):
            policy.to(device)
            return policy
        from lossscale.dynamic import DynamicScale

        return LossScale(DynamicScale() if policy is None else policy, device)

    @property
    def policy(self) -> Any:
        """The frozen rule."""
        return self._policy

    @property
    def state(self) -> Any:
        """The whole state record (0-d tensors; no host read)."""
        return self._state

    @property
    def scale(self) -> torch.Tensor:
        """The current scale: a 0-d float32 tensor (no host read)."""
        return self._state.scale

    @property
    def device(self) -> torch.device:
        """Where the state lives."""
        return self._state.scale.device

    def to(self, device: torch.device | str) -> None:
        """Move the state to ``device``, in place for every holder."""
        self._state = move_state(self._state, device)

    def set_policy(self, policy: Any) -> None:
        """Change the rule (e.g. torch's ``set_growth_factor``); the state carries on if it fits the bounds."""
        from lossscale.policy import check_policy

        check_policy("LossScale.set_policy", policy)
        checked_scale(f"LossScale.set_policy({policy!r})", self.scale, policy.min_scale, policy.max_scale,
                      "the current scale")
        self._policy = policy

    def set_scale(self, value: float | torch.Tensor, door: str = "LossScale.set_scale(value)",
                  name: str = "the scale") -> None:
        """Set the scale; the counters carry on. ``door`` and ``name`` say who set what in the error.

        Cost: none for a float or a CPU tensor; one device sync for a tensor on an accelerator."""
        scale = checked_scale(door, value, self._policy.min_scale, self._policy.max_scale, name)
        self._state = dataclasses.replace(self._state, scale=torch.full_like(self._state.scale, scale))

    def follow(self, scale: torch.Tensor) -> None:
        """Take the scale from a tensor the caller keeps as the live scale (MindSpore's ``loss_scale``
        Parameter), before an update. No host read, so not validated here: the cell's caller set that
        tensor through a validated door, and the pipeline's guard (:func:`lossscale.step.guarded_found`)
        turns a corrupted scale into an overflow, never into a gradient."""
        self._state = dataclasses.replace(self._state, scale=scale.detach().reshape(()).to(self._state.scale))

    def update(self, found_inf: torch.Tensor, amax: torch.Tensor | None = None,
               loss_finite: torch.Tensor | None = None, *, clean_on_host: bool = False) -> None:
        """Advance the rule by one step (pure tensor ops), then apply the policy's floor rule:
        :meth:`commit` of :meth:`next_state`.

        Cost: no host read, unless the policy raises at its floor (``at_floor="raise"``: one read)."""
        self.commit(self.next_state(found_inf, amax, loss_finite, clean_on_host=clean_on_host))

    def next_state(self, found_inf: torch.Tensor, amax: torch.Tensor | None = None,
                   loss_finite: torch.Tensor | None = None, *, clean_on_host: bool = False) -> NextState:
        """The state one step on, computed now and not installed (policies are pure: the current state is
        untouched); :meth:`commit` installs it. ``loss_finite`` reaches policies that observe it
        (``observes_loss_finite``). ``clean_on_host``: the caller has read found_inf on the host and it was
        0 (a front end whose step decision was that read); a policy with ``update_known_clean``
        (DynamicScale) then skips the ops that only an overflow needs. No host read."""
        inputs = (found_inf, amax, loss_finite, clean_on_host)
        return NextState(self._state, self._policy, self._advanced(self._state, *inputs), inputs,
                         _versions(self._state))

    def _advanced(self, state: Any, found_inf: torch.Tensor, amax: torch.Tensor | None,
                  loss_finite: torch.Tensor | None, clean_on_host: bool) -> Any:
        known_clean = getattr(self._policy, "update_known_clean", None) if clean_on_host else None
        if known_clean is not None:
            return known_clean(state, found_inf)
        if self._policy.observes_loss_finite:
            return self._policy.update(state, found_inf, amax=amax, loss_finite=loss_finite)
        return self._policy.update(state, found_inf, amax=amax)

    def commit(self, next_state: NextState) -> None:
        """Install what :meth:`next_state` computed (computed again from the same inputs if the state or the
        rule was set or written in place in between: a ``set_growth_factor`` or a ``scaler._scale.fill_(x)``
        between torch's ``step`` and ``update`` applies to that update, as in torch), then the policy's floor
        rule (``check_floor``: may raise FloorError; one host read where ``at_floor="raise"``). No host read
        for the check (tensor write counters)."""
        unchanged = next_state.base is self._state and next_state.policy is self._policy
        if unchanged and next_state.versions is not None and next_state.versions == _versions(self._state):
            self._state = next_state.state
        else:
            self._state = self._advanced(self._state, *next_state.inputs)
        self._policy.check_floor(self._state)

    def state_dict(self) -> dict[str, Any]:
        """Every state field as plain numbers (one host read)."""
        return state_to_dict(self._state)

    def load_state_dict(self, values: dict[str, Any], door: str = "LossScale.load_state_dict") -> None:
        """Restore what :meth:`state_dict` saved; the whole record is checked before anything changes."""
        if isinstance(values, dict) and "scale" in values and not isinstance(values["scale"], (list, tuple)):
            checked_scale(door, values["scale"], self._policy.min_scale, self._policy.max_scale, "field 'scale'")
        state = state_from_dict(self._state, values, door)
        for scale in state.scale.reshape(-1).tolist():  # each state of a batch, and the float32 value itself
            checked_scale(door, scale, self._policy.min_scale, self._policy.max_scale, "field 'scale'")
        self._state = state

    def __repr__(self) -> str:
        return f"LossScale({self._policy!r})"
