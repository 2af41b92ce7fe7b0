"""The nnabla facade end to end: accumulation equals one large batch, the retry, weight decay, all-reduce."""

import math

import pytest
import torch

from lossscale.compat import nnabla as nnabla_compat
from lossscale.compat.nnabla import MAX_RETRIES, DynamicLossScalingUpdater


def integer_data(batches=4, rows=3):
    """Small integers: every product and sum below is exact, so summation order cannot change a bit."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randint(-3, 4, (rows, 5), generator=gen).float() for _ in range(batches)]
    ys = [torch.randint(-3, 4, (rows, 2), generator=gen).float() for _ in range(batches)]
    return xs, ys


def linear():
    model = torch.nn.Linear(5, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(10.0).reshape(2, 5) / 8)
        model.bias.copy_(torch.tensor([0.5, -0.25]))
    return model


def sum_loss(model, x, y):
    return ((model(x) - y) ** 2).sum()  # nnabla sums gradients over accum_grad passes: a sum loss is one batch


def test_accum_grad_4_equals_one_large_batch():
    xs, ys = integer_data()
    model, big = linear(), linear()
    it = iter(range(10**6))
    current = {}

    def feeder():
        k = next(it) % 4
        current["x"], current["y"] = xs[k], ys[k]

    updater = DynamicLossScalingUpdater(
        torch.optim.SGD(model.parameters(), lr=2.0**-10),
        lambda: sum_loss(model, current["x"], current["y"]),
        data_feeder=feeder,
        scale=2.0**6,
        accum_grad=4,
        N=1,
    )
    ref_opt = torch.optim.SGD(big.parameters(), lr=2.0**-10)
    for _ in range(3):
        updater.update()
        ref_opt.zero_grad()
        sum_loss(big, torch.cat(xs), torch.cat(ys)).backward()
        ref_opt.step()
        for p, q in zip(model.parameters(), big.parameters()):
            assert torch.equal(p, q)
    assert updater.scale == 2.0**7  # N=1: grows on the third clean update


def test_overflow_halves_and_reruns_the_whole_step_on_the_next_batch():
    model = linear()
    batches = iter([math.inf, math.inf, 1.0, 1.0])
    fed = []

    def feeder():
        fed.append(next(batches))

    x = torch.ones(1, 5)
    updater = DynamicLossScalingUpdater(
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda: sum_loss(model, x * fed[-1], torch.zeros(1, 2)),
        data_feeder=feeder,
        scale=64.0,
    )
    before = [p.detach().clone() for p in model.parameters()]
    updater.update()
    assert fed == [math.inf, math.inf, 1.0]  # two overflowing attempts, then the step on fresh data
    assert updater.scale == 16.0
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert not bool(updater.last_result.found_inf)


def test_gives_up_silently_after_a_hundred_retries():
    model = linear()
    calls = []
    updater = DynamicLossScalingUpdater(
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda: sum_loss(model, torch.full((1, 5), math.inf), torch.zeros(1, 2)),
        data_feeder=lambda: calls.append(1),
        scale=2.0**120,
    )
    before = [p.detach().clone() for p in model.parameters()]
    updater.update()  # returns without raising
    assert len(calls) == MAX_RETRIES + 1 == 101
    assert updater.scale == 2.0**19
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_weight_decay_is_nnablas_l2_on_the_unscaled_gradients():
    xs, ys = integer_data(1)
    model, ref = linear(), linear()
    updater = DynamicLossScalingUpdater(
        torch.optim.SGD(model.parameters(), lr=2.0**-8, momentum=0.5),
        lambda: sum_loss(model, xs[0], ys[0]),
        scale=2.0**10,
        weight_decay=2.0**-4,
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=2.0**-8, momentum=0.5, weight_decay=2.0**-4)  # torch's is L2 too
    for _ in range(3):
        updater.update()
        ref_opt.zero_grad()
        sum_loss(ref, xs[0], ys[0]).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_comm_sums_the_listed_gradients_before_the_overflow_check(monkeypatch):
    calls = []

    def fake_all_reduce(grads, group, average=False):  # a second rank whose gradients overflowed
        calls.append((group, [g.clone() for g in grads]))
        for g in grads:
            g.add_(math.inf if len(calls) == 1 else g)
        return grads

    monkeypatch.setattr(nnabla_compat, "all_reduce_grads_", fake_all_reduce)
    model = linear()
    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)  # one rank, never initialized
    x, y = torch.ones(1, 5), torch.zeros(1, 2)
    updater = DynamicLossScalingUpdater(
        torch.optim.SGD(model.parameters(), lr=0.0),
        lambda: sum_loss(model, x, y),
        scale=8.0,
        comm=group,
        grads=[model.weight],
    )
    updater.update()
    assert len(calls) == 2 and all(c[0] is group for c in calls)  # the first attempt overflowed through the sum
    assert updater.scale == 4.0
    assert calls[1][1][0].shape == model.weight.shape


def test_scale_attribute_reads_and_assigns():
    model = linear()
    updater = DynamicLossScalingUpdater(
        torch.optim.SGD(model.parameters(), lr=0.1), lambda: model(torch.ones(1, 5)).sum()
    )
    assert updater.scale == 8.0
    updater.scale = 1024.0
    assert updater.scale == 1024.0 and float(updater.scale_state.scale) == 1024.0


def test_rejects_non_callables():
    with pytest.raises(TypeError, match=r"DynamicLossScalingUpdater\(loss=.*zero-argument callable"):
        DynamicLossScalingUpdater(torch.optim.SGD(linear().parameters(), lr=0.1), torch.ones(()))


# --- issue 14: facade defects found porting nnabla's examples -------------------------------------------


def test_weight_decay_is_added_after_the_overflow_check():
    # nnabla checks the scaled gradients, unscales, then adds weight_decay * param. Adding it to the scaled
    # gradients first (2**14 * 2**120 = 2**134 > float32 max) reads as an overflow nnabla never sees.
    w = torch.nn.Parameter(torch.full((2,), 2.0**120))
    ref = torch.nn.Parameter(w.detach().clone())
    x = torch.tensor([1.0, -2.0])
    attempts = []
    updater = DynamicLossScalingUpdater(
        torch.optim.SGD([w], lr=2.0**-10),
        lambda: (w * x).sum(),
        data_feeder=lambda: attempts.append(1),
        scale=2.0**14,
        weight_decay=1.0,
    )
    updater.update()
    ref_opt = torch.optim.SGD([ref], lr=2.0**-10, weight_decay=1.0)
    (ref * x).sum().backward()
    ref_opt.step()
    assert len(attempts) == 1
    assert updater.scale == 2.0**14
    assert torch.equal(w, ref) and torch.isfinite(w).all()


def test_weight_decay_leaves_the_solver_unhooked_between_updates():
    w = torch.nn.Parameter(torch.ones(2))
    solver = torch.optim.SGD([w], lr=0.5)
    updater = DynamicLossScalingUpdater(solver, lambda: w.sum(), weight_decay=1.0)
    updater.update()
    w.grad = torch.zeros(2)
    solver.step()  # a plain step outside the updater: no weight decay added
    assert torch.equal(w.detach(), torch.full((2,), 1.0 - 0.5 * (1.0 + 1.0)))


@pytest.mark.parametrize("skip_mode", [None, "auto"])
def test_weight_decay_with_a_fused_solver_decays_the_unscaled_weights(skip_mode):
    # "auto" resolves to "fused" for a fused solver, which never writes the unscaled gradients: the decay would be
    # added to the scaled ones and divided by the scale (0.99990 instead of 0.9 here). It must run host-side.
    w = torch.nn.Parameter(torch.ones(2))
    extra = {} if skip_mode is None else {"skip_mode": skip_mode}
    solver = torch.optim.SGD([w], lr=0.1, fused=True)
    updater = DynamicLossScalingUpdater(solver, lambda: (w * 0).sum(), scale=1024.0, weight_decay=1.0, **extra)
    updater.update()
    assert torch.allclose(w.detach(), torch.full((2,), 0.9))


def test_weight_decay_refuses_the_fused_skip_mode():
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=r"weight_decay=0.1.*skip_mode='fused'"):
        DynamicLossScalingUpdater(torch.optim.SGD([w], lr=0.5), lambda: w.sum(), weight_decay=0.1, skip_mode="fused")


def test_grads_none_means_no_gradients_to_all_reduce():
    model = linear()
    updater = DynamicLossScalingUpdater(
        torch.optim.SGD(model.parameters(), lr=0.1), lambda: model(torch.ones(1, 5)).sum(), grads=None
    )
    before = model.weight.detach().clone()
    updater.update()
    assert updater.grads == [] and not torch.equal(model.weight, before)


@pytest.mark.parametrize("comm", ["nccl", 1, object()])
def test_comm_must_be_a_process_group(comm):
    model = linear()
    with pytest.raises(TypeError, match=r"DynamicLossScalingUpdater\(comm=.*ProcessGroup.*got"):
        DynamicLossScalingUpdater(
            torch.optim.SGD(model.parameters(), lr=0.1), lambda: model.weight.sum(), comm=comm, grads=[model.weight]
        )


def test_comm_without_grads_is_refused():
    model = linear()
    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)
    with pytest.raises(ValueError, match=r"DynamicLossScalingUpdater\(comm=.*grads=\[\]\)"):
        DynamicLossScalingUpdater(torch.optim.SGD(model.parameters(), lr=0.1), lambda: model.weight.sum(), comm=group)
