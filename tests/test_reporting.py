"""lossscale.reporting: StepResult and ScalerStep, a step as one dict (one host read), the CSV/TensorBoard logger,
and HostReadCounter, which the other tests use to count host reads."""

import csv
import dataclasses
import importlib.util
import json
import multiprocessing
import os
import signal
import sys
import time
import types
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
import torch

from lossscale import (
    DynamicScale,
    GradScaler,
    LossScaleOptimizer,
    OverflowDiagnosis,
    OverflowWarning,
    ScalerStep,
    StepResult,
)
from lossscale.reporting import COLUMNS, EventFields, StepLogger, atomic_write, step_record
from lossscale.testing import HostReadCounter

EXPECTED_COLUMNS = (
    "step",
    "stepped",
    "found_inf",
    "scale",
    "next_scale",
    "forward_fault",
    "grad_norm",
    "underflow",
    "accumulating",
    "skipped",
    "skipped_steps",
    "forward_faults",
)
#: The fields a diagnosis adds to every result (empty but in the step whose trace made a report).
DIAGNOSIS_COLUMNS = ("overflow_kind", "overflow_module")


def result(skipped=False, step=0, grad_norm=None, accumulating=False):
    flag = torch.tensor(skipped)
    return StepResult(
        stepped=~flag,
        found_inf=flag,
        scale=torch.tensor(1024.0),
        next_scale=torch.tensor(512.0 if skipped else 1024.0),
        grad_norm=None if grad_norm is None else torch.tensor(grad_norm),
        accumulating=accumulating,
        step=step,
    )


def test_columns_are_step_result_fields_plus_skip_counts():
    assert COLUMNS == EXPECTED_COLUMNS


def test_host_read_counter_counts_each_scalar_read_and_nothing_else():
    t = torch.tensor([1.5, -2.0])
    with HostReadCounter() as reads:
        _ = (t * 2).sum() + t.abs().max()  # tensor ops, no read
        assert reads.count == 0
        _ = t[0].item(), bool(t[1] < 0), float(t[0]), int(t[1])
    assert reads.count == 4


def test_a_step_result_is_frozen_and_reads_as_plain_values_at_once():
    r = result(skipped=True, step=5, grad_norm=0.25)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.stepped = torch.tensor(True)  # type: ignore[misc]
    assert bool(r.skipped) and not bool(result(skipped=True, accumulating=True).skipped)
    assert r.as_dict() == {
        "stepped": False,
        "found_inf": True,
        "scale": 1024.0,
        "next_scale": 512.0,
        "grad_norm": 0.25,
        "accumulating": False,
        "step": 5,
        "forward_fault": None,
        "underflow": None,
    }
    with_fields = dataclasses.replace(r, fields={"precision": "float16", "layer_scales": {"0": torch.tensor(2.0)}})
    assert with_fields.precision == "float16" and float(with_fields.layer_scales["0"]) == 2.0  # by their names
    assert with_fields.as_dict()["precision"] == "float16" and "layer_scales" not in with_fields.as_dict()
    with pytest.raises(AttributeError, match=r"no attribute 'switched' \(the added fields are \['layer_scales', "):
        _ = with_fields.switched


def test_scaler_step_flags_are_bool_tensors_and_stepped_is_their_negation():
    for found in (False, True):
        decision = ScalerStep(found_inf=torch.tensor(found))
        assert decision.found_inf.dtype == torch.bool and decision.stepped.dtype == torch.bool
        assert bool(decision.found_inf) is found and bool(decision.stepped) is not found
        for fault in (False, True):  # a forward fault skips the step too
            decision = ScalerStep(found_inf=torch.tensor(found), forward_fault=torch.tensor(fault))
            assert bool(decision.stepped) is not (found or fault)


def test_step_record_reads_all_tensors_together_without_scalar_reads():
    with HostReadCounter() as reads:
        rec = step_record(result(skipped=True, step=4, grad_norm=2.5), loss=torch.tensor(3.25), lr=0.1)
    assert reads.count == 0  # no .item()/bool() per field: one stacked tolist() for every tensor
    assert rec == {
        "stepped": False,
        "found_inf": True,
        "scale": 1024.0,
        "next_scale": 512.0,
        "grad_norm": 2.5,
        "accumulating": False,
        "step": 4,
        "forward_fault": None,
        "underflow": None,
        "skipped": True,
        "loss": 3.25,
        "lr": 0.1,
    }


def test_step_record_refuses_extras_that_shadow_columns_or_are_not_scalars():
    with pytest.raises(ValueError, match="'scale' is a StepResult column"):
        step_record(result(), scale=2.0)
    with pytest.raises(ValueError, match=r"loss=tensor of shape \(2,\)"):
        step_record(result(), loss=torch.ones(2))


def test_csv_has_expected_columns_rows_per_boundary_and_running_skip_count(tmp_path):
    path = tmp_path / "steps.csv"
    with StepLogger(path) as log:
        assert log.log(result(accumulating=True), loss=1.0) is None  # micro-steps are not rows
        log.log(result(step=0, grad_norm=1.5), loss=torch.tensor(2.0))
        log.log(result(skipped=True, step=1), loss=torch.tensor(1.75))
        row = log.log(result(step=2, grad_norm=0.5), loss=torch.tensor(1.5))
    assert row["skipped_steps"] == 1
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == EXPECTED_COLUMNS + ("loss",)
    table = [dict(zip(rows[0], r)) for r in rows[1:]]
    assert [r["step"] for r in table] == ["0", "1", "2"]
    assert [r["skipped"] for r in table] == ["False", "True", "False"]
    assert [r["skipped_steps"] for r in table] == ["0", "1", "1"]
    assert [r["scale"] for r in table] == ["1024.0"] * 3
    assert [r["next_scale"] for r in table] == ["1024.0", "512.0", "1024.0"]
    assert [r["grad_norm"] for r in table] == ["1.5", "", "0.5"]  # None is an empty cell
    assert [r["loss"] for r in table] == ["2.0", "1.75", "1.5"]


def test_extra_columns_are_fixed_by_the_first_row(tmp_path):
    with StepLogger(tmp_path / "steps.csv") as log:
        log.log(result(), loss=1.0)
        with pytest.raises(ValueError, match="log the same extra names every step"):
            log.log(result(step=1), loss=1.0, lr=0.1)


def test_logs_a_real_loop_with_accumulation_and_an_overflow(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = LossScaleOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.1, fused=True),
        policy=DynamicScale(init_scale=8.0),
        accumulation_steps=2,
        clip_grad_norm=10.0,
    )
    path = tmp_path / "loop.csv"
    with StepLogger(path) as log:
        for i in range(6):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            if i == 2:
                loss = loss * float("inf")  # the second optimizer step overflows
            opt.backward(loss)
            log.log(opt.step(), loss=loss.detach())
            opt.zero_grad()
    with open(path, newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["step"] for r in table] == ["0", "1", "2"]
    assert [r["skipped"] for r in table] == ["False", "True", "False"]
    assert [r["scale"] for r in table] == ["8.0", "8.0", "4.0"]
    assert table[0]["grad_norm"] != "" and table[1]["skipped_steps"] == "1"


def test_diagnosis_columns_are_there_from_the_first_row_and_filled_in_the_traced_steps_row(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        policy=DynamicScale(init_scale=2.0**10),
        diagnose=OverflowDiagnosis(model, patience=2),
    )
    path = tmp_path / "steps.csv"
    with StepLogger(path) as log, pytest.warns(OverflowWarning, match="forward overflow: '0'"):
        for i in range(8):
            if i == 3:  # from step 3 on the first Linear's float16 output passes 65504
                with torch.no_grad():
                    model[0].weight.mul_(1e6)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 4)).float().pow(2).mean()
            opt.backward(loss)
            row = log.log(opt.step(), loss=loss.detach())
            assert row is not None and row.keys() >= set(DIAGNOSIS_COLUMNS)
            opt.zero_grad()
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == EXPECTED_COLUMNS + DIAGNOSIS_COLUMNS + ("loss",)
    table = [dict(zip(rows[0], r)) for r in rows[1:]]
    assert [r["skipped"] for r in table] == ["False"] * 3 + ["True"] * 5
    # overflows at steps 3 and 4 (patience 2) fire the trigger; step 5 acts on it (one step later, on every device),
    # step 6 is traced and its row says what it found
    assert [(r["overflow_kind"], r["overflow_module"]) for r in table] == [("", "")] * 6 + [("forward", "0")] + [
        ("", "")
    ]


def test_the_diagnosis_argument_is_no_longer_needed_and_says_so_and_added_fields_keep_their_names(tmp_path):
    model = torch.nn.Linear(2, 2)
    scaler = GradScaler("cpu", diagnose=model)
    with pytest.warns(FutureWarning, match=r"StepLogger\(diagnosis=...\) is no longer needed.*Leave it out"):
        StepLogger(diagnosis=scaler)
    added = StepResult(
        stepped=torch.tensor(True),
        found_inf=torch.tensor(False),
        scale=torch.tensor(8.0),
        next_scale=torch.tensor(8.0),
        fields={"overflow_kind": None, "overflow_module": None},
    )
    with StepLogger(tmp_path / "steps.csv") as log:
        with pytest.raises(ValueError, match=r"'overflow_kind' is a field the step's add-ons added"):
            log.log(added, overflow_kind="mine")
        with pytest.raises(ValueError, match=r"'scale' is a StepResult column"):
            log.log(added, scale=1.0)
        row = log.log(added)
    assert row is not None and [k for k in row if k not in COLUMNS] == ["overflow_kind", "overflow_module"]


def test_event_fields_keep_a_value_until_it_is_taken_and_a_later_one_replaces_it():
    events = EventFields()
    events.add({"precision": "float16", "overflow_kind": None})
    events.add({"precision": "float32", "overflow_kind": "forward"})
    assert events.take() == {"precision": "float32", "overflow_kind": "forward"}
    events.add({"overflow_kind": None})
    assert events.take() == {}


def test_tensorboard_gets_the_diagnosis_as_text(tmp_path, monkeypatch):
    written: list[tuple[str, str, object, int]] = []

    class Writer:  # torch.utils.tensorboard.SummaryWriter's calls (tensorboard need not be installed)
        def __init__(self, log_dir: str) -> None:
            pass

        def add_scalar(self, tag: str, value: float, global_step: int) -> None:
            written.append(("scalar", tag, value, global_step))

        def add_text(self, tag: str, text: str, global_step: int) -> None:
            written.append(("text", tag, text, global_step))

        def close(self) -> None:
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    diagnosis = OverflowDiagnosis(model, patience=1, initial_limit=1)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), diagnose=diagnosis)
    with StepLogger(tensorboard_dir=tmp_path) as log, pytest.warns(OverflowWarning):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.full((2, 4), 1e5)).float().sum()  # the first Linear's output passes 65504
            opt.backward(loss)
            log.log(opt.step())
    texts = [(tag, text, step) for kind, tag, text, step in written if kind == "text"]
    # fired at step 0, acted on at step 1, step 2 traced
    assert texts == [("lossscale/overflow_kind", "forward", 2), ("lossscale/overflow_module", "0", 2)]
    assert not [tag for kind, tag, _, _ in written if kind == "scalar" and "overflow" in tag]


def test_tensorboard_writes_events_or_says_what_to_install(tmp_path):
    board = tmp_path / "tb"
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            StepLogger(tensorboard_dir=board)
        return
    with StepLogger(tensorboard_dir=board) as log:
        log.log(result(skipped=True, step=3), loss=1.0)
    assert any(p.name.startswith("events.out.tfevents") for p in board.iterdir())


# --- killed mid-write: real processes, each forked from multiprocessing's fork server, which imports lossscale (and
# so torch) once for them all; the distributed tests' ranks come from the same server. A writer sends a line through
# a pipe when it reaches the point the test kills it at.


def start_writer(write: Callable[[str, Connection], None], path: Path) -> tuple[BaseProcess, Connection]:
    """A process running ``write(path, said)``, and the end of the pipe ``said`` that it sends its lines to."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["lossscale"])  # where the server is not running yet
    lines, said = context.Pipe(duplex=False)
    writer = context.Process(target=write, args=(str(path), said), daemon=True)
    writer.start()
    said.close()
    return writer, lines


def kill_when(writer: BaseProcess, lines: Connection, line: str) -> None:
    assert lines.poll(120), f"the writer did not say {line!r} within 120 s"
    try:
        assert lines.recv() == line
    except EOFError:
        writer.join(60)
        pytest.fail(f"the writer ended (exit code {writer.exitcode}) before it said {line!r}")
    writer.kill()
    writer.join(60)
    lines.close()
    assert writer.exitcode == -signal.SIGKILL


def half_written_save(path: str, said: Connection) -> None:
    with atomic_write(path) as tmp, open(tmp, "w") as f:
        f.write('{"version": 2, "runs": [')
        f.write("1, " * 100_000)
        f.flush()
        said.send("half written")
        time.sleep(120)


def test_atomic_write_killed_mid_save_leaves_the_previous_file(tmp_path):
    path = tmp_path / "results.json"
    with atomic_write(path) as tmp, open(tmp, "w") as f:
        json.dump({"version": 1}, f)
    kill_when(*start_writer(half_written_save, path), "half written")
    assert json.loads(path.read_text()) == {"version": 1}
    with atomic_write(path) as tmp, open(tmp, "w") as f:  # the next save replaces it whole
        json.dump({"version": 3}, f)
    assert json.loads(path.read_text()) == {"version": 3}


def test_atomic_write_leaves_the_file_and_no_temporary_when_the_block_raises(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="while writing"):
        with atomic_write(path) as tmp, open(tmp, "w") as f:
            f.write("new, half")
            raise RuntimeError("while writing")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["results.json"]


def create_log(path: str, said: Connection) -> None:
    log = StepLogger(path)  # noqa: F841  (alive until the kill)
    said.send("created")
    time.sleep(120)


def write_rows(path: str, said: Connection) -> None:
    log = StepLogger(path)
    for step in range(10**9):
        record = {"step": step, "scale": 1024.0, "next_scale": 1024.0, "skipped": False, "loss": 1.0 / (step + 1)}
        log.write(record)
        if step == 200:
            said.send("200 rows")


def test_step_logger_killed_keeps_the_previous_log_until_its_first_row_then_whole_rows(tmp_path):
    path = tmp_path / "steps.csv"
    path.write_text("the previous run's log\n")
    kill_when(*start_writer(create_log, path), "created")
    assert path.read_text() == "the previous run's log\n"

    kill_when(*start_writer(write_rows, path), "200 rows")
    with open(path, newline="") as f:
        table = list(csv.reader(f))
    header, body = table[0], table[1:]
    assert header[-1] == "loss" and len(body) > 200
    assert all(len(r) == len(header) for r in body)  # no torn row
    assert [int(r[0]) for r in body] == list(range(len(body)))
    assert path.read_text().endswith("\n")
