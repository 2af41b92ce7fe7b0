"""FlatGrads: every gradient a view of one buffer per (device, dtype), filled by autograd in place.

LossScaleOptimizer(flat_grads=True) against torch's pipeline: the flat cases of test_optimizer.py's twin, clip,
accumulation and random-overflow tests. Host ops per tensor: test_host_ops.py.
"""

from __future__ import annotations

import pytest
import torch

from lossscale.ops.flat import FlatGrads


def _params():
    torch.manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(3, 4)),
        torch.nn.Parameter(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)),
        torch.nn.Parameter(torch.randn(5, 3).t()),  # transposed: dense, not contiguous
        torch.nn.Parameter(torch.randn(4, dtype=torch.float64)),
        torch.nn.Parameter(torch.randn(6), requires_grad=False),
    ]


def _backward(params, seed):
    gen = torch.Generator().manual_seed(seed)
    sum(
        (p.double() * torch.randn(p.shape, generator=gen, dtype=torch.float64)).sum() for p in params if p.requires_grad
    ).backward()


def test_gradients_are_views_of_one_buffer_per_dtype_with_their_parameters_layout():
    params = _params()
    flat = FlatGrads(params, "test")
    assert set(flat.buffers) == {(torch.device("cpu"), torch.float32), (torch.device("cpu"), torch.float64)}
    assert flat.buffers[(torch.device("cpu"), torch.float32)].numel() == 12 + 120 + 15
    for p in params[:4]:
        assert p.grad.stride() == p.stride() and p.grad.shape == p.shape
        assert p.grad.untyped_storage().data_ptr() == flat.buffers[(p.device, p.dtype)].untyped_storage().data_ptr()
    assert params[4].grad is None  # takes no part: requires no gradient and has none
    assert flat.attached(params)


def test_backward_accumulates_into_the_buffer_as_into_ordinary_gradients():
    params, plain = _params(), _params()
    flat = FlatGrads(params, "test")
    for seed in (1, 2):  # two backwards: the second adds in place
        _backward(params, seed)
        _backward(plain, seed)
    assert flat.attached(params)
    for p, q in zip(params[:4], plain[:4]):
        assert torch.equal(p.grad, q.grad)
    total = torch.cat([q.grad.reshape(-1) for q in plain[:4] if q.dtype == torch.float32])
    assert torch.equal(flat.buffers[(torch.device("cpu"), torch.float32)].sort().values, total.sort().values)


def test_zeroing_keeps_the_views_and_a_detached_gradient_is_copied_back_in():
    params = _params()
    flat = FlatGrads(params, "test")
    _backward(params, 1)
    flat.zero_()
    assert flat.attached(params) and all(not p.grad.any() for p in params[:4])
    params[0].grad = None  # model.zero_grad()
    params[1].grad = torch.full_like(params[1], 2.0)  # replaced
    assert not flat.attached(params)
    assert flat.attach() == 1  # one copy: the replaced gradient; the None became a zero view
    assert flat.attached(params)
    assert not params[0].grad.any() and torch.equal(params[1].grad, torch.full_like(params[1], 2.0))
    for p in params:  # every gradient released (Lightning's model.zero_grad() before validating)
        p.grad = None
    assert flat.attach() == 0 and flat.attached(params)
    assert not any(buffer.any() for buffer in flat.buffers.values())


def test_gradients_present_at_construction_are_kept_and_a_new_participant_gets_a_new_buffer():
    params = _params()
    _backward(params, 3)
    before = [p.grad.clone() for p in params[:4]]
    flat = FlatGrads(params, "test")
    assert all(torch.equal(p.grad, g) for p, g in zip(params[:4], before))
    params[4].requires_grad_(True)
    _backward(params, 4)  # the newcomer's gradient is autograd's own tensor
    assert not flat.attached(params)
    old = flat.buffers[(torch.device("cpu"), torch.float32)]
    flat.attach()
    assert flat.attached(params) and flat.buffers[(torch.device("cpu"), torch.float32)].numel() == old.numel() + 6


def test_parameters_a_buffer_cannot_hold_are_refused_by_name():
    gapped = torch.nn.Parameter(torch.randn(4, 4)[:, ::2])
    with pytest.raises(
        ValueError,
        match=r"test\(flat_grads=True\): param_groups\[0\]\[1\] is not dense in memory "
        r"\(shape \(4, 2\), strides \(4, 2\)\).*flat_grads=False",
    ):
        FlatGrads([torch.nn.Parameter(torch.ones(2)), gapped], "test", ["param_groups[0][0]", "param_groups[0][1]"])
    with pytest.raises(ValueError, match=r"parameter 0 has layout torch.sparse_coo"):
        FlatGrads([torch.nn.Parameter(torch.randn(3, 3).to_sparse())], "test")

    class Shard(torch.Tensor):  # what FSDP2's DTensor parameters look like to the check: a tensor subclass
        pass

    with pytest.raises(ValueError, match=r"parameter 0 is a Shard; flat gradients need dense torch.Tensor"):
        FlatGrads([torch.nn.Parameter(torch.randn(3).as_subclass(Shard))], "test")


def test_a_sparse_gradient_is_refused_when_attached_again():
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    flat = FlatGrads(list(embedding.parameters()), "test")
    embedding.weight.grad = None
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="got a sparse gradient, which cannot live in a dense buffer"):
        flat.attach()
