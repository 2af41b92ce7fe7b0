"""nnabla's ``DynamicLossScalingUpdater`` for PyTorch: a whole update with dynamic loss scaling per call.

A translation table onto the core; the rule is :func:`lossscale.presets.nnabla`.

===================================================  ============================================================
nnabla                                                lossscale
===================================================  ============================================================
``DynamicLossScalingUpdater(solver, loss, ...)``      ``DynamicLossScalingUpdater(optimizer, loss_fn, ...)`` on a
                                                      :class:`~lossscale.LossScaleOptimizer` with
                                                      ``presets.nnabla(scale, scaling_factor, N)``
``solver`` (an nnabla Solver)                         a torch optimizer
``loss`` (a Variable; ``loss.forward()``)             a zero-argument callable running the forward pass and
                                                      returning the loss
``data_feeder`` (called before each forward)          same (a zero-argument callable)
``scale=8.0, scaling_factor=2.0, N=2000``             same: ``S /= f`` on overflow; ``S *= f`` when the counter
                                                      passes N (first growth on the (N+2)-th clean attempt, then
                                                      every N+1)
``accum_grad=1``                                      that many forward/backward passes per attempt; gradients
                                                      are summed (not averaged), as nnabla's backward accumulates
``weight_decay=None``                                 ``solver.weight_decay``: ``grad += weight_decay * param`` on
                                                      the unscaled gradients after the overflow check (L2,
                                                      coupled), applied steps only; needs skip_mode host/masked
``comm=None, grads=[]``                               ``comm`` a torch.distributed ProcessGroup (anything else is
                                                      refused, as is a comm with no grads); the gradients of
                                                      ``grads`` (parameters, or gradient tensors; None = []) are
                                                      summed over it before the overflow check
``clear_buffer=True``                                 accepted; PyTorch frees the graph after backward anyway
on overflow: halve and re-run ``update()``            re-run the whole step (new data from ``data_feeder``), up to
(recursively), giving up silently after 100 retries   100 retries, then give up silently
``updater.scale`` (a Python float)                    a property: reads the scale on the host; assignable
===================================================  ============================================================

Host reads: the retry needs the overflow flag on the host, so each attempt reads it once (twice with an
optimizer without ``grad_scale``/``found_inf`` support, whose skip the core also decides on the host).
Deviations: nnabla keeps the scale in a Python float that can grow past float32's range (then every
scaled gradient is inf) and halve towards 0 (then it divides by zero); ours stays within
``[2**-126, float32 max]``, and with a ``scaling_factor`` that is not a power of two rounds to float32 at
each step.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from lossscale import presets
from lossscale.checks import ArgumentTypeError, check_choice, check_int_at_least
from lossscale.compat._checks import checked_tensors
from lossscale.ops.distributed import all_reduce_grads_
from lossscale.optimizer import LossScaleOptimizer
from lossscale.reporting import StepResult

__all__ = ["DynamicLossScalingUpdater", "MAX_RETRIES"]

#: nnabla's ``_max_recursive_count``: overflowing re-runs of one ``update()`` before it gives up.
MAX_RETRIES = 100


def _check_comm(call: str, comm: Any, grads: list[torch.Tensor]) -> None:
    """``comm`` is None (no all-reduce) or a torch.distributed ProcessGroup with gradients to sum."""
    if comm is None:
        return
    if not isinstance(comm, torch.distributed.ProcessGroup):
        raise TypeError(f"{call}(comm={comm!r}): comm must be None or a torch.distributed.ProcessGroup (e.g. "
                        f"torch.distributed.group.WORLD after torch.distributed.init_process_group('nccl')); "
                        f"got {type(comm).__name__}.")
    if not grads:
        raise ValueError(f"{call}(comm={comm!r}, grads=[]): comm sums the gradients listed in grads, and none "
                         f"are listed, so nothing would be all-reduced; pass grads=[p for p in model.parameters()].")


class DynamicLossScalingUpdater:
    """Zero grads, forward and scaled backward ``accum_grad`` times, all-reduce, check, and either step or
    shrink the scale and re-run.

    Args:
        solver: The torch optimizer to step.
        loss: Zero-argument callable: the forward pass, returning the loss tensor.
        data_feeder: Zero-argument callable run before each forward pass (loads the next batch).
        scale: Initial loss scale.
        scaling_factor: The scale is divided by it on overflow and multiplied by it on growth.
        N: Clean updates between growths (see the module docstring for the exact count).
        clear_buffer: Accepted for compatibility; no effect.
        accum_grad: Forward/backward passes per update; their gradients are summed.
        weight_decay: L2 coefficient added to the unscaled gradients (``grad += weight_decay * param``).
        comm: A torch.distributed process group to sum ``grads`` over.
        grads: Parameters (their ``.grad``) or gradient tensors to all-reduce over ``comm``.
        **kwargs: Further :class:`~lossscale.LossScaleOptimizer` arguments (``overflow_mode``, ...).

    Raises:
        TypeError: ``loss`` or ``data_feeder`` is not callable, ``comm`` not a ProcessGroup, ``grads`` not a
            list of tensors, or a number of the wrong type.
        ValueError: a number out of range, ``comm`` without ``grads``, or ``weight_decay`` with
            ``skip_mode="fused"``.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> updater = DynamicLossScalingUpdater(torch.optim.SGD([w], lr=0.1), lambda: (2 * w).sum(), N=10)
        >>> updater.update()
        >>> (round(float(w.detach()), 4), updater.scale)
        (0.8, 8.0)
    """

    def __init__(self, solver: torch.optim.Optimizer, loss: Callable[[], torch.Tensor],
                 data_feeder: Callable[[], Any] = lambda: True, scale: float = 8.0, scaling_factor: float = 2.0,
                 N: int = 2000, clear_buffer: bool = True, accum_grad: int = 1,  # noqa: N803
                 weight_decay: float | None = None, comm: Any = None, grads: Sequence[torch.Tensor] | None = (),
                 **kwargs: Any) -> None:
        call = "DynamicLossScalingUpdater"
        for name, value, role in (("loss", loss, "running the forward pass and returning the loss"),
                                  ("data_feeder", data_feeder, "loading the next batch")):
            if not callable(value):
                raise TypeError(f"{call}({name}={value!r}): {name} must be a zero-argument callable ({role}).")
        check_int_at_least(call, "accum_grad", accum_grad, 1)
        if weight_decay is not None and (isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float))):
            raise ArgumentTypeError(f"{call}(weight_decay={weight_decay!r}): weight_decay must be None or a finite "
                                    f"number >= 0; got {type(weight_decay).__name__}.")
        if weight_decay is not None and not 0 <= weight_decay < float("inf"):
            raise ValueError(f"{call}(weight_decay={weight_decay!r}): weight_decay must be None or a finite number "
                             f">= 0; got {weight_decay!r}.")
        check_choice(call, "clear_buffer", clear_buffer, (True, False))
        grads = [] if grads is None else checked_tensors(call, "grads", grads, none_items=False)
        _check_comm(call, comm, grads)
        if weight_decay and kwargs.get("skip_mode", "auto") not in ("auto", "host", "masked"):
            raise ValueError(f"{call}(weight_decay={weight_decay!r}, skip_mode={kwargs['skip_mode']!r}): weight decay "
                             f"is added to the unscaled gradients, which skip_mode='fused' never writes; use "
                             f"skip_mode='host' (the default here) or 'masked'.")
        if weight_decay:
            kwargs.setdefault("skip_mode", "host")
        policy = presets.nnabla(scale, scaling_factor, N, call=call)
        self.solver = solver
        self.loss = loss
        self.data_feeder = data_feeder
        self.scaling_factor = scaling_factor
        self.N = N
        self.clear_buffer = clear_buffer
        self.accum_grad = accum_grad
        self.weight_decay = weight_decay
        self.comm = comm
        self.grads = grads
        self._opt = LossScaleOptimizer(solver, policy=policy, **kwargs)
        self.last_result: StepResult | None = None

    @property
    def scale(self) -> float:
        """The current loss scale (reads it on the host). Assigning it sets the scale through the checked
        setter :meth:`lossscale.LossScale.set_scale`; the counters carry on."""
        return float(self._opt.scale)

    @scale.setter
    def scale(self, value: float) -> None:
        self._opt.loss_scale.set_scale(value, call=f"DynamicLossScalingUpdater.scale = {value!r}")

    @property
    def scale_state(self) -> Any:
        """The whole state record (scale and counters)."""
        return self._opt.scale_state

    def update(self) -> None:
        """One update: up to 1 + 100 attempts, each ``accum_grad`` passes; steps on the first clean one."""
        hook = self.solver.register_step_pre_hook(self._add_weight_decay) if self.weight_decay else None
        try:
            for _ in range(MAX_RETRIES + 1):
                self._opt.inner.zero_grad(set_to_none=False)
                for _ in range(self.accum_grad):
                    self.data_feeder()
                    self._opt.backward(self.loss())
                if self.comm is not None:
                    all_reduce_grads_([t.grad if t.requires_grad and t.is_leaf else t for t in self.grads], self.comm)
                self.last_result = self._opt.step()
                if not bool(self.last_result.found_inf):  # the host read nnabla's retry needs
                    return
        finally:
            if hook is not None:
                hook.remove()

    @torch.no_grad()
    def _add_weight_decay(self, solver: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """nnabla's ``solver.weight_decay``: ``grad += weight_decay * param``, after the overflow check and
        the unscale, as a step pre-hook of the solver (installed only during ``update()``). In skip_mode
        ``host`` it runs only for applied steps; in ``masked`` a skipped step's restore undoes it."""
        params = [p for g in solver.param_groups for p in g["params"] if p.grad is not None]
        if params:
            torch._foreach_add_([p.grad for p in params], params, alpha=self.weight_decay)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's and the scale's state."""
        return self._opt.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self._opt.load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("DynamicLossScalingUpdater is not pickled directly; save updater.state_dict() with "
                        "torch.save.")
