"""lossscale.ops.overflow: the overflow checks in both modes (inf/NaN, saturation) at every position, the fused
unscale-and-check, the flag they set, attribution, and no host reads; the LOSSSCALE_TRITON switch of the CUDA amax
kernel (the kernel itself: tests/cuda/test_cuda_amax_kernel.py)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lossscale.ops.overflow import check_, check_with_amax_, overflowing, saturation_threshold, unscale_and_check_
from lossscale.testing import HostReadCounter


def grads(dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.randn(n, dtype=dtype) for n in (7, 1, 33, 128)]


def found(gs, mode, unscale=False):
    f = torch.zeros(())
    if unscale:
        unscale_and_check_(gs, f, torch.tensor(0.5), mode)
    else:
        check_(gs, f, mode)
    return float(f) > 0


@pytest.mark.parametrize("unscale", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_saturation_catches_65504_and_not_60000(unscale, dtype):
    for value, caught_sat in [(65504.0, True), (-65504.0, True), (60000.0, False), (-60000.0, False)]:
        gs = grads(dtype)
        gs[2][5] = value
        assert found([g.clone() for g in gs], "saturation", unscale) is caught_sat, value
        assert found([g.clone() for g in gs], "inf_nan", unscale) is False, value


@pytest.mark.parametrize("mode", ["inf_nan", "saturation"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("unscale", [False, True])
def test_non_finite_at_every_position_is_caught(mode, bad, unscale):
    base = grads()
    assert found([g.clone() for g in base], mode, unscale) is False
    for t in range(len(base)):
        for i in range(base[t].numel()):
            gs = [g.clone() for g in base]
            gs[t].view(-1)[i] = bad
            assert found(gs, mode, unscale), (t, i)


def test_unscale_multiplies_in_place():
    gs = grads()
    expected = [g * 0.25 for g in gs]
    unscale_and_check_(gs, torch.zeros(()), torch.tensor(0.25), "saturation")
    for g, e in zip(gs, expected):
        assert torch.equal(g, e)


def test_check_does_not_write():
    gs = grads()
    before = [g.clone() for g in gs]
    check_(gs, torch.zeros(()), "inf_nan")
    check_(gs, torch.zeros(()), "saturation")
    assert all(torch.equal(a, b) for a, b in zip(gs, before))


def test_no_host_reads_and_empty_tensors_are_fine():
    gs = grads() + [torch.empty(0)]
    with HostReadCounter() as reads:
        f = torch.zeros(())
        check_(gs, f, "saturation")
        check_(gs, f, "inf_nan")
        unscale_and_check_(gs, f, torch.tensor(0.5), "saturation")
    assert reads.count == 0 and float(f) == 0


def test_threshold_follows_the_format():
    assert saturation_threshold(torch.float16) == 65504.0
    assert saturation_threshold(torch.bfloat16) == float(torch.finfo(torch.bfloat16).max)
    with pytest.raises(ValueError, match="floating-point"):
        saturation_threshold(torch.int32)


def test_attribution_names_only_the_overflowing_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[1].weight.grad[0, 1] = float("nan")
    model[0].bias.grad[2] = 65504.0
    named = list(model.named_parameters())
    assert overflowing(((n, p.grad) for n, p in named), "inf_nan") == ["1.weight"]
    assert overflowing(((n, p.grad) for n, p in named), "saturation") == ["0.bias", "1.weight"]
    # after unscaling by 2**10 the saturated value is 65504 / 1024: still attributed
    model[0].bias.grad.mul_(2.0**-10)
    assert overflowing(((n, p.grad) for n, p in named), "saturation", unscaled_by=2.0**10) == ["0.bias", "1.weight"]


def _straddling():
    """Tensors of several sizes."""
    torch.manual_seed(1)
    return [torch.randn(n) for n in (5, 1_000, 40_000, 200_007)]


def test_the_check_catches_every_non_finite_in_large_tensors_into_any_flag_dtype_and_changes_no_value():
    base = _straddling()
    flags = [torch.float32, torch.float64, torch.bool]
    for dtype in flags:
        clean = torch.zeros((), dtype=dtype)
        check_([g.clone() for g in base], clean, "inf_nan")
        assert not bool(clean)
    for k, bad in enumerate([float("inf"), float("-inf"), float("nan")]):
        for t in range(len(base)):
            for j, i in enumerate((0, base[t].numel() // 2, base[t].numel() - 1)):
                gs = [g.clone() for g in base]
                gs[t].view(-1)[i] = bad
                before = [g.clone() for g in gs]
                f = torch.zeros((), dtype=flags[(k + t + j) % 3])
                check_(gs, f, "inf_nan")
                assert bool(f), (bad, t, i, f.dtype)
                for a, b in zip(gs, before):
                    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("mode", ["inf_nan", "saturation"])
@pytest.mark.parametrize("check", [check_, check_with_amax_], ids=["check_", "check_with_amax_"])
def test_every_check_sets_the_flag_to_one_and_never_adds(check, mode):
    # a step's flag is born 0 or 1 (the scale guard) and is handed to fused kernels as it is: they skip only
    # where it is exactly 1.0, so a check that added to a raised flag would let the step through
    for start in (0.0, 1.0):
        gs = _straddling()
        gs[0][0], gs[3][-1] = float("nan"), float("inf")
        f = torch.full((), start)
        check(gs, f, mode)
        assert float(f) == 1.0, start
        f = torch.full((), start)
        check(_straddling(), f, mode)
        assert float(f) == start


def test_a_raised_flag_stays_raised_and_opposite_infinities_are_caught():
    gs = _straddling()
    gs[3][0], gs[3][1] = float("inf"), float("-inf")  # their sum is NaN, not a finite cancellation
    f = torch.full((), 3.0)
    check_(gs, f, "inf_nan")
    assert float(f) > 0
    big = [torch.full((20000,), 1e30)]  # large but finite: its float32 sum (2e34) is finite, no overflow
    f = torch.zeros(())
    check_(big, f, "inf_nan")
    assert float(f) == 0


@pytest.mark.parametrize("mode", ["inf_nan", "saturation"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), 65504.0])
def test_the_largest_magnitude_is_exact_and_is_the_check(mode, bad):
    gs = grads()
    f = torch.zeros(())
    assert float(check_with_amax_(gs, f, mode)) == max(float(g.abs().max()) for g in gs) and float(f) == 0
    gs[2][17] = bad
    amax = check_with_amax_(gs, f, mode)
    caught = bad != 65504.0 or mode == "saturation"
    assert float(f) == float(caught)
    assert float(amax) == abs(bad) if bad == bad else amax.isnan()


class KernelCounter(TorchDispatchMode):
    """Ops that launch work (views such as stack's per-tensor unsqueeze excluded)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_the_largest_magnitude_takes_the_same_kernels_for_20_or_200_tensors_on_an_accelerator():
    def kernels(n):  # the meta device takes the accelerator path: one multi-tensor inf-norm, whatever n
        gs = [torch.randn(64, device="meta") for _ in range(n)]
        f = torch.zeros((), device="meta")
        check_with_amax_(gs, f, "inf_nan")  # the first call of a size makes the buffer its norms are gathered in
        with KernelCounter() as counter:
            check_with_amax_(gs, f, "inf_nan")
        return counter.ops

    assert kernels(20) == kernels(200)
    assert len(kernels(20)) <= 8, kernels(20)


@pytest.fixture
def fresh_kernel_choice():
    """lossscale.ops.overflow.amax_kernel_module() decides afresh in the test and after it."""
    from lossscale.ops.overflow import amax_kernel_module

    amax_kernel_module.cache_clear()
    yield amax_kernel_module
    amax_kernel_module.cache_clear()


def test_a_bad_lossscale_triton_setting_is_refused_naming_the_variable(fresh_kernel_choice, monkeypatch):
    monkeypatch.setenv("LOSSSCALE_TRITON", "yes")
    with pytest.raises(ValueError, match=r"LOSSSCALE_TRITON must be '0' .* or '1' .*; got 'yes'"):
        fresh_kernel_choice()


def test_lossscale_triton_0_turns_the_kernel_off(fresh_kernel_choice, monkeypatch):
    monkeypatch.setenv("LOSSSCALE_TRITON", "0")
    assert fresh_kernel_choice() is None


def test_a_triton_that_fails_to_import_says_how_to_turn_the_kernel_off(fresh_kernel_choice, monkeypatch):
    import importlib.machinery
    import sys

    monkeypatch.delenv("LOSSSCALE_TRITON", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: importlib.machinery.ModuleSpec(name, None))
    monkeypatch.setitem(sys.modules, "triton", None)  # installed, but its import fails
    monkeypatch.delitem(sys.modules, "lossscale.ops.amax_kernel", raising=False)
    monkeypatch.delattr("lossscale.ops.amax_kernel", raising=False)
    with pytest.raises(RuntimeError, match=r"triton is installed but its import failed .* Set LOSSSCALE_TRITON=0"):
        fresh_kernel_choice()
