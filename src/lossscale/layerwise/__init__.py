"""Per-layer loss scales: one extra power-of-two factor per parameter-owning module, on top of the global scale.

:class:`LayerScales` keeps an exponent ``e[m] >= 0`` per module (a *unit*). Inside unit m the backward pass, and
so its parameters' gradients, carry ``S * 2**e[m]`` (S: the global loss scale); between units a gradient carries
``S * 2**s``, where ``s`` belongs to the *region* it flows through (the tensors joined by operations outside the
units). Hooks convert at each unit's edges::

    gradient entering m (sum over readers of m's outputs)  *= 2 ** (e[m] - s(output region))
    gradient leaving m into its inputs (m's share only)    *= 2 ** (s(input region) - e[m])
    s(region) = e[n]  if unit n is the region's only reader (no other unit, no loss, no leaf, no parameter)
              = 0     else (a residual stream, the loss side, a region holding parameters outside the units)

A chain of units (nn.Sequential) thus hands each factor on without leaving float16's range, and any wiring is
exact. The regions are read from the autograd graph at the first backward pass (walking back from the units'
inputs, the model's outputs and the loss given to ``backward_from``), and again when the units that run, their
order, their numbers of tensor inputs and outputs, whether the loss was given, or the units kept in float32 change.
A factor's rule::

    group     = units that share a parameter: one exponent (the smallest of their targets), so every use of
                the parameter carries one factor; a unit parameter read outside its unit pins its group at 0
    kept      = a unit keep_float32 runs in float32 (itself, or a module around it in a model given whole)
                computes its gradients in float32: its group is pinned at 0 once all its units are kept
    C = log2(float16's largest value): no factor lifts a unit's scaled maximum above 2**(C - margin)
    first backward: each group's exponent is set as the gradient reaches it (no calibration steps):
        a[m]  = log2 max|gradient entering m| - s(output region);  T = max of a over the units reached so far
        e[m]  = clamp(floor(min(T, C) - a[m]) - margin, 0, max_exponent)   (a not finite or zero: e[m] = s)
    update (after unscale_, every step):
        level[m]  = moving average of log2(unscaled amax[m])           (clean steps, amax > 0)
        top       = min(max_j level[j], C - log2 S)                    (the largest unit may compute in float32)
        e[m]      = clamp(floor(top - level[m]) - margin - penalty[m], 0, max_exponent)
        blind     = ran, clean, amax[m] == 0, and its output region's reader saw nonzero gradients (or has none)
        e[m]      = e[reader] if e[m] < e[reader] else e[m] + search_step, while blind
        culprits  = overflowing units none of whose readers that ran later overflowed too (an inf spreads from
                    a unit into the units that ran before it and feed it; a reader: a unit reading a region m writes)
        penalty[culprit] += 1 if e[culprit] > 0; penalties decay by 1 / forget_interval per step
        returns found_inf for the global policy: an overflow with a culprit at e == 0 (the global scale's), or
        with no culprit (only the parameters outside the units overflowed)

A backward pass whose loss was not scaled (``is_scaled()`` False when it starts: a front end's answer while it
does not scale, as in a precision schedule's float32 or bfloat16 phase) goes through unchanged: no factor is
applied and the first-backward rule waits for the first scaled pass.

Requirements (checked where they can be): each unit runs once per forward (a recomputation inside the backward
pass, activation checkpointing without reentrance, is left alone; with ``use_reentrant=True`` it raises); tensors
enter a unit as arguments (directly, or in tuples, lists and dicts) and leave it as its outputs; no unit contains
another; the loss reads the model's outputs (in list mode: only tensors that no unit reads); in list mode the
loss is given to ``backward_from`` (else a unit weight read after the units goes unseen: the first backward pass
warns); who reads a tensor changes only with the units that run, their order or their numbers of tensor inputs and
outputs.

Cost: two tiny ops per unit edge per backward, an identity node per unit input that is not the only reader of
its region; per step one read and one write pass over the gradients and about twenty element-wise ops on
``[units]`` tensors. One time: the wiring read (a walk over the autograd graph in Python) and, in the first
backward, one amax per unit's output gradient (under torch.distributed, with one MAX all-reduce per group of units,
so that every rank sets the same factors, after one check that every rank ran the same units: the only host read,
once). No host read otherwise.

The package by job: ``wiring.py`` (the units, what a forward showed, the regions read from the graph),
``hooks.py`` (the module and tensor hooks, the identity Function), ``rule.py`` (the exponents' first values and
update, the factors, the saved record's check); :class:`LayerScales` holds the state and runs them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch

from lossscale import stages
from lossscale.layerwise.hooks import Recorder, times, unit_of
from lossscale.layerwise.rule import (
    FIELDS,
    Factors,
    FirstBackward,
    Levels,
    Rule,
    SavedLayers,
    edge_factors,
    first_exponent,
    tied,
    updated,
    validated_layer_state,
)
from lossscale.layerwise.wiring import Units, Wiring, chain_wiring, find_units, read_wiring
from lossscale.ops import distributed as _dist
from lossscale.ops.clip import norms
from lossscale.validation import validate_process_group

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["LayerScales"]


def _always() -> bool:
    return True


@dataclass
class _Backward:
    """The backward pass under way (or the last one): whether it applies factors, and the first pass's state."""

    scaling: bool = True  # False: its loss is not scaled, and every hook returns the gradient as it is
    first: FirstBackward | None = None  # the first scaled backward pass: it sets the exponents


class _GradientIndex(NamedTuple):
    """For the gradients :meth:`LayerScales.unscale_` reads: each (unit, gradient) pair's unit and gradient (device
    tensors), and the gradients' positions grouped by the exponent index that divides them (units: the global
    scale)."""

    owner: torch.Tensor
    which: torch.Tensor
    by_factor: list[tuple[int, list[int]]]


class LayerScales:
    """One power-of-two factor per module on top of the global loss scale, applied by hooks at the units' edges.

    Exact for any wiring (residual streams, branches); units that share a parameter (tied input and output
    embeddings) form one group with one factor, so the parameter's gradient is unscaled exactly; parameters outside
    every unit follow the global scale (pass them to :meth:`unscale_` as ``params``). The first backward pass sets
    every factor. The rule, the wiring it reads and its costs: see the module docstring.

    By hand: ``backward_from(loss * S).backward()``, then ``update(*unscale_(S), S)``. In a front end of its own
    (:class:`~lossscale.optimizer.layerwise.LayerwiseOptimizer`, what ``LossScaleOptimizer(..., layerwise=...)``
    builds): :meth:`bind` takes the front end's parameters, process group and ``is_scaled``; the front end passes
    each scaled loss to :meth:`backward_from`; :meth:`unscale` unscales and checks every gradient of the front end's
    parameters; :meth:`layer_scales` gives the result's ``layer_scales``; :meth:`update_observed` moves the
    exponents and returns the found_inf the global policy sees.

    Args:
        modules: A model (every module that owns parameters directly becomes a unit) or a list of modules, none
            inside another (each becomes a unit with all its parameters: a residual block is one unit). Each unit
            costs host time, so on a GPU pass the blocks (docs/layerwise.md, "Choosing the units").
        margin: Powers of two each unit stays below the largest unit's scaled maximum (>= 0).
        search_step: Powers of two a unit whose gradients are all zero rises per step (>= 1).
        max_exponent: Largest factor, as a power of two (>= 1).
        history: Steps the per-unit level averages over (>= 1).
        forget_interval: Steps to forget one power of two of a unit's overflow penalty (>= 1).
        device: Where the per-unit state lives (default: the first parameter's device).
        process_group: Under torch.distributed, the ranks that agree on the first backward pass's factors (None:
            the world). Every rank of it must run the same units in that pass (as data parallelism does; checked
            first, with one all-reduce and one host read, and refused with a RuntimeError otherwise); it then holds
            one all-reduce (MAX) per group of units. Outside torch.distributed, or in a group of one rank, nothing
            is reduced.

    Attributes:
        is_scaled: Called with no argument at the start of each backward pass: whether that pass's loss carries
            the loss scale. False: the hooks pass every gradient through unchanged (and :meth:`unscale_` must not
            run on it). Default: always True, for a caller that scales every loss; :meth:`bind` sets it to the
            front end's.
        process_group: As the argument; :meth:`bind` sets it to the front end's.

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

    key: ClassVar[str | None] = "layerwise"
    label: ClassVar[str] = "per-layer scales"

    def __init__(
        self,
        modules: torch.nn.Module | Sequence[torch.nn.Module],
        *,
        margin: int = 1,
        search_step: int = 8,
        max_exponent: int = 64,
        history: int = 8,
        forget_interval: int = 1000,
        device: torch.device | str | None = None,
        process_group: ProcessGroup | None = None,
    ) -> None:
        self._rule = Rule(margin, search_step, max_exponent, history, forget_interval)
        validate_process_group("LayerScales", process_group)
        self.process_group = process_group
        self.is_scaled: Callable[[], bool] = _always
        # set once
        self._units: Units = find_units(modules, device)
        self._device: torch.device = self._units.group_index.device
        # per step (and the first backward pass): the exponents and what the rule keeps
        self._levels = Levels.zeros(len(self._units), self._device)
        # when the units run in another order or wiring: read again at the next backward pass
        self._wiring: Wiring = chain_wiring([], len(self._units), self._device)
        # per backward pass
        self._backward = _Backward()
        self._factors: Factors | None = None  # edge_factors of the exponents and wiring now; None: to compute
        # once a run
        self._calibrated = False  # the first scaled backward pass (which sets the exponents) has run
        self._warned_no_loss = False
        # per bind, and per step through the front end
        self._front_end_params: tuple[torch.Tensor, ...] = ()
        self._observation: tuple[torch.Tensor, torch.Tensor] | None = None  # unscale's per-unit (found, amax)
        self._gradient_index: tuple[tuple[tuple[bool, ...], int], _GradientIndex] | None = None  # unscale_'s cache
        model = modules if isinstance(modules, torch.nn.Module) else None
        self._recorder = Recorder(self._units, model, self._current_wiring, self._scale_output, self._scale_input)

    # -- what a reader sees --------------------------------------------------------------------------
    @property
    def units(self) -> list[tuple[str, torch.nn.Module]]:
        """(name, module) of each unit, in index order."""
        return self._units.named

    @property
    def exponent(self) -> torch.Tensor:
        """Per unit, e[m] (float32): its gradients carry ``global scale * 2**e[m]``."""
        return self._levels.exponent

    @property
    def level(self) -> torch.Tensor:
        """Per unit, the moving average of log2 of its unscaled amax, less its exponent."""
        return self._levels.level

    @property
    def observed(self) -> torch.Tensor:
        """Per unit (bool), whether :attr:`level` holds a measurement."""
        return self._levels.observed

    @property
    def penalty(self) -> torch.Tensor:
        """Per unit, the overflows it caused, forgotten by ``1 / forget_interval`` per step."""
        return self._levels.penalty

    @property
    def margin(self) -> int:
        return self._rule.margin

    @property
    def search_step(self) -> int:
        return self._rule.search_step

    @property
    def max_exponent(self) -> int:
        return self._rule.max_exponent

    @property
    def history(self) -> int:
        return self._rule.history

    @property
    def forget_interval(self) -> int:
        return self._rule.forget_interval

    def parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter a unit owns, each once."""
        return [p for p, _ in self._units.unique]

    def layer_scales(self, global_scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """Unit name -> total scale (0-d tensor) its gradients carry: ``global_scale * 2**e``. No host read."""
        totals = torch.exp2(self.exponent) * global_scale.to(self._device).float()
        return dict(zip((name for name, _ in self.units), totals.unbind()))  # one op, not one per unit

    # -- what its front end calls (lossscale.optimizer.layerwise.LayerwiseOptimizer) ------------------------------
    def bind(
        self,
        call: str,
        params: Sequence[torch.Tensor],
        process_group: ProcessGroup | None,
        is_scaled: Callable[[], bool],
    ) -> None:
        """Take the front end's parameters (:meth:`unscale` measures them all), process group and ``is_scaled``;
        again whenever its options change.

        Raises:
            ValueError: none of ``params`` belongs to a unit.
        """
        if not any(id(p) in self._units.owners for p in params):
            raise ValueError(
                f"{call}(layerwise={self._units.given}): none of the inner optimizer's "
                f"{len(params)} parameters belongs to a unit of the per-layer scales; pass the "
                f"model whose parameters the optimizer updates, or modules of it."
            )
        self._front_end_params = tuple(params)
        self.process_group = process_group
        self.is_scaled = is_scaled

    def unscale(self, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`unscale_` over the front end's parameters (those outside the units at ``scale``), per unit
        [found_inf, amax] agreed over the process group (one MAX all-reduce) and kept for :meth:`update_observed`;
        returns their ``any`` (0-d bool) and ``max`` on ``scale``'s device. No host read."""
        found_u, amax_u = self.unscale_(scale, params=self._front_end_params)  # [units + 1]: the rest at the scale
        agreed = stages.agree_amax_(torch.stack([found_u.float(), amax_u.float()]), self.process_group)
        found_u, amax_u = agreed[0] > 0, agreed[1]
        self._observation = (found_u, amax_u)
        return found_u.any().to(scale.device), amax_u.max().to(scale.device)

    def update_observed(self, found_inf: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """:meth:`update` from what :meth:`unscale` kept; returns the found_inf the global policy sees (``found_inf``
        as it is where :meth:`unscale` did not run since the last call)."""
        if self._observation is None:
            return found_inf
        observation, self._observation = self._observation, None
        return self.update(*observation, scale)

    # -- by hand -------------------------------------------------------------------------------------
    def backward_from(self, loss: torch.Tensor) -> torch.Tensor:
        """Note ``loss`` as the tensor the next backward pass starts from, and return it:
        ``layers.backward_from(loss * scale).backward()``.

        The wiring walk then starts from the loss too, so it finds a unit's parameter read after the units (a tied
        output head left out of a list of units, a loss term on a unit's weights); that read carries the global
        scale, so it pins the unit's group at factor 1 and the parameter's gradient stays exact. Without the loss
        the walk starts from the units' inputs and, for a model given whole, from its outputs: in list mode such a
        read goes unseen and the parameter's gradient would mix two scales, so the first backward pass without it
        warns. Its front end calls this on every loss it scales. No host read.

        Raises:
            TypeError: ``loss`` is not a tensor.
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"LayerScales.backward_from(loss): loss must be a torch.Tensor; got {type(loss).__name__}.")
        self._recorder.note_loss(loss)
        return loss

    def unscale_(
        self, global_scale: torch.Tensor, params: Iterable[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Divide each unit's gradients by ``global_scale * 2**e[m]`` (a shared parameter's once, by its group's
        factor); return per-unit (found_inf, amax).

        found_inf: bool [units]; amax: float32 [units], the largest scaled magnitude (0 without gradients).
        DTensor gradients (FSDP2): this rank's shards are read and divided, so both are this rank's (take their
        MAX over the ranks before :meth:`update`). ``params`` (the optimizer's parameters): those no unit owns are
        divided by ``global_scale`` and measured as one more, last, entry ([units + 1]). One read pass and one
        write pass; no host read. Host ops: none per gradient where the gradients share the state's device (the
        per-tensor maxima gathered, :func:`lossscale.ops.clip.norms`), and one multi-tensor multiply per unit (its
        gradients by its factor, a 0-d tensor: torch's multi-tensor fast path, where a list of per-gradient factors
        takes one kernel per gradient on CUDA).
        """
        dev, n = self._device, len(self._units)
        unique = self._units.unique
        present = tuple(p.grad is not None for p, _ in unique)
        shard = _dist.local_shard  # a DTensor's (FSDP2's) local shard; any other tensor itself
        grads = [shard(p.grad) for p, _ in unique if p.grad is not None]
        outside = (
            []
            if params is None
            else [shard(p.grad) for p in params if id(p) not in self._units.owners and p.grad is not None]
        )
        size = n + (params is not None)
        if not grads and not outside:
            return torch.zeros(size, dtype=torch.bool, device=dev), torch.zeros(size, device=dev)
        owner, which, by_factor = self._index_gradients(present, len(outside))
        grads += outside
        if all(g.device == dev for g in grads):
            maxima = norms(grads, math.inf, torch.float32)
        else:
            maxima = torch.stack([t.to(dev) for t in torch._foreach_norm(grads, math.inf, dtype=torch.float32)])
        amax = torch.zeros(size, device=dev).scatter_reduce(0, owner, maxima[which], "amax")
        padded = torch.cat([self.exponent, self.exponent.new_zeros(1)])  # index n: the global scale
        factors = (torch.exp2(-padded) / global_scale.to(dev).float()).unbind()
        for index, positions in by_factor:
            members = [grads[i] for i in positions]
            torch._foreach_mul_(members, factors[index].to(members[0].device))
        return ~torch.isfinite(amax), amax

    def update(
        self, found_inf: torch.Tensor, amax: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Move the exponents from this step's per-unit measurements; return the global policy's found_inf
        (0-d bool, see the module's rule). ``global_scale``: the scale the step ran at (default 1).
        ``found_inf``/``amax``: what :meth:`unscale_` returned ([units], or [units + 1] whose last entry, the
        parameters outside the units, only counts towards the skip and the global scale's overflow).
        """
        dev, n = self._device, len(self._units)
        if found_inf.shape[:1] not in ((n,), (n + 1,)) or amax.shape != found_inf.shape:
            raise ValueError(
                f"LayerScales.update(found_inf, amax): both must hold one entry per unit ({n}), or "
                f"{n + 1} with the parameters outside the units last (what unscale_ returns); got "
                f"shapes {tuple(found_inf.shape)} and {tuple(amax.shape)}."
            )
        scale = torch.ones((), device=dev) if global_scale is None else global_scale.to(dev).float()
        self._levels, found = updated(
            self._rule, self._levels, self._wiring, self._units, found_inf.to(dev).bool(), amax.to(dev).float(), scale
        )
        self._factors = None
        return found

    def remove(self) -> None:
        """Remove the hooks (the model then backpropagates at the global scale only)."""
        self._recorder.remove()

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Unit names, every per-unit tensor as lists, the forward order and whether the first backward pass ran
        (reads them on the host: one sync)."""
        return {
            "units": [n for n, _ in self.units],
            "order": list(self._wiring.order),
            "calibrated": self._calibrated,
            **{k: getattr(self._levels, k).tolist() for k in FIELDS},
        }

    def validate_state_dict(self, state: object) -> None:
        """Raise the ValueError :meth:`load_state_dict` would raise for ``state``; change nothing."""
        self._validated(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, checked whole first (:meth:`validate_state_dict`). A group's units
        take their smallest exponent; the wiring is read again at the next backward pass."""
        saved = self._validated(state)
        self._levels, self._calibrated = saved.levels, saved.calibrated
        self._wiring = chain_wiring(saved.order, len(self._units), self._device, kept=self._wiring)
        self._factors = None
        self._levels.exponent = tied(self._levels.exponent, self._wiring, self._units)

    def _validated(self, state: object) -> SavedLayers:
        return validated_layer_state([n for n, _ in self.units], state, self._levels)

    def __repr__(self) -> str:
        groups = len(self._units) - len(self._units.members)
        return (
            f"LayerScales({len(self._units)} units{f', {groups} shared' if groups else ''}, "
            f"margin={self.margin}, search_step={self.search_step})"
        )

    # -- the backward pass: convert at each unit's edges ---------------------------------------------
    def _current_wiring(self) -> Wiring:
        return self._wiring

    def _scaling(self) -> bool:
        """At each hook: begin the backward pass at its first one; whether this pass applies factors (False: its
        loss is not scaled, and the hook returns the gradient as it is)."""
        if self._recorder.forward.open:
            self._begin_backward()
        return self._backward.scaling

    def _begin_backward(self) -> None:
        """At the first hook of a backward pass: read the wiring if it changed, then fix this pass's factors."""
        forward = self._recorder.take()
        if forward.key() != self._wiring.key:
            self._wiring = read_wiring(forward, self._units, unit_of, self._device)
            self._levels.exponent = tied(self._levels.exponent, self._wiring, self._units)
            self._factors = None
        # in list mode the walk's only starts past the units are the losses given to backward_from
        if not self._units.whole and not forward.roots and not self._warned_no_loss:
            self._warned_no_loss = True
            warnings.warn(
                "LayerScales (a list of units): this backward pass started from a loss it was not given, "
                "so a unit's parameter read after the units (a tied output head left out of the list, a "
                "loss term on a unit's weights) cannot be found, and its gradient would mix two scales. "
                "Pass the loss through layers.backward_from(loss) before backward (LossScaleOptimizer "
                "does), or give the model whole.",
                stacklevel=2,
            )
        self._backward = _Backward(scaling=self.is_scaled())
        if self._backward.scaling and not self._calibrated:
            if _dist.active(self.process_group):
                self._refuse_uneven_units(forward.order)
            self._calibrated = True
            self._backward.first = FirstBackward(torch.full((), -math.inf, device=self._device))
            self._factors = None

    def _refuse_uneven_units(self, order: list[int]) -> None:
        """Under torch.distributed, before the first backward pass agrees its factors unit by unit: every rank
        must have run the same units, or the ranks would issue different numbers of all-reduces (and hang). One
        all-reduce and one host read, once."""
        ran = torch.zeros(len(self._units), device=self._device)
        ran[order] = 1.0
        bounds = torch.stack([ran, -ran])  # MAX over ranks of each: ran somewhere, and -(ran everywhere)
        torch.distributed.all_reduce(bounds, op=torch.distributed.ReduceOp.MAX, group=self.process_group)
        uneven = (bounds[0] + bounds[1]).nonzero().flatten().tolist()
        if uneven:
            names = ", ".join(repr(self._units.name(i)) for i in uneven[:5]) + (", ..." if len(uneven) > 5 else "")
            raise RuntimeError(
                f"LayerScales: in the first backward pass the ranks ran different units ({len(uneven)} ran on some "
                f"ranks only: {names}), so they cannot agree on those units' factors. Under torch.distributed every "
                f"rank must run the same units in the first training step; make a module whose submodules run "
                f"conditionally (a mixture-of-experts layer) one unit: layerwise=[...] with it as one entry."
            )

    def _scale_output(self, index: int, slot: int, grad: torch.Tensor) -> torch.Tensor:
        """The gradient entering unit ``index`` through its output ``slot``, times 2 ** (e[m] - s)."""
        if not self._scaling():
            return grad
        k = self._wiring.out_position[(index, slot)]
        first = self._backward.first
        if first is not None:
            factor = self._first_backward_factor(first, index, self._wiring.out_source[k], grad)
        else:
            factor = self._edge_factors()[0][k]
        return times(grad, factor)

    def _scale_input(self, index: int, slot: int, grad: torch.Tensor) -> torch.Tensor:
        """Unit ``index``'s share of its input ``slot``'s gradient, times 2 ** (s - e[m])."""
        if not self._scaling():
            return grad
        k = self._wiring.in_position[(index, slot)]
        source = self._wiring.in_source[k]
        if source == index:
            return grad
        if self._backward.first is not None:
            factor = torch.exp2(self._region_exponent(source) - self.exponent[index])
        else:
            factor = self._edge_factors()[1][k]
        return times(grad, factor)

    def _region_exponent(self, source: int) -> torch.Tensor:
        return self.exponent[source] if source >= 0 else self.exponent.new_zeros(())

    def _first_backward_factor(self, first: FirstBackward, index: int, source: int, grad: torch.Tensor) -> torch.Tensor:
        """First backward: set the unit's group exponent from the gradient entering it (if not set yet)."""
        group = self._units.group[index]
        region = self._region_exponent(source)
        if group not in first.done:
            first.done.add(group)
            level = torch.log2(torch.linalg.vector_norm(grad, math.inf, dtype=torch.float32)).to(region.device)
            if _dist.active(self.process_group):  # every rank sets the same factors: DDP sums the gradients
                level = torch.nan_to_num(level, nan=math.inf)  # NaN is not ordered: the MAX would differ by rank
                torch.distributed.all_reduce(level, op=torch.distributed.ReduceOp.MAX, group=self.process_group)
            members = self._units.members[group]
            pinned = any(m in self._wiring.pinned for m in members)
            e = first_exponent(self._rule, first, level, region, pinned)
            for m in members:
                self.exponent[m] = e
        return torch.exp2(self.exponent[index] - region)

    def _edge_factors(self) -> Factors:
        """``rule.edge_factors`` of the exponents now, cached until they or the wiring change."""
        if self._factors is None:
            self._factors = edge_factors(self.exponent, self._wiring.slots)
        return self._factors

    def _index_gradients(self, present: tuple[bool, ...], outside: int) -> _GradientIndex:
        """:class:`_GradientIndex` for the units' parameters that have a gradient (``present``), then ``outside``
        more; built (a copy to the device) only when which gradients exist changes."""
        key = (present, outside)
        if self._gradient_index is None or self._gradient_index[0] != key:
            self._gradient_index = (key, _gradient_index(self._units, present, outside, self._device))
        return self._gradient_index[1]


def _gradient_index(units: Units, present: tuple[bool, ...], outside: int, device: torch.device) -> _GradientIndex:
    n = len(units)
    owner: list[int] = []
    which: list[int] = []
    factor_of: list[int] = []
    for (_, owners), has in zip(units.unique, present):
        if has:
            owner += owners
            which += [len(factor_of)] * len(owners)
            factor_of.append(owners[0])
    owner += [n] * outside
    which += range(len(factor_of), len(factor_of) + outside)
    factor_of += [n] * outside
    by_factor: dict[int, list[int]] = {}
    for position, index in enumerate(factor_of):
        by_factor.setdefault(index, []).append(position)
    return _GradientIndex(
        torch.tensor(owner, dtype=torch.long, device=device),
        torch.tensor(which, dtype=torch.long, device=device),
        list(by_factor.items()),
    )
