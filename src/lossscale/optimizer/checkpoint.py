"""The checks of a :class:`~lossscale.LossScaleOptimizer` checkpoint, run whole before anything is loaded.

Keys: ``inner`` (the inner optimizer's state_dict), ``policy_state`` (every field of the scale's state),
``micro_step`` and ``boundaries`` (the accumulation position), and where they apply ``accumulated_grads``
and ``window`` (saved mid-window: ``(scaled, None)``), ``loss_finite`` (mid-window, where the losses are watched),
and one entry per add-on with a ``key`` (``ema``, ``schedule``, ``diagnosis``) and ``layerwise``.

Checkpoints saved before the add-ons held their own state still load (:func:`migrated`): a top-level ``seen_switch``
becomes the schedule's ``reported``, and a window's precision the schedule's ``window``.
"""

from __future__ import annotations

from typing import Any

from lossscale.validation import unlike_tensor, validate_int_in_range, validated_state_dict

_REQUIRED = ("inner", "policy_state", "micro_step", "boundaries")


def validated_position(call: str, state_dict: dict[str, Any], accumulation_steps: int) -> tuple[int, int]:
    """(micro_step, boundaries) of a checkpoint holding every required key."""
    validated_state_dict(
        call, state_dict, _REQUIRED, " A plain torch optimizer's state_dict goes to opt.inner.load_state_dict(...)."
    )
    micro, boundaries = state_dict["micro_step"], state_dict["boundaries"]
    validate_int_in_range(call, "micro_step", micro, 0, accumulation_steps - 1)
    validate_int_in_range(call, "boundaries", boundaries, 0, 2**62)
    return micro, boundaries


_PRECISIONS = (None, "float16", "bfloat16", "float32")  # what a window records


def validated_window(
    call: str, state_dict: dict[str, Any], params: list[Any], micro: int
) -> tuple[list[Any], bool | None]:
    """The gradients accumulated so far (one entry per parameter: None, or a tensor of its shape and dtype)
    and whether the window scales its losses (saved as ``(scaled, precision)``; a precision of an older checkpoint
    is the schedule's, :func:`migrated`), both required mid-window and refused otherwise."""
    grads, window = state_dict.get("accumulated_grads"), state_dict.get("window")
    if not micro:
        if grads is not None or window is not None:
            raise ValueError(
                f"{call}: micro_step=0 (a window's start) holds no accumulated_grads or window; got "
                f"accumulated_grads={'...' if grads is not None else None}, window={window!r}."
            )
        return [None] * len(params), None
    if not isinstance(grads, (list, tuple)) or len(grads) != len(params):
        size = f"{len(grads)} entries" if isinstance(grads, (list, tuple)) else repr(type(grads).__name__)
        raise ValueError(
            f"{call}: micro_step={micro} (mid-window) needs accumulated_grads, one entry (None or a "
            f"tensor) per parameter of the inner optimizer ({len(params)}); got {size}."
        )
    for i, (p, grad) in enumerate(zip(params, grads)):
        got = None if grad is None else unlike_tensor(grad, p)
        if got is not None:
            raise ValueError(
                f"{call}: accumulated_grads[{i}] must be None or a {p.dtype} tensor of shape "
                f"{tuple(p.shape)} (its parameter's); got {got}."
            )
    if not (
        isinstance(window, (list, tuple))
        and len(window) == 2
        and isinstance(window[0], bool)
        and window[1] in _PRECISIONS
    ):
        raise ValueError(
            f"{call}: micro_step={micro} (mid-window) needs window = (scaled: bool, precision: one of "
            f"{list(_PRECISIONS)}); got {window!r}."
        )
    return list(grads), window[0]


def validated_loss_finite(call: str, state_dict: dict[str, Any], micro: int) -> bool | None:
    """Whether every loss of the window so far was finite (saved mid-window for a policy that observes the losses),
    or None where the checkpoint holds no such entry."""
    finite = state_dict.get("loss_finite")
    if finite is None:
        return None
    if not micro:
        raise ValueError(f"{call}: micro_step=0 (a window's start) holds no loss_finite; got loss_finite={finite!r}.")
    if not isinstance(finite, bool):
        raise ValueError(
            f"{call}: loss_finite must be a bool (whether every loss of the window so far was finite); got {finite!r}."
        )
    return finite


def migrated(call: str, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` as this version saves it (a new dict where anything moved; the caller's is never changed):
    a top-level ``seen_switch`` (whether the run reported its switch back to the original precision) becomes the
    ``schedule`` entry's ``reported``, and a mid-window ``window``'s precision that entry's ``window``.

    Raises:
        ValueError: ``seen_switch`` is not a bool.
    """
    if not isinstance(state_dict, dict) or "seen_switch" not in state_dict:
        return state_dict
    seen = state_dict["seen_switch"]
    if not isinstance(seen, bool):
        raise ValueError(
            f"{call}: seen_switch must be a bool (whether the run reported its switch back to the "
            f"original precision); got {seen!r}."
        )
    out = {k: v for k, v in state_dict.items() if k != "seen_switch"}
    schedule = out.get("schedule")
    if isinstance(schedule, dict):
        schedule = {**schedule, "reported": seen}
        window = out.get("window")
        if isinstance(window, (list, tuple)) and len(window) == 2 and window[1] is not None:
            schedule["window"] = window[1]
        out["schedule"] = schedule
    return out
