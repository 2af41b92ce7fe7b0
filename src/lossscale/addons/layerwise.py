"""Per-layer loss scales: one extra power-of-two factor per parameter-owning module, on top of the global scale.

:class:`LayerScales` keeps an exponent ``e[m] >= 0`` per module (a *unit*); hooks on each unit's output
tensors multiply the gradient entering the unit so that its backward, and its parameters' gradients, carry
``S * 2**e[m]`` (S: the global loss scale)::

    grad_output[m] *= 2 ** (e[m] - e[next(m)])      # next(m): the unit that ran after m (none: e = 0)

After backward, :meth:`LayerScales.unscale_` divides each unit's gradients by its total scale and measures
per unit found_inf and amax; :meth:`LayerScales.update` then moves the exponents::

    level[m]  = moving average of log2(unscaled amax[m])           (clean steps, amax > 0)
    e[m]      = clamp(floor(max_j level[j] - level[m]) - margin - penalty[m], 0, max_exponent)
                # equalise: every unit's scaled maximum near the largest unit's, which the global policy keeps safe
    blind     = ran, clean, amax[m] == 0, and next(m) saw nonzero gradients (or m is last)
    e[m]      = e[next(m)] if e[m] < e[next(m)] else e[m] + search_step, while blind  (calibration)
    culprit   = the overflowing unit nearest the loss (an inf spreads to every unit before it in backward)
    penalty[culprit] += 1 if e[culprit] > 0; penalties decay by 1 / forget_interval per step
    returns found_inf for the global policy: only an overflow whose culprit has e == 0 (it is the global scale's)

Requirements (checked where they can be): the units form a chain in backward (nn.Sequential-like; a residual
block is one unit), each runs once per forward, no parameter is shared by two units, and no unit that owns
parameters also contains other units.

Cost: two tiny ops per unit per backward; per step one read and one write pass over the gradients and about
twenty element-wise ops on ``[units]`` tensors. No host read.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from lossscale.checks import check_int_at_least

__all__ = ["LayerScales"]


def _units(source: torch.nn.Module | Sequence[torch.nn.Module]
           ) -> list[tuple[str, torch.nn.Module, list[torch.nn.Parameter]]]:
    """(name, module, parameters) for every module that owns parameters directly (its own parameters),
    or for each module given (all its parameters: a residual block is one unit)."""
    if isinstance(source, torch.nn.Module):
        found = [(n or type(source).__name__, m) for n, m in source.named_modules()
                 if any(p.requires_grad for p in m.parameters(recurse=False))]
        containers = [n for n, m in found if any(c is not m and any(True for _ in c.parameters(recurse=False))
                                                   for c in m.modules())]
        if containers:
            raise ValueError(f"LayerScales(model): module {containers[0]!r} owns parameters directly and also "
                             f"contains modules with parameters, so its own parameters' gradients have no single "
                             f"place in the backward chain; wrap them in a submodule, or pass a list of modules "
                             f"that form a chain.")
        return [(n, m, list(m.parameters(recurse=False))) for n, m in found]
    modules = list(source)
    if not modules or not all(isinstance(m, torch.nn.Module) for m in modules):
        raise TypeError(f"LayerScales(modules): modules must be a torch.nn.Module or a non-empty sequence of them; "
                        f"got {type(source).__name__} of {[type(m).__name__ for m in modules][:4]}.")
    return [(f"{i}:{type(m).__name__}", m, list(m.parameters())) for i, m in enumerate(modules)]


class LayerScales:
    """One power-of-two factor per module on top of the global loss scale, applied by gradient hooks.

    Args:
        modules: A model (every module that owns parameters directly becomes a unit) or a list of modules
            that form a chain in backward.
        margin: Powers of two each unit stays below the largest unit's scaled maximum (>= 0).
        search_step: Powers of two a unit whose gradients are all zero rises per step (>= 1).
        max_exponent: Largest factor, as a power of two (>= 1).
        history: Steps the per-unit level averages over (>= 1).
        forget_interval: Steps to forget one power of two of a unit's overflow penalty (>= 1).
        device: Where the per-unit state lives (default: the first parameter's device).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> layers = LayerScales(model)
        >>> model(torch.ones(2, 4)).sum().mul(8.0).backward()
        >>> found, amax = layers.unscale_(torch.tensor(8.0))
        >>> bool(layers.update(found, amax))
        False
        >>> sorted(layers.layer_scales(torch.tensor(8.0)))
        ['0', '1']
    """

    def __init__(self, modules: torch.nn.Module | Sequence[torch.nn.Module], *, margin: int = 1,
                 search_step: int = 8, max_exponent: int = 64, history: int = 8, forget_interval: int = 1000,
                 device: torch.device | str | None = None) -> None:
        call = "LayerScales"
        for name, value, low in (("margin", margin, 0), ("search_step", search_step, 1),
                                 ("max_exponent", max_exponent, 1), ("history", history, 1),
                                 ("forget_interval", forget_interval, 1)):
            check_int_at_least(call, name, value, low)
        self.margin, self.search_step, self.max_exponent = margin, search_step, max_exponent
        self.history, self.forget_interval = history, forget_interval
        found = _units(modules)
        self.units = [(name, module) for name, module, _ in found]
        self._params = [params for _, _, params in found]
        self._check_shared()
        n = len(self.units)
        if device is None:
            device = next(p for params in self._params for p in params).device
        self.exponent = torch.zeros(n, device=device)
        self.level = torch.zeros(n, device=device)
        self.observed = torch.zeros(n, dtype=torch.bool, device=device)
        self.penalty = torch.zeros(n, device=device)
        self._order: list[int] = []  # units in the order the last forward ran them
        self._set_order([])
        self._recording: list[int] | None = None
        self._factors: torch.Tensor | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for i, (_, module) in enumerate(self.units):
            self._handles.append(module.register_forward_pre_hook(self._forward_hook(i)))
            self._handles.append(module.register_forward_hook(self._output_hook(i)))

    def _check_shared(self) -> None:
        owner: dict[int, str] = {}
        for (name, _), params in zip(self.units, self._params):
            for p in params:
                if id(p) in owner and owner[id(p)] != name:
                    raise ValueError(f"LayerScales: a parameter is shared by units {owner[id(p)]!r} and {name!r}; "
                                     f"its gradient would mix two scales. Pass a module that contains both as one "
                                     f"unit.")
                owner[id(p)] = name

    # -- hooks ---------------------------------------------------------------------------------------
    def _forward_hook(self, index: int) -> Callable[[torch.nn.Module, Any], None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled():
                return
            if self._recording is None or self._recording[:1] == [index]:  # a new forward (the last had no backward)
                self._recording = []
            if index in self._recording:
                raise RuntimeError(f"LayerScales: module {self.units[index][0]!r} ran twice in one forward; a unit "
                                   f"must run once per forward (pass the module that calls it as one unit).")
            self._recording.append(index)
        return hook

    def _output_hook(self, index: int) -> Callable[[torch.nn.Module, Any, Any], None]:
        """After the unit's forward: hook each output tensor so its gradient is scaled before the unit's backward."""
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outputs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g: self._scale_gradient(index, g))
        return hook

    def _scale_gradient(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        if self._recording is not None:  # the first hook of this backward: the forward's order is final
            if self._recording != self._order:
                self._set_order(self._recording)
            self._recording = None
        factor = self._chain_factors()[index].to(grad.device)
        # in float32: a factor can pass float16's range; a power of two, so the product is exact
        return (grad.float() * factor).to(grad.dtype)

    def _chain_factors(self) -> torch.Tensor:
        """2 ** (e[m] - e[next(m)]) per unit, for the last recorded order (cached until an update)."""
        if self._factors is None:
            self._factors = torch.exp2(self.exponent - self._downstream(self.exponent, 0.0))
        return self._factors

    def _set_order(self, order: list[int]) -> None:
        """Remember the chain order and, as index tensors, each unit's position and its downstream neighbour."""
        following, rank = [-1] * len(self.units), [-1] * len(self.units)
        for a, b in zip(order, order[1:]):
            following[a] = b
        for position, unit in enumerate(order):
            rank[unit] = position
        self._order, self._factors = list(order), None
        self._following = torch.tensor(following, device=self.exponent.device)
        self._rank = torch.tensor(rank, device=self.exponent.device)

    def _downstream(self, values: torch.Tensor, last: float | bool) -> torch.Tensor:
        """values[next(m)] per unit (``last`` for the unit that ran last, or that did not run)."""
        index = self._following
        return torch.where(index >= 0, values[index.clamp_min(0)], torch.full_like(values, last))

    # -- per step ------------------------------------------------------------------------------------
    def parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter a unit owns (the optimizer checks that its parameters are all here)."""
        return [p for params in self._params for p in params]

    def unscale_(self, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Divide each unit's gradients by ``global_scale * 2**e[m]``; return per-unit (found_inf, amax).

        found_inf: bool [units]. amax: float32 [units], the largest scaled magnitude (0 without gradients).
        One read pass and one write pass; no host read.
        """
        dev = self.exponent.device
        pairs = [(i, p.grad) for i, params in enumerate(self._params) for p in params if p.grad is not None]
        if not pairs:
            return torch.zeros(len(self.units), dtype=torch.bool, device=dev), torch.zeros(len(self.units), device=dev)
        owner = torch.tensor([i for i, _ in pairs], device=dev)
        grads = [g for _, g in pairs]
        norms = torch.stack([n.to(dev) for n in torch._foreach_norm(grads, math.inf, dtype=torch.float32)])
        amax = torch.zeros(len(self.units), device=dev).scatter_reduce(0, owner, norms, "amax")  # NaN, inf pass
        inv = (torch.exp2(-self.exponent) / global_scale.to(dev).float())[owner]
        torch._foreach_mul_(grads, [f.to(g.device) for f, g in zip(inv.unbind(), grads)])
        return ~torch.isfinite(amax), amax

    def update(self, found_inf: torch.Tensor, amax: torch.Tensor, global_scale: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Move the exponents from this step's per-unit measurements; return the global policy's found_inf
        (0-d bool, see the module's rule). ``global_scale``: the scale the step ran at (default 1).
        """
        dev = self.exponent.device
        found, amax = found_inf.to(dev).bool(), amax.to(dev).float()
        scale = torch.ones((), device=dev) if global_scale is None else global_scale.to(dev).float()
        any_bad = found.any()
        rank = self._rank
        culprit = found & (rank == torch.where(found, rank, torch.full_like(rank, -2)).max())
        local = culprit & (self.exponent > 0)

        seen = ~any_bad & torch.isfinite(amax) & (amax > 0)
        x = torch.log2(torch.where(seen, amax, torch.ones_like(amax))) - torch.log2(scale) - self.exponent
        self.level = torch.where(seen & self.observed, self.level + (x - self.level) / self.history,
                                 torch.where(seen, x, self.level))
        self.observed = self.observed | seen
        self.penalty = (self.penalty - 1.0 / self.forget_interval).clamp_min(0.0) + local.float()

        top = torch.where(self.observed, self.level, torch.full_like(self.level, -math.inf)).max()
        target = torch.floor(top - self.level) - self.margin - torch.floor(self.penalty)
        ran = rank >= 0
        blind = ran & ~self.observed & ~any_bad & (amax == 0) & self._downstream(amax > 0, True)
        downstream = self._downstream(self.exponent, 0.0)  # first pass the stream on unchanged, then search up
        searched = torch.where(self.exponent < downstream, downstream, self.exponent + self.search_step)
        exponent = torch.where(self.observed, target, torch.where(blind, searched, self.exponent))
        exponent = torch.where(local & ~self.observed, self.exponent - max(1, self.search_step // 2), exponent)
        self.exponent = exponent.clamp(0.0, float(self.max_exponent))
        self._factors = None
        return any_bad & ~local.any()

    # -- reading and checkpoints ---------------------------------------------------------------------
    def layer_scales(self, global_scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """Unit name -> total scale (0-d tensor) its gradients carry: ``global_scale * 2**e``. No host read."""
        totals = torch.exp2(self.exponent) * global_scale.to(self.exponent.device).float()
        return {name: totals[i] for i, (name, _) in enumerate(self.units)}

    def state_dict(self) -> dict[str, Any]:
        """Unit names and every per-unit tensor as lists (reads them on the host: one sync)."""
        return {"units": [n for n, _ in self.units], "order": list(self._order),
                **{k: getattr(self, k).tolist() for k in ("exponent", "level", "observed", "penalty")}}

    def check_state_dict(self, state: Any) -> tuple[dict[str, torch.Tensor], list[int]]:
        """What :meth:`load_state_dict` would install, or the error it would raise; changes nothing."""
        like = {k: getattr(self, k) for k in ("exponent", "level", "observed", "penalty")}
        return checked_layer_state([n for n, _ in self.units], state, like)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, checked whole first (:meth:`check_state_dict`)."""
        tensors, order = self.check_state_dict(state)
        for k, value in tensors.items():
            setattr(self, k, value)
        self._set_order(order)

    def remove(self) -> None:
        """Remove the hooks (the model then backpropagates at the global scale only)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __repr__(self) -> str:
        return f"LayerScales({len(self.units)} units, margin={self.margin}, search_step={self.search_step})"


_LOADER = "LayerScales.load_state_dict"
_FIELDS = ("exponent", "level", "observed", "penalty")


def checked_layer_state(names: list[str], state: Any, like: dict[str, torch.Tensor]) -> tuple[dict, list[int]]:
    """The per-unit tensors (shaped, typed and placed as ``like``) and the chain order of ``state``.

    Rule: ``state`` is what ``LayerScales.state_dict()`` saved for the same units (``names``, in order);
    ``exponent``, ``level`` and ``penalty`` (>= 0) hold one finite number per unit, ``observed`` one bool per unit,
    ``order`` distinct unit indices. Else a ValueError naming the field."""
    if not isinstance(state, dict) or not {"units", "order", *_FIELDS} <= state.keys():
        raise ValueError(f"{_LOADER}(state={state!r:.80}): state must be the dict LayerScales.state_dict() returned "
                         f"(keys units, order, {', '.join(_FIELDS)}).")
    if state["units"] != names:
        raise ValueError(f"{_LOADER}: the checkpoint's units {state['units']!r} differ from this model's {names!r}.")
    tensors = {k: _field(k, state[k], like[k]) for k in _FIELDS}
    order = state["order"]
    if not (isinstance(order, (list, tuple)) and len(set(order)) == len(order) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(names) for i in order)):
        raise ValueError(f"{_LOADER}: order must list distinct unit indices in [0, {len(names)}); got {order!r}.")
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
        raise ValueError(f"{_LOADER}: {name} must hold {wanted}, one per unit; got {value!r:.120}.")
    return values.to(like.dtype).to(like.device)


def _as_float64(value: Any) -> torch.Tensor | None:
    try:
        return torch.as_tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return None
