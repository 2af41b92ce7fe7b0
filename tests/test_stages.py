"""lossscale.stages, each stage on its own: scale the loss, group the gradients, guard the scale, measure, invert,
apply (fused or on the host). How the front ends compose them: test_scaler.py and test_optimizer.py."""

from __future__ import annotations

import math

import pytest
import torch

from lossscale import stages
from lossscale.testing import HostReadCounter

INF = math.inf


def sgd_over(*grads: torch.Tensor | None) -> torch.optim.SGD:
    """An SGD over one parameter per entry, whose gradient is that entry."""
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(2) if g is None else torch.zeros(g.shape, dtype=g.dtype))
        p.grad = g
        params.append(p)
    return torch.optim.SGD(params, lr=1.0)


def test_scale_loss_multiplies_by_the_scale_over_the_divisor_and_keeps_the_graph():
    w = torch.nn.Parameter(torch.tensor([1.5, -2.0]))
    loss = (w * w).sum()
    with HostReadCounter() as reads:
        scaled = stages.scale_loss(loss, torch.tensor(1024.0), divisor=4)
    assert reads.count == 0
    assert float(scaled.detach()) == float(loss.detach()) * 256.0 and scaled.requires_grad
    scaled.backward()
    assert torch.equal(w.grad, 2 * w.detach() * 256.0)


def test_grouped_gradients_keep_each_groups_order_and_skip_missing_gradients():
    dtypes = [torch.float32, torch.float64, None, torch.float32, torch.bfloat16, torch.float32]
    params = [torch.nn.Parameter(torch.zeros(2, dtype=d or torch.float32)) for d in dtypes]
    for i, (p, d) in enumerate(zip(params, dtypes)):
        p.grad = None if d is None else torch.full_like(p, float(i))
    groups = stages.grouped_gradients(torch.optim.SGD(params, lr=1.0), "test")
    seen = {dtype: [int(g[0]) for g in grads] for (_, dtype), grads in groups.items()}
    assert seen == {torch.float32: [0, 3, 5], torch.float64: [1], torch.bfloat16: [4]}
    # the gradients themselves (unscaled in place later), not copies
    assert groups.plain and all(g.data_ptr() == params[int(g[0])].grad.data_ptr() for v in groups.values() for g in v)


def test_grouped_gradients_take_a_sparse_gradients_values_and_say_so():
    dense = torch.ones(3)
    sparse = torch.sparse_coo_tensor([[1, 3]], [5.0, 6.0], (4,), check_invariants=True)
    groups = stages.grouped_gradients(sgd_over(dense, sparse), "test")
    (grads,) = groups.values()
    assert not groups.plain and [g.tolist() for g in grads] == [[1.0, 1.0, 1.0], [5.0, 6.0]]


def test_grouped_gradients_refuse_float16_where_asked_and_raise_without_gradients():
    opt = sgd_over(torch.ones(2, dtype=torch.float16))
    assert stages.grouped_gradients(opt, "test")  # allowed by default
    with pytest.raises(ValueError, match=r"test: the optimizer holds float16 gradients"):
        stages.grouped_gradients(opt, "test", allow_fp16=False)
    opt.param_groups[0]["params"][0].grad = None
    with pytest.raises(stages.NoGradientsError, match=r"test: No inf checks were recorded"):
        stages.grouped_gradients(opt, "test")
    assert stages.grouped_gradients(opt, "test", required=False) == {}


@pytest.mark.parametrize("mode", ["inf_nan", "saturation"])
def test_measure_adds_the_overflow_and_returns_the_largest_scaled_magnitude(mode):
    grads = [torch.tensor([1.0, -3.0]), torch.tensor([2.0]), torch.tensor([-5.0], dtype=torch.float64)]
    groups = stages.grouped_gradients(sgd_over(*grads), "test")
    found = torch.zeros(())
    with HostReadCounter() as reads:
        amax = stages.measure_(groups, found, mode, 65504.0, amax=True)
        assert stages.measure_(groups, found, mode, 65504.0, amax=False) is None
    assert reads.count == 0
    assert (float(found), float(amax), amax.dtype, amax.shape) == (0.0, 5.0, torch.float32, ())
    grads[1][0] = 7e4  # finite, but saturated in float16
    amax = stages.measure_(groups, found, mode, 65504.0, amax=True)
    assert float(amax) == 7e4 and float(found) == (1.0 if mode == "saturation" else 0.0)
    grads[0][1] = -INF
    found = torch.zeros(())
    assert float(stages.measure_(groups, found, mode, 65504.0, amax=True)) == INF and float(found) == 1.0
    empty = stages.grouped_gradients(sgd_over(None), "test", required=False)
    assert float(stages.measure_(empty, torch.zeros(()), mode, 65504.0, amax=True)) == 0.0


@pytest.mark.parametrize(
    "scale, refused",
    [
        (0.0, True),
        (-1.0, True),
        (math.nan, True),
        (INF, True),
        (-INF, True),
        (1e-40, True),
        (2.0**-128, True),
        (2.0**-127, True),
        (2.0**-126, False),
        (1.0, False),
        (65536.0, False),
        (3.4028234663852886e38, False),
    ],
)
def test_the_guard_refuses_a_scale_no_setter_accepts_and_the_inverse_never_leaves_the_finite(scale, refused):
    found = stages.guarded_found(torch.tensor(scale))
    inv = stages.inverse(torch.tensor(scale), found)
    assert found.dtype == torch.float32 and found.dim() == 0 and float(found) == float(refused)
    expected = 1.0 if refused else float(torch.tensor(scale).double().reciprocal().float())
    assert float(inv) == expected and 0 < float(inv) < INF


def test_the_inverse_is_torchs_double_rounded_reciprocal_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0x00800000, 0x7F7FFFFF, (2048,), dtype=torch.int32, generator=gen)  # normal positive float32
    scales = torch.cat([bits.view(torch.float32), 2.0 ** torch.arange(-126, 128, dtype=torch.float32)])
    expected = scales.double().reciprocal().float()
    for scale, want in zip(scales, expected):
        found = stages.guarded_found(scale)
        got = stages.inverse(scale, found)
        assert got.view(torch.int32) == want.view(torch.int32) and float(found) == 0.0, float(scale)


def _fused_sgd_step(grad_scale: torch.Tensor, found_inf: torch.Tensor) -> torch.Tensor:
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    p.grad = torch.tensor([4.0, -8.0])
    opt = torch.optim.SGD([p], lr=0.5, fused=True)
    with HostReadCounter() as reads:
        stages.fused_step_(opt, grad_scale, found_inf)
    assert reads.count == 0
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")  # handed for the one call only
    return p.detach()


def test_fused_step_hands_the_kernel_its_divisor_and_its_flag_for_one_call():
    assert torch.equal(_fused_sgd_step(torch.tensor(4.0), torch.tensor(0.0)), torch.tensor([0.5, 3.0]))
    assert torch.equal(_fused_sgd_step(torch.tensor(4.0), torch.tensor(1.0)), torch.tensor([1.0, 2.0]))  # skipped
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = torch.optim.SGD([p], lr=0.5, fused=True)

    def fail(*_):
        raise RuntimeError("inner step failed")

    opt.register_step_pre_hook(fail)
    with pytest.raises(RuntimeError, match="inner step failed"):
        stages.fused_step_(opt, torch.tensor(2.0), torch.tensor(0.0))
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


def test_a_host_decision_reads_the_flag_once():
    for overflow, applies in [(0.0, True), (1.0, False), (2.0, False), (True, False)]:
        with HostReadCounter() as reads:
            got = stages.applies_on_host(torch.tensor(overflow))
        assert got is applies and reads.count == 1


def test_how_a_step_takes_the_scale_is_decided_by_the_optimizer_and_its_step_function():
    """Torch's fused optimizers take the flags; a class whose step takes ``grad_scaler=``, and an instance whose step
    was replaced by a wrapper that does, take the scaler; one that supports no amp scaling takes nothing; each gets its
    own answer, however often asked."""

    class Takes(torch.optim.SGD):
        def step(self, closure=None, grad_scaler=None):
            return super().step(closure)

    w = torch.nn.Parameter(torch.ones(2))
    takes, plain = Takes([w], lr=0.1), torch.optim.SGD([w], lr=0.1)
    wrapped = torch.optim.SGD([w], lr=0.1)
    wrapped.step = lambda closure=None, grad_scaler=None: None
    fused = torch.optim.AdamW([w], fused=True)
    for opt in (takes, wrapped):
        opt._step_supports_amp_scaling = True
    for _ in range(2):
        assert stages.fused_scaling(takes) == "scaler"
        assert stages.fused_scaling(plain) is None
        assert stages.fused_scaling(wrapped) == "scaler"
        assert stages.fused_scaling(fused) == "flags"


@pytest.mark.parametrize("norm", [0.0, 0.5, 1.0, 3.0, 1e15, INF, math.nan])
def test_the_norm_clip_is_torchs_rule_on_the_unscaled_norm_and_a_non_finite_norm_is_an_overflow(norm):
    scale = 2.0**10
    grad = torch.tensor([norm * scale, 0.0]) if math.isfinite(norm) else torch.tensor([norm, 1.0])
    opt = sgd_over(grad)
    groups = stages.grouped_gradients(opt, "test")
    found = torch.zeros(())
    with HostReadCounter() as reads:
        got_norm, coefficient = stages.clip_norm(groups, lambda: [grad], torch.tensor(1 / scale), found, 1.0)
    assert reads.count == 0 and got_norm.shape == coefficient.shape == ()
    if math.isfinite(norm):
        assert float(found) == 0.0 and float(got_norm) == pytest.approx(norm, rel=1e-6)
        assert float(coefficient) == pytest.approx(min(1.0, 1.0 / (norm + 1e-6)), rel=1e-6, abs=0)
        # torch's clip_grad_norm_ on the unscaled gradient agrees
        unscaled = torch.nn.Parameter(torch.zeros(2))
        unscaled.grad = grad / scale
        torch.nn.utils.clip_grad_norm_([unscaled], 1.0)
        assert torch.allclose(unscaled.grad, grad / scale * coefficient, rtol=1e-6, atol=0)
    else:
        assert float(found) == 1.0
