"""``WrapsInner``: a torch optimizer that wraps another shows the inner one's ``param_groups``, ``state`` and
``defaults`` as its own (read and assigned through), as torch's LR schedulers and checkpoint code expect."""

from __future__ import annotations

from typing import Any

import torch


class WrapsInner(torch.optim.Optimizer):
    """The inner optimizer's groups, state and defaults, read and set through ``self.inner`` (set by the subclass)."""

    inner: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value
