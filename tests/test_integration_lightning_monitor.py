"""LossScaleMonitor in a real Trainer: what it logs, when, and how many host reads that costs."""

from __future__ import annotations

from argparse import Namespace
from typing import Any

import pytest
from _lightning_models import LIGHTNING_WARNINGS, TORCH_ARGS, Tiny, fit, torch_plugin
from lightning.pytorch.loggers.logger import Logger

import lossscale
from lossscale.reporting import read_scalars as _read
from lossscale.integrations.lightning import LossScaleMonitor, LossScalePrecision, MixedPrecision

pytestmark = [pytest.mark.filterwarnings(w) for w in LIGHTNING_WARNINGS]  # the reasons are in _lightning_models


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))


def plugin() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", **TORCH_ARGS)


def test_logs_scale_and_skipped_steps_at_lightnings_cadence() -> None:
    logger, monitor = MemoryLogger(), LossScaleMonitor()
    _, rec, _ = fit(plugin(), logger=logger, log_every_n_steps=2, callbacks=[monitor])
    rows = [(step, m) for step, m in logger.rows if any(k.startswith("lossscale/") for k in m)]
    assert [step for step, _ in rows] == [1, 3, 5, 7]  # every 2nd optimizer step (skips at 0, 3 and 5)
    assert [m["lossscale/skipped_steps"] for _, m in rows] == [1, 2, 3, 3]
    assert [m["lossscale/scale"] for _, m in rows] == [float(rec.results[s].scale) for s in (1, 3, 5, 7)]
    assert all("lossscale/underflow" not in m for _, m in rows)  # the scaler does not measure it
    assert monitor.state_dict() == {"skipped_steps": 3}


def test_logs_the_underflow_the_wrapper_measures_under_loss_scale_precision() -> None:
    logger = MemoryLogger()
    _, rec, _ = fit(LossScalePrecision(device="cpu"), Tiny(wrap=dict(underflow_stride=1)), logger=logger,
                    log_every_n_steps=2, callbacks=[LossScaleMonitor(prefix="amp")])
    rows = [m for _, m in logger.rows if "amp/scale" in m]
    assert [m["amp/skipped_steps"] for m in rows] == [1, 2, 3, 3]
    assert [m["amp/underflow"] for m in rows] == [float(rec.results[s].underflow) for s in (1, 3, 5, 7)]
    assert all(0.0 <= m["amp/underflow"] <= 1.0 for m in rows)


def test_reads_the_host_only_when_it_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    from lossscale.integrations import lightning

    reads: list[dict[str, Any]] = []  # the monitor's one batched read (tolist) per log
    monkeypatch.setattr(lightning, "read_scalars", lambda v: reads.append(v) or _read(v))
    with lossscale.HostReadCounter() as without:
        fit(plugin(), logger=MemoryLogger(), log_every_n_steps=3, epochs=2)
    logger = MemoryLogger()
    with lossscale.HostReadCounter() as with_monitor:
        fit(plugin(), logger=logger, log_every_n_steps=3, epochs=2, callbacks=[LossScaleMonitor()])
    logged = sum(any(k.startswith("lossscale/") for k in m) for _, m in logger.rows)
    assert logged == len(reads) == 2  # steps 2 and 5 of 8
    assert with_monitor.count == without.count  # and no scalar read (.item(), bool()) anywhere else


def test_refuses_a_trainer_it_cannot_serve() -> None:
    with pytest.raises(RuntimeError, match=r"LossScaleMonitor: the Trainer has no logger"):
        fit(plugin(), epochs=1, callbacks=[LossScaleMonitor()])
    with pytest.raises(TypeError, match=r"precision plugin is lightning.pytorch.plugins.precision.amp.MixedPrecision"):
        fit(torch_plugin(), logger=MemoryLogger(), epochs=1, callbacks=[LossScaleMonitor()])
    with pytest.raises(ValueError, match=r"LossScaleMonitor\(prefix=''\): prefix must be a non-empty string"):
        LossScaleMonitor(prefix="")
