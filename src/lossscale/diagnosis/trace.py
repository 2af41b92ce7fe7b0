"""The tracer behind :func:`~lossscale.find_overflow` and the automatic diagnosis: module hooks that record
each call's largest input and output magnitudes, tensor hooks that record each gradient's, and the rule that turns
them into an :class:`~lossscale.diagnosis.report.OverflowReport`.

Every magnitude stays a 0-d device tensor until :meth:`Tracer.report` reads them all at once; the hooks do no host
read. A forward hook that runs inside a backward (activation checkpointing's recomputation) records no new call: it
only watches the recomputed tensors' gradients where the original call's tensors carried none (``use_reentrant=True``
runs the first forward without grad).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lossscale.diagnosis.float32 import autocast_on, to_float32
from lossscale.diagnosis.report import FLOAT16_MAX, Kind, ModuleRecord, OverflowReport
from lossscale.ops.nested import map_tensors, tensors_in
from lossscale.ops.overflow import largest_magnitude
from lossscale.validation import in_backward


def floating_tensors(obj: Any) -> list[torch.Tensor]:
    """The floating-point (and complex) tensors in ``obj`` (:func:`~lossscale.ops.nested.tensors_in`)."""
    return [t for t in tensors_in(obj) if t.is_floating_point() or t.is_complex()]


def _amax(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Largest ``|x|`` over ``tensors`` (a sparse tensor's values, a complex one's moduli; any devices and dtypes) as
    a 0-d float32 tensor on the first one's device, NaN where any is NaN
    (:func:`~lossscale.ops.overflow.largest_magnitude` per device and dtype); None where every tensor is empty."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        t = t.detach()
        if t.is_sparse:
            t = t._values()
        if t.is_complex():
            t = t.abs()
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    if not groups:
        return None
    maxima = [largest_magnitude(group).to(tensors[0].device) for group in groups.values()]
    return maxima[0] if len(maxima) == 1 else torch.stack(maxima).amax()


@dataclass(eq=False)
class _Call:
    """One module call in one forward pass."""

    name: str
    type: str
    index: int
    parent: _Call | None
    depth: int
    forward_pass: int
    start: int
    end: int = -1
    input_max: torch.Tensor | None = None
    output_max: torch.Tensor | None = None
    output_dtype: str | None = None
    watched: bool = False  # whether a gradient hook watches any of its outputs
    casts_to_half: bool = False  # autocast to float16 was on for its inputs' device when the call began
    float32_max: torch.Tensor | None = None  # the first float16 call to end non-finite from finite inputs: its
    # output's largest magnitude when run again in float32 (finite: a range fault, not a NaN-making op)


@dataclass(eq=False)
class _Watched:
    """A tensor whose gradient a hook records: the calls that produced it (innermost first) and took it as input."""

    ref: Callable[[], torch.Tensor | None]
    producers: list[_Call] = field(default_factory=list)
    consumers: list[_Call] = field(default_factory=list)
    owners: list[str] = field(default_factory=list)  # a parameter's modules (several where it is tied)


@dataclass(eq=False)
class _GradEvent:
    run: int
    forward_pass: int
    watched: _Watched
    amax: torch.Tensor
    limit: float


def _eager() -> Any:
    """Make ``torch.compile``'d code run eagerly until the returned stance is exited (a compiled graph would not call
    the hooks); None where that cannot be (inside a compiled region)."""
    try:
        return torch.compiler.set_stance("force_eager")
    except RuntimeError:
        return None


class Tracer:
    """Hooks on every module and parameter of ``model`` that record magnitudes until :meth:`remove`; meanwhile
    ``torch.compile``'d code runs eagerly (its graphs would not call the hooks).

    A forward pass ends at :meth:`end_forward` (the loss); the backward events after it belong to that pass.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.handles: list[Any] = []
        self.calls: list[_Call] = []
        self.events: list[_GradEvent] = []
        self.losses: list[torch.Tensor | None] = []
        self.run = 0
        self._seq = 0
        self._pass = 0
        self._backward_pass = 0
        self._stack: list[_Call] = []
        self._counts: dict[str, int] = {}
        self._recomputed: dict[str, int] = {}
        self._last_recomputed: dict[str, _Call] = {}
        self._watched: dict[int, _Watched] = {}
        self._types: dict[str, str] = {}
        self._replaying = False  # a call run again in float32: the hooks stand aside
        self._culprit_seen = False  # whether a float16 call already ended non-finite from finite inputs
        for name, module in model.named_modules():
            self._types[name] = type(module).__name__
            self.handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post_hook(name), with_kwargs=True, always_call=True))
        params: dict[int, _Watched] = {}
        for name, module in model.named_modules():
            for param in module._parameters.values():
                if param is None or not param.requires_grad:
                    continue
                if id(param) not in params:
                    params[id(param)] = _Watched(weakref.ref(param))
                    self.handles.append(param.register_hook(self._grad_hook(params[id(param)])))
                params[id(param)].owners.append(name)
        self._stance = _eager()

    # hooks ------------------------------------------------------------------------------------------------------

    def _pre_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._replaying:
                return
            if in_backward():
                call = self._recomputation(name)
                if call is not None and not call.watched:
                    for t in floating_tensors((args, kwargs)):
                        self._watch(t, call, produced=False)
                return
            parent = self._stack[-1] if self._stack else None
            index = self._counts.get(name, 0)
            self._counts[name] = index + 1
            inputs = list(floating_tensors((args, kwargs)))
            call = _Call(
                name,
                self._types[name],
                index,
                parent,
                0 if parent is None else parent.depth + 1,
                self._pass,
                self._next(),
                input_max=_amax(inputs),
                casts_to_half=bool(inputs) and _autocasts_to_half(inputs[0].device.type),
            )
            self.calls.append(call)
            self._stack.append(call)
            for t in inputs:
                self._watch(t, call, produced=False)

        return hook

    def _post_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self._replaying:
                return
            if in_backward():
                call = self._last_recomputed.get(name)
                if call is not None and not call.watched:
                    for t in floating_tensors(output):
                        self._watch(t, call, produced=True)
                return
            index = next((i for i in range(len(self._stack) - 1, -1, -1) if self._stack[i].name == name), None)
            if index is None:
                return
            call = self._stack[index]
            del self._stack[index:]
            outputs = list(floating_tensors(output))
            call.output_max = _amax(outputs)
            call.output_dtype = str(outputs[0].dtype).replace("torch.", "") if outputs else None
            for t in outputs:
                call.watched |= self._watch(t, call, produced=True)
            call.end = self._next()
            if call.casts_to_half and not self._culprit_seen and outputs and outputs[0].dtype == torch.float16:
                self._check_range(module, call, args, kwargs)

        return hook

    def _check_range(self, module: nn.Module, call: _Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """For a float16 call: whether it ended non-finite from finite inputs (one host read); for the first that did,
        its output's largest magnitude when its forward runs again in float32 (:attr:`_Call.float32_max`), so the
        report tells an overflow inside its float16 computation (inf - inf is NaN) from an op that makes a NaN at
        any precision. The rerun takes no gradient, consumes no random numbers and leaves the module's buffers as
        they were; an error in it only leaves the answer unknown."""
        assert call.output_max is not None  # a float16 output was seen
        bad = ~torch.isfinite(call.output_max)
        if call.input_max is not None:
            bad &= torch.isfinite(call.input_max)
        if not bool(bad):
            return
        self._culprit_seen = True
        device = call.output_max.device
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
        devices = (
            [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
        )
        self._replaying = True
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad(), torch.autocast(device.type, enabled=False):
                out = module.forward(*map_tensors(to_float32, args), **map_tensors(to_float32, kwargs))
            call.float32_max = _amax(floating_tensors(out))
        except Exception:  # the answer stays unknown; the step goes on as traced
            call.float32_max = None
        finally:
            self._replaying = False
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)

    def _grad_hook(self, watched: _Watched) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self._replaying:
                return
            amax = _amax([grad])
            if amax is not None:
                limit = torch.finfo(grad.dtype).max if grad.is_floating_point() else math.inf
                self.events.append(_GradEvent(self.run, self._backward_pass, watched, amax, limit))

        return hook

    def _watch(self, t: torch.Tensor, call: _Call, produced: bool) -> bool:
        if not t.requires_grad:
            return False
        watched = self._watched.get(id(t))
        if watched is None or watched.ref() is not t:
            watched = _Watched(weakref.ref(t))
            try:
                self.handles.append(t.register_hook(self._grad_hook(watched)))
            except RuntimeError:  # a tensor that cannot take a hook (e.g. a view made in no-grad mode)
                return False
            self._watched[id(t)] = watched
        (watched.producers if produced else watched.consumers).append(call)
        return True

    def _recomputation(self, name: str) -> _Call | None:
        """The original call a recomputation (in the backward) repeats: the module's calls in turn."""
        calls = [c for c in self.calls if c.name == name and c.forward_pass == self._backward_pass]
        if not calls:
            return None
        k = self._recomputed.get(name, 0)
        self._recomputed[name] = k + 1
        call = calls[k % len(calls)]
        self._last_recomputed[name] = call
        return call

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    # phases -----------------------------------------------------------------------------------------------------

    def end_forward(self, loss: torch.Tensor | None) -> None:
        """The current forward pass ended with ``loss``; its backward comes next."""
        self.losses.append(None if loss is None else _amax([loss]))
        self._backward_pass = self._pass
        self._pass += 1
        self._counts.clear()
        self._recomputed.clear()
        self._stack.clear()

    def remove(self) -> None:
        """Remove every hook and give torch.compile its stance back (idempotent)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._watched.clear()
        if self._stance is not None:
            self._stance.__exit__(None, None, None)
            self._stance = None

    # analysis ---------------------------------------------------------------------------------------------------

    def backward_peak(self, run: int) -> tuple[bool, float]:
        """For backward ``run``: whether every gradient was finite, and the smallest ``dtype max / |grad|`` (how far
        the scale could be multiplied before the closest gradient leaves its format's range). One host read."""
        events = [e for e in self.events if e.run == run]
        values = _floats(_read([e.amax for e in events]))
        finite = all(math.isfinite(v) for v in values)
        ratio = min((e.limit / v for e, v in zip(events, values) if v > 0 and math.isfinite(v)), default=math.inf)
        return finite, ratio

    def report(
        self, scale: float, max_safe_scale: float | None = None, run: int = 0, rank: int | None = None
    ) -> OverflowReport:
        """The first non-finite value over the traced passes (forward, then loss, then backward ``run``), read in
        one host read."""
        calls = self.calls
        run_events = [e for e in self.events if e.run == run]
        values = _read(
            [c.input_max for c in calls]
            + [c.output_max for c in calls]
            + [c.float32_max for c in calls]
            + list(self.losses)
            + [e.amax for e in run_events]
        )
        n, m = len(calls), len(self.losses)
        inputs, outputs, peaks = values[:n], values[n : 2 * n], values[2 * n : 3 * n]
        losses, grads = values[3 * n : 3 * n + m], _floats(values[3 * n + m :])
        counts: dict[tuple[int, str], int] = {}
        for c in calls:
            counts[(c.forward_pass, c.name)] = counts.get((c.forward_pass, c.name), 0) + 1
        grad_of: dict[int, float] = {}
        for e, v in zip(run_events, grads):
            for c in e.watched.producers:
                old = grad_of.get(id(c))
                grad_of[id(c)] = v if old is None or _worse(v, old) else old

        def records_of(p: int) -> tuple[ModuleRecord, ...]:
            return tuple(
                ModuleRecord(c.name, c.type, c.index, inputs[i], outputs[i], c.output_dtype, grad_of.get(id(c)))
                for i, c in enumerate(calls)
                if c.forward_pass == p
            )

        def located(
            p: int,
            kind: Kind,
            call: _Call | None,
            value: float | None,
            name: str | None = None,
            cast_input: float | None = None,
        ) -> OverflowReport:
            peak = peaks[calls.index(call)] if call is not None and kind == "forward" else None
            module = call.name if call is not None else name
            index = call.index if call is not None else None
            total = counts.get((call.forward_pass, call.name)) if call is not None else None
            if call is None and name is not None:
                total = sum(1 for c in calls if c.name == name and c.forward_pass == p) or None
                index = 0 if total == 1 else None
            nan = value is not None and math.isnan(value)
            return OverflowReport(
                kind,
                module,
                index if (total or 0) > 1 else None,
                total,
                nan,
                scale,
                None if kind in ("input", "forward", "loss") else max_safe_scale,
                advice_for(kind, module, nan, scale, max_safe_scale, cast_input, peak),
                records_of(p),
                losses[p] if p < m else None,
                rank,
            )

        passes = sorted({c.forward_pass for c in calls} | set(range(m)))
        for p in passes:
            events: list[tuple[int, str, _Call, float]] = []
            for c, seen_in, seen_out in zip(calls, inputs, outputs):
                if c.forward_pass != p:
                    continue
                if seen_in is not None and not math.isfinite(seen_in):
                    events.append((c.start, "start", c, seen_in))
                if c.end >= 0 and seen_out is not None and not math.isfinite(seen_out):
                    events.append((c.end, "end", c, seen_out))
            if events:
                _, where, c, v = min(events, key=lambda e: e[0])
                if where == "end":
                    seen_in = inputs[calls.index(c)]
                    cast = c.casts_to_half and seen_in is not None and FLOAT16_MAX < seen_in < math.inf
                    return located(p, "forward", c, v, cast_input=seen_in if cast else None)
                return located(p, "input", c, v) if c.parent is None else located(p, "forward", c.parent, v)
            loss = losses[p] if p < m else None
            if loss is not None and not math.isfinite(loss):
                return located(p, "loss", None, loss)
            for e, v in zip(run_events, grads):
                if e.forward_pass == p and not math.isfinite(v):
                    call, name = _blame(e.watched, [c for c in calls if c.forward_pass == p])
                    return located(p, "backward", call, v, name)
        return located(passes[0] if passes else 0, "none", None, None)


def _blame(watched: _Watched, calls: list[_Call]) -> tuple[_Call | None, str | None]:
    """Whose backward made this gradient: a parameter's module (tied: the holder whose call ended last in the
    forward, the first to run backward), the innermost call that took the tensor as input, else the code around
    the outermost call that produced it (None: the loss)."""
    if watched.owners:
        if len(watched.owners) == 1:
            return None, watched.owners[0]
        ends = {c.name: c.end for c in calls if c.name in watched.owners}
        return None, max(watched.owners, key=lambda name: ends.get(name, -1))
    if watched.consumers:
        return max(watched.consumers, key=lambda c: c.depth), None
    if watched.producers:
        return watched.producers[-1].parent, None
    return None, None


def _worse(a: float, b: float) -> bool:
    if math.isnan(a):
        return True
    if math.isnan(b):
        return False
    return a > b


def _floats(values: list[float | None]) -> list[float]:
    """``values`` where none can be None (every tensor was given)."""
    return [math.nan if v is None else v for v in values]


def _read(tensors: list[torch.Tensor | None]) -> list[float | None]:
    """Every 0-d tensor as a float (None stays None), one host read per device."""
    out: list[float | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        if t is not None:
            by_device.setdefault(t.device, []).append((i, t))
    for present in by_device.values():
        read = torch.stack([t.reshape(()).float() for _, t in present]).tolist()
        for (i, _), v in zip(present, read):
            out[i] = v
    return out


def _autocasts_to_half(device_type: str) -> bool:
    """Whether autocast to float16 is on for ``device_type`` now."""
    return autocast_on(device_type) and torch.get_autocast_dtype(device_type) == torch.float16


#: What restores a scale a fault lowered, once the fault is fixed (the end of a forward fault's advice).
RESTORE = (
    " A scale lowered meanwhile stays low once the fault is fixed: set it back to your initial scale, e.g. "
    "opt.set_scale(2.0**16) (or scaler.update(new_scale=2.0**16)); heal=True fixes the module and restores the scale "
    "by itself."
)


def advice_for(
    kind: Kind,
    module: str | None,
    nan: bool,
    scale: float,
    max_safe_scale: float | None,
    cast_input: float | None = None,
    float32_peak: float | None = None,
) -> str:
    """One or two sentences on what fixes a fault of this kind (a fix that fixes it: the module and its outputs in
    float32 for a forward overflow). ``cast_input``: the finite input past float16's range that autocast cast to
    float16 on its way into ``module``'s op, where that was the cause; ``float32_peak``: the module's output's largest
    magnitude when run again in float32 (finite: its NaN came from an overflow inside its float16 computation)."""
    name = "the model" if module == "" else repr(module)
    fix = f"keep_float32(model.get_submodule({module!r}), outputs='float32')"
    if kind == "input":
        return (
            "A batch already holds inf or NaN before the model sees it, and no loss scale fixes that: check the "
            "data loader and preprocessing (e.g. assert torch.isfinite(batch).all()), or skip such batches."
        )
    if kind == "forward":
        if cast_input is not None:
            return (
                f"The input of {name} ({_pow2(cast_input)}) is finite but past float16's 65504, and autocast casts it "
                f"to float16 on its way into the module's float16 op, where it becomes inf"
                f"{' and then NaN' if nan else ''}: run {name} in float32 with {fix} (or keep its input smaller). "
                f"Lowering the loss scale cannot fix a forward overflow.{RESTORE}"
            )
        if nan and float32_peak is not None and math.isfinite(float32_peak):
            return (
                f"{name} made a NaN in float16 from finite inputs, and in float32 its output stays finite (largest "
                f"{float32_peak:.4g}): its float16 computation overflows inside (inf - inf is NaN). Run it in "
                f"float32, its outputs too, with {fix}. Lowering the loss scale cannot fix a forward overflow."
                f"{RESTORE}"
            )
        if nan:
            return (
                f"{name} made a NaN in its own code from finite inputs (0/0, inf-inf, log or sqrt of a negative, a "
                f"softmax over all -inf): guard that op (an eps, a mask that keeps one entry), or run it in "
                f"float32 with {fix}. Lowering the loss scale cannot fix it.{RESTORE}"
            )
        return (
            f"The activations of {name} pass float16's 65504: run it in float32, its outputs too (cast back to "
            f"float16 they would overflow again), with {fix} (or keep its weights and inputs smaller). Lowering the "
            f"loss scale cannot fix a forward overflow.{RESTORE}"
        )
    if kind == "loss":
        return (
            "The loss computation overflowed though every module's output was finite: compute the loss in "
            "float32, outside autocast (e.g. loss_fn(logits.float(), target)), and use a mean, not a sum."
            f"{RESTORE.replace(' heal=True fixes the module and restores the scale by itself.', '')}"
        )
    if kind == "backward":
        if max_safe_scale is not None and max_safe_scale < 1:
            return (
                f"Even an unscaled backward overflows at {name if module is not None else 'the loss'} "
                f"(exploding gradients): lower the learning rate, clip gradients, or run that module in float32 "
                f"with keep_float32."
            )
        cap = f" (max_scale={_pow2(max_safe_scale)})" if max_safe_scale is not None else ""
        return (
            f"The scale is too large for this batch's gradients at "
            f"{name if module is not None else 'the loss'}: bound the scale{cap}, use per-layer scales "
            f"(LossScaleOptimizer(..., layerwise=model)) so one module's gradients do not set every other's, "
            f"or clip gradients."
        )
    safe = f"; this batch's backward stays finite up to scale {_pow2(max_safe_scale)}" if max_safe_scale else ""
    return (
        f"Nothing overflowed at scale {_pow2(scale)}{safe}. If the scale keeps collapsing, the fault depends on "
        f"the batch or the step: let OverflowDiagnosis trace the failing step."
    )


def _pow2(x: float | None) -> str:
    if x is None:
        return "-"
    if x > 0 and math.isfinite(x) and x == 2.0 ** round(math.log2(x)):
        return f"2**{round(math.log2(x))}"
    return f"{x:.4g}"
