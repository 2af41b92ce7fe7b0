"""GradScaler's torch-compatible knobs and checkpoints, over the one owner of its state.

``get/set_growth_factor``, ``get/set_backoff_factor``, ``get/set_growth_interval`` replace the frozen
policy through :meth:`~lossscale.state.LossScale.set_policy` (validated). ``state_dict`` is torch's format
plus ``policy_state``; ``load_state_dict`` takes either and validates the whole dict before it changes
anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lossscale.dynamic import DynamicScale

__all__ = ["ScalerCheckpoint"]


class ScalerCheckpoint:
    """Mixin for :class:`~lossscale.GradScaler` (uses ``self._owner``, ``self._enabled``, ``self._replicas``)."""

    _owner: Any
    _enabled: bool
    _replicas: dict

    @property
    def policy(self) -> Any:
        """The frozen rule (owned, with the state, by ``loss_scale``)."""
        return self._owner.policy

    # torch's getters and setters of the dynamic rule
    def _dynamic(self, call: str) -> DynamicScale:
        if not isinstance(self.policy, DynamicScale):
            raise TypeError(f"GradScaler.{call}: only a DynamicScale policy has this knob; "
                            f"the policy is {type(self.policy).__name__}.")
        return self.policy

    def get_growth_factor(self) -> float:
        return self._dynamic("get_growth_factor()").growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._owner.set_policy(dataclasses.replace(self._dynamic("set_growth_factor()"), growth_factor=new_factor))

    def get_backoff_factor(self) -> float:
        return self._dynamic("get_backoff_factor()").backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._owner.set_policy(dataclasses.replace(self._dynamic("set_backoff_factor()"), backoff_factor=new_factor))

    def get_growth_interval(self) -> int:
        return self._dynamic("get_growth_interval()").growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._owner.set_policy(dataclasses.replace(self._dynamic("set_growth_interval()"),
                                                   growth_interval=new_interval))

    def state_dict(self) -> dict[str, Any]:
        """torch's keys (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``) where the policy has them, plus ``policy_state`` (every state field).
        Empty when disabled, as in torch. Reads the state on the host. ``torch.amp.GradScaler`` loads
        it only with a :class:`DynamicScale` policy (it needs the growth/backoff keys)."""
        if not self._enabled:
            return {}
        values = self._owner.state_dict()
        out: dict[str, Any] = {"scale": float(values["scale"])}
        if isinstance(self.policy, DynamicScale):
            out.update(growth_factor=self.policy.growth_factor, backoff_factor=self.policy.backoff_factor,
                       growth_interval=self.policy.growth_interval)
        if "growth_tracker" in values:
            out["_growth_tracker"] = int(values["growth_tracker"])
        out["policy_state"] = values
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from our ``state_dict()`` or from ``torch.amp.GradScaler.state_dict()``; the whole dict
        is validated before anything changes (a bad scale raises here, naming the key)."""
        if not self._enabled:
            return
        door = "GradScaler.load_state_dict(state_dict)"
        if not isinstance(state_dict, dict):
            raise TypeError(f"{door}: state_dict must be a dict; got {type(state_dict).__name__}.")
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled "
                               "instance of GradScaler: GradScaler.load_state_dict({}) has nothing to restore.")
        policy = self.policy
        if isinstance(policy, DynamicScale) and "growth_factor" in state_dict:
            policy = dataclasses.replace(policy, growth_factor=state_dict["growth_factor"],
                                         backoff_factor=state_dict["backoff_factor"],
                                         growth_interval=state_dict["growth_interval"])
        values = self._owner.state_dict()
        values.update(state_dict.get("policy_state", {}))
        if "policy_state" not in state_dict:  # torch's format
            if "scale" not in state_dict:
                raise KeyError(f"{door}: the state dict has neither 'policy_state' nor torch's 'scale'; got keys "
                               f"{sorted(state_dict)}.")
            values["scale"] = state_dict["scale"]
            if "_growth_tracker" in state_dict and "growth_tracker" in values:
                values["growth_tracker"] = state_dict["_growth_tracker"]
        self._owner.load_state_dict(values, door)
        self._owner.set_policy(policy)
        self._replicas = {}

