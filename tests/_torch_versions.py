"""The installed torch's version, for tests that need a newer torch than the declared floor (pyproject.toml's
``torch>=``): they skip on an older one with :func:`needs_torch`, saying what it lacks. (Not in conftest.py: tests/cuda
has a conftest of its own, and a whole-suite run imports only one module named ``conftest``.)"""

import pytest
import torch

#: The installed torch as (major, minor).
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def needs_torch(version: tuple[int, int], why: str) -> pytest.MarkDecorator:
    """A skip mark for a test that needs torch >= ``version``; ``why`` names what it needs."""
    reason = f"needs torch>={version[0]}.{version[1]} ({why}); this is torch {torch.__version__}"
    return pytest.mark.skipif(TORCH_VERSION < version, reason=reason)
