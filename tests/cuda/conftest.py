"""CUDA tests: each test in this folder is skipped, with the reason, where torch sees no CUDA device, so a CPU-only CI
reports them as skipped rather than silently leaving them out. benchmarks/gpu_check.sh runs them on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
BUILD = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
REASON = (
    f"needs a CUDA device: torch.cuda.is_available() is False on this machine (torch {torch.__version__}, "
    f"{BUILD}); run on a machine with an NVIDIA GPU (benchmarks/gpu_check.sh)"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.skip(reason=REASON))


@pytest.fixture(autouse=True)
def cuda_synchronized():
    """Each test starts and ends with the device idle and the sync debug mode at torch's default."""
    torch.cuda.synchronize()
    yield
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
