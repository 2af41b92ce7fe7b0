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
