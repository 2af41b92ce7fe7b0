"""GradScaler's torch-compatible knobs and checkpoints, over the one owner of its state.

``get/set_growth_factor``, ``get/set_backoff_factor``, ``get/set_growth_interval`` replace the frozen
policy through :meth:`~lossscale.state.LossScale.set_policy` (validated). ``state_dict`` is torch's format
plus ``policy_state``; ``load_state_dict`` takes either and validates the whole dict before it changes
anything.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from lossscale.dynamic import DynamicScale
from lossscale.policy import Policy, check_policy
from lossscale.state import StateDictError

__all__ = ["ScalerCheckpoint", "policy_from_args"]

_TORCH_DEFAULTS = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


def policy_from_args(policy: Policy | None, torch_args: dict[str, Any]) -> Policy:
    """torch's four arguments as a DynamicScale, or ``policy`` (then those arguments must be left alone)."""
    if policy is None:
        return DynamicScale(**torch_args)
    changed = {k: v for k, v in torch_args.items() if v != _TORCH_DEFAULTS[k]}
    if changed:
        raise ValueError(f"GradScaler(policy=..., {', '.join(f'{k}={v!r}' for k, v in changed.items())}): pass "
                         f"either policy= or torch's scale arguments, not both; got both.")
    check_policy("GradScaler", policy)
    return policy


_TORCH_COPIES = {"scale": "scale", "_growth_tracker": "growth_tracker"}  # torch's key -> policy_state's field


def _check_copies_agree(state_dict: dict[str, Any], door: str) -> None:
    """Our ``state_dict()`` writes the scale and the growth tracker twice (torch's keys, and the whole record
    in ``policy_state``); a dict whose two copies differ was edited in one place, and loading either would
    silently drop the other edit: raise, naming both."""
    record = state_dict["policy_state"]
    if not isinstance(record, dict):
        return  # the record's own validation names it
    for key, field in _TORCH_COPIES.items():
        if key in state_dict and field in record and _differ(state_dict[key], record[field]):
            raise StateDictError(
                f"{door}: state_dict[{key!r}] = {state_dict[key]!r} and state_dict['policy_state'][{field!r}] = "
                f"{record[field]!r} disagree (state_dict() writes both); set both to the value you mean, or "
                f"remove 'policy_state' to load torch's keys alone.")


def _differ(torch_value: Any, recorded: Any) -> bool:
    """Whether torch's copy differs from the record's (a record value that is not a finite number is left to
    the record's validation, which names it)."""
    if not isinstance(recorded, (int, float)) or isinstance(recorded, bool) or not math.isfinite(recorded):
        return False
    return not isinstance(torch_value, (int, float)) or float(torch_value) != float(recorded)


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
        policy = self._policy_from(state_dict, door)
        if "policy_state" in state_dict:  # ours: the whole record
            values = state_dict["policy_state"]
            _check_copies_agree(state_dict, door)
        else:  # torch's format
            if "scale" not in state_dict:
                raise StateDictError(f"{door}: the state dict has neither 'policy_state' nor torch's 'scale'; got "
                                     f"keys {sorted(state_dict)}.")
            values = self._owner.state_dict()
            values["scale"] = state_dict["scale"]
            if "_growth_tracker" in state_dict and "growth_tracker" in values:
                values["growth_tracker"] = state_dict["_growth_tracker"]
        self._owner.load_state_dict(values, door)
        self._owner.set_policy(policy)
        self._replicas = {}

    def _policy_from(self, state_dict: dict[str, Any], door: str) -> Any:
        """The policy with torch's three knobs from ``state_dict`` (a DynamicScale; validated), else unchanged."""
        policy = self._owner.policy
        knobs = ("growth_factor", "backoff_factor", "growth_interval")
        if not isinstance(policy, DynamicScale) or not any(k in state_dict for k in knobs):
            return policy
        missing = [k for k in knobs if k not in state_dict]
        missing += ["scale"] if "scale" not in state_dict and "policy_state" not in state_dict else []
        if missing:
            raise StateDictError(f"{door}: torch's format holds scale, growth_factor, backoff_factor and "
                                 f"growth_interval together; missing {missing} (got keys {sorted(state_dict)}).")
        return dataclasses.replace(policy, **{k: state_dict[k] for k in knobs})
