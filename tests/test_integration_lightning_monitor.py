"""LossScaleMonitor in a real Trainer: what it logs, when, and how many host reads that costs."""

from __future__ import annotations

import csv
from argparse import Namespace
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.logger import Logger

import lossscale
import lossscale.testing
from _lightning_models import LIGHTNING_WARNINGS, TORCH_ARGS, Healable, Planted, Tiny, fit, torch_plugin
from lossscale import OverflowWarning
from lossscale.integrations.lightning import LossScaleMonitor, LossScalePrecision, MixedPrecision
from lossscale.reporting import read_scalars as _read

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
    _, rec, _ = fit(
        LossScalePrecision(device="cpu"),
        Tiny(wrap=dict(underflow_stride=1)),
        logger=logger,
        log_every_n_steps=2,
        callbacks=[LossScaleMonitor(prefix="amp")],
    )
    rows = [m for _, m in logger.rows if "amp/scale" in m]
    assert [m["amp/skipped_steps"] for m in rows] == [1, 2, 3, 3]
    assert [m["amp/underflow"] for m in rows] == [float(rec.results[s].underflow) for s in (1, 3, 5, 7)]
    assert all(0.0 <= m["amp/underflow"] <= 1.0 for m in rows)


def test_reads_the_host_only_when_it_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    from lossscale.integrations import lightning

    reads: list[dict[str, Any]] = []  # the monitor's one batched read (tolist) per log
    monkeypatch.setattr(lightning, "read_scalars", lambda v: reads.append(v) or _read(v))
    with lossscale.testing.HostReadCounter() as without:
        fit(plugin(), logger=MemoryLogger(), log_every_n_steps=3, epochs=2)
    logger = MemoryLogger()
    with lossscale.testing.HostReadCounter() as with_monitor:
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


class LoggedTiny(Tiny):
    """Tiny logging its loss with ``self.log``: the logger gets a row at every log."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss


def test_logs_nothing_of_its_own_under_bf16_mixed() -> None:
    logger, monitor = MemoryLogger(), LossScaleMonitor()
    plugin = MixedPrecision("bf16-mixed", "cpu")  # a config switched from "16-mixed" keeps its monitor
    fit(plugin, LoggedTiny(inf_at=set()), logger=logger, log_every_n_steps=1, callbacks=[monitor])
    assert [step for step, m in logger.rows if "loss" in m] == list(range(8))  # a log at each of the 8 steps
    assert not [k for _, m in logger.rows for k in m if k.startswith("lossscale/")]  # no scale, nothing skipped
    assert monitor.state_dict() == {"skipped_steps": 0}


class Board:
    """What a TensorBoardLogger's writer is asked to write."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.texts: list[tuple[str, str, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if not isinstance(value, (int, float)):
            raise ValueError(f"add_scalar({tag!r}, {value!r}): a number")  # as TensorBoard's own writer refuses
        self.scalars.append((tag, value, step))

    def add_text(self, tag: str, text: str, global_step: int) -> None:
        self.texts.append((tag, text, global_step))


class BoardLogger(TensorBoardLogger):
    """A TensorBoardLogger whose writer is a :class:`Board` (tensorboard need not be installed)."""

    def __init__(self, root: str, monkeypatch: pytest.MonkeyPatch) -> None:
        from lightning.fabric.loggers import tensorboard

        with monkeypatch.context() as patch:
            patch.setattr(tensorboard, "_TENSORBOARD_AVAILABLE", True)  # its check at construction, for a writer
            super().__init__(root)
        self.board = Board()

    @property
    def experiment(self) -> Any:
        return self.board

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def save(self) -> None:
        pass

    def finalize(self, status: str) -> None:
        pass


@pytest.mark.parametrize("precision", ["MixedPrecision", "LossScalePrecision"])
def test_logs_the_diagnosis_of_a_collapse_once_as_text(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, precision: str
) -> None:
    memory, board = MemoryLogger(), BoardLogger(str(tmp_path / "tb"), monkeypatch)
    table = CSVLogger(str(tmp_path), name="csv")
    plugin = (
        MixedPrecision("16-mixed", "cpu", diagnose=True, **TORCH_ARGS)
        if precision == "MixedPrecision"
        else LossScalePrecision(device="cpu", diagnose=True)
    )
    with pytest.warns(OverflowWarning, match="net.amplify"):
        fit(
            plugin,
            Planted(factor=1e6, wrap=None if precision == "MixedPrecision" else {}),
            epochs=3,
            accumulate_grad_batches=1,
            logger=[memory, board, table],
            log_every_n_steps=1,
            callbacks=[LossScaleMonitor()],
        )
    found = [(step, m) for step, m in memory.rows if "lossscale/overflow_kind" in m]
    assert [(step, m["lossscale/overflow_kind"], m["lossscale/overflow_module"]) for step, m in found] == [
        # in the log of each traced step: 3 (two non-finite losses fired the trigger, acted on one step later), and
        # 21 (16 overflows in a row after that trace, the default patience); warned once (the same cause)
        (3, "forward", "net.amplify"),
        (21, "forward", "net.amplify"),
    ]
    assert board.board.texts == [
        ("lossscale/overflow_kind", "forward", 3),
        ("lossscale/overflow_module", "net.amplify", 3),
        ("lossscale/overflow_kind", "forward", 21),
        ("lossscale/overflow_module", "net.amplify", 21),
    ]
    assert {tag for tag, _, _ in board.board.scalars} == {"lossscale/scale", "lossscale/skipped_steps"}
    with open(table.experiment.metrics_file_path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["lossscale/overflow_kind"]]
    assert [(r["lossscale/overflow_kind"], r["lossscale/overflow_module"]) for r in rows] == [
        ("forward", "net.amplify"),
        ("forward", "net.amplify"),
    ]


@pytest.mark.parametrize("precision", ["MixedPrecision", "LossScalePrecision"])
def test_heal_true_heals_the_planted_module_and_the_monitor_logs_it_once(precision: str) -> None:
    """The one line, ``heal=True`` beside ``diagnose=True``: the forward overflow planted in ``net.big`` is healed at
    the traced step (3), the scale never moves, and the monitor logs ``healed_modules`` in that step's row only,
    with the forward faults counted apart from the skipped steps."""
    memory = MemoryLogger()
    plugin = (
        MixedPrecision("16-mixed", "cpu", diagnose=True, heal=True, **TORCH_ARGS)
        if precision == "MixedPrecision"
        else LossScalePrecision(device="cpu", diagnose=True, heal=True)
    )
    with pytest.warns(lossscale.HealWarning, match=r"healed at step 3: 'net.big' now runs in float32") as caught:
        _, recorder, _ = fit(
            plugin,
            Healable(wrap=None if precision == "MixedPrecision" else {}),
            epochs=2,
            accumulate_grad_batches=1,
            logger=[memory],
            log_every_n_steps=1,
            callbacks=[LossScaleMonitor()],
        )
    assert len([w for w in caught if isinstance(w.message, lossscale.HealWarning)]) == 1
    assert plugin.diagnosis is not None and plugin.diagnosis.healed == {"net.big": torch.float32}
    healed = [(step, m["lossscale/healed_modules"]) for step, m in memory.rows if "lossscale/healed_modules" in m]
    assert healed == [(3, "net.big")]
    faults = [m["lossscale/forward_faults"] for _, m in memory.rows]
    skipped = [m["lossscale/skipped_steps"] for _, m in memory.rows]
    assert faults[:5] == [1, 2, 3, 4, 4] and faults[-1] == 4  # none after the heal
    assert skipped[:5] == [1, 2, 3, 4, 4]  # later skips: the scale's own growth overflowing (growth_interval=2)
    assert recorder.scales[:4] == [2.0**10] * 4  # the policy never saw the faulted steps
    assert bool(recorder.results[4].stepped) and recorder.scales[5] == 2.0**11  # then grew as torch's rule does
