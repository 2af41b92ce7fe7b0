"""Exponential moving average of the weights, advanced only on steps that were really applied."""

from __future__ import annotations

from typing import Iterable

import torch

from lossscale._validate import ArgumentTypeError, check_int_at_least

__all__ = ["EMA"]


class EMA:
    """Shadow weights ``ema = momentum * ema + (1 - momentum) * param`` after every applied step.

    A skipped step leaves the shadow bit-for-bit unchanged (the update weight is 0 there), without a
    host read. With ``overwrite_every=N`` the parameters are overwritten by the shadow every N optimizer
    steps (boundaries), as Keras's ``ema_overwrite_frequency`` does, unless that step was skipped.

    Cost: one read of params and shadow and one write of the shadow per step.

    Args:
        momentum: In [0, 1).
        overwrite_every: None, or an int >= 1.
    """

    def __init__(self, momentum: float = 0.99, overwrite_every: int | None = None) -> None:
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
            raise ArgumentTypeError(f"EMA(momentum={momentum!r}): momentum must be a number in [0, 1); got "
                                    f"{type(momentum).__name__}.")
        if not (0.0 <= momentum < 1.0):
            raise ValueError(f"EMA(momentum={momentum!r}): momentum must be in [0, 1); got {momentum!r}.")
        if overwrite_every is not None:
            check_int_at_least("EMA", "overwrite_every", overwrite_every, 1)
        self.momentum = float(momentum)
        self.overwrite_every = overwrite_every
        self.params: list[torch.Tensor] = []
        self.shadow: list[torch.Tensor] = []

    def bind(self, params: Iterable[torch.Tensor]) -> None:
        """Start the average at the current values of ``params``."""
        self.params = list(params)
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, stepped: torch.Tensor, boundary: int) -> None:
        """Advance the average where ``stepped`` (0-d bool); overwrite params every ``overwrite_every``."""
        if not self.params:
            return
        weight = stepped.to(self.shadow[0].dtype) * (1.0 - self.momentum)
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], weight)
        if self.overwrite_every and boundary % self.overwrite_every == 0:
            torch._foreach_lerp_([p.detach() for p in self.params], self.shadow, stepped.to(self.shadow[0].dtype))

    @torch.no_grad()
    def copy_to(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Write the shadow weights into ``params`` (default: the bound parameters), e.g. for evaluation."""
        for p, s in zip(self.params if params is None else list(params), self.shadow):
            p.copy_(s)

    def state_dict(self) -> dict:
        return {"momentum": self.momentum, "overwrite_every": self.overwrite_every,
                "shadow": [s.clone() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError(f"EMA.load_state_dict: the checkpoint has {len(state['shadow'])} shadow tensors, "
                             f"this EMA tracks {len(self.shadow)}.")
        for s, v in zip(self.shadow, state["shadow"]):
            s.copy_(v)
