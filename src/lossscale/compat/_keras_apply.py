"""What Keras's ``apply`` does around the core step: check the gradients, write them into ``.grad``, and
Keras's EMA rules (the first applied step copies the weights; ``ema_overwrite_frequency``)."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from lossscale.compat._checks import checked_tensors

__all__ = ["KerasVariables", "checked_grads", "split_pairs", "write_grads", "keras_ema_rules"]


def checked_grads(call: str, grads: Any, variables: Sequence[torch.Tensor],
                  known: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """``grads`` as a list, one per variable (None allowed), shapes matching, not all None (Keras's
    "No gradients provided for any variable"); every variable a parameter of the inner optimizer."""
    grads = checked_tensors(call, "grads", grads, none_items=True)
    if len(grads) != len(variables):
        raise ValueError(f"{call}(grads, trainable_variables): got {len(grads)} gradients for {len(variables)} "
                         f"variables; pass one gradient (or None) per variable.")
    ids = {id(p) for p in known}
    stray = [i for i, v in enumerate(variables) if id(v) not in ids]
    if stray:
        raise ValueError(f"{call}(grads, trainable_variables): variable {stray[0]} is not a parameter of the inner "
                         f"optimizer; pass the parameters it was built with.")
    for i, (v, g) in enumerate(zip(variables, grads)):
        if g is not None and g.shape != v.shape:
            raise ValueError(f"{call}(grads, trainable_variables): grads[{i}] has shape {tuple(g.shape)}, its "
                             f"variable {tuple(v.shape)}; pass one gradient per variable, in order.")
    if all(g is None for g in grads):
        raise ValueError(f"{call}(grads=[None] * {len(grads)}): No gradients provided for any variable (as Keras "
                         f"says); nothing would be applied and the scale would count a clean step.")
    return grads


@torch.no_grad()
def write_grads(grads: Sequence[torch.Tensor | None], variables: Sequence[torch.Tensor], divisor: float) -> None:
    """Add ``g / divisor`` to each variable's ``.grad`` (a copy: the caller's tensor is never written)."""
    for v, g in zip(variables, grads):
        if g is None:
            continue
        g = g.detach().to(device=v.device, dtype=v.dtype)
        g = g / divisor if divisor != 1 else g.clone()
        if v.grad is None:
            v.grad = g
        else:
            v.grad.add_(g)


@torch.no_grad()
def keras_ema_rules(ema: Any, stepped: torch.Tensor, first: torch.Tensor, applied: torch.Tensor,
                    overwrite_frequency: int | None) -> None:
    """Keras's first applied step sets the average to the weights; ``overwrite_frequency`` then writes the
    average into the weights every so many applied steps. Masks, no host read."""
    copy = (stepped & first).to(ema.shadow[0].dtype)
    torch._foreach_lerp_(ema.shadow, [p.detach() for p in ema.params], copy)
    if overwrite_frequency:
        due = stepped & (applied % overwrite_frequency == 0)
        torch._foreach_lerp_([p.detach() for p in ema.params], ema.shadow, due.to(ema.shadow[0].dtype))


def split_pairs(call: str, grads_and_vars: Iterable[Any]) -> tuple[list[Any], list[Any]]:
    """``(grads, vars)`` from Keras's ``(gradient, variable)`` pairs; a TypeError for anything else."""
    pairs = list(grads_and_vars)
    if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
        raise TypeError(f"{call}(grads_and_vars=...): grads_and_vars must hold (gradient, variable) pairs; got "
                        f"{[type(p).__name__ for p in pairs][:4]}.")
    return [g for g, _ in pairs], [v for _, v in pairs]


class KerasVariables:
    """Keras's ``learning_rate`` and ``variables``, read from (and written to) the inner torch optimizer."""

    inner_optimizer: torch.optim.Optimizer

    @property
    def learning_rate(self) -> float:
        """The inner optimizer's learning rate (of its first param group)."""
        return self.inner_optimizer.param_groups[0]["lr"]

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        for group in self.inner_optimizer.param_groups:
            group["lr"] = value

    @property
    def variables(self) -> list[torch.Tensor]:
        """The parameters the inner optimizer updates."""
        return [p for g in self.inner_optimizer.param_groups for p in g["params"]]
