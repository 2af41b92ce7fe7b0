"""Checkpoints of a :class:`~lossscale.LossScaleOptimizer`: one dict, validated whole before it is loaded.

Keys: ``inner`` (the inner optimizer's state_dict), ``policy_state`` (every field of the scale's state),
``micro_step`` and ``boundaries`` (the accumulation position), and where they apply ``accumulated_grads``
and ``window`` (saved mid-window), ``ema``, ``schedule`` and ``seen_switch``.
"""

from __future__ import annotations

from typing import Any

from lossscale._validate import check_int_in_range, unlike_tensor
from lossscale.state import checked_state_dict

__all__ = ["optimizer_state_dict", "load_optimizer_state_dict"]

_REQUIRED = ("inner", "policy_state", "micro_step", "boundaries")


def optimizer_state_dict(opt: Any) -> dict[str, Any]:
    """Everything a resumed run needs to continue the same trajectory (reads the scale state on the host)."""
    run = opt._run
    out: dict[str, Any] = {
        "inner": opt.inner.state_dict(),
        "policy_state": opt._owner.state_dict(),
        "micro_step": run.micro,
        "boundaries": run.boundaries,
    }
    if run.micro:  # mid-window: the gradients accumulated so far are part of the position
        out["accumulated_grads"] = [None if p.grad is None else p.grad.detach().clone()
                                    for g in opt.inner.param_groups for p in g["params"]]
        out["window"] = run.window
    if opt.options.ema is not None:
        out["ema"] = opt.options.ema.state_dict()
    if run.layers is not None:
        out["layerwise"] = run.layers.state_dict()
    if run.schedule is not None:
        out["schedule"] = run.schedule.state_dict()
        out["seen_switch"] = run.seen_switch
    return out


def _validated_position(door: str, state_dict: dict[str, Any], accumulation_steps: int) -> tuple[int, int]:
    checked_state_dict(door, state_dict, _REQUIRED, " A plain torch optimizer's state_dict goes to "
                       "opt.inner.load_state_dict(...).")
    micro, boundaries = state_dict["micro_step"], state_dict["boundaries"]
    check_int_in_range(door, "micro_step", micro, 0, accumulation_steps - 1)
    check_int_in_range(door, "boundaries", boundaries, 0, 2**62)
    return micro, boundaries


_PRECISIONS = (None, "float16", "bfloat16", "float32")  # what a window records (OptimizerHooks._precision)


def _validated_window(door: str, state_dict: dict[str, Any], params: list[Any], micro: int) -> list[Any]:
    """The gradients accumulated so far (one entry per parameter: None, or a tensor of its shape and dtype)
    and the window's decision ``(scaled, precision)``, both required mid-window and refused otherwise."""
    grads, window = state_dict.get("accumulated_grads"), state_dict.get("window")
    if not micro:
        if grads is not None or window is not None:
            raise ValueError(f"{door}: micro_step=0 (a window's start) holds no accumulated_grads or window; got "
                             f"accumulated_grads={'...' if grads is not None else None}, window={window!r}.")
        return [None] * len(params)
    if not isinstance(grads, (list, tuple)) or len(grads) != len(params):
        got = f"{len(grads)} entries" if isinstance(grads, (list, tuple)) else repr(type(grads).__name__)
        raise ValueError(f"{door}: micro_step={micro} (mid-window) needs accumulated_grads, one entry (None or a "
                         f"tensor) per parameter of the inner optimizer ({len(params)}); got {got}.")
    for i, (p, grad) in enumerate(zip(params, grads)):
        got = None if grad is None else unlike_tensor(grad, p)
        if got is not None:
            raise ValueError(f"{door}: accumulated_grads[{i}] must be None or a {p.dtype} tensor of shape "
                             f"{tuple(p.shape)} (its parameter's); got {got}.")
    if not (isinstance(window, (list, tuple)) and len(window) == 2 and isinstance(window[0], bool)
            and window[1] in _PRECISIONS):
        raise ValueError(f"{door}: micro_step={micro} (mid-window) needs window = (scaled: bool, precision: one of "
                         f"{list(_PRECISIONS)}); got {window!r}.")
    return list(grads)


def _parts(opt: Any, state_dict: dict[str, Any]) -> list[tuple[str, Any]]:
    """(key, owner) of each optional part the optimizer has and the checkpoint holds."""
    run = opt._run
    parts = [("ema", opt.options.ema), ("layerwise", run.layers), ("schedule", run.schedule)]
    return [(key, owner) for key, owner in parts if owner is not None and key in state_dict]


def _check_parts(door: str, opt: Any, state_dict: dict[str, Any]) -> None:
    """The EMA's, the per-layer scales' and the schedule's parts, each by its owner's own check (changes
    nothing), so that a bad part is refused before the scale or the inner optimizer is loaded."""
    for key, owner in _parts(opt, state_dict):
        owner.check_state_dict(state_dict[key])
    if "seen_switch" in state_dict and not isinstance(state_dict["seen_switch"], bool):
        raise ValueError(f"{door}: seen_switch must be a bool (whether the run reported its switch back to the "
                         f"original precision); got {state_dict['seen_switch']!r}.")


def load_optimizer_state_dict(opt: Any, state_dict: dict[str, Any]) -> None:
    """Restore what :func:`optimizer_state_dict` saved; nothing changes unless every part is valid."""
    door = "LossScaleOptimizer.load_state_dict"
    run = opt._run
    micro, boundaries = _validated_position(door, state_dict, opt.options.accumulation_steps)
    params = [p for g in opt.inner.param_groups for p in g["params"]]
    grads = _validated_window(door, state_dict, params, micro)
    _check_parts(door, opt, state_dict)
    before = opt._owner.state_dict()
    opt._owner.load_state_dict(state_dict["policy_state"], f"{door} (key 'policy_state')")
    try:
        opt.inner.load_state_dict(state_dict["inner"])
    except Exception:
        opt._owner.load_state_dict(before)
        raise
    run.micro, run.boundaries = micro, boundaries
    for p, grad in zip(params, grads):
        p.grad = None if grad is None else grad.to(p.device).clone()
    run.window = None if state_dict.get("window") is None else tuple(state_dict["window"])
    for key, owner in _parts(opt, state_dict):
        owner.load_state_dict(state_dict[key])
    if run.schedule is not None and "schedule" in state_dict:
        run.seen_switch = state_dict.get("seen_switch", run.schedule.switched)
