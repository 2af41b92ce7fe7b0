"""Runs the distributed tests N times in a row beside a CPU-heavy job and counts the runs that abort.

    python tests/soak_distributed.py --runs 20

A run aborts when pytest exits non-zero or a rank prints ``terminate called`` (a thread or process group still
alive at exit). The load is a second process multiplying matrices on every core for the whole soak.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOAD = "import torch\nx = torch.randn(512, 512)\nwhile True:\n    x = torch.tanh(x @ x)\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args(argv)
    load = subprocess.Popen([sys.executable, "-c", LOAD])
    aborts = 0
    try:
        for i in range(args.runs):
            start = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_distributed.py"],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            output = proc.stdout + proc.stderr
            aborted = proc.returncode != 0 or "terminate called" in output
            aborts += aborted
            summary = output.strip().splitlines()[-1] if output.strip() else ""
            print(
                f"run {i + 1}/{args.runs}: {'ABORT' if aborted else 'ok'} in {time.monotonic() - start:.0f} s: "
                f"{summary}",
                flush=True,
            )
            if aborted:
                print(output[-3000:], flush=True)
    finally:
        load.kill()
        load.wait()
    print(f"{aborts} of {args.runs} runs aborted")
    return 1 if aborts else 0


if __name__ == "__main__":
    sys.exit(main())
