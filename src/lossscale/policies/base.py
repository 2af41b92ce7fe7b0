"""The policy protocol, its state record, the fixed scale, and the helpers every policy's state goes through.

A policy is a frozen config validated once at construction; its state a frozen record of 0-d tensors;
``update(state, found_inf, amax=None) -> state`` the whole rule, in tensor ops (no host read).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch

from lossscale.validation import (
    FLOAT32_MAX,
    INT32_MAX,
    SMALLEST_NORMAL_FLOAT32,
    StateDictError,
    found_flag,
    validated_scale,
)

#: Counters stop here instead of wrapping.
SATURATE = 2**30


class StateRecord(Protocol):
    """What every policy's state is: a frozen dataclass of tensors with a ``scale`` field (0-d float32, or one
    per state of a batch). Its other fields are the policy's own; records are saved, moved and copied field by
    field through :func:`dataclasses.fields`."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # what dataclasses.fields and replace read

    @property
    def scale(self) -> torch.Tensor: ...


#: A policy's state record type: ``Policy[StateT]`` returns it from ``init`` and takes and returns it in ``update``.
StateT = TypeVar("StateT", bound=StateRecord)


class FloorError(RuntimeError):
    """Raised when a policy with ``at_floor="raise"`` must back off below ``min_scale``."""


@dataclass(frozen=True)
class ScaleState:
    """The state of a dynamic (or fixed) scale, as 0-d tensors on one device.

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


class Policy(Generic[StateT]):
    """The protocol of a loss-scale policy over its state record ``StateT``: everything the step stages call, with
    defaults.

    Required: ``init(device) -> state`` (a ``StateRecord``: a frozen dataclass of tensors with a ``scale``
    field) and ``update(state, found_inf, amax=None) -> state`` (tensor ops only). ``found_inf`` is a tensor on
    any device: a bool flag, or a count of overflows (torch's scaler keeps a float32 count, the core a 0-d float32
    0/1 flag); nonzero means the step overflowed, and its dtype and device are the caller's. Optional, with defaults
    here:

    - ``observes_amax`` (False): True asks for ``amax``, the largest scaled-gradient magnitude of the step.
    - ``observes_loss_finite`` (False): True asks for ``update(..., loss_finite=...)`` (keyword-only), whether every
      loss of the step was finite (0-d bool).
    - ``enforce_floor(state)``: a floor rule that raises (:class:`FloorError`), run after every update where
      ``floor_reads_host`` is True (a floor the state keeps itself belongs in ``update``).
    - ``floor_reads_host`` (False): True where the policy has such a rule: it reads the state on the host (so it
      cannot run inside a CUDA graph).
    - ``cuda_graph`` (False): True asks :class:`~lossscale.LossScale` to replay ``update`` from a CUDA graph when the
      state is on a CUDA device (worth it for a rule of many small kernels; ``update`` must then make no host read).
    - ``min_scale`` / ``max_scale`` (2**-126 / float32 max): the bounds every scale set from outside is
      checked against.
    """

    observes_amax: ClassVar[bool] = False
    observes_loss_finite: ClassVar[bool] = False
    cuda_graph: bool = False
    min_scale: float = SMALLEST_NORMAL_FLOAT32
    max_scale: float = FLOAT32_MAX

    def init(self, device: torch.device | str | None = None) -> StateT:
        """A fresh state on ``device`` (default CPU)."""
        raise NotImplementedError(f"{type(self).__name__}.init(device) is required by the Policy protocol")

    def update(self, state: StateT, found_inf: torch.Tensor, amax: torch.Tensor | None = None) -> StateT:
        """The next state after a step whose gradients did (``found_inf``) or did not overflow.

        Args:
            state: The current state (not changed: a new record is returned).
            found_inf: A tensor on any device, 0-d (or one value per state of a batch): a bool flag, or a count of
                overflows of any dtype (torch's scaler passes its float32 count, the core its 0/1 float32 flag);
                nonzero means the step overflowed. Moved to the state's device without a host read.
            amax: The largest scaled-gradient magnitude of the step, for a policy that ``observes_amax``; else None.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.update(state, found_inf, amax) is required by the Policy protocol"
        )

    def enforce_floor(self, state: StateT) -> None:
        """The floor rule after an update: by default none (the scale stays at its floor and steps skip)."""

    @property
    def floor_reads_host(self) -> bool:
        """Whether :meth:`enforce_floor` reads the state on the host (by default it does nothing)."""
        return False


def validate_policy(call: str, policy: object) -> None:
    """A TypeError unless ``policy`` is a :class:`Policy`."""
    if not isinstance(policy, Policy):
        raise TypeError(
            f"{call}(policy={policy!r}): policy must have init(device) and update(state, found_inf, "
            f"amax=None): pass a lossscale.Policy (DynamicScale, FixedScale, PredictiveScale, a "
            f"preset, or your own subclass of Policy); got {type(policy).__name__}."
        )


@dataclass(frozen=True)
class FixedScale(Policy[ScaleState]):
    """A constant loss scale: overflowing steps are still detected and skipped, the scale never moves.

    Args:
        scale: The loss scale, default 2**16: a finite number > 0 whose float32 value is a normal number (at least
            2**-126, at most the largest finite float32); the state holds its float32 value.

    Example:
        >>> import torch
        >>> policy = FixedScale(128.0)
        >>> float(policy.update(policy.init(), torch.tensor(True)).scale)
        128.0
    """

    scale: float = 2.0**16

    def __post_init__(self) -> None:
        validated_scale(f"{type(self).__name__}(scale={self.scale!r})", self.scale, name="scale")

    def init(self, device: torch.device | str | None = None) -> ScaleState:
        """A state holding the fixed scale on ``device`` (default CPU)."""
        zero = torch.zeros((), dtype=torch.int32, device=device)
        return ScaleState(
            scale=torch.full((), self.scale, dtype=torch.float32, device=device),
            growth_tracker=zero,
            hysteresis_left=torch.ones((), dtype=torch.int32, device=device),
            floor_hits=zero.clone(),
        )

    def update(self, state: ScaleState, found_inf: torch.Tensor, amax: torch.Tensor | None = None) -> ScaleState:
        """The same state: a fixed scale ignores overflow (found_inf's type is still checked)."""
        found_flag(found_inf, state.scale.device)
        return state


# --- state records, field by field -----------------------------------------------------------------------------


def move_state(state: StateT, device: torch.device | str) -> StateT:
    """Any state record with every field on ``device`` (a copy only where it moves). A copy from host memory to an
    accelerator does not wait for the device (no host synchronisation: the values are staged before the call
    returns); a copy to host memory is a blocking one, so the values can be read at once."""
    non_blocking = torch.device(device).type != "cpu"
    return dataclasses.replace(
        state,
        **{f.name: getattr(state, f.name).to(device, non_blocking=non_blocking) for f in dataclasses.fields(state)},
    )


def state_to_dict(state: StateRecord) -> dict[str, float | int | list[float] | list[int]]:
    """Plain Python numbers for every field of a state record (one host read per field)."""
    return {f.name: getattr(state, f.name).tolist() for f in dataclasses.fields(state)}


def _field_tensor(call: str, name: str, value: object, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a tensor shaped, typed and placed like ``like``; finite, and in int32 for counters."""
    try:
        raw = torch.as_tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"{call}: state field {name!r} must be a number (or a list of numbers); got "
            f"{type(value).__name__} {value!r}."
        ) from None
    batched = like.dim() == 0 and raw.dim() == 1  # a batch of states: a rule evaluated over many at once
    if tuple(raw.shape) != tuple(like.shape) and not batched:
        raise ValueError(
            f"{call}: state field {name!r} must have shape {tuple(like.shape)} (or (n,) for a batch of "
            f"n states); got {tuple(raw.shape)}."
        )
    values = raw.reshape(-1).tolist()
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{call}: state field {name!r} must be finite; got {value!r}.")
    if not like.is_floating_point() and not all(v == int(v) and -INT32_MAX - 1 <= v <= INT32_MAX for v in values):
        raise ValueError(
            f"{call}: state field {name!r} is a counter: it must hold integers in the int32 range; got {value!r}."
        )
    return raw.to(like.dtype).to(like.device)


def state_from_dict(template: StateT, values: object, call: str = "load_state_dict") -> StateT:
    """A state like ``template`` (dtype, device) holding ``values``: every field required, finite, of the right
    shape; counters int32 integers. The scale's own check is :class:`~lossscale.state.LossScale`'s."""
    if not isinstance(values, dict):
        raise TypeError(f"{call}: the loss-scale state must be a dict of its fields; got {type(values).__name__}.")
    names = [f.name for f in dataclasses.fields(template)]
    missing = [n for n in names if n not in values]
    if missing:
        raise StateDictError(f"{call}: the loss-scale state is missing {missing}; expected the fields {names}.")
    fields = {n: _field_tensor(call, n, values[n], getattr(template, n)) for n in names}
    batches = {tuple(t.shape) for n, t in fields.items() if getattr(template, n).dim() == 0}
    if len(batches) > 1:
        raise ValueError(
            f"{call}: the state's scalar fields must all be scalars or all batches of one length; got "
            f"shapes { {n: tuple(t.shape) for n, t in fields.items()} }."
        )
    return dataclasses.replace(template, **fields)
