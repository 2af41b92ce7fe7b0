"""Helpers for testing and running training scripts with lossscale; nothing in the library imports them.

- :class:`HostReadCounter` counts host reads (the test of "no host read on a healthy step").
- :func:`init_from_env`, :func:`is_main_process` and :func:`shutdown`: the lines a script needs to run alone or
  under ``torchrun``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from torch._ops import OpOverload

__all__ = ["HostReadCounter", "init_from_env", "is_main_process", "shutdown"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class HostReadCounter(TorchDispatchMode):
    """Context manager counting scalar host reads while active: calls of ``aten._local_scalar_dense``, the op
    behind ``.item()``, ``bool(t)``, ``float(t)`` and ``int(t)`` (on CUDA each one waits for the device).

    Example:
        >>> import torch
        >>> with HostReadCounter() as reads:
        ...     _ = torch.ones(()).item()
        >>> reads.count
        1
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def init_from_env(backend: str = "gloo", timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the process group that ``torchrun`` describes in the environment; return ``(rank, world_size)``.

    Rule: already initialized -> that group's (rank, world_size); ``RANK`` and ``WORLD_SIZE`` set ->
    ``init_process_group(backend, init_method="env://")``; otherwise -> ``(0, 1)``, nothing initialized.
    Call :func:`shutdown` at exit.

    Args:
        backend: The torch.distributed backend: ``"gloo"`` (CPU) by default, ``"nccl"`` on GPUs.
        timeout_s: Seconds the process group's operations (joining it, then each collective) wait before they
            fail, default 300; passed to ``init_process_group`` as its ``timeout``. Unused where no group is
            initialized here.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return 0, 1
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_from_env(backend={backend!r}): torchrun sets {', '.join(_TORCHRUN_VARS)}; "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing. Launch with "
            f"`torchrun --nproc_per_node=N script.py`, or unset RANK and WORLD_SIZE to run alone."
        )
    if not dist.is_available():
        raise RuntimeError(
            f"init_from_env(backend={backend!r}): RANK is set but this torch build has no "
            f"torch.distributed; install a build with it, or unset RANK and WORLD_SIZE."
        )
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def is_main_process() -> bool:
    """True on rank 0, and in a single process: the rank that prints, plots and saves checkpoints."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def shutdown() -> None:
    """Destroy the default process group if one is initialized (the pair of :func:`init_from_env`)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
