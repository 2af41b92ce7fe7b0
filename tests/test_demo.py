"""``lossscale demo``: end to end on a tiny configuration, kill-and-resume, bad input, and what the README quotes."""

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from lossscale import DynamicScale
from lossscale.demo import cli, machine, plot, runs
from lossscale.demo.config import DEFAULT, QUICK
from lossscale.demo.data import load_corpus
from lossscale.demo.train import train_run

ROOT = Path(__file__).resolve().parent.parent
SIZE = ["--steps", "6", "--accumulation", "2", "--sequences", "4", "--context", "16", "--d-model", "8",
        "--heads", "2", "--files", "3", "--eval-every", "3", "--measure-every", "2"]
TINY = [*SIZE, "--jobs", "1"]  # one process: tests may add runs to the table, which workers would not see
RUN_NAMES = ["fp32", "fp16-noscale", "fp16-dynamic", "fp16-predictive", "bf16", "fast|step|0.9"]
KEYS = {"name", "final_loss", "skipped_steps", "final_scale", "underflow", "seconds"}


@pytest.fixture(autouse=True)
def one_thread():
    # The demo's tiny models gain nothing from threads, and a shared 2-core machine loses a lot to them.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def read_png(path):
    """(width, height, RGB rows) of an 8-bit RGB(A) PNG, checking signature, chunk CRCs and the pixel data size."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert depth == 8 and color in (2, 6)
    pixels = zlib.decompress(chunks[b"IDAT"])
    assert len(pixels) == height * (1 + width * (3 if color == 2 else 4))
    assert b"IEND" in chunks
    return width, height, pixels


def demo(*args):
    return cli.main([*TINY, *args])


def test_import_lossscale_loads_no_demo_and_no_optional_dependency():
    # torch itself imports tqdm (torch.hub), so look at what `import lossscale` adds to `import torch`.
    code = ("import sys, torch; before = set(sys.modules); import lossscale; "
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('matplotlib', 'tqdm', "
            "'tensorboard', 'PIL') or m.startswith(('lossscale.demo', 'torch.utils.tensorboard'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tiny_demo_end_to_end_writes_results_plot_and_csvs(tmp_path, capsys):
    assert demo("--out", str(tmp_path)) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["name"] for r in results["runs"]] == RUN_NAMES
    for r in results["runs"]:
        assert KEYS <= set(r)
        assert r["final_loss"] > 0 and r["seconds"] > 0 and 0.0 <= r["underflow"] <= 1.0
        # six updates applied; a skipped step comes on top of them
        assert len(r["train_loss"]) == len(r["scale"]) == len(r["underflow_meter"]) == 6 + r["skipped_steps"]
        if r["name"] in ("fp16-noscale", "fp16-dynamic", "fp16-predictive"):  # the meter runs while scaling
            assert all(v is not None and 0.0 <= v <= 1.0 for v in r["underflow_meter"])
        assert (tmp_path / f"{cli._slug(r['name'])}.csv").exists()
    by_name = {r["name"]: r for r in results["runs"]}
    assert by_name["fp32"]["underflow"] == 0.0  # the float32 run is its own reference
    assert by_name["fp32"]["final_scale"] == 1.0 and by_name["fp32"]["skipped_steps"] == 0
    dynamic = by_name["fp16-dynamic"]  # from 2**32, which overflows: one halving per skipped step, no growth yet
    assert dynamic["skipped_steps"] >= 1 and dynamic["final_scale"] == 2.0**32 / 2**dynamic["skipped_steps"]
    assert dynamic["skipped"] == list(range(dynamic["skipped_steps"]))  # the first steps, then none
    assert results["machine"]["cpu_flags"] == machine.machine()["cpu_flags"] and results["machine"]["jobs"] == 1
    assert results["underflow_definition"].startswith("share of parameter-gradient values")
    width, height, _ = read_png(tmp_path / "demo.png")
    assert width > 200 and height > 200
    table = capsys.readouterr().out
    for name in RUN_NAMES:
        assert re.search(rf"^{re.escape(name)}\s+\d+\.\d{{4}}", table, re.M)


def test_quick_code_path_in_worker_processes_matches_one_process(tmp_path, capsys):
    # --quick's code path (its runs, two worker processes, the plot, the table, the summary line) at a tiny size.
    assert cli.main(["--quick", *SIZE, "--jobs", "2", "--out", str(tmp_path / "workers")]) == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "workers" / "results.json").read_text())
    assert [r["name"] for r in results["runs"]] == list(runs.QUICK_RUNS)
    assert results["machine"]["jobs"] == 2 and results["machine"]["torch_threads"] >= 1
    assert results["config"]["steps"] == 6 and results["config"]["init_scale"] == 2.0**32
    width, height, _ = read_png(tmp_path / "workers" / "demo.png")
    assert width >= 800 and height >= 800
    for name in runs.QUICK_RUNS:
        assert re.search(rf"^{re.escape(name)}\s+\d+\.\d{{4}}\s+[+-]\d+\.\d%\s+\d+\s+\S+\s+\d+\.\d% / ", out, re.M)
    last = out.strip().splitlines()[-1]
    assert last.startswith("fp16-noscale ") and str(tmp_path / "workers" / "demo.png") in last
    assert str(tmp_path / "workers" / "results.json") in last

    args = ["--quick", *SIZE, "--jobs", "1", "--runs", "fp16-dynamic", "--out", str(tmp_path / "alone")]
    assert cli.main(args) == 0
    alone = json.loads((tmp_path / "alone" / "results.json").read_text())["runs"][0]
    worker = next(r for r in results["runs"] if r["name"] == "fp16-dynamic")
    for key in ("train_loss", "scale", "skipped", "heldout_loss", "underflow_samples"):
        assert worker[key] == alone[key], key  # a worker trains exactly what this process trains


def test_jobs_under_torchrun_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main([*SIZE, "--jobs", "2", "--out", str(tmp_path)]) == 2
    assert "--jobs 2: runs train side by side only on the CPU without torchrun" in capsys.readouterr().err


def test_plot_without_matplotlib_is_still_a_valid_png(tmp_path, monkeypatch):
    monkeypatch.setattr(plot, "have_matplotlib", lambda: False)
    assert demo("--out", str(tmp_path), "--runs", "fp32,fp16-dynamic", "--steps", "3") == 0
    width, height, _ = read_png(tmp_path / "demo.png")
    assert (width, height) == (900, 780)


def test_without_tqdm_and_matplotlib_progress_is_plain_lines_with_a_note(tmp_path, monkeypatch, capsys):
    from lossscale.demo import progress

    monkeypatch.setattr(progress, "have_tqdm", lambda: False)
    monkeypatch.setattr(cli, "have_tqdm", lambda: False)
    monkeypatch.setattr(cli, "have_matplotlib", lambda: False)
    monkeypatch.setattr(plot, "have_matplotlib", lambda: False)
    assert demo("--out", str(tmp_path), "--runs", "fp16-dynamic") == 0
    out = capsys.readouterr().out
    assert "note: tqdm and matplotlib not installed" in out and "pip install 'lossscale[demo]'" in out
    assert re.search(r"fp16-dynamic  update 3/6  loss \d\.\d+  scale \S+  skips \d  left ~\d+s", out)
    assert re.search(r"fp16-dynamic  update 6/6  loss \d\.\d+  scale \S+  skips \d  left ~0s", out)
    read_png(tmp_path / "demo.png")


def test_runs_option_picks_runs_in_order(tmp_path):
    assert demo("--out", str(tmp_path), "--runs", "bf16,fp32", "--steps", "2") == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["name"] for r in results["runs"]] == ["bf16", "fp32"]


def test_fp16_without_scaling_flushes_gradients_that_dynamic_scaling_keeps():
    # The mechanism of the demo at a size a test can afford: the loss divided by 2**20 characters.
    cfg = QUICK.replace(steps=3, accumulation=2, sequences=8, d_model=16, files=3, measure_every=1, eval_every=3)
    corpus = load_corpus(cfg.files, cfg.seed, cfg.context)
    noscale = train_run(runs.RUNS["fp16-noscale"], cfg, corpus)
    dynamic = train_run(runs.RUNS["fp16-dynamic"], cfg, corpus)
    assert max(u for _, u in noscale.underflow) > 0.05
    assert max(u for _, u in dynamic.underflow) < 0.01


def test_skipped_steps_advance_neither_the_learning_rate_nor_the_data(monkeypatch):
    # fp16-dynamic starts at 2**32, which overflows: its first steps are skipped; the warm-up and the batches
    # wait for them, and the run goes on until it has applied cfg.steps updates.
    from lossscale.demo import data, train

    seen, positions = [], []
    batch = data.Corpus.batch

    def recording_batch(self, seed, position, micro, *args):
        if micro == 0:
            positions.append(position)
        return batch(self, seed, position, micro, *args)

    monkeypatch.setattr(train, "learning_rate", lambda cfg, applied: seen.append(applied) or cfg.lr)
    monkeypatch.setattr(data.Corpus, "batch", recording_batch)
    cfg = QUICK.replace(steps=6, accumulation=2, sequences=4, context=16, d_model=8, files=3, eval_every=6)
    history = train_run(runs.RUNS["fp16-dynamic"], cfg, load_corpus(cfg.files, cfg.seed, cfg.context))
    skipped = [bool(row["skipped"]) for row in history.rows]
    assert skipped[0] and sum(not s for s in skipped) == 6  # 2**32 overflows this model's float16 gradients
    applied = [sum(not s for s in skipped[:i]) for i in range(len(skipped))]
    assert seen == applied and positions == applied
    assert history.heldout[-1][0] == len(skipped)


@pytest.mark.parametrize("bad", [-1, 2.5, True, "1024"])
def test_loss_normalizer_must_be_a_count(bad):
    expected = rf"loss_normalizer={re.escape(repr(bad))}\): loss_normalizer must be an int >= 0"
    with pytest.raises(ValueError, match=expected):
        QUICK.replace(loss_normalizer=bad)


def test_loss_normalizer_leaves_float32_training_unchanged():
    # AdamW's eps is divided by the same factor as the loss: float32 trains as with a plain mean.
    cfg = QUICK.replace(steps=4, accumulation=2, sequences=4, context=16, d_model=8, files=3, eval_every=2)
    corpus = load_corpus(cfg.files, cfg.seed, cfg.context)
    plain = train_run(runs.RUNS["fp32"], cfg.replace(loss_normalizer=0), corpus)
    divided = train_run(runs.RUNS["fp32"], cfg, corpus)
    assert cfg.normalizer() == 2**20 and cfg.replace(loss_normalizer=0).normalizer() == cfg.tokens_per_step() == 128
    for (step, a), (step_b, b) in zip(plain.heldout, divided.heldout, strict=True):
        assert step == step_b and a == pytest.approx(b, rel=1e-5)
    assert [r["loss"] for r in plain.rows] == pytest.approx([r["loss"] for r in divided.rows], rel=1e-5)


GROWING = runs.RunSpec("fp16-growing", "float16, scale grows every 2 steps", torch.float16,
                       lambda cfg: DynamicScale(init_scale=2.0**13, growth_interval=2))


@pytest.mark.parametrize("name", ["fp16-growing", "fast|step|0.9"])
def test_killed_and_resumed_run_equals_uninterrupted_run(tmp_path, monkeypatch, name):
    monkeypatch.setitem(runs.RUNS, GROWING.name, GROWING)  # the run table takes one more entry
    args = ["--runs", name, "--steps", "10", "--checkpoint-every", "3"]
    assert demo("--out", str(tmp_path / "whole"), *args) == 0

    # "Kill" after step 7: the checkpoint of step 6 is the last one written.
    cfg = cli._config(cli.build_parser().parse_args([*TINY, *args]))
    corpus = load_corpus(cfg.files, cfg.seed, cfg.context)
    ckpt = tmp_path / "killed" / "checkpoints" / f"{cli._slug(name)}.pt"
    ckpt.parent.mkdir(parents=True)
    train_run(runs.RUNS[name], cfg, corpus, checkpoint_path=str(ckpt), checkpoint_every=3, stop_after=7)
    assert torch.load(ckpt, weights_only=True)["step"] == 6
    assert demo("--out", str(tmp_path / "killed"), *args, "--resume") == 0

    whole = json.loads((tmp_path / "whole" / "results.json").read_text())["runs"][0]
    resumed = json.loads((tmp_path / "killed" / "results.json").read_text())["runs"][0]
    for key in ("train_loss", "scale", "skipped", "heldout_loss", "underflow_samples", "final_loss", "final_scale",
                "skipped_steps", "switch_step", "precision"):
        assert resumed[key] == whole[key], key
    if name == "fp16-growing":
        assert len(set(whole["scale"])) > 2  # the policy's state really moved across the checkpoint
    else:
        # the schedule switches after 90% of the 10 updates; the skipped steps come on top
        skips = whole["skipped_steps"]
        assert whole["switch_step"] == 9 + skips and whole["precision"][8 + skips:] == ["float16", "float32"]
    with open(tmp_path / "killed" / f"{cli._slug(name)}.csv") as f:
        assert len(f.readlines()) == 1 + 10 + whole["skipped_steps"]  # the resumed CSV has every step once


def test_resume_with_other_settings_is_a_one_line_error(tmp_path, capsys):
    assert demo("--out", str(tmp_path), "--runs", "fp32", "--steps", "2", "--checkpoint-every", "1") == 0
    capsys.readouterr()
    assert demo("--out", str(tmp_path), "--runs", "fp32", "--steps", "2", "--seed", "5", "--resume") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "seed 0 -> 5" in err


@pytest.mark.parametrize("args,message", [
    (["--runs", "fp8"], "unknown run 'fp8'; the runs are fp32, fp16-noscale"),
    (["--steps", "-3"], "must be an integer >= 1; got -3"),
    (["--checkpoint-every", "x"], "must be an integer >= 0; got 'x'"),
    (["--loss-normalizer", "-1"], "--loss-normalizer: must be an integer >= 0; got -1"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--d-model", "10", "--heads", "4"], "--d-model 10 must be a multiple of --heads 4"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    assert demo("--out", str(tmp_path), *args) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and message in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def test_unwritable_out_is_one_line_and_exit_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = subprocess.run([sys.executable, "-m", "lossscale", "demo", *TINY, "--out", str(blocker / "sub")],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "is not a writable directory" in out.stderr


def test_readme_quotes_the_presets_it_claims():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## The demo"):]
    assert QUICK.describe() in section and DEFAULT.describe() in section
    assert "pip install 'lossscale[demo]'" in section or "make demo" in section


def test_console_script_and_module_reach_the_demo():
    script = Path(sys.executable).parent / "lossscale"  # the console script of the installed package
    for command in ([sys.executable, "-m", "lossscale", "demo", "--help"], [str(script), "demo", "--help"]):
        out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0 and "--checkpoint-every" in out.stdout and QUICK.describe() in out.stdout


@pytest.mark.distributed
def test_under_torchrun_every_rank_trains_and_rank_0_writes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "lossscale", "demo", *TINY,
                          "--steps", "2", "--runs", "fp16-dynamic", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["world_size"] == 2
    assert out.stdout.count("lossscale demo: a character-level transformer") == 1  # rank 0 alone prints


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has exited
    except OSError:
        return False


def _demo_with_two_workers(tmp_path):
    """A demo of two endless runs in two workers, started as a terminal's foreground job would be (SIGINT
    at its default: a shell starts background jobs with SIGINT ignored, and Python keeps an inherited
    SIG_IGN), its output in files so that it never blocks; returns (process, worker pids) once both train."""
    import time

    cmd = [sys.executable, "-m", "lossscale", "demo", *SIZE, "--steps", "100000", "--jobs", "2",
           "--runs", "fp32,bf16", "--out", str(tmp_path / "out")]
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 180
    csvs = [tmp_path / "out" / f"{name}.csv" for name in ("fp32", "bf16")]
    while not all(csv.exists() and csv.stat().st_size > 200 for csv in csvs):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError((tmp_path / "stderr").read_text())
        time.sleep(0.2)
    return proc, _children(proc.pid)


def _gone(pids, seconds=30):
    import time

    deadline = time.monotonic() + seconds
    while [pid for pid in pids if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    return not [pid for pid in pids if _alive(pid)]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from Linux's /proc")
def test_ctrl_c_stops_the_workers_and_exits_130(tmp_path):
    # Ctrl-C while two runs train in worker processes: the parent stops them within a step and exits.
    proc, workers = _demo_with_two_workers(tmp_path)
    try:
        assert len(workers) >= 2
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
        proc.wait()
    assert "lossscale demo: interrupted; nothing saved" in (tmp_path / "stderr").read_text()
    assert _gone(workers)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from Linux's /proc")
def test_workers_stop_when_the_demo_is_killed_outright(tmp_path):
    # SIGKILL leaves the parent no chance to tell the workers; they notice it is gone and stop.
    proc, workers = _demo_with_two_workers(tmp_path)
    assert len(workers) >= 2
    proc.kill()
    proc.wait()
    assert _gone(workers)
