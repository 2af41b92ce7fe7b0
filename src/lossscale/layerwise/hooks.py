"""The hooks per-layer scales put on the units: module hooks that record each forward pass, tensor hooks on each
unit output, and an identity autograd Function before each unit input that is not its region's only reader. The
backward side calls back into the owner of the factors with (unit, slot, gradient) and gets the gradient to pass
on (see the package docstring for the conversion rule).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch
from torch.autograd.graph import Node, get_gradient_edge

from lossscale.layerwise.wiring import Edge, Forward, Slot, Units, Wiring
from lossscale.ops.kept import is_kept
from lossscale.ops.nested import map_tensors, tensors_in
from lossscale.validation import in_backward

#: (unit, slot, gradient) -> the gradient to pass on: the conversion at one slot of a unit's edge.
Convert = Callable[[int, int, torch.Tensor], torch.Tensor]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def eager(hook: Callable[_P, _R]) -> Callable[_P, _R]:
    """``hook`` run eagerly under torch.compile: its bookkeeping is Python state, which dynamo would otherwise
    trace, guard on and recompile for at every unit."""
    disabled = torch.compiler.disable(hook, recursive=True)

    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch.compiler.is_compiling():  # constant while dynamo traces: the call to ``disabled`` breaks the graph
            return disabled(*args, **kwargs)
        return hook(*args, **kwargs)  # eager: without the wrapper's cost (about 1 us a call)

    return run


def times(grad: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``grad * factor`` in ``grad``'s dtype, multiplied in float32: a factor (a power of two, so the product is
    exact) can be past float16's range, where torch would cast it to the gradient's dtype first."""
    return (grad.float() * factor.to(grad.device)).to(grad.dtype)


def tensors(tree: Any, plain: bool = False) -> list[torch.Tensor]:
    """The tensors that require grad in ``tree`` (:func:`~lossscale.ops.nested.tensors_in`; with ``plain``, only in
    exact tuples, lists and dicts: the ones :func:`mapped` rebuilds)."""
    return [t for t in tensors_in(tree, plain=plain) if t.requires_grad]


def mapped(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``tree`` with ``fn`` applied to each tensor that requires grad (exact tuples, lists and dicts rebuilt)."""
    return map_tensors(lambda t: fn(t) if t.requires_grad else t, tree, plain=True)


def edge(t: torch.Tensor) -> Edge:
    """(node, output index) where ``t``'s gradient enters the autograd graph (a leaf's: its AccumulateGrad node)."""
    node = t.grad_fn
    if node is None:
        gradient_edge = get_gradient_edge(t)
        return gradient_edge.node, gradient_edge.output_nr
    return node, t.output_nr


def _around(model: torch.nn.Module | None, name: str, module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and, where the model is known, every module of it that contains ``module`` (named ``name``)."""
    if model is None:
        return [module]
    parts = name.split(".") if name else []
    return [module] + [model.get_submodule(".".join(parts[:k])) for k in range(len(parts))]


class UnitInput(torch.autograd.Function):
    """Identity in forward; in backward, the unit's share of its input's gradient as ``convert`` makes it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, convert: Convert, unit: int, slot: int) -> torch.Tensor:
        ctx.convert, ctx.unit, ctx.slot = convert, unit, slot
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.convert(ctx.unit, ctx.slot, grad), None, None, None


def unit_of(node: Node) -> int | None:
    """The unit whose input ``node`` is the :class:`UnitInput` backward of (None: any other node)."""
    if not isinstance(node, UnitInput._backward_cls):
        return None
    return node.unit  # type: ignore[attr-defined]  # the ctx attribute UnitInput.forward sets


class Recorder:
    """The units' module hooks: each forward pass recorded into :attr:`forward`, each unit output's gradient
    converted by ``scale_output`` and each wrapped input's by ``scale_input`` (through :class:`UnitInput`).

    Args:
        units: The units to hook.
        model: The model given whole (its outputs are walk starts), or None.
        wiring: The wiring known now (its order and its inputs that need no identity node).
        scale_output: The conversion of a gradient entering a unit.
        scale_input: The conversion of a unit's share of its input's gradient.
    """

    def __init__(
        self,
        units: Units,
        model: torch.nn.Module | None,
        wiring: Callable[[], Wiring],
        scale_output: Convert,
        scale_input: Convert,
    ) -> None:
        self.forward = Forward()
        self._units, self._wiring = units, wiring
        self._scale_output, self._scale_input = scale_output, scale_input
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        # per unit, the modules whose keep_float32 keeps it in float32: itself, and the modules around it (known for a
        # model given whole)
        self._around = [_around(model, name, module) for name, module in units.named]
        for i, (_, module) in enumerate(units.named):
            self.handles.append(module.register_forward_pre_hook(eager(self._input_hook(i)), with_kwargs=True))
            self.handles.append(module.register_forward_hook(eager(self._output_hook(i))))
        if model is not None:  # the model's outputs are what the loss reads
            self.handles.append(model.register_forward_hook(eager(self._root_hook)))

    def take(self) -> Forward:
        """At a backward pass's first hook: the forward recorded; from then on, the units that ran in it only
        (the graph's nodes dropped)."""
        forward = self.forward
        self.forward = forward.closed()
        return forward

    def note_loss(self, loss: torch.Tensor) -> None:
        """A loss the next backward pass starts from: one more walk start."""
        if loss.requires_grad and self.forward.open and not in_backward():
            self.forward.roots.append(edge(loss))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _input_hook(self, index: int) -> Callable[[torch.nn.Module, Any, Any], Any]:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return None
            if in_backward():
                self._refuse_reentrant(index)
                return None
            wiring = self._wiring()
            forward = self._record(index, wiring.order)
            if any(is_kept(m) for m in self._around[index]):
                forward.kept.add(index)
            sole_reader = wiring.sole_reader
            wrapped = set()
            single = not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor)
            found = ([args[0]] if args[0].requires_grad else []) if single else tensors((args, kwargs), plain=True)
            for slot, t in enumerate(found):
                # the unit is its region's only reader: the region carries its factor already
                sole = not forward.changed and (index, slot) in sole_reader
                forward.inputs.append(Slot(index, slot, edge(t), not sole))
                if not sole:
                    wrapped.add(slot)
            if not wrapped:
                return None
            slots = itertools.count()

            def enter(t: torch.Tensor) -> torch.Tensor:
                slot = next(slots)
                return UnitInput.apply(t, self._scale_input, index, slot) if slot in wrapped else t

            return mapped(args, enter), mapped(kwargs, enter)

        return hook

    def _refuse_reentrant(self, index: int) -> None:
        """A unit's forward inside a backward pass: activation checkpointing recomputing it. Without reentrance
        (``use_reentrant=False``) the recomputed graph only refills saved tensors, and the hooks of the forward that
        ran with gradients apply: nothing to do. A unit that did not run with gradients in that forward is being
        recomputed to be backpropagated through (``use_reentrant=True``): its gradients cannot carry its factor."""
        if index not in self.forward.ran:
            raise RuntimeError(
                f"LayerScales: unit {self._units.name(index)!r} ran inside a backward pass without having run with "
                f"gradients enabled in the forward. That is torch.utils.checkpoint with use_reentrant=True, which "
                f"runs the forward under no_grad and backpropagates through a recomputation, where the unit's "
                f"gradients cannot carry its factor. Checkpoint with use_reentrant=False (with transformers: "
                f"model.activation_checkpointing_enable(activation_checkpointing_kwargs={{'use_reentrant': False}}), "
                f"named gradient_checkpointing_enable(gradient_checkpointing_kwargs=...) before 5.24)."
            )

    def _record(self, index: int, order: list[int]) -> Forward:
        """Note that unit ``index`` runs: the first unit again (the last forward had no backward) starts a new
        forward; a unit that already ran in this one is refused; one that leaves the wiring's ``order`` marks the
        forward changed."""
        forward = self.forward
        if not forward.open or (forward.order and forward.order[0] == index):
            forward = self.forward = Forward(open=True)
        if index in forward.ran:
            raise RuntimeError(
                f"LayerScales: module {self._units.name(index)!r} ran twice in one forward; a unit "
                f"must run once per forward (pass the module that calls it as one unit)."
            )
        forward.ran.add(index)
        forward.order.append(index)
        position = len(forward.order) - 1
        if position >= len(order) or order[position] != index:
            forward.changed = True  # wrap every input from here on: the wiring is read again at backward
        return forward

    def _output_hook(self, index: int) -> Callable[[torch.nn.Module, Any, Any], None]:
        """After the unit's forward: hook each output tensor so its gradient is scaled before the unit's backward."""

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() or not self.forward.open or in_backward():
                return
            single = isinstance(output, torch.Tensor)
            found = ([output] if output.requires_grad else []) if single else tensors(output)
            for slot, t in enumerate(found):
                self.forward.outputs.append(Slot(index, slot, edge(t), True))
                t.register_hook(functools.partial(self._scale_output, index, slot))

        return hook

    def _root_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and self.forward.open and not in_backward():
            self.forward.roots = [edge(t) for t in tensors(output)]
