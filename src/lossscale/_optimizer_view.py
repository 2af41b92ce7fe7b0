"""A ``torch.optim.Optimizer`` that is a view of another one: its param_groups, state and defaults.

A wrapper that subclasses ``Optimizer`` without running ``Optimizer.__init__`` lacks the hook tables, so
``register_step_pre_hook`` and its kin raise, and ``step`` is not wrapped to call them. This base sets
the tables up and patches ``step`` as ``Optimizer.__init__`` does, but keeps no param_groups of its own:
reading or assigning ``param_groups``, ``state`` and ``defaults`` goes to the inner optimizer, so LR
schedulers, hooks and code written for torch optimizers see the inner one's groups. ``state_dict`` and
``load_state_dict`` of a subclass call :meth:`_state_dict_with_hooks` / :meth:`_load_with_hooks` so the
registered state-dict hooks run as on any torch optimizer.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch

__all__ = ["OptimizerView"]


class OptimizerView(torch.optim.Optimizer):
    """A torch optimizer whose groups, state and defaults are ``inner``'s."""

    inner: torch.optim.Optimizer

    def _init_view(self, inner: torch.optim.Optimizer) -> None:
        """What ``Optimizer.__init__`` sets up, minus the parameter groups (they are ``inner``'s)."""
        self.inner = inner
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._patch_step_function()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer."""
        self.inner.add_param_group(param_group)

    def _state_dict_with_hooks(self, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``build()`` between the registered state-dict pre hooks and post hooks (torch's order)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = build()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            changed = post_hook(self, state_dict)
            if changed is not None:
                state_dict = changed
        return state_dict

    def _load_with_hooks(self, state_dict: dict[str, Any], load: Callable[[dict[str, Any]], None]) -> None:
        """``load(state_dict)`` between the registered load pre hooks (which may replace it) and post hooks."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            changed = pre_hook(self, state_dict)
            if changed is not None:
                state_dict = changed
        load(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
