"""Lightning's own ``MixedPrecision`` plugin with lossscale's :class:`~lossscale.GradScaler` in its scaler slot."""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch.plugins.precision import MixedPrecision as _LightningMixedPrecision

from lossscale.integrations._amp import make_scaler, scaler_result
from lossscale.result import StepResult
from lossscale.scaler import GradScaler, ScalerStep

__all__ = ["MixedPrecision"]


class MixedPrecision(_LightningMixedPrecision):
    """Lightning's float16 AMP plugin driving a :class:`lossscale.GradScaler`; use it alone in ``plugins=``.

    Usage::

        from lossscale.integrations.lightning import MixedPrecision
        trainer = Trainer(plugins=[MixedPrecision("16-mixed", "cuda", growth_interval=1000)])

    Everything is Lightning's plugin (autocast, ``scaler.scale(loss)`` in backward, unscale before
    ``on_before_optimizer_step`` and clipping, ``scaler.step`` + ``update``); with torch's scaler
    arguments the scale trajectory and weights equal Lightning's plugin with ``torch.amp.GradScaler``,
    bit for bit. Added: ``last_result``, the :class:`~lossscale.StepResult` of the last optimizer step
    (skipped or not, scale before and after, and the gradient norm when Lightning clipped by norm),
    built without a host read.

    Checkpoints: the class keeps Lightning's name, so its state is saved under the same key
    (``"MixedPrecision"``) in torch's format plus ``policy_state``; a checkpoint written with
    Lightning's plugin and torch's scaler resumes here, and one written here resumes there.

    Args:
        precision: ``"16-mixed"`` (the only precision that uses a scaler).
        device: The autocast device type (``"cuda"``, ``"cpu"``, ...).
        scaler: An existing :class:`~lossscale.GradScaler`; or leave it out and pass ``scaler_kwargs``.
        **scaler_kwargs: Arguments of ``GradScaler`` (``init_scale``, ``growth_interval``, ``policy``, ...).
    """

    def __init__(self, precision: str = "16-mixed", device: str = "cuda", scaler: GradScaler | None = None,
                 **scaler_kwargs: Any) -> None:
        scaler = make_scaler("MixedPrecision", precision, device, scaler, scaler_kwargs)
        super().__init__(precision, device, scaler=scaler)  # type: ignore[arg-type]
        self.last_result: StepResult | None = None
        self._carried: torch.Tensor | None = None
        self._grad_norm: torch.Tensor | None = None

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        """After backward and unscale: hooks and clipping (Lightning's), then note the scale the gradients carry."""
        self._grad_norm = None
        super()._after_closure(model, optimizer)
        self._carried = self.scaler.get_scale_tensor()

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        """Lightning's clip (``torch.nn.utils.clip_grad_norm_``), keeping the norm for ``last_result``."""
        self._grad_norm = torch.nn.utils.clip_grad_norm_(self.main_params(optimizer), clip_val)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Lightning's step; returns what ``optimizer.step()`` returned (as with torch's scaler) and records
        the decision in ``last_result``."""
        out = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if not isinstance(out, ScalerStep):  # no step: the closure skipped backward
            return out
        self.last_result = scaler_result(out, self._carried, self.scaler, model.trainer.global_step, self._grad_norm)
        return out.value
