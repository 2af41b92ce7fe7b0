"""LossScale: the one object that holds a policy and its current state.

Every front end and facade reads and writes the scale and counters through it; every setter and loader checks
the scale with :func:`~lossscale.validation.validated_scale` against the policy's bounds. On a CUDA device, a
policy whose ``cuda_graph`` is True (PredictiveScale: its rule is about 80 small kernels) is updated by replaying
its update from a CUDA graph (``ReplayedUpdate``): one launch instead of one per op.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeAlias, cast

import torch

from lossscale.policies.base import (
    Policy,
    StateRecord,
    StateT,
    move_state,
    state_from_dict,
    state_to_dict,
    validate_policy,
)
from lossscale.policies.dynamic import DynamicScale
from lossscale.validation import capturing, validated_scale


class LossScale(Generic[StateT]):
    """A policy and its current state (scale, counters): ``LossScale[StateT]`` holds a ``Policy[StateT]``.

    Args:
        policy: A :class:`~lossscale.Policy`.
        device: Where the state lives (default CPU); :meth:`to` moves it.

    Example:
        >>> import torch
        >>> from lossscale import DynamicScale
        >>> loss_scale = LossScale(DynamicScale(init_scale=1024.0))
        >>> float(loss_scale.update(torch.tensor(True)))  # the scale the step ran at
        1024.0
        >>> float(loss_scale.scale)
        512.0
    """

    def __init__(self, policy: Policy[StateT], device: torch.device | str | None = None) -> None:
        validate_policy("LossScale", policy)
        self._policy = policy
        self._floor_reads_host = policy.floor_reads_host  # whether the floor rule runs after each update
        self._state = policy.init(device)
        # built at the first update on a CUDA device (policy.cuda_graph)
        self._replay: ReplayedUpdate[StateT] | None = None

    @staticmethod
    def shared_or_new(policy: Policy[Any] | LossScale[Any] | None, device: torch.device | str) -> LossScale[Any]:
        """``policy`` itself if it is a LossScale (moved to ``device``, still shared), else a new one of ``policy``
        (default :class:`~lossscale.DynamicScale`) on ``device``."""
        if isinstance(policy, LossScale):
            policy.to(device)
            return policy
        return LossScale(DynamicScale() if policy is None else policy, device)

    @property
    def policy(self) -> Policy[StateT]:
        """The frozen rule."""
        return self._policy

    @property
    def state(self) -> StateT:
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

    def set_policy(self, policy: Policy[StateT]) -> None:
        """Change the rule (torch's ``set_growth_factor``, ...); the state carries on if it fits the new bounds."""
        validate_policy("LossScale.set_policy", policy)
        validated_scale(
            f"LossScale.set_policy({policy!r})", self.scale, policy.min_scale, policy.max_scale, "the current scale"
        )
        self._policy = policy
        self._floor_reads_host = policy.floor_reads_host
        self._replay = None  # captured from the old rule

    def set_scale(
        self, value: float | torch.Tensor, call: str = "LossScale.set_scale(value)", name: str = "the scale"
    ) -> None:
        """Set the scale; the counters carry on. Host reads: one for a tensor on an accelerator, else none."""
        scale = validated_scale(call, value, self._policy.min_scale, self._policy.max_scale, name)
        self._state = dataclasses.replace(self._state, scale=torch.full_like(self._state.scale, scale))

    def follow(self, scale: torch.Tensor) -> None:
        """Take the scale from a tensor the caller keeps as the live scale (MindSpore's ``loss_scale`` Parameter).
        Not checked, no host read (:func:`lossscale.stages.guarded_found` turns a corrupted scale into an overflow)."""
        self._state = dataclasses.replace(self._state, scale=scale.detach().reshape(()).to(self._state.scale))

    def update(
        self,
        found_inf: torch.Tensor,
        amax: torch.Tensor | None = None,
        loss_finite: torch.Tensor | None = None,
        *,
        skip: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Move the rule by one step, then the policy's floor rule (may raise FloorError); where ``skip`` (0-d, a
        forward fault) is nonzero, the whole state stays exactly as it was (the policy does not see the step).
        Returns the scale the step ran at: the state's scale before the update, a tensor the update does not write.
        Host reads: none, unless the policy raises at its floor (``at_floor="raise"``: one).

        Under CUDA graph capture the new state is written into the current state's tensors (one multi-tensor
        copy), so each replay of the graph reads and updates the same state (the scale returned is then a copy);
        outside capture the state is replaced and the tensors read before stay as they were. Outside capture, on a
        CUDA device, a policy with ``cuda_graph`` True is updated by ``ReplayedUpdate`` (the same result, bit for
        bit)."""
        old = self._state
        if not capturing(old.scale):
            if self._policy.cuda_graph and old.scale.is_cuda:
                if self._replay is None:
                    self._replay = ReplayedUpdate(self._policy)
                new = self._replay(old, found_inf, amax, loss_finite)
            else:
                new = _policy_update(self._policy, old, found_inf, amax, loss_finite)
            self._state = new if skip is None else _kept_where(skip, old, new)
            if self._floor_reads_host:
                self._policy.enforce_floor(self._state)
            return old.scale
        if self._floor_reads_host:
            raise RuntimeError(
                f"LossScale.update under CUDA graph capture: the floor rule of {self._policy!r} "
                f"reads the state on the host, which a graph cannot capture. Use a policy that "
                f"keeps skipping at its floor (DynamicScale's at_floor='skip', the default) for a "
                f"captured step."
            )
        ran_at = old.scale.clone()
        new = _policy_update(self._policy, old, found_inf, amax, loss_finite)
        _write_into(old, new if skip is None else _kept_where(skip, old, new))
        return ran_at

    def state_dict(self) -> dict[str, float | int | list[float] | list[int]]:
        """Every state field as plain numbers (host reads)."""
        return state_to_dict(self._state)

    def load_state_dict(self, values: object, call: str = "LossScale.load_state_dict") -> None:
        """Restore what :meth:`state_dict` saved; the whole record is checked before anything changes."""
        if isinstance(values, dict) and "scale" in values and not isinstance(values["scale"], (list, tuple)):
            validated_scale(call, values["scale"], self._policy.min_scale, self._policy.max_scale, "field 'scale'")
        state = state_from_dict(self._state, values, call)
        for scale in state.scale.reshape(-1).tolist():  # each state of a batch, and the float32 value itself
            validated_scale(call, scale, self._policy.min_scale, self._policy.max_scale, "field 'scale'")
        self._state = state

    def __getstate__(self) -> dict[str, object]:
        """Pickled and deep-copied without the captured graph (the copy captures its own at its first update)."""
        return {**self.__dict__, "_replay": None}

    def __repr__(self) -> str:
        return f"LossScale({self._policy!r})"


class _UpdateWithLossFinite(Protocol[StateT]):
    """``update`` of a policy whose ``observes_loss_finite`` is True (the :class:`~lossscale.Policy` contract)."""

    def __call__(
        self,
        state: StateT,
        found_inf: torch.Tensor,
        amax: torch.Tensor | None = None,
        *,
        loss_finite: torch.Tensor | None = None,
    ) -> StateT: ...


def _policy_update(
    policy: Policy[StateT],
    state: StateT,
    found_inf: torch.Tensor,
    amax: torch.Tensor | None,
    loss_finite: torch.Tensor | None,
) -> StateT:
    """``policy.update`` with ``loss_finite`` passed only to a policy that observes it."""
    if policy.observes_loss_finite:
        # observes_loss_finite is the policy's promise that its update takes loss_finite=
        update = cast("_UpdateWithLossFinite[StateT]", policy.update)
        return update(state, found_inf, amax=amax, loss_finite=loss_finite)
    return policy.update(state, found_inf, amax=amax)


#: (dtype, shape) of a tensor.
_Spec: TypeAlias = "tuple[torch.dtype, torch.Size]"
#: What a captured graph was built for: the state's device and fields, then found_inf, amax and loss_finite
#: (None where absent).
_Key: TypeAlias = "tuple[torch.device, tuple[_Spec, ...], tuple[_Spec | None, ...]]"


class ReplayedUpdate(Generic[StateT]):
    """``policy.update`` captured once in a CUDA graph and replayed at every call: one launch for the whole rule.

    For a rule of many small kernels (PredictiveScale's is about 80 ops on 0-d tensors, each a kernel launch and
    some microseconds of host time) on a CUDA device, outside any capture of the caller's; :class:`LossScale` makes
    one at the first update of a policy whose ``cuda_graph`` is True.

    Contract of ``replayed(state, found_inf, amax=None, loss_finite=None)`` (``loss_finite`` only for a policy that
    observes it):

    - returns what ``policy.update`` returns for the same arguments, bit for bit (the same kernels), as a new record
      whose tensors are views of new buffers (one per dtype): a record returned earlier is never written again;
    - reads ``state`` as it is at the call (also after in-place writes to it, as a captured step of the caller's
      makes);
    - per call, for a state of one or two dtypes (PredictiveScale's float32 and int32): a copy per dtype into the
      graph's inputs (per field for a record this object did not return), one copy per input tensor, the replay,
      a copy per dtype out; no host read and no synchronisation;
    - captures at the first call, and again when the state's or the inputs' shapes, dtypes or device change, or
      ``amax``/``loss_finite`` go from absent to present: a warm-up run, then the capture, both on a side stream
      that the current one waits on (no synchronisation). The graph keeps its own memory pool.

    ``capture=False`` runs the same buffers and copies with the update called eagerly where the graph would be
    replayed (any device; the CPU tests run it so).
    """

    def __init__(self, policy: Policy[StateT], capture: bool = True) -> None:
        self.policy = policy
        self.capture = capture
        self._key: _Key | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._state_inputs: list[torch.Tensor] = []  # the graph's copy of the state, field by field
        self._in_buffers: list[torch.Tensor] = []  # the same memory, one buffer per dtype
        self._inputs: list[torch.Tensor] = []  # found_inf, then amax and loss_finite where given
        self._out_buffers: list[torch.Tensor] = []
        self._out_layout: _Layout | None = None
        self._last: tuple[StateT, list[torch.Tensor]] | None = None  # (record returned last, the buffers it views)
        self._body: Callable[[], None] | None = None  # the update into the output buffers: what the graph holds
        self._same_layout = False  # the outputs laid out as the inputs

    def __call__(
        self,
        state: StateT,
        found_inf: torch.Tensor,
        amax: torch.Tensor | None = None,
        loss_finite: torch.Tensor | None = None,
    ) -> StateT:
        given = (found_inf, amax, loss_finite)
        key: _Key
        if self._last is not None and self._last[0] is state and self._same_layout and self._key is not None:
            key = (self._key[0], self._key[1], tuple(None if t is None else (t.dtype, t.shape) for t in given))
            if key == self._key:
                for target, source in zip(self._in_buffers, self._last[1]):
                    target.copy_(source)
            else:
                self._build(state, key)
        else:
            fields = [getattr(state, f.name) for f in dataclasses.fields(state)]
            key = (
                state.scale.device,
                tuple((t.dtype, t.shape) for t in fields),
                tuple(None if t is None else (t.dtype, t.shape) for t in given),
            )
            if key != self._key:
                self._build(state, key)
            torch._foreach_copy_(self._state_inputs, fields)
        for target, value in zip(self._inputs, [t for t in given if t is not None]):
            target.copy_(value)
        if self._graph is not None:
            self._graph.replay()
        elif self._body is not None:  # built above
            self._body()
        assert self._out_layout is not None
        buffers = [b.clone() for b in self._out_buffers]
        record = type(state)(**self._out_layout.fields(buffers))
        self._last = (record, buffers)
        return record

    def _build(self, state: StateT, key: _Key) -> None:
        """Static inputs (the state's fields by dtype, then the input tensors); a warm-up run that gives the
        outputs' layout and buffers; then the capture (``capture=True``)."""
        device = state.scale.device
        layout = _Layout(state)
        self._in_buffers = layout.buffers(device)
        in_record = type(state)(**layout.fields(self._in_buffers))
        self._state_inputs = [getattr(in_record, f.name) for f in dataclasses.fields(in_record)]
        found_inf, amax, loss_finite = (
            None if spec is None else torch.zeros(spec[1], dtype=spec[0], device=device) for spec in key[2]
        )
        assert found_inf is not None  # always given
        self._inputs = [t for t in (found_inf, amax, loss_finite) if t is not None]
        self._graph, self._last = None, None
        # The warm-up reads the state (not uninitialised memory) and the zeroed inputs: a step with no overflow.
        torch._foreach_copy_(self._state_inputs, [getattr(state, f.name) for f in dataclasses.fields(state)])

        def run() -> StateT:
            return _policy_update(self.policy, in_record, found_inf, amax, loss_finite)

        def body() -> None:
            new = run()
            assert self._out_layout is not None
            outputs = self._out_layout.fields(self._out_buffers)
            torch._foreach_copy_(list(outputs.values()), [getattr(new, name) for name in outputs])

        def set_outputs(new: StateT) -> None:
            self._out_layout = _Layout(new)
            self._out_buffers = self._out_layout.buffers(device)
            self._same_layout = self._out_layout.groups == layout.groups  # a record returned is copied in whole

        if self.capture:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.device(device), torch.cuda.stream(side):
                set_outputs(run())  # the warm-up also loads the kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    body()
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(device).wait_stream(side)
            self._graph = graph
        else:
            set_outputs(run())
        self._body, self._key = body, key

    def __repr__(self) -> str:
        return f"ReplayedUpdate({self.policy!r}, capture={self.capture})"


class _Layout:
    """Where each field of a state record lives in one flat buffer per dtype (fields in their record's order)."""

    def __init__(self, record: StateRecord) -> None:
        groups: dict[torch.dtype, list[tuple[str, torch.Size]]] = {}
        for f in dataclasses.fields(record):
            tensor = getattr(record, f.name)
            groups.setdefault(tensor.dtype, []).append((f.name, tensor.shape))
        self.groups = list(groups.items())

    def buffers(self, device: torch.device) -> list[torch.Tensor]:
        """One new, uninitialised buffer per dtype."""
        return [
            torch.empty(sum(math.prod(shape) for _, shape in members), dtype=dtype, device=device)
            for dtype, members in self.groups
        ]

    def fields(self, buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each field as a view of its dtype's buffer (0-d fields by one ``unbind``)."""
        out: dict[str, torch.Tensor] = {}
        for (_, members), buffer in zip(self.groups, buffers):
            parts: list[torch.Tensor] | tuple[torch.Tensor, ...]
            if all(len(shape) == 0 for _, shape in members):
                parts = buffer.unbind()
            else:
                parts = [
                    p.view(shape)
                    for p, (_, shape) in zip(buffer.split([math.prod(shape) for _, shape in members]), members)
                ]
            out.update(zip((name for name, _ in members), parts))
        return out


def _kept_where(skip: torch.Tensor, old: StateT, new: StateT) -> StateT:
    """``new`` with every field taken from ``old`` where ``skip`` (0-d) is nonzero: the update masked. No host read."""
    keep = skip.to(device=old.scale.device, dtype=torch.bool)
    return dataclasses.replace(
        new, **{f.name: torch.where(keep, getattr(old, f.name), getattr(new, f.name)) for f in dataclasses.fields(old)}
    )


def _write_into(target: StateRecord, source: StateRecord) -> None:
    """Copy every field of the state record ``source`` into ``target``'s tensor of that field, in place."""
    pairs = [(getattr(target, f.name), getattr(source, f.name)) for f in dataclasses.fields(target)]
    pairs = [(t, s) for t, s in pairs if t is not s]
    if pairs:
        torch._foreach_copy_([t for t, _ in pairs], [s for _, s in pairs])
