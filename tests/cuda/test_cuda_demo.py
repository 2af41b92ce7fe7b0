"""The quick demo on a GPU: ``python -m lossscale demo --quick --device cuda`` trains every quick run there and writes
its results (the CPU run of the same command: tests/test_demo.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys


def test_the_quick_demo_runs_on_cuda(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "lossscale", "demo", "--quick", "--device", "cuda", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["machine"]["device"] == "cuda"
    runs = {r["name"]: r for r in results["runs"]}
    assert set(runs) == set(results["config"]["runs"])
    for name in ("fp32", "fp16-dynamic", "bf16"):
        assert math.isfinite(runs[name]["heldout_loss"]), name
    assert runs["fp16-dynamic"]["skipped_steps"] > 0  # the demo starts at 2**32: it backs off on the GPU too
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
