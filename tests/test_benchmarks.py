"""Every benchmark script runs at tiny sizes and produces its table (no timing is asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_") and p.stem != "run_all")


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_runs_tiny(name, tmp_path):
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--tiny", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["rows"] and payload["markdown"].count("|") > 10
    assert payload["machine"]["torch"]


def test_host_read_counts_are_what_the_docs_claim(tmp_path):
    out = tmp_path / "reads.json"
    subprocess.run([sys.executable, str(BENCH / "host_reads.py"), "--json", str(out)], check=True,
                   capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    added = {(r["optimizer"], r["loss scaling"], r["skip mode"]): r["added by loss scaling"] for r in rows}
    assert added[("fused AdamW", "LossScaleOptimizer + clip", "fused")] == 0
    assert added[("foreach Adam", "LossScaleOptimizer", "masked")] == 0
    assert added[("SGD momentum", "torch.amp.GradScaler", "(torch's)")] == 1


def test_run_all_writes_results(tmp_path):
    out = tmp_path / "RESULTS.md"
    subprocess.run([sys.executable, str(BENCH / "run_all.py"), "--tiny", "--only", "host_reads", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    text = out.read_text()
    assert text.startswith("# Benchmark results") and "Host reads per step" in text and "Do not edit by hand" in text


def _common():
    sys.path.insert(0, str(BENCH))
    try:
        import _common
    finally:
        sys.path.remove(str(BENCH))
    return _common


def test_alternate_samples_rotates_the_order_and_drops_the_warm_up_round():
    common = _common()
    calls = []
    samples = common.alternate_samples({n: (lambda n=n: calls.append(n)) for n in "abc"}, rounds=4)
    rounds = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert rounds == [list("abc"), list("bca"), list("cab"), list("abc"), list("bca")]
    assert {n: len(ts) for n, ts in samples.items()} == {"a": 4, "b": 4, "c": 4}


def test_paired_ratio_is_the_median_of_per_round_ratios_with_the_sign_test_interval():
    common = _common()
    drift = [1.0, 2.0, 1.5, 3.0, 0.8] * 20  # the machine's speed moves 4x over the run
    times = {"x": [1.02 * d for d in drift], "torch": drift}
    mid, low, high = common.paired_ratio(times, "x", "torch")
    assert mid == pytest.approx(1.02) and low == pytest.approx(1.02) and high == pytest.approx(1.02)
    ratios = [1.0 + i / 1000 for i in range(100)]  # 1.000 ... 1.099, shuffled across rounds
    order = sorted(range(100), key=lambda i: (i * 37) % 100)
    times = {"x": [ratios[i] * drift[k] for k, i in enumerate(order)], "torch": drift}
    mid, low, high = common.paired_ratio(times, "x", "torch")
    # n = 100: ranks 50 -+ 9.8 -> the 40th and 61st smallest (1-based), around the median 1.0495
    assert mid == pytest.approx(1.0495) and low == pytest.approx(1.039) and high == pytest.approx(1.060)
