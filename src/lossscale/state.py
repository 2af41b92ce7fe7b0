"""LossScale: the one object that holds a policy and its current state.

Every front end and facade reads and writes the scale and counters through it; every setter and loader checks
the scale with :func:`~lossscale.checks.checked_scale` against the policy's bounds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lossscale.checks import capturing, checked_scale
from lossscale.policies.base import Policy, check_policy, move_state, state_from_dict, state_to_dict
from lossscale.policies.dynamic import DynamicScale

__all__ = ["LossScale"]


class LossScale:
    """A policy and its current state (scale, counters).

    Args:
        policy: A :class:`~lossscale.Policy`.
        device: Where the state lives (default CPU); :meth:`to` moves it.

    Example:
        >>> import torch
        >>> from lossscale import DynamicScale
        >>> loss_scale = LossScale(DynamicScale(init_scale=1024.0))
        >>> loss_scale.update(torch.tensor(True))
        >>> float(loss_scale.scale)
        512.0
    """

    def __init__(self, policy: Policy, device: torch.device | str | None = None) -> None:
        check_policy("LossScale", policy)
        self._policy = policy
        self._state = policy.init(device)

    @staticmethod
    def shared_or_new(policy: Policy | LossScale | None, device: torch.device | str) -> LossScale:
        """``policy`` itself if it is a LossScale (moved to ``device``, still shared), else a new one of ``policy``
        (default :class:`~lossscale.DynamicScale`) on ``device``."""
        if isinstance(policy, LossScale):
            policy.to(device)
            return policy
        return LossScale(DynamicScale() if policy is None else policy, device)

    @property
    def policy(self) -> Policy:
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

    def set_policy(self, policy: Policy) -> None:
        """Change the rule (torch's ``set_growth_factor``, ...); the state carries on if it fits the new bounds."""
        check_policy("LossScale.set_policy", policy)
        checked_scale(f"LossScale.set_policy({policy!r})", self.scale, policy.min_scale, policy.max_scale,
                      "the current scale")
        self._policy = policy

    def set_scale(self, value: float | torch.Tensor, call: str = "LossScale.set_scale(value)",
                  name: str = "the scale") -> None:
        """Set the scale; the counters carry on. Host reads: one for a tensor on an accelerator, else none."""
        scale = checked_scale(call, value, self._policy.min_scale, self._policy.max_scale, name)
        self._state = dataclasses.replace(self._state, scale=torch.full_like(self._state.scale, scale))

    def follow(self, scale: torch.Tensor) -> None:
        """Take the scale from a tensor the caller keeps as the live scale (MindSpore's ``loss_scale`` Parameter).
        Not checked, no host read (:func:`lossscale.stages.guarded_found` turns a corrupted scale into an overflow)."""
        self._state = dataclasses.replace(self._state, scale=scale.detach().reshape(()).to(self._state.scale))

    def update(self, found_inf: torch.Tensor, amax: torch.Tensor | None = None,
               loss_finite: torch.Tensor | None = None) -> None:
        """Advance the rule by one step, then the policy's floor rule (may raise FloorError).
        Host reads: none, unless the policy raises at its floor (``at_floor="raise"``: one).

        Under CUDA graph capture the new state is written into the current state's tensors (one multi-tensor
        copy), so each replay of the graph reads and advances the same state; outside capture the state is
        replaced and the tensors read before stay as they were."""
        old = self._state
        if self._policy.observes_loss_finite:
            new = self._policy.update(old, found_inf, amax=amax, loss_finite=loss_finite)
        else:
            new = self._policy.update(old, found_inf, amax=amax)
        if not capturing(old.scale):
            self._state = new
            self._policy.check_floor(new)
            return
        if self._policy.floor_reads_host:
            raise RuntimeError(f"LossScale.update under CUDA graph capture: the floor rule of {self._policy!r} "
                               f"reads the state on the host, which a graph cannot capture. Use a policy that "
                               f"keeps skipping at its floor (DynamicScale's at_floor='skip', the default) for a "
                               f"captured step.")
        _write_into(old, new)
        self._policy.check_floor(old)

    def state_dict(self) -> dict[str, Any]:
        """Every state field as plain numbers (host reads)."""
        return state_to_dict(self._state)

    def load_state_dict(self, values: dict[str, Any], call: str = "LossScale.load_state_dict") -> None:
        """Restore what :meth:`state_dict` saved; the whole record is checked before anything changes."""
        if isinstance(values, dict) and "scale" in values and not isinstance(values["scale"], (list, tuple)):
            checked_scale(call, values["scale"], self._policy.min_scale, self._policy.max_scale, "field 'scale'")
        state = state_from_dict(self._state, values, call)
        for scale in state.scale.reshape(-1).tolist():  # each state of a batch, and the float32 value itself
            checked_scale(call, scale, self._policy.min_scale, self._policy.max_scale, "field 'scale'")
        self._state = state

    def __repr__(self) -> str:
        return f"LossScale({self._policy!r})"


def _write_into(target: Any, source: Any) -> None:
    """Copy every field of the state record ``source`` into ``target``'s tensor of that field, in place."""
    pairs = [(getattr(target, f.name), getattr(source, f.name)) for f in dataclasses.fields(target)]
    pairs = [(t, s) for t, s in pairs if t is not s]
    if pairs:
        torch._foreach_copy_([t for t, _ in pairs], [s for _, s in pairs])
