"""Every benchmark script runs at tiny sizes, in one process, and produces its section (no timing is asserted)."""

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import _common  # noqa: E402
from run_all import BENCHMARKS  # noqa: E402

sys.path.remove(str(BENCH))


# run_all.py --tiny, then profile_step.py --tiny (a diagnostic outside RESULTS.md) with its output in a file: one
# process, as each pays seconds to import torch and its compiler
TINY_RUNS = """
import contextlib, sys
sys.path.insert(0, sys.argv[1])
import profile_step, run_all
run_all.main(["--tiny", "--out", sys.argv[2], "--json-dir", sys.argv[3]])
with open(sys.argv[4], "w") as f, contextlib.redirect_stdout(f):
    profile_step.main(["--tiny"])
"""


def start_tiny_runs() -> tuple[subprocess.Popen, Path]:
    """The benchmarks' tiny runs started in a process of their own with one torch thread (at these sizes a second
    OpenMP thread only waits at barriers, for seconds where another process shares the cores): the process, and the
    folder it writes RESULTS.md, each benchmark's JSON, profile_step's output and its own stdout and stderr to."""
    folder = Path(tempfile.mkdtemp(prefix="lossscale-benchmarks-"))
    with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                TINY_RUNS,
                str(BENCH),
                str(folder / "RESULTS.md"),
                str(folder),
                str(folder / "profile_step.txt"),
            ],
            stdout=out,
            stderr=err,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    return proc, folder


def stop(proc: subprocess.Popen, folder: Path) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


# Started as pytest collects this module, one of the first it imports, so that the runs take the second core while
# pytest imports and collects the others (torch's compiler, Lightning, Transformers: seconds of work); ended at exit,
# also where no selected test waited for them.
TINY = start_tiny_runs()
atexit.register(stop, *TINY)


@pytest.fixture(scope="module")
def tiny_run():
    """(the RESULTS.md run_all wrote, the folder of each benchmark's JSON, what profile_step printed)."""
    proc, folder = TINY
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the benchmarks' tiny runs gave no answer in 600 s:\n{(folder / 'stderr').read_text()[-3000:]}")
    assert proc.returncode == 0, (folder / "stderr").read_text()[-3000:]
    return (folder / "RESULTS.md").read_text(), folder, (folder / "profile_step.txt").read_text()


@pytest.mark.parametrize("name,title", [(name, title) for name, title, _ in BENCHMARKS])
def test_every_benchmark_writes_its_section_with_the_machine(tiny_run, name, title):
    text, folder, _ = tiny_run
    payload = json.loads((folder / f"{name}.json").read_text())
    assert payload["rows"] and payload["markdown"].count("|") > 10
    assert payload["machine"]["torch"]
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    assert f"python benchmarks/{name}.py --tiny" in section and "Machine: " in section
    assert text.startswith("# Benchmark results") and "Do not edit by hand" in text


def test_host_read_counts_are_what_the_docs_claim(tiny_run):
    rows = json.loads((tiny_run[1] / "host_reads.json").read_text())["rows"]
    added = {(r["optimizer"], r["loss scaling"], r["skip mode"]): r["added by loss scaling"] for r in rows}
    assert added[("fused AdamW", "LossScaleOptimizer + clip", "fused")] == 0
    assert added[("foreach Adam", "LossScaleOptimizer", "masked")] == 0
    assert added[("SGD momentum", "torch.amp.GradScaler", "(torch's)")] == 1


def test_healing_heals_each_forward_fault_with_at_most_two_modules_and_torch_does_not(tiny_run):
    """benchmarks/heal.py at its tiny size: every planted forward fault (a feed-forward output past 65504, attention
    scores past it) is healed with at most 2 modules kept and the run ends finite, where torch.amp.GradScaler's run
    ends NaN; bad batches and an overflowing loss heal nothing and keep the scale. A heal restores the scale the run
    had when its faulted steps began (2**16: nothing lowered it before the fault); gradient overflows after it (the
    kept attention's gradients are large) may lower it as they would anywhere."""
    rows = json.loads((tiny_run[1] / "heal.json").read_text())["rows"]
    by = {(r["model"], r["fault"], r["run"]): r for r in rows}
    for model in ("gpt2", "llama"):
        for fault in ("ff_overflow", "nan_op"):
            healed, torch_run = by[(model, fault, "heal")], by[(model, fault, "torch")]
            assert 1 <= len(healed["kept"].split(", ")) <= 2 and healed["healed at"] != "-", healed
            assert healed["scales at heals"] and set(healed["scales at heals"]) == {2.0**16}, healed  # restored
            assert healed["final scale"] > torch_run["final scale"] and healed["held-out loss"] < 10, healed
            assert torch_run["held-out loss"] != torch_run["held-out loss"], torch_run  # NaN: the run broke
        for fault in ("bad_batches", "loss_overflow"):
            healed = by[(model, fault, "heal")]
            assert healed["kept"] == "-" and healed["final scale"] >= 2.0**14 and healed["skipped"] > 0, healed


def test_alternate_samples_rotates_the_order_and_drops_the_warm_up_round():
    calls = []
    samples = _common.alternate_samples({n: (lambda n=n: calls.append(n)) for n in "abc"}, rounds=4)
    rounds = [calls[i : i + 3] for i in range(0, len(calls), 3)]
    assert rounds == [list("abc"), list("bca"), list("cab"), list("abc"), list("bca")]
    assert {n: len(ts) for n, ts in samples.items()} == {"a": 4, "b": 4, "c": 4}


def test_paired_ratio_is_the_median_of_per_round_ratios_with_the_sign_test_interval():
    drift = [1.0, 2.0, 1.5, 3.0, 0.8] * 20  # the machine's speed moves 4x over the run
    times = {"x": [1.02 * d for d in drift], "torch": drift}
    mid, low, high = _common.paired_ratio(times, "x", "torch")
    assert mid == pytest.approx(1.02) and low == pytest.approx(1.02) and high == pytest.approx(1.02)
    ratios = [1.0 + i / 1000 for i in range(100)]  # 1.000 ... 1.099, shuffled across rounds
    order = sorted(range(100), key=lambda i: (i * 37) % 100)
    times = {"x": [ratios[i] * drift[k] for k, i in enumerate(order)], "torch": drift}
    mid, low, high = _common.paired_ratio(times, "x", "torch")
    # n = 100: ranks 50 -+ 9.8 -> the 40th and 61st smallest (1-based), around the median 1.0495
    assert mid == pytest.approx(1.0495) and low == pytest.approx(1.039) and high == pytest.approx(1.060)


def test_the_step_profiler_times_and_profiles_every_contender(tiny_run):
    """benchmarks/profile_step.py, a diagnostic outside RESULTS.md, at its tiny size."""
    printed = tiny_run[2]
    names = [
        "torch.amp.GradScaler",
        "LossScaleOptimizer, DynamicScale",
        "LossScaleOptimizer, PredictiveScale",
        "LossScaleOptimizer, PredictiveScale op by op",
        "LossScaleOptimizer, per-layer",
        "LossScaleOptimizer, per-block",
    ]
    for name in names:
        row = next(line for line in printed.splitlines() if line.startswith(f"| {name} |"))
        whole, step, host = (float(v) for v in row.strip("| ").split(" | ")[1:])
        assert 0 < host <= step <= whole, row
        assert f"== {name}, 1 step(s) under the profiler" in printed
    assert printed.count("Self CPU time total") == len(names)
    section = printed.split("== The optimizer call alone under the profiler")[1].split("\n== ")[0]
    total = next(line for line in section.splitlines() if line.startswith("| all ops |"))
    calls_dynamic, us_dynamic, calls_predictive, us_predictive, more = total.strip("| ").split(" | ")[1:]
    assert 0 < float(calls_dynamic) < float(calls_predictive) and float(us_dynamic) > 0  # its update's ops, op by op
    assert float(more) == pytest.approx(float(us_predictive) - float(us_dynamic), abs=1.0)


def test_the_free_running_measure_reads_nothing_back():
    """language_model's free-running steps take no host read (on a GPU each is a wait for the device, which would
    make the measure per-step timing again); the training run counts skips, with a read per step."""
    import argparse

    from lossscale.testing import HostReadCounter

    sys.path.insert(0, str(BENCH))
    try:
        import language_model as lm
    finally:
        sys.path.remove(str(BENCH))
    args = argparse.Namespace(
        layers=1, d_model=16, heads=2, context=16, sequences=2, files=4, steps=0, lr=1e-3, free_rounds=1, free_steps=2
    )
    runs = {name: lm.Run(name, args, "cpu") for name in (lm.REFERENCE, "PredictiveScale")}
    with HostReadCounter() as reads:
        times = lm.free_running(runs, args, "cpu")
    assert reads.count == 0
    assert {name: len(t) for name, t in times.items()} == {lm.REFERENCE: 1, "PredictiveScale": 1}
    x, y = (torch.zeros(2, 16, dtype=torch.long) for _ in range(2))
    with HostReadCounter() as reads:
        for run in runs.values():
            run.backward(x, y)
            run.step()
    assert reads.count >= 2  # counting skips reads the scale or the step's result
