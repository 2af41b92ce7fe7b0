"""The rule of per-layer scales (the package docstring gives it as pseudo-code): the exponents' first values in the
first backward pass, their update after each step, the factors at the units' edges, and the check of a saved
record. Pure functions over device tensors: no host read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from lossscale.layerwise.wiring import SlotIndex, Units, Wiring
from lossscale.validation import validate_int_at_least

#: C in the rule: log2 of float16's largest value.
CEILING = math.log2(torch.finfo(torch.float16).max)

#: The smallest value of each of :class:`Rule`'s fields.
_LOWEST = {"margin": 0, "search_step": 1, "max_exponent": 1, "history": 1, "forget_interval": 1}


@dataclass(frozen=True)
class Rule:
    """The rule's settings, validated once (see :class:`~lossscale.layerwise.LayerScales` for each)."""

    margin: int = 1
    search_step: int = 8
    max_exponent: int = 64
    history: int = 8
    forget_interval: int = 1000

    def __post_init__(self) -> None:
        for f in fields(self):
            validate_int_at_least("LayerScales", f.name, getattr(self, f.name), _LOWEST[f.name])


@dataclass
class Levels:
    """Per unit (1-d tensors on the state's device): what the rule keeps from step to step, and what a checkpoint
    saves (with the forward order and whether the first scaled backward pass ran)."""

    exponent: torch.Tensor  # e[m]: the unit's factor is 2**e[m]
    level: torch.Tensor  # moving average of log2 of the unit's unscaled amax, less e[m]
    observed: torch.Tensor  # bool: the level holds a measurement
    penalty: torch.Tensor  # overflows the unit caused, forgotten by 1 / forget_interval per step

    @classmethod
    def zeros(cls, n: int, device: torch.device) -> Levels:
        return cls(
            exponent=torch.zeros(n, device=device),
            level=torch.zeros(n, device=device),
            observed=torch.zeros(n, dtype=torch.bool, device=device),
            penalty=torch.zeros(n, device=device),
        )


#: The names of :class:`Levels`'s fields, in a checkpoint's order.
FIELDS = tuple(f.name for f in fields(Levels))


def tied(exponent: torch.Tensor, wiring: Wiring, units: Units) -> torch.Tensor:
    """Pinned units at 0, then each group at its smallest exponent."""
    if wiring.pinned:
        exponent = exponent.index_fill(0, wiring.pinned_index, 0.0)
    if units.grouped:
        lowest = torch.full_like(exponent, math.inf).scatter_reduce(0, units.group_index, exponent, "amin")
        exponent = lowest[units.group_index]
    return exponent


@dataclass
class FirstBackward:
    """The first scaled backward pass's running state: T, and the groups whose exponent it has set."""

    top: torch.Tensor
    done: set[int] = field(default_factory=set)


def first_exponent(
    rule: Rule, first: FirstBackward, level: torch.Tensor, region: torch.Tensor, pinned: bool
) -> torch.Tensor:
    """A group's exponent from the gradient entering its first unit to run: ``level`` = log2 of that gradient's
    amax, ``region`` = the exponent its output region carries (T moves to include it)."""
    level = level - region
    ok = torch.isfinite(level)
    first.top = torch.maximum(first.top, torch.where(ok, level, first.top))
    e = torch.where(ok, torch.floor(first.top.clamp_max(CEILING) - level) - rule.margin, region)
    if pinned:
        e = torch.zeros_like(e)
    return e.clamp(0.0, float(rule.max_exponent))


#: Per output slot 2 ** (e[m] - s), per input slot 2 ** (s - e[m]): each slot's factor as a 0-d view.
Factors = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]


def edge_factors(exponent: torch.Tensor, slots: SlotIndex) -> Factors:
    """Every slot's factor at once (a hook then indexes a tuple, not the tensor, which would be one more op)."""
    padded = torch.cat([exponent, exponent.new_zeros(1)])  # the last index: a region at the global scale
    return (
        torch.exp2(exponent[slots.out_unit] - padded[slots.out_source]).unbind(),
        torch.exp2(padded[slots.in_source] - exponent[slots.in_unit]).unbind(),
    )


def updated(
    rule: Rule,
    levels: Levels,
    wiring: Wiring,
    units: Units,
    found_inf: torch.Tensor,
    amax: torch.Tensor,
    scale: torch.Tensor,
) -> tuple[Levels, torch.Tensor]:
    """The levels after one step's per-unit measurements, and the global policy's found_inf (0-d bool).

    ``found_inf`` (bool) and ``amax`` (float32): one entry per unit, or one more last (the parameters outside the
    units: it only counts towards the skip and the global scale's overflow); ``scale``: the global scale (0-d
    float32), all on the state's device.
    """
    n = len(units)
    found, amax = found_inf[:n], amax[:n]
    any_bad = found_inf.any()
    explained = (wiring.readers @ found.float()) > 0  # a later reader overflowed: the inf may have come from it
    culprit = found & ~explained
    local = culprit & (levels.exponent > 0)

    seen = ~any_bad & torch.isfinite(amax) & (amax > 0)
    x = torch.log2(torch.where(seen, amax, torch.ones_like(amax))) - torch.log2(scale) - levels.exponent
    level = torch.where(
        seen & levels.observed, levels.level + (x - levels.level) / rule.history, torch.where(seen, x, levels.level)
    )
    observed = levels.observed | seen
    penalty = (levels.penalty - 1.0 / rule.forget_interval).clamp_min(0.0) + local.float()

    top = torch.where(observed, level, torch.full_like(level, -math.inf)).max()
    top = torch.minimum(top, CEILING - torch.log2(scale))  # the largest unit may compute in float32
    target = torch.floor(top - level) - rule.margin - torch.floor(penalty)
    ran = wiring.rank >= 0
    blind = ran & ~observed & ~any_bad & (amax == 0) & _downstream(amax > 0, True, wiring)
    downstream = _downstream(levels.exponent, 0.0, wiring)  # first pass the stream on unchanged, then search up
    searched = torch.where(levels.exponent < downstream, downstream, levels.exponent + rule.search_step)
    exponent = torch.where(observed, target, torch.where(blind, searched, levels.exponent))
    exponent = torch.where(local & ~observed, levels.exponent - max(1, rule.search_step // 2), exponent)
    exponent = tied(exponent.clamp(0.0, float(rule.max_exponent)), wiring, units)
    policy_found = any_bad & ((culprit & ~local).any() | ~culprit.any())
    return Levels(exponent=exponent, level=level, observed=observed, penalty=penalty), policy_found


def _downstream(values: torch.Tensor, last: float | bool, wiring: Wiring) -> torch.Tensor:
    """values[reader of m's output region] per unit (``last`` where that region carries the global scale)."""
    index = wiring.following
    return torch.where(index >= 0, values[index.clamp_min(0)], torch.full_like(values, last))


# -- a saved record -----------------------------------------------------------------------------------------

_LOADER = "LayerScales.load_state_dict"


@dataclass(frozen=True)
class SavedLayers:
    """A saved record :func:`validated_layer_state` accepted."""

    levels: Levels
    order: list[int]  # the forward order
    calibrated: bool  # whether the first scaled backward pass ran


def validated_layer_state(names: list[str], state: object, like: Levels) -> SavedLayers:
    """The per-unit tensors (shaped, typed and placed as ``like``'s), the chain order and ``calibrated`` of
    ``state``.

    Rule: ``state`` is what ``LayerScales.state_dict()`` saved for the same units (``names``, in order);
    ``exponent``, ``level`` and ``penalty`` (>= 0) hold one finite number per unit, ``observed`` one bool per unit,
    ``order`` distinct unit indices, ``calibrated`` a bool (absent in older checkpoints: any unit observed).
    Else a ValueError naming the field."""
    if not isinstance(state, dict) or not {"units", "order", *FIELDS} <= state.keys():
        raise ValueError(
            f"{_LOADER}(state={state!r:.80}): state must be the dict LayerScales.state_dict() returned "
            f"(keys units, order, calibrated, {', '.join(FIELDS)})."
        )
    if state["units"] != names:
        raise ValueError(f"{_LOADER}: the checkpoint's units {state['units']!r} differ from this model's {names!r}.")
    levels = Levels(*(_field(k, state[k], getattr(like, k)) for k in FIELDS))
    order = state["order"]
    if not (
        isinstance(order, (list, tuple))
        and len(set(order)) == len(order)
        and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(names) for i in order)
    ):
        raise ValueError(f"{_LOADER}: order must list distinct unit indices in [0, {len(names)}); got {order!r}.")
    calibrated = state.get("calibrated", bool(levels.observed.any()))
    if not isinstance(calibrated, bool):
        raise ValueError(
            f"{_LOADER}: calibrated must be a bool (whether the first backward pass ran); got {calibrated!r}."
        )
    return SavedLayers(levels=levels, order=list(order), calibrated=calibrated)


def _field(name: str, value: object, like: torch.Tensor) -> torch.Tensor:
    """One per-unit field as a tensor like ``like``, or a ValueError naming it."""
    bools = like.dtype == torch.bool
    wanted = f"{like.numel()} {'bools' if bools else 'finite numbers'}" + (" >= 0" if name == "penalty" else "")
    values = _as_float64(value)
    ok = values is not None and tuple(values.shape) == tuple(like.shape) and bool(torch.isfinite(values).all())
    if ok and bools:
        if isinstance(value, torch.Tensor):
            ok = value.dtype == torch.bool
        else:
            ok = isinstance(value, (list, tuple)) and all(isinstance(v, bool) for v in value)
    if ok and name == "penalty":
        ok = values is not None and not bool((values < 0).any())
    if values is None or not ok:
        raise ValueError(f"{_LOADER}: {name} must hold {wanted}, one per unit; got {value!r:.120}.")
    return values.to(like.dtype).to(like.device)


def _as_float64(value: object) -> torch.Tensor | None:
    try:
        return torch.as_tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return None
