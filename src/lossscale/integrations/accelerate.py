"""lossscale inside HF Accelerate: :class:`lossscale.GradScaler` in the ``Accelerator``'s scaler slot.

=================================  ============================================================
Accelerate call                    what lossscale's scaler does there (as torch's scaler would)
=================================  ============================================================
``accelerator.backward(loss)``     ``scaler.scale(loss).backward()``
``accelerator.clip_grad_norm_``    ``scaler.unscale_(optimizer)`` first
``optimizer.step()``               ``scaler.step`` + ``update`` at accumulation boundaries
``optimizer_step_was_skipped``     True after a step skipped for overflow (non-fused optimizers)
``save_state`` / ``load_state``    ``scaler.pt`` in torch's format (+ ``policy_state``), both ways
=================================  ============================================================

``use_lossscale(accelerator, fp16_on_cpu=..., diagnose=model)``: when the loss scale collapses, the next step of
``model`` is traced and a :class:`lossscale.OverflowWarning` names the module (:mod:`lossscale.diagnosis`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from lossscale.integrations import require

require("accelerate", "accelerate", "accelerate")

from accelerate import Accelerator
from accelerate.utils import DistributedType

from lossscale.diagnosis.addon import OverflowDiagnosis, validate_heal
from lossscale.scaler import GradScaler

__all__ = ["use_lossscale"]

_OWN_SCALERS = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def prepared(accelerator: Accelerator) -> bool:
    """Whether ``accelerator.prepare()`` has run: prepared optimizers keep the scaler they were given."""
    return bool(accelerator._models or accelerator._optimizers)  # read only: Accelerate keeps no public list


def _validate(accelerator: object, fp16_on_cpu: bool, name: str) -> None:
    call = f"use_lossscale({name}, ...)"
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"use_lossscale(accelerator={type(accelerator).__name__}): accelerator must be an "
            f"accelerate.Accelerator; got {type(accelerator).__name__}."
        )
    if not isinstance(fp16_on_cpu, bool):
        raise TypeError(f"use_lossscale(fp16_on_cpu={fp16_on_cpu!r}): fp16_on_cpu must be True or False.")
    if prepared(accelerator):
        raise RuntimeError(
            f"{call} was called after accelerator.prepare(): prepared optimizers keep the scaler "
            f"they were prepared with. Call use_lossscale right after Accelerator(...), "
            f"before prepare()."
        )
    if accelerator.distributed_type in _OWN_SCALERS:
        raise ValueError(
            f"{call}: {accelerator.distributed_type.value} keeps its own loss scaler, which "
            f"lossscale does not replace; use_lossscale works with the other distributed types."
        )
    precision = accelerator.mixed_precision
    if precision != "fp16":
        raise ValueError(
            f"{call}: the accelerator was created with mixed_precision={precision!r}; loss scaling "
            f"needs mixed_precision='fp16' (bfloat16 and float32 need none). Create it with "
            f"Accelerator(mixed_precision='fp16')."
        )
    on_cpu = accelerator.device.type == "cpu"
    if on_cpu and not fp16_on_cpu:
        raise ValueError(
            f"{call}: Accelerate drops fp16 on CPU without a word (no autocast, no scaler), so the "
            f"scaler would never run. Pass use_lossscale({name}, fp16_on_cpu=True) to autocast "
            f"to float16 on CPU with lossscale's scaler, or train on an accelerator device."
        )
    if fp16_on_cpu and not on_cpu:
        raise ValueError(
            f"use_lossscale({name}, fp16_on_cpu=True): the {name}'s device is "
            f"{accelerator.device.type!r}, where Accelerate keeps fp16 itself; fp16_on_cpu is for "
            f"CPU only. Leave it False."
        )


def use_lossscale(
    accelerator: Accelerator,
    *,
    fp16_on_cpu: bool = False,
    diagnose: torch.nn.Module | OverflowDiagnosis | Literal[False] | None = None,
    heal: bool | torch.dtype = False,
    **scaler_kwargs: Any,
) -> GradScaler:
    """Install ``GradScaler(device=accelerator.device.type, **scaler_kwargs)`` as ``accelerator.scaler``; return it.

    Call it right after ``Accelerator(mixed_precision="fp16", ...)`` and before ``prepare()``::

        scaler = use_lossscale(accelerator, growth_interval=1000, diagnose=model)

    Args:
        accelerator: An ``Accelerator`` made with ``mixed_precision="fp16"``, not yet ``prepare()``-d.
        fp16_on_cpu: True turns float16 autocast on for a CPU device, where Accelerate turns fp16 off.
        diagnose: The model to trace when the loss scale collapses (the module you pass to ``prepare()``, before
            or after it), or an :class:`~lossscale.OverflowDiagnosis` (its ``patience``); None or False: none.
            The scaler's ``diagnose=`` (:mod:`lossscale.diagnosis`).
        heal: True (or ``torch.bfloat16``): with ``diagnose``, a forward overflow keeps the faulting modules in
            float32 (or bfloat16) at once, skips the step without lowering the scale and warns with a
            :class:`~lossscale.HealWarning` (:ref:`healing`); False (default): diagnosis only.
        **scaler_kwargs: Arguments of ``GradScaler``; or give them in the Accelerator's ``GradScalerKwargs``.

    Raises:
        TypeError: ``accelerator`` is not an ``Accelerator``, ``fp16_on_cpu`` not a bool, or ``diagnose`` none of
            the values above.
        RuntimeError: called after ``prepare()``.
        ValueError: mixed_precision is not ``"fp16"``; a CPU device without ``fp16_on_cpu``, or
            ``fp16_on_cpu`` elsewhere; DeepSpeed or Megatron-LM; both ``scaler_kwargs`` and ``GradScalerKwargs``.
    """
    validate_heal("use_lossscale", diagnose, heal)
    return install(accelerator, fp16_on_cpu, scaler_kwargs, diagnose=diagnose, heal=heal)


def install(
    accelerator: Accelerator,
    fp16_on_cpu: bool,
    scaler_kwargs: dict[str, Any],
    name: str = "accelerator",
    scaler_type: type[GradScaler] = GradScaler,
    diagnose: torch.nn.Module | OverflowDiagnosis | Literal[False] | None = None,
    heal: bool | torch.dtype = False,
) -> GradScaler:
    """:func:`use_lossscale`'s checks and installation, for the front ends built on it: ``name`` is the argument
    their errors echo, ``scaler_type`` the GradScaler (or subclass) they install, ``diagnose`` its diagnosis."""
    _validate(accelerator, fp16_on_cpu, name)
    handler = accelerator.scaler_handler
    if handler is not None and scaler_kwargs:
        raise ValueError(
            f"use_lossscale({name}, {', '.join(f'{k}=...' for k in scaler_kwargs)}): the "
            f"accelerator already has GradScalerKwargs({handler.to_kwargs()}); give the scaler's "
            f"arguments in one place, not both."
        )
    kwargs = handler.to_kwargs() if handler is not None else scaler_kwargs
    scaler = scaler_type(device=accelerator.device.type, diagnose=diagnose, heal=heal, **kwargs)
    accelerator.scaler = scaler
    accelerator.native_amp = True
    return scaler
