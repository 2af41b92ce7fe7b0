"""The one check of a :class:`~lossscale.layerwise.LayerScales` checkpoint, before anything is loaded."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["checked_layer_state"]

DOOR = "LayerScales.load_state_dict"
_FIELDS = ("exponent", "level", "observed", "penalty")


def checked_layer_state(names: list[str], state: Any, like: dict[str, torch.Tensor]) -> tuple[dict, list[int]]:
    """The per-unit tensors (shaped, typed and placed as ``like``) and the chain order of ``state``.

    Rule: ``state`` is what ``LayerScales.state_dict()`` saved for the same units (``names``, in order);
    ``exponent``, ``level`` and ``penalty`` hold one finite number per unit (penalty >= 0: a factor 2**e
    with a non-finite e would multiply the gradients by inf or NaN), ``observed`` one bool per unit, and
    ``order`` distinct unit indices. Raises ValueError naming the field otherwise. No device read."""
    if not isinstance(state, dict) or not {"units", "order", *_FIELDS} <= state.keys():
        raise ValueError(f"{DOOR}(state={state!r:.80}): state must be the dict LayerScales.state_dict() returned "
                         f"(keys units, order, {', '.join(_FIELDS)}).")
    if state["units"] != names:
        raise ValueError(f"{DOOR}: the checkpoint's units {state['units']!r} differ from this model's {names!r}.")
    tensors = {k: _field(k, state[k], like[k]) for k in _FIELDS}
    order = state["order"]
    if not (isinstance(order, (list, tuple)) and len(set(order)) == len(order) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(names) for i in order)):
        raise ValueError(f"{DOOR}: order must list distinct unit indices in [0, {len(names)}); got {order!r}.")
    return tensors, list(order)


def _field(name: str, value: Any, like: torch.Tensor) -> torch.Tensor:
    """One per-unit field as a tensor like ``like``, or a ValueError naming it."""
    bools = like.dtype == torch.bool
    wanted = f"{like.numel()} {'bools' if bools else 'finite numbers'}" + (" >= 0" if name == "penalty" else "")
    values = _as_float64(value)
    ok = values is not None and tuple(values.shape) == tuple(like.shape) and bool(torch.isfinite(values).all())
    if ok and bools:
        ok = (value.dtype == torch.bool) if isinstance(value, torch.Tensor) else all(isinstance(v, bool) for v in value)
    if ok and name == "penalty":
        ok = not bool((values < 0).any())
    if not ok:
        raise ValueError(f"{DOOR}: {name} must hold {wanted}, one per unit; got {value!r:.120}.")
    return values.to(like.dtype).to(like.device)


def _as_float64(value: Any) -> torch.Tensor | None:
    try:
        return torch.as_tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return None
