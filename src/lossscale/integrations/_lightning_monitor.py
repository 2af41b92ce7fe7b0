"""LossScaleMonitor: a Lightning callback logging the loss scale, skipped steps and underflow."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lossscale._host import read_scalars
from lossscale.result import StepResult

__all__ = ["LossScaleMonitor"]


class LossScaleMonitor(Callback):
    """Logs ``<prefix>/scale``, ``<prefix>/skipped_steps`` and ``<prefix>/underflow`` to the Trainer's loggers.

    In the style of Lightning's ``LearningRateMonitor``: values go to ``logger.log_metrics`` at
    Lightning's logging cadence (``Trainer(log_every_n_steps=...)``), at the step Lightning logs its own
    metrics under. Works with the lossscale precision plugins, whose ``last_result`` it reads.

    Rule, after each optimizer step (a new ``last_result``)::

        skipped_steps += result.skipped          # on the device: no host read
        if Lightning logs at this step:          # one host read for all values
            log(scale=result.scale, skipped_steps, underflow=result.underflow if measured)

    ``scale`` is the scale the step's gradients carried (as :class:`~lossscale.StepLogger` writes it);
    ``underflow`` appears when the plugin measures it (``LossScaleOptimizer(underflow_stride=n)``).
    The running count is saved in the callback's checkpoint state (one host read at save).

    Args:
        prefix: The metric-name prefix (default ``"lossscale"``).
    """

    def __init__(self, prefix: str = "lossscale") -> None:
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"LossScaleMonitor(prefix={prefix!r}): prefix must be a non-empty string; "
                             f"got {prefix!r}.")
        self.prefix = prefix
        self._skipped: torch.Tensor | int = 0
        self._seen: StepResult | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a Trainer without a logger or without a lossscale precision plugin."""
        if not trainer.loggers:
            raise RuntimeError("LossScaleMonitor: the Trainer has no logger (logger=False); give it one, e.g. "
                               "Trainer(logger=CSVLogger('logs')), or drop the callback.")
        plugin = trainer.precision_plugin
        if not hasattr(plugin, "last_result"):
            raise TypeError(f"LossScaleMonitor: the Trainer's precision plugin is "
                            f"{type(plugin).__module__}.{type(plugin).__qualname__}, which does not report its "
                            f"steps; use lossscale.integrations.lightning.MixedPrecision or LossScalePrecision "
                            f"in Trainer(plugins=[...]).")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        """Count a new step's skip on the device; read and log only when Lightning logs."""
        result = trainer.precision_plugin.last_result
        if result is None or result is self._seen:
            return
        self._seen = result
        self._skipped = result.skipped.to(torch.int64) + self._skipped
        if not trainer._logger_connector.should_update_logs:  # Lightning's own cadence (LearningRateMonitor's)
            return
        values: dict[str, Any] = {"scale": result.scale, "skipped_steps": self._skipped}
        if result.underflow is not None:
            values["underflow"] = result.underflow
        metrics = {f"{self.prefix}/{k}": v for k, v in read_scalars(values).items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.fit_loop.epoch_loop._batches_that_stepped)

    def state_dict(self) -> dict[str, Any]:
        """The running count of skipped steps (a host read)."""
        return {"skipped_steps": int(self._skipped)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the count from a checkpoint."""
        self._skipped = int(state_dict["skipped_steps"])
