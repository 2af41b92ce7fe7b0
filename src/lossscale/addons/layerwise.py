"""Per-layer loss scales: one extra power-of-two factor per parameter-owning module, on top of the global scale.

:class:`LayerScales` keeps an exponent ``e[m] >= 0`` per module (a *unit*). Inside unit m the backward pass, and
so its parameters' gradients, carry ``S * 2**e[m]`` (S: the global loss scale); between units a gradient carries
``S * 2**s``, where ``s`` belongs to the *region* it flows through (the tensors joined by operations outside the
units). Hooks convert at each unit's boundary::

    gradient entering m (sum over readers of m's outputs)  *= 2 ** (e[m] - s(output region))
    gradient leaving m into its inputs (m's share only)    *= 2 ** (s(input region) - e[m])
    s(region) = e[n]  if unit n is the region's only reader (no other unit, no loss, no leaf, no parameter)
              = 0     else (a residual stream, the loss side, a region holding parameters outside the units)

A chain of units (nn.Sequential) thus hands each factor on without leaving float16's range, and any wiring is
exact. The regions are read from the autograd graph at the first backward pass (walking back from the units'
inputs, the model's outputs and the loss given to ``backward_from``), and again when the units that run, their
order, their numbers of tensor inputs and outputs, or whether the loss was given change. A factor's rule::

    group     = units that share a parameter: one exponent (the smallest of their targets), so every use of
                the parameter carries one factor; a unit parameter read outside its unit pins its group at 0
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

A backward pass whose loss was not scaled (``is_scaled()`` False when it starts: LossScaleOptimizer's answer in
a precision schedule's float32 or bfloat16 phase) goes through unchanged: no factor is applied and the first-backward
rule waits for the first scaled pass.

Requirements (checked where they can be): each unit runs once per forward (a recomputation inside the backward
pass, activation checkpointing without reentrance, is left alone; with ``use_reentrant=True`` it raises); tensors
enter a unit as arguments (directly, or in tuples, lists and dicts) and leave it as its outputs; no unit contains
another; the loss reads the model's outputs (in list mode: only tensors that no unit reads); in list mode the
loss is given to ``backward_from`` (else a unit weight read after the units goes unseen: the first backward pass
warns); who reads a tensor changes only with the units that run, their order or their numbers of tensor inputs and
outputs.

Cost: two tiny ops per unit boundary per backward, an identity node per unit input that is not the only reader of
its region; per step one read and one write pass over the gradients and about twenty element-wise ops on
``[units]`` tensors. One time: the wiring read (a walk over the autograd graph in Python) and, in the first
backward, one amax per unit's output gradient (under torch.distributed, with one MAX all-reduce per group of units,
so that every rank sets the same factors, after one check that every rank ran the same units: the only host read,
once). No host read otherwise.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.autograd.graph import get_gradient_edge

from lossscale.validation import validate_int_at_least, validate_process_group
from lossscale.ops import distributed as _dist
from lossscale.ops.gather import gathered

__all__ = ["LayerScales"]

#: C in the rule: log2 of float16's largest value.
_CEILING = math.log2(torch.finfo(torch.float16).max)


def _always() -> bool:
    return True


def _eager(hook: Callable) -> Callable:
    """``hook`` run eagerly under torch.compile: its bookkeeping is Python state, which dynamo would otherwise
    trace, guard on and recompile for at every unit."""
    disabled = torch.compiler.disable(hook, recursive=True)

    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # constant while dynamo traces: the call to ``disabled`` breaks the graph
            return disabled(*args, **kwargs)
        return hook(*args, **kwargs)  # eager: without the wrapper's cost (about 1 us a call)
    return run


def _times(grad: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``grad * factor`` in ``grad``'s dtype, multiplied in float32: a factor (a power of two, so the product is
    exact) can be past float16's range, where torch would cast it to the gradient's dtype first."""
    return (grad.float() * factor.to(grad.device)).to(grad.dtype)


def _in_backward() -> bool:
    """Whether this thread is inside a backward pass (where a module's forward is a recomputation)."""
    return torch._C._current_graph_task_id() != -1


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
                             f"contains modules with parameters, so its hooks would scale theirs twice; wrap its "
                             f"own parameters in a submodule, or pass a list of modules, none inside another.")
        return [(n, m, list(m.parameters(recurse=False))) for n, m in found]
    modules = list(source)
    if not modules or not all(isinstance(m, torch.nn.Module) for m in modules):
        raise TypeError(f"LayerScales(modules): modules must be a torch.nn.Module or a non-empty sequence of them; "
                        f"got {type(source).__name__} of {[type(m).__name__ for m in modules][:4]}.")
    names = [f"{i}:{type(m).__name__}" for i, m in enumerate(modules)]
    position = {id(m): i for i, m in enumerate(modules)}
    for i, m in enumerate(modules):
        if position[id(m)] != i:
            raise ValueError(f"LayerScales(modules): {names[position[id(m)]]!r} and {names[i]!r} are the same "
                             f"module; list each unit once.")
        inner = [position[id(c)] for c in m.modules() if c is not m and id(c) in position]
        if inner:
            raise ValueError(f"LayerScales(modules): unit {names[i]!r} contains unit {names[inner[0]]!r}, so its "
                             f"hooks would scale the inner unit's gradients twice; pass either the outer module or "
                             f"the modules inside it.")
    return [(name, m, list(m.parameters())) for name, m in zip(names, modules)]


def _tensors(tree: Any, plain: bool = False) -> list[torch.Tensor]:
    """The tensors that require grad in ``tree`` (tuples, lists and dicts, depth first; with ``plain``, only in
    those exact types: the ones :func:`_mapped` rebuilds)."""
    if isinstance(tree, torch.Tensor):
        return [tree] if tree.requires_grad else []
    if type(tree) in (tuple, list) if plain else isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item, plain)]
    if type(tree) is dict if plain else isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item, plain)]
    return []


def _edge(t: torch.Tensor) -> tuple[Any, int]:
    """(node, output index) where ``t``'s gradient enters the autograd graph (a leaf's: its AccumulateGrad node)."""
    node = t.grad_fn
    if node is None:
        edge = get_gradient_edge(t)
        return edge.node, edge.output_nr
    return node, t.output_nr


def _mapped(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``tree`` with ``fn`` applied to each tensor that requires grad (plain tuples, lists and dicts rebuilt)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree) if tree.requires_grad else tree
    if type(tree) in (tuple, list):
        return type(tree)(_mapped(item, fn) for item in tree)
    if type(tree) is dict:
        return {k: _mapped(v, fn) for k, v in tree.items()}
    return tree


class _UnitInput(torch.autograd.Function):
    """Identity in forward; in backward, the unit's share of its input's gradient times the input factor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layers: LayerScales, unit: int, slot: int) -> torch.Tensor:
        ctx.layers, ctx.unit, ctx.slot = layers, unit, slot
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.layers._scale_input(ctx.unit, ctx.slot, grad), None, None, None


class _FirstBackward:
    """The first backward pass's running state: T and the groups whose exponent it has set."""

    def __init__(self, device: torch.device) -> None:
        self.top = torch.full((), -math.inf, device=device)
        self.done: set[int] = set()


class LayerScales:
    """One power-of-two factor per module on top of the global loss scale, applied by hooks at the units' edges.

    Exact for any wiring (residual streams, branches); units that share a parameter (tied input and output
    embeddings) form one group with one factor, so the parameter's gradient is unscaled exactly; parameters outside
    every unit follow the global scale (pass them to :meth:`unscale_` as ``params``). The first backward pass sets
    every factor. The rule, the wiring it reads and its costs: see the module docstring.

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
            run on it). Default: always True, for a caller that scales every loss. :class:`LossScaleOptimizer`
            sets it to whether its accumulation window is scaled (not in a precision schedule's float32 or
            bfloat16 phase).
        process_group: As the argument. :class:`LossScaleOptimizer` sets it to its own ``process_group``.

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
                 device: torch.device | str | None = None, process_group: Any = None) -> None:
        call = "LayerScales"
        for name, value, low in (("margin", margin, 0), ("search_step", search_step, 1),
                                 ("max_exponent", max_exponent, 1), ("history", history, 1),
                                 ("forget_interval", forget_interval, 1)):
            validate_int_at_least(call, name, value, low)
        validate_process_group(call, process_group)
        self.process_group = process_group
        self.margin, self.search_step, self.max_exponent = margin, search_step, max_exponent
        self.history, self.forget_interval = history, forget_interval
        found = _units(modules)
        self.units = [(name, module) for name, module, _ in found]
        self._params = [params for _, _, params in found]
        n = len(self.units)
        if device is None:
            device = next((p.device for params in self._params for p in params), torch.device("cpu"))
        self._owners: dict[int, list[int]] = {}  # id(parameter) -> the units that own it
        self._unique: list[tuple[torch.nn.Parameter, list[int]]] = []  # each parameter once, with its owners
        for i, params in enumerate(self._params):
            for p in params:
                if id(p) not in self._owners:
                    self._owners[id(p)] = []
                    self._unique.append((p, self._owners[id(p)]))
                if i not in self._owners[id(p)]:
                    self._owners[id(p)].append(i)
        self._group = self._groups()
        self._members = {g: [i for i in range(n) if self._group[i] == g] for g in set(self._group)}
        self._group_index = torch.tensor(self._group, device=device)
        self.exponent = torch.zeros(n, device=device)
        self.level = torch.zeros(n, device=device)
        self.observed = torch.zeros(n, dtype=torch.bool, device=device)
        self.penalty = torch.zeros(n, device=device)
        self.is_scaled: Callable[[], bool] = _always
        self._calibrated = False  # the first scaled backward pass (which sets the exponents) has run
        self._passing = False  # this backward pass's loss is not scaled: the hooks change nothing
        self._index_cache: tuple[Any, Any] = (None, ())
        self._first: _FirstBackward | None = None
        self._pinned: list[int] = []  # units whose parameters are read outside them: factor 1
        self._order: list[int] = []  # units in the order the last forward ran them
        self._set_order([])
        self._forget_wiring()
        self._recording: list[int] | None = None
        self._ran: set[int] = set()  # the units that ran in the forward being recorded, or the last one
        self._seen: dict[str, list] = {"in": [], "out": [], "root": []}
        self._warned_no_loss = False
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for i, (_, module) in enumerate(self.units):
            self._handles.append(module.register_forward_pre_hook(_eager(self._input_hook(i)), with_kwargs=True))
            self._handles.append(module.register_forward_hook(_eager(self._output_hook(i))))
        self._model = modules if isinstance(modules, torch.nn.Module) else None
        if self._model is not None:  # the model's outputs are what the loss reads
            self._handles.append(self._model.register_forward_hook(_eager(self._root_hook)))

    def _groups(self) -> list[int]:
        """Per unit, the smallest unit index of its group (units joined by shared parameters)."""
        group = list(range(len(self.units)))

        def find(i: int) -> int:
            while group[i] != i:
                i = group[i]
            return i

        for _, owners in self._unique:
            roots = sorted({find(i) for i in owners})
            for r in roots[1:]:
                group[r] = roots[0]
        return [find(i) for i in range(len(self.units))]

    # -- forward: record what ran and where tensors enter and leave units ----------------------------
    def _input_hook(self, index: int) -> Callable[[torch.nn.Module, Any, Any], Any]:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return None
            if _in_backward():
                self._check_recomputed(index)
                return None
            self._record(index)
            wrapped = set()
            single = not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor)
            tensors = ([args[0]] if args[0].requires_grad else []) if single else _tensors((args, kwargs), plain=True)
            for slot, t in enumerate(tensors):
                # the unit is its region's only reader: the region carries its factor already
                sole = not self._changed and (index, slot) in self._sole_reader
                self._seen["in"].append((index, slot, _edge(t), not sole))
                if not sole:
                    wrapped.add(slot)
            if not wrapped:
                return None
            slots = itertools.count()

            def enter(t: torch.Tensor) -> torch.Tensor:
                slot = next(slots)
                return _UnitInput.apply(t, self, index, slot) if slot in wrapped else t

            return _mapped(args, enter), _mapped(kwargs, enter)
        return hook

    def _check_recomputed(self, index: int) -> None:
        """A unit's forward inside a backward pass: activation checkpointing recomputing it. Without reentrance
        (``use_reentrant=False``) the recomputed graph only refills saved tensors, and the hooks of the forward that
        ran with gradients apply: nothing to do. A unit that did not run with gradients in that forward is being
        recomputed to be backpropagated through (``use_reentrant=True``): its gradients cannot carry its factor."""
        if index not in self._ran:
            raise RuntimeError(
                f"LayerScales: unit {self.units[index][0]!r} ran inside a backward pass without having run with "
                f"gradients enabled in the forward. That is torch.utils.checkpoint with use_reentrant=True, which "
                f"runs the forward under no_grad and backpropagates through a recomputation, where the unit's "
                f"gradients cannot carry its factor. Checkpoint with use_reentrant=False (with transformers: "
                f"model.activation_checkpointing_enable(activation_checkpointing_kwargs={{'use_reentrant': False}}), "
                f"named gradient_checkpointing_enable(gradient_checkpointing_kwargs=...) before 5.24).")

    def _record(self, index: int) -> None:
        # a new forward (the last one had no backward: its first unit runs again)
        if self._recording is None or (self._recording and self._recording[0] == index):
            self._recording, self._ran = [], set()
            self._seen = {"in": [], "out": [], "root": []}
            self._changed = self._wiring is None
        if index in self._ran:
            raise RuntimeError(f"LayerScales: module {self.units[index][0]!r} ran twice in one forward; a unit "
                               f"must run once per forward (pass the module that calls it as one unit).")
        self._ran.add(index)
        self._recording.append(index)
        position = len(self._recording) - 1
        if position >= len(self._order) or self._order[position] != index:
            self._changed = True  # wrap every input from here on: the wiring is read again at backward

    def _output_hook(self, index: int) -> Callable[[torch.nn.Module, Any, Any], None]:
        """After the unit's forward: hook each output tensor so its gradient is scaled before the unit's backward."""
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() or self._recording is None or _in_backward():
                return
            single = isinstance(output, torch.Tensor)
            tensors = ([output] if output.requires_grad else []) if single else _tensors(output)
            for slot, t in enumerate(tensors):
                self._seen["out"].append((index, slot, _edge(t), True))
                t.register_hook(functools.partial(self._scale_output, index, slot))
        return hook

    def _root_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and self._recording is not None and not _in_backward():
            self._seen["root"] = [_edge(t) for t in _tensors(output)]

    def backward_from(self, loss: torch.Tensor) -> torch.Tensor:
        """Note ``loss`` as the tensor the next backward pass starts from, and return it:
        ``layers.backward_from(loss * scale).backward()``.

        The wiring walk then starts from the loss too, so it finds a unit's parameter read after the units (a tied
        output head left out of a list of units, a loss term on a unit's weights); that read carries the global
        scale, so it pins the unit's group at factor 1 and the parameter's gradient stays exact. Without the loss
        the walk starts from the units' inputs and, for a model given whole, from its outputs: in list mode such a
        read goes unseen and the parameter's gradient would mix two scales, so the first backward pass without it
        warns. :class:`LossScaleOptimizer` calls this on every loss it scales. No host read.

        Raises:
            TypeError: ``loss`` is not a tensor.
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"LayerScales.backward_from(loss): loss must be a torch.Tensor; got "
                            f"{type(loss).__name__}.")
        if loss.requires_grad and self._recording is not None and not _in_backward():
            self._seen["root"].append(_edge(loss))
        return loss

    # -- backward: convert at each unit's edges ------------------------------------------------------
    def _begin_backward(self) -> None:
        """At the first hook of a backward pass: read the wiring if it changed, then fix this pass's factors."""
        order, self._recording = self._recording, None
        seen, self._seen = self._seen, {"in": [], "out": [], "root": []}  # drop the graph's nodes when done
        key = (tuple(order), tuple(k[:2] for k in seen["in"]), tuple(k[:2] for k in seen["out"]),
               len(seen["root"]))
        if key != self._wiring:
            if order != self._order:
                self._set_order(order)
            self._read_wiring(seen)
            self._wiring = key
        # in list mode the walk's only starts past the units are the losses given to backward_from
        if self._model is None and not seen["root"] and not self._warned_no_loss:
            self._warned_no_loss = True
            warnings.warn("LayerScales (a list of units): this backward pass started from a loss it was not given, "
                          "so a unit's parameter read after the units (a tied output head left out of the list, a "
                          "loss term on a unit's weights) cannot be found, and its gradient would mix two scales. "
                          "Pass the loss through layers.backward_from(loss) before backward (LossScaleOptimizer "
                          "does), or give the model whole.", stacklevel=2)
        self._first = None
        self._passing = not self.is_scaled()
        if not self._passing and not self._calibrated:
            if _dist.active(self.process_group):
                self._check_same_units(order)
            self._calibrated = True
            self._first = _FirstBackward(self.exponent.device)
            self._factors = None

    def _check_same_units(self, order: list[int]) -> None:
        """Under torch.distributed, before the first backward pass agrees its factors unit by unit: every rank
        must have run the same units, or the ranks would issue different numbers of all-reduces (and hang). One
        all-reduce and one host read, once."""
        ran = torch.zeros(len(self.units), device=self.exponent.device)
        ran[order] = 1.0
        bounds = torch.stack([ran, -ran])  # MAX over ranks of each: ran somewhere, and -(ran everywhere)
        torch.distributed.all_reduce(bounds, op=torch.distributed.ReduceOp.MAX, group=self.process_group)
        uneven = (bounds[0] + bounds[1]).nonzero().flatten().tolist()
        if uneven:
            names = ", ".join(repr(self.units[i][0]) for i in uneven[:5]) + (", ..." if len(uneven) > 5 else "")
            raise RuntimeError(
                f"LayerScales: in the first backward pass the ranks ran different units ({len(uneven)} ran on some "
                f"ranks only: {names}), so they cannot agree on those units' factors. Under torch.distributed every "
                f"rank must run the same units in the first training step; make a module whose submodules run "
                f"conditionally (a mixture-of-experts layer) one unit: layerwise=[...] with it as one entry.")

    def _scaling(self) -> bool:
        """At each hook: begin the backward pass at its first one; whether this pass applies factors (False: its
        loss is not scaled, and the hook returns the gradient as it is)."""
        if self._recording is not None:
            self._begin_backward()
        return not self._passing

    def _scale_output(self, index: int, slot: int, grad: torch.Tensor) -> torch.Tensor:
        if not self._scaling():
            return grad
        k = self._out_position[(index, slot)]
        if self._first is not None:
            factor = self._first_backward_factor(index, self._out_source[k], grad)
        else:
            factor = self._boundary_factors()[0][k]
        return _times(grad, factor)

    def _scale_input(self, index: int, slot: int, grad: torch.Tensor) -> torch.Tensor:
        if not self._scaling():
            return grad
        k = self._in_position[(index, slot)]
        source = self._in_source[k]
        if source == index:
            return grad
        if self._first is not None:
            factor = torch.exp2(self._region_exponent(source) - self.exponent[index])
        else:
            factor = self._boundary_factors()[1][k]
        return _times(grad, factor)

    def _region_exponent(self, source: int) -> torch.Tensor:
        return self.exponent[source] if source >= 0 else self.exponent.new_zeros(())

    def _first_backward_factor(self, index: int, source: int, grad: torch.Tensor) -> torch.Tensor:
        """First backward: set the unit's group exponent from the gradient entering it (if not set yet)."""
        first, group = self._first, self._group[index]
        region = self._region_exponent(source)
        if group not in first.done:
            first.done.add(group)
            level = torch.log2(torch.linalg.vector_norm(grad, math.inf, dtype=torch.float32)).to(region.device)
            if _dist.active(self.process_group):  # every rank sets the same factors: DDP sums the gradients
                level = torch.nan_to_num(level, nan=math.inf)  # NaN is not ordered: the MAX would differ by rank
                torch.distributed.all_reduce(level, op=torch.distributed.ReduceOp.MAX, group=self.process_group)
            level = level - region
            ok = torch.isfinite(level)
            first.top = torch.maximum(first.top, torch.where(ok, level, first.top))
            e = torch.where(ok, torch.floor(first.top.clamp_max(_CEILING) - level) - self.margin, region)
            if any(m in self._pinned for m in self._members[group]):
                e = torch.zeros_like(e)
            e = e.clamp(0.0, float(self.max_exponent))
            for m in self._members[group]:
                self.exponent[m] = e
        return torch.exp2(self.exponent[index] - region)

    def _boundary_factors(self) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
        """Per output slot 2 ** (e[m] - s), per input slot 2 ** (s - e[m]), each slot's a 0-d view (cached until
        the exponents change: a hook then indexes a tuple, not the tensor, which would be one more op each)."""
        if self._factors is None:
            padded = torch.cat([self.exponent, self.exponent.new_zeros(1)])  # index -1: a region at the global scale
            out_owner, out_source, in_owner, in_source = self._slot_index
            self._factors = (torch.exp2(self.exponent[out_owner] - padded[out_source]).unbind(),
                             torch.exp2(padded[in_source] - self.exponent[in_owner]).unbind())
        return self._factors

    # -- the wiring ----------------------------------------------------------------------------------
    def _forget_wiring(self) -> None:
        self._wiring: tuple | None = None
        self._changed = True
        self._in_position: dict[tuple[int, int], int] = {}
        self._out_position: dict[tuple[int, int], int] = {}
        self._in_source: list[int] = []
        self._out_source: list[int] = []
        self._sole_reader: set[tuple[int, int]] = set()  # input slots whose region only their unit reads
        chain = list(zip(self._order, self._order[1:]))  # until the wiring is read: the forward order's chain
        following = [-1] * len(self.units)
        for a, b in chain:
            following[a] = b
        self._following = torch.tensor(following, device=self.exponent.device)
        self._readers = self._reader_matrix(chain)
        self._factors: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None

    def _reader_matrix(self, pairs: list[tuple[int, int]]) -> torch.Tensor:
        """[units, units] float32: 1 where unit n reads a region unit p writes and n ran after p (p, n in pairs)."""
        position = {unit: i for i, unit in enumerate(self._order)}
        readers = torch.zeros(len(self.units), len(self.units))
        for p, n in pairs:
            if p in position and n in position and position[p] < position[n]:
                readers[p, n] = 1.0
        return readers.to(self.exponent.device)

    def _read_wiring(self, seen: dict[str, list]) -> None:
        """Regions from the autograd graph: walk back from every unit input (and the model's outputs, and the loss
        given to :meth:`backward_from`) through operations outside the units, up to unit outputs and leaves; what
        one walk meets is one region."""
        ins, outs = seen["in"], seen["out"]
        parent = list(range(len(ins) + len(outs) + 1))
        outside = len(parent) - 1  # the global scale: the loss, leaves, parameters outside the units

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        def join(a: int, b: int) -> None:
            parent[find(a)] = find(b)

        output_of = {edge: len(ins) + k for k, (_, _, edge, _) in enumerate(outs)}
        unit_of_node = {edge[0]: unit for unit, _, edge, _ in outs}
        visited: dict[Any, int] = {}
        pinned: set[int] = set()
        starts = [(k, edge) for k, (_, _, edge, _) in enumerate(ins)] + [(outside, edge) for edge in seen["root"]]
        for start, edge in starts:
            stack = [edge]
            while stack:
                node, nr = stack.pop()
                if node is None:
                    continue
                if (node, nr) in output_of:
                    join(start, output_of[(node, nr)])
                    continue
                if node in unit_of_node:  # a unit's inner tensor read outside it
                    pinned.add(unit_of_node[node])
                    join(start, outside)
                    continue
                if node in visited:
                    join(start, visited[node])
                    continue
                visited[node] = start
                if isinstance(node, _UnitInput._backward_cls):  # reached a unit's inside other than by its output
                    pinned.add(node.unit)
                    join(start, outside)
                elif hasattr(node, "variable"):  # a leaf: a parameter outside its unit, or a model input
                    pinned.update(self._owners.get(id(node.variable), ()))
                    join(start, outside)
                else:
                    stack.extend(node.next_functions)
        readers: dict[int, set[int]] = {}
        for k, (unit, _, _, _) in enumerate(ins):
            readers.setdefault(find(k), set()).add(unit)
        global_region = find(outside)

        def source(element: int) -> int:
            region = find(element)
            units = readers.get(region, set())
            return next(iter(units)) if region != global_region and len(units) == 1 else -1

        self._in_position = {(unit, slot): k for k, (unit, slot, _, _) in enumerate(ins)}
        self._out_position = {(unit, slot): k for k, (unit, slot, _, _) in enumerate(outs)}
        self._in_source = [source(k) for k in range(len(ins))]
        self._sole_reader = {(unit, slot) for (unit, slot, _, _), s in zip(ins, self._in_source) if s == unit}
        for unit, slot, _, wrapped in ins:
            if not wrapped and (unit, slot) not in self._sole_reader:
                raise RuntimeError(f"LayerScales: the wiring around unit {self.units[unit][0]!r} changed while the "
                                   f"units ran in their usual order (its input {slot} is no longer read by it "
                                   f"alone), so this backward pass would mix two scales; per-layer scales need one "
                                   f"wiring per order of the units (a branch taken on some steps only must change "
                                   f"which units run).")
        self._out_source = [source(len(ins) + k) for k in range(len(outs))]
        following = [-2] * len(self.units)  # -2: no output seen; the region's reader if all outputs agree, else -1
        for (unit, _, _, _), s in zip(outs, self._out_source):
            following[unit] = s if following[unit] in (-2, s) else -1
        dev = self.exponent.device
        self._following = torch.tensor([max(f, -1) for f in following], device=dev)
        region_readers: dict[int, set[int]] = {}
        for k, (unit, _, _, _) in enumerate(ins):
            region_readers.setdefault(find(k), set()).add(unit)
        self._readers = self._reader_matrix([(unit, reader) for k, (unit, _, _, _) in enumerate(outs)
                                             for reader in region_readers.get(find(len(ins) + k), ())])

        def pad(sources: list[int]) -> list[int]:
            return [s if s >= 0 else len(self.units) for s in sources]

        self._slot_index = (torch.tensor([u for u, _, _, _ in outs], dtype=torch.long, device=dev),
                            torch.tensor(pad(self._out_source), dtype=torch.long, device=dev),
                            torch.tensor([u for u, _, _, _ in ins], dtype=torch.long, device=dev),
                            torch.tensor(pad(self._in_source), dtype=torch.long, device=dev))
        self._pinned = sorted(m for p in pinned for m in self._members[self._group[p]])
        self._pinned_index = torch.tensor(self._pinned, dtype=torch.long, device=dev)
        self.exponent = self._tied(self.exponent)
        self._factors = None
        self._changed = False

    def _set_order(self, order: list[int]) -> None:
        """Remember the forward order and, as a tensor, each unit's position in it (-1: did not run)."""
        rank = [-1] * len(self.units)
        for position, unit in enumerate(order):
            rank[unit] = position
        self._order = list(order)
        self._rank = torch.tensor(rank, device=self.exponent.device)

    def _downstream(self, values: torch.Tensor, last: float | bool) -> torch.Tensor:
        """values[reader of m's output region] per unit (``last`` where that region carries the global scale)."""
        index = self._following
        return torch.where(index >= 0, values[index.clamp_min(0)], torch.full_like(values, last))

    def _tied(self, exponent: torch.Tensor) -> torch.Tensor:
        """Pinned units at 0, then each group at its smallest exponent."""
        if self._pinned:
            exponent = exponent.index_fill(0, self._pinned_index, 0.0)
        if len(self._members) < len(self.units):
            lowest = torch.full_like(exponent, math.inf).scatter_reduce(0, self._group_index, exponent, "amin")
            exponent = lowest[self._group_index]
        return exponent

    # -- per step ------------------------------------------------------------------------------------
    def parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter a unit owns, each once."""
        return [p for p, _ in self._unique]

    def unscale_(self, global_scale: torch.Tensor, params: Iterable[torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Divide each unit's gradients by ``global_scale * 2**e[m]`` (a shared parameter's once, by its group's
        factor); return per-unit (found_inf, amax).

        found_inf: bool [units]; amax: float32 [units], the largest scaled magnitude (0 without gradients).
        DTensor gradients (FSDP2): this rank's shards are read and divided, so both are this rank's (take their
        MAX over the ranks before :meth:`update`). ``params`` (the optimizer's parameters): those no unit owns are
        divided by ``global_scale`` and measured as one more, last, entry ([units + 1]). One read pass and one
        write pass; no host read. Host ops: none per gradient where the gradients share the state's device (the
        per-tensor maxima gathered, :mod:`lossscale.ops.gather`), and one multi-tensor multiply per unit (its
        gradients by its factor, a 0-d tensor: torch's multi-tensor fast path, where a list of per-gradient factors
        takes one kernel per gradient on CUDA).
        """
        dev, n = self.exponent.device, len(self.units)
        present = tuple(p.grad is not None for p, _ in self._unique)
        shard = _dist.local_shard  # a DTensor's (FSDP2's) local shard; any other tensor itself
        grads = [shard(p.grad) for p, _ in self._unique if p.grad is not None]
        outside = [] if params is None else [shard(p.grad) for p in params if id(p) not in self._owners
                                               and p.grad is not None]
        size = n + (params is not None)
        if not grads and not outside:
            return torch.zeros(size, dtype=torch.bool, device=dev), torch.zeros(size, device=dev)
        owner, which, by_factor = self._unscale_index(present, len(outside))
        grads += outside
        norms = torch._foreach_norm(grads, math.inf, dtype=torch.float32)
        if all(t.device == dev for t in norms):
            maxima = gathered(norms)
        else:
            maxima = torch.stack([t.to(dev) for t in norms])
        amax = torch.zeros(size, device=dev).scatter_reduce(0, owner, maxima[which], "amax")
        padded = torch.cat([self.exponent, self.exponent.new_zeros(1)])  # index n: the global scale
        factors = (torch.exp2(-padded) / global_scale.to(dev).float()).unbind()
        for index, positions in by_factor:
            members = [grads[i] for i in positions]
            torch._foreach_mul_(members, factors[index].to(members[0].device))
        return ~torch.isfinite(amax), amax

    def _unscale_index(self, present: tuple[bool, ...], outside: int
                       ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, list[int]]]]:
        """For the gradients :meth:`unscale_` reads (the units' parameters that have one, then ``outside`` more):
        each (unit, gradient) pair's unit and gradient (device tensors), and the gradients' positions grouped by
        the exponent index that divides them (n: the global scale). Cached: built (a copy to the device) only when
        which gradients exist changes."""
        key = (present, outside)
        if self._index_cache[0] != key:
            n = len(self.units)
            owner, which, factor_of = [], [], []
            for (_, owners), has in zip(self._unique, present):
                if has:
                    owner += owners
                    which += [len(factor_of)] * len(owners)
                    factor_of.append(owners[0])
            owner += [n] * outside
            which += range(len(factor_of), len(factor_of) + outside)
            factor_of += [n] * outside
            dev = self.exponent.device
            by_factor: dict[int, list[int]] = {}
            for position, index in enumerate(factor_of):
                by_factor.setdefault(index, []).append(position)
            self._index_cache = (key, (torch.tensor(owner, dtype=torch.long, device=dev),
                                       torch.tensor(which, dtype=torch.long, device=dev), list(by_factor.items())))
        return self._index_cache[1]

    def update(self, found_inf: torch.Tensor, amax: torch.Tensor, global_scale: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Move the exponents from this step's per-unit measurements; return the global policy's found_inf
        (0-d bool, see the module's rule). ``global_scale``: the scale the step ran at (default 1).
        ``found_inf``/``amax``: what :meth:`unscale_` returned ([units], or [units + 1] whose last entry, the
        parameters outside the units, only counts towards the skip and the global scale's overflow).
        """
        dev, n = self.exponent.device, len(self.units)
        if found_inf.shape[:1] not in ((n,), (n + 1,)) or amax.shape != found_inf.shape:
            raise ValueError(f"LayerScales.update(found_inf, amax): both must hold one entry per unit ({n}), or "
                             f"{n + 1} with the parameters outside the units last (what unscale_ returns); got "
                             f"shapes {tuple(found_inf.shape)} and {tuple(amax.shape)}.")
        found_all = found_inf.to(dev).bool()
        found, amax = found_all[:n], amax.to(dev).float()[:n]
        scale = torch.ones((), device=dev) if global_scale is None else global_scale.to(dev).float()
        any_bad = found_all.any()
        rank = self._rank
        explained = (self._readers @ found.float()) > 0  # a later reader overflowed: the inf may have come from it
        culprit = found & ~explained
        local = culprit & (self.exponent > 0)

        seen = ~any_bad & torch.isfinite(amax) & (amax > 0)
        x = torch.log2(torch.where(seen, amax, torch.ones_like(amax))) - torch.log2(scale) - self.exponent
        self.level = torch.where(seen & self.observed, self.level + (x - self.level) / self.history,
                                 torch.where(seen, x, self.level))
        self.observed = self.observed | seen
        self.penalty = (self.penalty - 1.0 / self.forget_interval).clamp_min(0.0) + local.float()

        top = torch.where(self.observed, self.level, torch.full_like(self.level, -math.inf)).max()
        top = torch.minimum(top, _CEILING - torch.log2(scale))  # the largest unit may compute in float32
        target = torch.floor(top - self.level) - self.margin - torch.floor(self.penalty)
        ran = rank >= 0
        blind = ran & ~self.observed & ~any_bad & (amax == 0) & self._downstream(amax > 0, True)
        downstream = self._downstream(self.exponent, 0.0)  # first pass the stream on unchanged, then search up
        searched = torch.where(self.exponent < downstream, downstream, self.exponent + self.search_step)
        exponent = torch.where(self.observed, target, torch.where(blind, searched, self.exponent))
        exponent = torch.where(local & ~self.observed, self.exponent - max(1, self.search_step // 2), exponent)
        self.exponent = self._tied(exponent.clamp(0.0, float(self.max_exponent)))
        self._factors = None
        return any_bad & ((culprit & ~local).any() | ~culprit.any())

    # -- reading and checkpoints ---------------------------------------------------------------------
    def layer_scales(self, global_scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """Unit name -> total scale (0-d tensor) its gradients carry: ``global_scale * 2**e``. No host read."""
        totals = torch.exp2(self.exponent) * global_scale.to(self.exponent.device).float()
        return dict(zip((name for name, _ in self.units), totals.unbind()))  # one op, not one per unit

    def state_dict(self) -> dict[str, Any]:
        """Unit names, every per-unit tensor as lists, the forward order and whether the first backward pass ran
        (reads them on the host: one sync)."""
        return {"units": [n for n, _ in self.units], "order": list(self._order), "calibrated": self._calibrated,
                **{k: getattr(self, k).tolist() for k in _FIELDS}}

    def validate_state_dict(self, state: Any) -> dict[str, Any]:
        """What :meth:`load_state_dict` would install, or the error it would raise; changes nothing."""
        like = {k: getattr(self, k) for k in _FIELDS}
        return validated_layer_state([n for n, _ in self.units], state, like)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, checked whole first (:meth:`validate_state_dict`). A group's units
        take their smallest exponent; the wiring is read again at the next backward pass."""
        checked = self.validate_state_dict(state)
        for k in _FIELDS:
            setattr(self, k, checked[k])
        self._calibrated = checked["calibrated"]
        self._set_order(checked["order"])
        self._forget_wiring()
        self.exponent = self._tied(self.exponent)

    def remove(self) -> None:
        """Remove the hooks (the model then backpropagates at the global scale only)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __repr__(self) -> str:
        groups = len(self.units) - len(self._members)
        return (f"LayerScales({len(self.units)} units{f', {groups} shared' if groups else ''}, margin={self.margin}, "
                f"search_step={self.search_step})")


_LOADER = "LayerScales.load_state_dict"
_FIELDS = ("exponent", "level", "observed", "penalty")


def validated_layer_state(names: list[str], state: Any, like: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The per-unit tensors (shaped, typed and placed as ``like``), the chain order and ``calibrated`` of ``state``.

    Rule: ``state`` is what ``LayerScales.state_dict()`` saved for the same units (``names``, in order);
    ``exponent``, ``level`` and ``penalty`` (>= 0) hold one finite number per unit, ``observed`` one bool per unit,
    ``order`` distinct unit indices, ``calibrated`` a bool (absent in older checkpoints: any unit observed).
    Else a ValueError naming the field."""
    if not isinstance(state, dict) or not {"units", "order", *_FIELDS} <= state.keys():
        raise ValueError(f"{_LOADER}(state={state!r:.80}): state must be the dict LayerScales.state_dict() returned "
                         f"(keys units, order, calibrated, {', '.join(_FIELDS)}).")
    if state["units"] != names:
        raise ValueError(f"{_LOADER}: the checkpoint's units {state['units']!r} differ from this model's {names!r}.")
    checked: dict[str, Any] = {k: _field(k, state[k], like[k]) for k in _FIELDS}
    order = state["order"]
    if not (isinstance(order, (list, tuple)) and len(set(order)) == len(order) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(names) for i in order)):
        raise ValueError(f"{_LOADER}: order must list distinct unit indices in [0, {len(names)}); got {order!r}.")
    calibrated = state.get("calibrated", bool(checked["observed"].any()))
    if not isinstance(calibrated, bool):
        raise ValueError(f"{_LOADER}: calibrated must be a bool (whether the first backward pass ran); got "
                         f"{calibrated!r}.")
    checked.update(order=list(order), calibrated=calibrated)
    return checked


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
