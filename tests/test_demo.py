"""``lossscale demo``: a tiny end-to-end run, the mechanism it shows, how it treats skipped steps, bad input, and
how it is reached (that ``import lossscale`` does not load it is test_integration_imports.py's)."""

import importlib
import importlib.metadata
import json
import re
import runpy
import shlex
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from _png_text import png_text
from lossscale.demo import cli
from lossscale.demo.plot import draw_runs, power_text
from lossscale.demo.train import DEFAULT, QUICK, QUICK_RUNS, load_corpus, train_run

SIZES = {"steps": 4, "accumulation": 2, "sequences": 4, "context": 16, "d_model": 8, "files": 3}
TINY_ARGS = [a for k, v in SIZES.items() for a in (f"--{k.replace('_', '-')}", str(v))]
TINY = replace(QUICK, **SIZES, eval_every=2, measure_every=2)


@pytest.fixture(autouse=True)
def one_thread():
    # As in the demo's workers: one torch thread (and the same numbers in this process as in a worker).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_quick_demo_writes_table_results_plot_and_csvs_and_its_worker_trains_as_one_process_does(tmp_path, capsys):
    # One worker process (each costs an interpreter with torch); the pool's code is the same for more.
    args = ["--quick", *TINY_ARGS, "--jobs", "1", "--out", str(tmp_path / "workers")]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "workers" / "results.json").read_text())
    runs = {r["name"]: r for r in results["runs"]}
    assert list(runs) == QUICK_RUNS and results["config"]["steps"] == 4 and results["config"]["init_scale"] == 2**32
    assert results["machine"]["torch"] == torch.__version__ and results["machine"]["jobs"] == 1
    assert runs["fp16-dynamic"]["skipped_steps"] > 0 and runs["fp16-dynamic"]["final_scale"] < 2**32  # backs off
    for name, run in runs.items():
        assert re.search(rf"^{name}\s+{run['heldout_loss']:.4f}\s+[+-]\d+\.\d%\s+{run['skipped_steps']}\s", out, re.M)
        csv = (tmp_path / "workers" / f"{name}.csv").read_text().splitlines()
        assert csv[0].startswith("step,") and len(csv) == 1 + 4 + run["skipped_steps"]  # a row per step, skips too
    assert "fp16-noscale " in out.splitlines()[-1] and "demo.png" in out.splitlines()[-1]
    png = (tmp_path / "workers" / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1000, 1000)
    recorded = png_text(png)  # the picture says what made it (docs/images/make_images.py relies on it)
    assert recorded["Command"] == shlex.join(["lossscale", "demo", *args])
    assert json.loads(recorded["Settings"]) == results["config"]

    here = train_run("fp16-dynamic", replace(QUICK, **SIZES))  # in this process, one thread
    assert json.loads(json.dumps(here["curves"])) == runs["fp16-dynamic"]["curves"]


def test_a_run_written_to_a_log_file_holds_no_cursor_escape_and_no_carriage_return(tmp_path):
    # `make demo > log 2>&1`: neither stream is a terminal, so no progress bar (tqdm's would write ESC [A cursor moves
    # and carriage returns for each of its bars); each run says in one line that it finished
    log = tmp_path / "log"
    runs = ["fp32", "fp16-dynamic"]
    with open(log, "wb") as out:
        subprocess.run(
            [sys.executable, "-m", "lossscale", "demo", "--quick", *TINY_ARGS, "--runs", ",".join(runs)]
            + ["--jobs", "1", "--out", str(tmp_path / "out")],
            stdout=out,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=600,
        )
    written = log.read_bytes()
    assert b"\x1b" not in written and b"\r" not in written, written.decode(errors="replace")
    for name in runs:
        assert re.search(rf"^ *{name}: {SIZES['steps']} updates, loss \d", written.decode(), re.M), name


def test_the_scale_panel_ends_a_line_at_the_final_scale_its_legend_names():
    cfg = replace(TINY, init_scale=2.0**10, growth_interval=1)  # no overflow; it grows after each step, the last too
    run = train_run("fp16-dynamic", cfg)
    assert run["final_scale"] == 2 * run["curves"]["scale"][-1]
    scale_panel = draw_runs([run], "title").axes[1]
    (line,) = [line for line in scale_panel.get_lines() if line.get_label().startswith("fp16-dynamic")]
    assert line.get_ydata()[-1] == run["final_scale"]
    assert f"final {power_text(run['final_scale'])} (after the last step)" in line.get_label()


def test_fp16_without_scaling_flushes_gradients_that_dynamic_scaling_keeps():
    # The loss divided by 2**20 characters makes this small model's float16 gradients as small as a large LM's.
    cfg = replace(QUICK, steps=3, accumulation=2, sequences=8, files=3, measure_every=1)
    corpus = load_corpus(cfg)
    noscale, dynamic = (train_run(name, cfg, corpus) for name in ("fp16-noscale", "fp16-dynamic"))
    assert noscale["underflow_peak"] > 0.05
    assert dynamic["underflow_peak"] < 0.01


def test_skipped_steps_advance_neither_the_learning_rate_nor_the_data():
    corpus = load_corpus(TINY)
    fp32, dynamic = (train_run(name, TINY, corpus) for name in ("fp32", "fp16-dynamic"))
    skipped, lr, loss = dynamic["curves"]["skipped"], dynamic["curves"]["lr"], dynamic["curves"]["train_loss"]
    assert skipped[0] == 0 and dynamic["updates"] == TINY.steps  # 2**32 overflows: the run starts by skipping
    assert [x for step, x in enumerate(lr) if step not in skipped] == fp32["curves"]["lr"]
    for step in skipped:  # the next step trains the same batch on the same weights at the same learning rate
        assert lr[step + 1] == lr[step] and loss[step + 1] == loss[step]


def test_loss_normalizer_leaves_float32_training_unchanged():
    # AdamW's eps is multiplied by the loss's factor: float32 trains as with a plain mean.
    corpus = load_corpus(TINY)
    plain_cfg = replace(TINY, loss_normalizer=0)
    assert plain_cfg.loss_factor == 1 and TINY.loss_factor == 128 / 2**20
    plain, divided = train_run("fp32", plain_cfg, corpus), train_run("fp32", TINY, corpus)
    assert divided["curves"]["train_loss"] == pytest.approx(plain["curves"]["train_loss"], rel=1e-5)
    assert [v for _, v in divided["curves"]["heldout_loss"]] == pytest.approx(
        [v for _, v in plain["curves"]["heldout_loss"]], rel=1e-5
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--runs", "fp32,fp8"], "argument --runs: got 'fp32,fp8'; name runs once each, from fp32, fp16-noscale,"),
        (["--steps", "0"], "argument --steps: must be an integer >= 1; got '0'"),
        (["--jobs", "two"], "argument --jobs: must be an integer >= 1; got 'two'"),
        (["--d-model", "9"], "argument --d-model: must be a multiple of the 2 heads; got 9"),
        (["--device", "nonsense"], "argument --device: 'nonsense' is not usable here"),
        (["--out", "FILE/sub"], "argument --out: cannot make directory '"),
        (["--context", "100000000"], "too few characters for --context 100000000; read more --files"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    (tmp_path / "FILE").write_text("")
    args = [a.replace("FILE", str(tmp_path / "FILE")) for a in args]
    with pytest.raises(SystemExit) as exited:
        cli.main(["--out", str(tmp_path / "out"), *args])
    captured = capsys.readouterr()
    assert exited.value.code == 2 and captured.out == ""
    assert (
        captured.err.count("\n") == 1 and captured.err.startswith("lossscale demo: error: ") and message in captured.err
    )


def test_missing_matplotlib_or_tqdm_is_one_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # an import of tqdm now fails
    monkeypatch.delitem(sys.modules, "lossscale.demo.cli")
    with pytest.raises(SystemExit, match=r"tqdm is not installed.*pip install '\.\[demo\]' in a clone"):
        importlib.import_module("lossscale.demo.cli")


def test_console_script_and_python_m_reach_the_demo(monkeypatch, capsys):
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="lossscale")
    with pytest.raises(SystemExit) as exited:
        script.load()(["demo", "--help"])
    assert exited.value.code == 0 and "usage: lossscale demo" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["lossscale", "demo", "--help"])
    monkeypatch.delitem(sys.modules, "lossscale.__main__")  # as in a fresh interpreter (no runpy warning)
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("lossscale", run_name="__main__")  # what python -m lossscale runs
    assert exited.value.code == 0 and "--quick" in capsys.readouterr().out


def test_docs_state_the_sizes_of_the_quick_and_the_default_run():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "demo.md").read_text()
    for flag, cfg in (("`--quick`", QUICK), ("default", DEFAULT)):
        per_step = cfg.accumulation * cfg.sequences * cfg.context
        line = (
            f"- {flag}: {cfg.steps} updates x {cfg.accumulation} micro-batches x {cfg.sequences} sequences x "
            f"{cfg.context} characters ({per_step:,} characters per step)"
        )
        assert line in " ".join(docs.split()), line
