"""Exponential moving average of the weights, moved only on steps that were really applied."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lossscale.addons.base import AddOn, FrontEnd, StepOutcome
from lossscale.validation import ArgumentTypeError, unlike_tensor, validate_int_at_least


class EMA(AddOn):
    """Shadow weights ``ema = momentum * ema + (1 - momentum) * param`` after every applied step.

    A skipped step leaves the shadow unchanged. With ``overwrite_every=N`` the shadow overwrites the parameters
    every N optimizer steps unless that step was skipped (Keras's ``ema_overwrite_frequency``).
    Passes per step: one read of params and shadow, one write of the shadow; no host read.

    Args:
        momentum: In [0, 1).
        overwrite_every: None, or an int >= 1.
    """

    def __init__(self, momentum: float = 0.99, overwrite_every: int | None = None) -> None:
        _validate_config("EMA", momentum, overwrite_every)
        self.momentum = float(momentum)
        self.overwrite_every = overwrite_every
        self.params: list[torch.Tensor] = []
        self.shadow: list[torch.Tensor] = []

    key = "ema"
    label = "an EMA"

    def attach(self, front_end: FrontEnd) -> None:
        """Bind to the front end's parameters (once: attaching again keeps the average)."""
        if [id(p) for p in self.params] != [id(p) for p in front_end.params]:
            self.bind(front_end.params)

    def after_step(self, outcome: StepOutcome) -> None:
        """Move the average where the step was applied."""
        self.update(outcome.stepped, outcome.step + 1)

    def bind(self, params: Iterable[torch.Tensor]) -> None:
        """Start the average at the current values of ``params``."""
        self.params = list(params)
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, stepped: torch.Tensor, boundary: int) -> None:
        """Move the average where ``stepped`` (0-d bool); overwrite params every ``overwrite_every``."""
        if not self.params:
            return
        weight = stepped.to(self.shadow[0].dtype) * (1.0 - self.momentum)
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], weight)  # type: ignore[call-overload]  # a 0-d tensor weight: torch takes it, its stubs list numbers only
        if self.overwrite_every and boundary % self.overwrite_every == 0:
            torch._foreach_lerp_(  # type: ignore[call-overload]  # a 0-d tensor weight, as above
                [p.detach() for p in self.params], self.shadow, stepped.to(self.shadow[0].dtype)
            )

    @torch.no_grad()
    def copy_to(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Write the shadow weights into ``params`` (default: the bound parameters), e.g. for evaluation."""
        for p, s in zip(self.params if params is None else list(params), self.shadow):
            p.copy_(s)

    def state_dict(self) -> dict[str, Any]:
        return {
            "momentum": self.momentum,
            "overwrite_every": self.overwrite_every,
            "shadow": [s.clone() for s in self.shadow],
        }

    def validate_state_dict(self, state: object) -> None:
        """Raise unless ``state`` is what :meth:`state_dict` saved for this EMA (same momentum and overwrite_every,
        one finite shadow per parameter, of its shape and dtype). Changes nothing."""
        call = "EMA.load_state_dict"
        if not isinstance(state, dict) or not {"momentum", "overwrite_every", "shadow"} <= state.keys():
            raise ValueError(
                f"{call}(state={state!r:.80}): state must be the dict EMA.state_dict() returned "
                f"(keys momentum, overwrite_every, shadow)."
            )
        saved, ours = (state["momentum"], state["overwrite_every"]), (self.momentum, self.overwrite_every)
        if saved != ours:
            raise ValueError(
                f"{call}: the checkpoint was saved by EMA(momentum={saved[0]!r}, overwrite_every="
                f"{saved[1]!r}); this one is EMA(momentum={ours[0]!r}, overwrite_every={ours[1]!r}). "
                f"Build the EMA with the saved arguments to resume it."
            )
        shadow = state["shadow"]
        if not isinstance(shadow, (list, tuple)) or len(shadow) != len(self.shadow):
            got = f"{len(shadow)} tensors" if isinstance(shadow, (list, tuple)) else type(shadow).__name__
            raise ValueError(
                f"{call}: shadow must hold one tensor per tracked parameter ({len(self.shadow)}); got {got}."
            )
        for i, (ours_t, theirs) in enumerate(zip(self.shadow, shadow)):
            unlike = unlike_tensor(theirs, ours_t, finite=True)
            if unlike is not None:
                raise ValueError(
                    f"{call}: shadow[{i}] must be a finite {ours_t.dtype} tensor of shape "
                    f"{tuple(ours_t.shape)}; got {unlike}."
                )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, checked whole first (one host read per tensor)."""
        self.validate_state_dict(state)
        with torch.no_grad():
            for s, v in zip(self.shadow, state["shadow"]):
                s.copy_(v)


def _validate_config(call: str, momentum: object, overwrite_every: object) -> None:
    """momentum a number in [0, 1); overwrite_every None or an int >= 1."""
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
        raise ArgumentTypeError(
            f"{call}(momentum={momentum!r}): momentum must be a number in [0, 1); got {type(momentum).__name__}."
        )
    if not (0.0 <= momentum < 1.0):
        raise ValueError(f"{call}(momentum={momentum!r}): momentum must be in [0, 1); got {momentum!r}.")
    if overwrite_every is not None:
        validate_int_at_least(call, "overwrite_every", overwrite_every, 1)
