"""Every benchmark script runs at tiny sizes, in one process, and produces its section (no timing is asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import _common  # noqa: E402
from run_all import BENCHMARKS  # noqa: E402

sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """``run_all.py --tiny`` once: (the RESULTS.md it wrote, the folder of each benchmark's JSON)."""
    folder = tmp_path_factory.mktemp("bench")
    out = folder / "RESULTS.md"
    proc = subprocess.run([sys.executable, str(BENCH / "run_all.py"), "--tiny", "--out", str(out), "--json-dir",
                           str(folder)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out.read_text(), folder


@pytest.mark.parametrize("name,title", [(name, title) for name, title, _ in BENCHMARKS])
def test_every_benchmark_writes_its_section_with_the_machine(tiny_run, name, title):
    text, folder = tiny_run
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


def test_alternate_samples_rotates_the_order_and_drops_the_warm_up_round():
    calls = []
    samples = _common.alternate_samples({n: (lambda n=n: calls.append(n)) for n in "abc"}, rounds=4)
    rounds = [calls[i:i + 3] for i in range(0, len(calls), 3)]
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


def test_the_step_profiler_times_and_profiles_every_contender():
    """benchmarks/profile_step.py, a diagnostic outside RESULTS.md, at its tiny size in a subprocess."""
    proc = subprocess.run([sys.executable, str(BENCH / "profile_step.py"), "--tiny"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = ["torch.amp.GradScaler", "LossScaleOptimizer, DynamicScale", "LossScaleOptimizer, PredictiveScale",
             "LossScaleOptimizer, PredictiveScale op by op", "LossScaleOptimizer, per-layer"]
    for name in names:
        row = next(line for line in proc.stdout.splitlines() if line.startswith(f"| {name} |"))
        whole, step, host = (float(v) for v in row.strip("| ").split(" | ")[1:])
        assert 0 < host <= step <= whole, row
        assert f"== {name}, 1 step(s) under the profiler" in proc.stdout
    assert proc.stdout.count("Self CPU time total") == len(names)


def test_the_free_running_measure_reads_nothing_back():
    """language_model's free-running steps take no host read (on a GPU each is a wait for the device, which would
    make the measure per-step timing again); the training run counts skips, with a read per step."""
    import argparse

    from lossscale.reporting import HostReadCounter

    sys.path.insert(0, str(BENCH))
    try:
        import language_model as lm
    finally:
        sys.path.remove(str(BENCH))
    args = argparse.Namespace(layers=1, d_model=16, heads=2, context=16, sequences=2, files=4, steps=0, lr=1e-3,
                              free_rounds=1, free_steps=2)
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
