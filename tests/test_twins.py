"""Twin runs against torch.amp.GradScaler on the CPU (tests/twins.py), for the cells no other CPU test runs: foreach
implementations and the remaining optimizer/implementation pairs for lossscale.GradScaler (test_scaler.py runs SGD and
Adam for-loop, fused AdamW and fused SGD), and LossScaleOptimizer in every skip mode against torch's scaler itself
(test_optimizer.py checks it against an fp32 control). Every cell on a GPU: tests/cuda/test_twins.py."""

from __future__ import annotations

import pytest
import torch

import twins
from lossscale import GradScaler

COVERED_BY_TEST_SCALER = {("SGD", "for-loop"), ("Adam", "for-loop"), ("AdamW", "fused"), ("SGD", "fused")}
GRAD_SCALER_CELLS = [
    (name, impl)
    for name in twins.OPTIMIZERS
    for impl in twins.IMPLEMENTATIONS
    if (name, impl) not in COVERED_BY_TEST_SCALER
]


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("name,implementation", GRAD_SCALER_CELLS)
def test_grad_scaler_equals_torch_bit_for_bit(name, implementation, clip):
    theirs = twins.run_grad_scaler(torch.amp.GradScaler, name, implementation, clip, "cpu")
    ours = twins.run_grad_scaler(GradScaler, name, implementation, clip, "cpu")
    twins.assert_same_training(ours, theirs)


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("name,implementation,skip_mode", twins.LOSS_SCALE_OPTIMIZER_CELLS)
def test_loss_scale_optimizer_equals_torchs_pipeline(name, implementation, skip_mode, clip):
    theirs = twins.run_grad_scaler(torch.amp.GradScaler, name, implementation, clip, "cpu", skip_mode)
    ours = twins.run_loss_scale_optimizer(name, implementation, clip, "cpu", skip_mode)
    twins.assert_same_training(ours, theirs, exact=not clip)
