"""Many small CPU tensors on two threads (lossscale._two_threads): the split, its results against torch's one
call bit for bit, found_inf's rule for any start, and the pipeline's steps with the split on and off."""

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lossscale import FixedScale, LossScaleOptimizer, _two_threads
from lossscale.overflow import check_

GRAIN = _two_threads.GRAIN


@pytest.fixture
def two_threads(monkeypatch):
    """Two torch threads and a threshold low enough for test-sized lists."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(_two_threads, "MIN_ELEMENTS", 4 * 1000)
    yield
    torch.set_num_threads(before)


def _mixed(seed=0):
    """Sub-grain tensors with two at or above the grain in between (these must stay on the calling thread)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1000, 3000, GRAIN, 700, 2500, 40000, 1200, 900, 4000, 10]
    return [torch.randn(n, generator=gen) * 100 for n in sizes]


def test_halves_keeps_large_tensors_and_hands_the_last_half_of_the_small_elements(two_threads):
    tensors = _mixed()
    kept, handed = _two_threads.halves(tensors)
    assert sorted(kept + handed) == list(range(len(tensors)))
    assert kept == sorted(kept) and handed == sorted(handed)
    sizes = [t.numel() for t in tensors]
    assert all(sizes[i] < GRAIN for i in handed)
    assert {2, 5} <= set(kept)  # GRAIN and 40000 elements
    small = sum(n for n in sizes if n < GRAIN)
    taken = sum(sizes[i] for i in handed)
    assert 2 * taken >= small and 2 * (taken - sizes[handed[0]]) < small  # the fewest from the end that reach half
    assert max(handed) == len(tensors) - 1


@pytest.mark.parametrize("case", ["one thread", "under the threshold", "one tensor", "not cpu", "dispatch mode"])
def test_halves_declines_where_one_call_is_better(two_threads, monkeypatch, case):
    tensors = _mixed()
    if case == "one thread":
        torch.set_num_threads(1)
    elif case == "under the threshold":
        monkeypatch.setattr(_two_threads, "MIN_ELEMENTS", 10**9)
    elif case == "one tensor":
        tensors = [torch.randn(5000)]  # over the test's threshold, yet nothing to hand over
    elif case == "not cpu":
        tensors = [torch.empty(1000, device="meta") for _ in range(20)]
    else:  # a mode's stack is per thread: the worker's half would escape it
        with TorchDispatchMode():
            assert _two_threads.halves(tensors) is None
        assert _two_threads.halves(tensors) is not None
        return
    assert _two_threads.halves(tensors) is None


def _threads_of(monkeypatch, name):
    """Record the thread of every call of torch.<name> (through the module's own reference to torch)."""
    seen, real = [], getattr(torch, name)

    def spy(*args, **kwargs):
        seen.append(threading.get_ident())
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, name, spy)
    return seen


def test_foreach_norm_is_torchs_one_call_bit_for_bit_from_two_threads(two_threads, monkeypatch):
    tensors = _mixed(1)
    tensors[7][3] = float("inf")
    expected = torch._foreach_norm(tensors, 2.0)
    seen = _threads_of(monkeypatch, "_foreach_norm")
    got = _two_threads.foreach_norm(tensors)
    assert len(set(seen)) == 2 and threading.get_ident() in seen
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("start", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("where", [None, 0, 9, 4])  # nowhere, kept, handed, kept (index 4 is 2,500 elements)
def test_check_and_unscale_matches_torchs_rule_for_any_start(two_threads, start, where):
    tensors = _mixed(2)
    if where is not None:
        tensors[where][-1] = float("nan")
    reference = [t.clone() for t in tensors]
    inv = torch.tensor(1 / 1024.0)
    found_ref = torch.tensor(start)
    torch._amp_foreach_non_finite_check_and_unscale_(reference, found_ref, inv)
    found = torch.tensor(start)
    _two_threads.check_and_unscale_(tensors, found, inv)
    assert found.item() == found_ref.item()
    for a, b in zip(tensors, reference):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_check_and_unscale_runs_the_handed_half_on_the_worker(two_threads, monkeypatch):
    seen = _threads_of(monkeypatch, "_amp_foreach_non_finite_check_and_unscale_")
    _two_threads.check_and_unscale_(_mixed(), torch.zeros(()), torch.ones(()))
    assert len(seen) == 2 and len(set(seen)) == 2


def test_foreach_mul_matches_torch(two_threads):
    tensors, factor = _mixed(3), torch.tensor(0.37)
    reference = [t * factor for t in tensors]
    _two_threads.foreach_mul_(tensors, factor)
    for a, b in zip(tensors, reference):
        assert torch.equal(a, b)


def test_the_worker_keeps_the_callers_grad_mode(two_threads):
    tensors = [t.requires_grad_() for t in _mixed(4)]
    with torch.no_grad():
        assert not any(n.requires_grad for n in _two_threads.foreach_norm(tensors))
    assert all(n.requires_grad for n in _two_threads.foreach_norm(tensors))


def test_a_forked_child_makes_its_own_worker(monkeypatch):
    first = _two_threads._executor()
    assert _two_threads._executor() is first
    monkeypatch.setattr(_two_threads.os, "getpid", lambda: -12345)
    assert _two_threads._executor() is not first


def test_the_read_only_check_sees_an_overflow_in_either_half(two_threads):
    for where in (0, 9):
        tensors = _mixed(5)
        tensors[where][0] = float("inf")
        found = torch.zeros(())
        check_(tensors, found)
        assert found.item() == 1.0


def _steps(clip, fused, inject, split, monkeypatch):
    """Weights after three LossScaleOptimizer steps (the second with an inf where ``inject``)."""
    if not split:
        monkeypatch.setattr(_two_threads, "MIN_ELEMENTS", 10**12)
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (3000, 2000, GRAIN, 2500, 1500)]
    inner = torch.optim.AdamW(params, lr=1e-2, fused=True) if fused else torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    opt = LossScaleOptimizer(inner, policy=FixedScale(1024.0), clip_grad_norm=0.5 if clip else None)
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1024.0
        if step == 1 and inject is not None:
            params[inject].grad[5] = float("inf")
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("inject", [None, 0, 4])
def test_steps_with_the_split_equal_steps_without(two_threads, monkeypatch, clip, fused, inject):
    with_split = _steps(clip, fused, inject, True, monkeypatch)
    without = _steps(clip, fused, inject, False, monkeypatch)
    for a, b in zip(with_split, without):
        assert torch.equal(a, b)
        assert torch.isfinite(a).all()
