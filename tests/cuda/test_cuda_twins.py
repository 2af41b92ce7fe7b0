"""On a GPU, both front ends against torch.amp.GradScaler (tests/twins.py): lossscale.GradScaler bit for bit for
SGD, Adam and AdamW x for-loop, foreach and fused x with and without unscale_ + clip_grad_norm_, an inf and a NaN
injected; LossScaleOptimizer in every skip mode against torch's pipeline, bit for bit without a clip and within float32
rounding with one (its clip coefficient comes from the scaled gradients' norm, computed in another order)."""

from __future__ import annotations

import pytest
import torch

import twins
from lossscale import GradScaler


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("implementation", list(twins.IMPLEMENTATIONS))
@pytest.mark.parametrize("name", list(twins.OPTIMIZERS))
def test_grad_scaler_equals_torch_bit_for_bit_on_cuda(name, implementation, clip):
    theirs = twins.run_grad_scaler(torch.amp.GradScaler, name, implementation, clip, "cuda")
    ours = twins.run_grad_scaler(GradScaler, name, implementation, clip, "cuda")
    twins.assert_same_training(ours, theirs)


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("name,implementation,skip_mode", twins.LOSS_SCALE_OPTIMIZER_CELLS)
def test_loss_scale_optimizer_equals_torchs_pipeline_on_cuda(name, implementation, skip_mode, clip):
    theirs = twins.run_grad_scaler(torch.amp.GradScaler, name, implementation, clip, "cuda", skip_mode)
    ours = twins.run_loss_scale_optimizer(name, implementation, clip, "cuda", skip_mode)
    twins.assert_same_training(ours, theirs, exact=not clip)
