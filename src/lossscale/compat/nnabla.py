"""nnabla's ``DynamicLossScalingUpdater`` for PyTorch: a whole update with dynamic loss scaling per call.
The rule is :func:`lossscale.presets.nnabla`.

+----------------------------------------------------+-----------------------------------------------------------------+
| nnabla                                             | lossscale                                                       |
+====================================================+=================================================================+
| ``DynamicLossScalingUpdater(solver, loss,          | the same on a :class:`~lossscale.LossScaleOptimizer` with       |
| data_feeder, scale=8.0, scaling_factor=2.0,        | ``presets.nnabla(scale, scaling_factor, N)``: first growth on   |
| N=2000, ...)``                                     | the (N+2)-th clean attempt, then every N+1                      |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``solver`` (an nnabla Solver)                      | a torch optimizer                                               |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``loss`` (a Variable), ``data_feeder``             | zero-argument callables: the forward pass (returns the loss),   |
|                                                    | the batch loader                                                |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``accum_grad=1``                                   | gradients summed over that many passes, as nnabla's backward    |
|                                                    | does                                                            |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``weight_decay=None``                              | ``grad += weight_decay * param`` on the unscaled gradients of   |
|                                                    | applied steps (skip_mode host or masked)                        |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``comm=None, grads=[]``                            | a torch.distributed ProcessGroup; ``grads`` summed over it      |
|                                                    | before the overflow check                                       |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``clear_buffer=True``                              | accepted; no effect                                             |
+----------------------------------------------------+-----------------------------------------------------------------+
| on overflow: halve, re-run (100 retries)           | the same, with new data from ``data_feeder``                    |
+----------------------------------------------------+-----------------------------------------------------------------+
| ``updater.scale`` (a Python float)                 | a property (a host read); assignable                            |
+----------------------------------------------------+-----------------------------------------------------------------+

Host reads: one per attempt, two with an optimizer without ``grad_scale``/``found_inf`` support. Deviation:
the scale stays within ``[2**-126, float32 max]`` and is rounded to float32 each step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lossscale import presets
from lossscale.compat._common import OptimizerHolder, validate_optional_number, validated_tensors
from lossscale.ops.distributed import all_reduce_grads_
from lossscale.optimizer import LossScaleOptimizer
from lossscale.reporting import StepResult
from lossscale.validation import validate_choice, validate_int_at_least

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DynamicLossScalingUpdater", "MAX_RETRIES"]

#: nnabla's ``_max_recursive_count``: overflowing re-runs of one ``update()`` before it gives up.
MAX_RETRIES = 100


def _check_comm(call: str, comm: object, grads: list[torch.Tensor]) -> None:
    """``comm`` is None (no all-reduce) or a torch.distributed ProcessGroup with gradients to sum."""
    if comm is None:
        return
    if not isinstance(comm, torch.distributed.ProcessGroup):
        raise TypeError(
            f"{call}(comm={comm!r}): comm must be None or a torch.distributed.ProcessGroup (e.g. "
            f"torch.distributed.group.WORLD after torch.distributed.init_process_group('nccl')); "
            f"got {type(comm).__name__}."
        )
    if not grads:
        raise ValueError(
            f"{call}(comm={comm!r}, grads=[]): comm sums the gradients listed in grads, and none "
            f"are listed, so nothing would be all-reduced; pass grads=[p for p in model.parameters()]."
        )


class DynamicLossScalingUpdater(OptimizerHolder):
    """One ``update()``: zero grads, ``accum_grad`` forward and scaled backward passes, all-reduce, check, then
    step, or shrink the scale and re-run.

    Args:
        solver: The torch optimizer to wrap (nnabla's Solver).
        loss: A zero-argument callable that runs the forward pass and returns the loss (nnabla's loss Variable).
        data_feeder: A zero-argument callable that loads the next batch, called before each forward pass (default:
            one that does nothing).
        scale: The first loss scale, default 8.0; a number in [2**-126, float32's largest finite value].
        scaling_factor: > 1, default 2.0: a backoff divides the scale by it, a growth multiplies it.
        N: nnabla's growth interval, an int >= 0, default 2000: the scale grows at the (N+2)-th clean attempt after
            the start or an overflow, then every N+1 clean attempts.
        clear_buffer: A bool, default True; accepted for nnabla's signature, no effect (torch frees the graph in
            backward).
        accum_grad: An int >= 1, default 1: forward and scaled backward passes per attempt, their gradients summed
            (not averaged), as nnabla's backward accumulates them.
        weight_decay: None (default) or a number >= 0: ``grad += weight_decay * param`` on the unscaled gradients
            of an applied step (nnabla's coupled L2); it makes the skip mode ``"host"`` unless ``skip_mode`` is
            ``"masked"`` (``"auto"`` included: for a fused solver it would pick ``"fused"``, which never writes the
            unscaled gradients), and refuses ``skip_mode="fused"``.
        comm: None (default) or a torch.distributed ProcessGroup (nnabla's communicator): the gradients in
            ``grads`` are summed over it before the overflow check.
        grads: Parameters (their ``.grad``) or gradient tensors to all-reduce over ``comm``; required with
            ``comm``.
        **kwargs: Further :class:`~lossscale.LossScaleOptimizer` arguments.

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

    instance_name = "updater"

    def __init__(
        self,
        solver: torch.optim.Optimizer,
        loss: Callable[[], torch.Tensor],
        data_feeder: Callable[[], object] = lambda: True,
        scale: float = 8.0,
        scaling_factor: float = 2.0,
        N: int = 2000,  # noqa: N803  # nnabla names it N
        clear_buffer: bool = True,
        accum_grad: int = 1,
        weight_decay: float | None = None,
        comm: ProcessGroup | None = None,
        grads: Sequence[torch.Tensor] | None = (),
        **kwargs: Any,
    ) -> None:
        call = "DynamicLossScalingUpdater"
        for name, value, role in (
            ("loss", loss, "running the forward pass and returning the loss"),
            ("data_feeder", data_feeder, "loading the next batch"),
        ):
            if not callable(value):
                raise TypeError(f"{call}({name}={value!r}): {name} must be a zero-argument callable ({role}).")
        validate_int_at_least(call, "accum_grad", accum_grad, 1)
        validate_optional_number(call, "weight_decay", weight_decay, inclusive=True)
        validate_choice(call, "clear_buffer", clear_buffer, (True, False))
        grads = [] if grads is None else validated_tensors(call, "grads", grads, none_items=False)
        _check_comm(call, comm, grads)
        if weight_decay and kwargs.get("skip_mode", "auto") not in ("auto", "host", "masked"):
            raise ValueError(
                f"{call}(weight_decay={weight_decay!r}, skip_mode={kwargs['skip_mode']!r}): weight decay "
                f"is added to the unscaled gradients, which skip_mode='fused' never writes; use "
                f"skip_mode='host' (the default here) or 'masked'."
            )
        if weight_decay and kwargs.get("skip_mode", "auto") == "auto":  # "auto" would pick fused for a fused solver
            kwargs["skip_mode"] = "host"
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
        super().__init__(LossScaleOptimizer(solver, policy=policy, **kwargs))
        self.last_result: StepResult | None = None

    @property
    def scale(self) -> float:
        """The current loss scale (reads it on the host); assigning it calls :meth:`lossscale.LossScale.set_scale`."""
        return float(self._opt.scale)

    @scale.setter
    def scale(self, value: float) -> None:
        self._opt.loss_scale.set_scale(value, call=f"DynamicLossScalingUpdater.scale = {value!r}")

    def update(self) -> None:
        """One update: up to 1 + 100 attempts of ``accum_grad`` passes; steps on the first clean one."""
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
                if not bool(self.last_result.found_inf):
                    return
        finally:
            if hook is not None:
                hook.remove()

    @torch.no_grad()
    def _add_weight_decay(
        self, solver: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> None:
        """``grad += weight_decay * param`` on the unscaled gradients: a step pre-hook during ``update()``."""
        assert self.weight_decay is not None  # registered only with a weight decay
        params = [p for g in solver.param_groups for p in g["params"] if p.grad is not None]
        if params:
            torch._foreach_add_([p.grad for p in params], params, alpha=self.weight_decay)
