"""Many small CPU tensors read on two cores at once.

ATen runs a CPU kernel on one thread when its tensor has fewer elements than the grain (32,768), so
torch's foreach kernels (``_foreach_norm``, ``_amp_foreach_non_finite_check_and_unscale_``,
``_foreach_mul_``) read 1,000 gradients of 20K elements on one core while the others idle. ATen releases
the GIL inside a kernel, so a second Python thread can run the same kernel over part of the list
meanwhile.

Rule: on CPU, with more than one torch thread, not under a thread's own state (torch.compile tracing, a
Python dispatch or function mode), where the tensors under the grain hold at least :data:`MIN_ELEMENTS`
together: one worker thread (made once per process, again after a fork) takes the sub-grain tensors at the
end of the list that make up half of the sub-grain elements; the calling thread keeps the rest, every
tensor at or above the grain included (their kernels are parallel already, and an OpenMP region opened
from the worker would start a second thread team). Each tensor goes through the same kernel as in one
call, so every result is the one-call result bit for bit.

Cost: a hand-off of 30-50 us and a Python pass over the list. Measured on a 2-core AVX2 EPYC with 2 torch
threads. Alone, caches warm (one call -> two threads): ``_foreach_norm`` 100 x 10K 600 -> 413 us, 1,000 x
20K 11.2 -> 6.5 ms; torch's fused check 456 -> 334 us and 10.0 -> 6.1 ms. In a whole step the gain is
smaller, and below MIN_ELEMENTS a loss (torch's OpenMP threads still spin after the step's parallel
kernels, so the worker finds no idle core): LossScaleOptimizer step time, split / one call, fused AdamW
without clipping: 100 x 10K 1.12, 300 x 10K 1.04, 300 x 20K and 1,000 x 5K 0.99, 500 x 20K 0.95, 1,000 x
20K 0.94-0.98; with clipping 1,000 x 20K 0.95, SGD with momentum 0.92-0.95 (GradScaler alike).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

__all__ = ["MIN_ELEMENTS", "GRAIN", "halves", "foreach_norm", "check_and_unscale_", "foreach_mul_"]

GRAIN = 32768  # at::internal::GRAIN_SIZE: below it an ATen CPU kernel runs on the calling thread
MIN_ELEMENTS = 1 << 23  # sub-grain elements (32 MiB of float32) from which the hand-off pays in a whole step

_worker: ThreadPoolExecutor | None = None
_worker_pid = -1


def _executor() -> ThreadPoolExecutor:
    """The one worker thread of this process (a forked child makes its own: threads do not survive fork)."""
    global _worker, _worker_pid
    if _worker is None or _worker_pid != os.getpid():
        _worker, _worker_pid = ThreadPoolExecutor(1, thread_name_prefix="lossscale-two-threads"), os.getpid()
    return _worker


def _thread_bound() -> bool:
    """Whether the calling thread has state a worker would not share: torch.compile tracing, or a Python
    torch-function or dispatch mode (a FakeTensorMode, a FLOP counter, benchmarks' pass counter): their
    stacks are per thread, so the worker's half would escape them."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and compiler.is_compiling():
        return True
    return bool(torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack())


def halves(tensors: Sequence[torch.Tensor]) -> tuple[list[int], list[int]] | None:
    """(kept, handed): indices for the calling thread and for the worker, each in list order; None where
    one call is better (see the module docstring). No tensor is read; under 256 tensors (the fewest that
    can hold MIN_ELEMENTS under the grain) not even their sizes."""
    if len(tensors) < 2 or len(tensors) * GRAIN <= MIN_ELEMENTS:  # too few to hold MIN_ELEMENTS: no scan
        return None
    if torch.get_num_threads() < 2 or tensors[0].device.type != "cpu" or _thread_bound():
        return None
    sizes = list(map(torch.Tensor.numel, tensors))
    if sum(sizes) < MIN_ELEMENTS:
        return None
    small = sum(n for n in sizes if n < GRAIN)
    if small < MIN_ELEMENTS:
        return None
    handed, taken = [], 0
    for i in range(len(sizes) - 1, -1, -1):
        if sizes[i] < GRAIN:
            handed.append(i)
            taken += sizes[i]
            if 2 * taken >= small:
                break
    handed.reverse()
    chosen = set(handed)
    return [i for i in range(len(sizes)) if i not in chosen], handed


def _submit(fn: Callable[..., Any], *args: Any) -> Future:
    """Run ``fn(*args)`` on the worker under the caller's grad and inference modes (thread-local in torch)."""
    grad_enabled, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def call() -> Any:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad_enabled):
            return fn(*args)
    return _executor().submit(call)


def _pick(tensors: Sequence[torch.Tensor], index: list[int]) -> list[torch.Tensor]:
    return [tensors[i] for i in index]


def _on_both(fn: Callable[..., Any], tensors: Sequence[torch.Tensor], split: tuple[list[int], list[int]],
             worker_args: tuple = (), own_args: tuple = ()) -> tuple[Any, Any]:
    """(the caller's result, the worker's): ``fn`` over the kept tensors here and the handed ones on the
    worker at once. The worker is waited for even when the caller's call raises, so no kernel still writes
    the tensors after this returns."""
    kept, handed = split
    pending = _submit(fn, _pick(tensors, handed), *worker_args)
    try:
        mine = fn(_pick(tensors, kept), *own_args)
    finally:
        theirs = pending.result()
    return mine, theirs


def foreach_norm(tensors: Sequence[torch.Tensor], ord: float = 2.0) -> list[torch.Tensor]:
    """``torch._foreach_norm(tensors, ord)``, the same 0-d norms in the same order; one read pass."""
    split = halves(tensors)
    if split is None:
        return list(torch._foreach_norm(list(tensors), ord))
    kept, handed = split
    mine, theirs = _on_both(torch._foreach_norm, tensors, split, (ord,), (ord,))
    out: list[Any] = [None] * len(tensors)
    for i, norm in zip(kept, mine):
        out[i] = norm
    for i, norm in zip(handed, theirs):
        out[i] = norm
    return out


def check_and_unscale_(tensors: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_``: every tensor multiplied by ``inv_scale`` in place,
    ``found_inf`` set to 1.0 where a value is inf or NaN and otherwise left as it was (torch's rule, for
    any start). One read+write pass; on two threads the worker's half reports into a flag of its own,
    copied in by one ``masked_fill_`` (2 ops)."""
    split = halves(tensors)
    if split is None:
        torch._amp_foreach_non_finite_check_and_unscale_(list(tensors), found_inf, inv_scale)
        return
    flag = torch.zeros_like(found_inf)
    _on_both(torch._amp_foreach_non_finite_check_and_unscale_, tensors, split, (flag, inv_scale),
             (found_inf, inv_scale))
    found_inf.masked_fill_(flag.bool(), 1.0)


def foreach_mul_(tensors: Sequence[torch.Tensor], factor: torch.Tensor) -> None:
    """``torch._foreach_mul_(tensors, factor)`` (one 0-d tensor factor); one read+write pass."""
    split = halves(tensors)
    if split is None:
        torch._foreach_mul_(list(tensors), factor)
        return
    _on_both(torch._foreach_mul_, tensors, split, (factor,), (factor,))
