"""lossscale.ops.masked.MaskedSkip: a step undone where found_inf; in chunks (torch's separable optimizers)
bit-identical to one whole snapshot and within its memory budget; whole where a step hook must fire once; found_inf
never copied to the host, and to another device once per step. Through LossScaleOptimizer(skip_mode="masked"),
against an fp32 control and with its host reads: test_optimizer.py; its host synchronisations on CUDA:
tests/cuda/test_syncs.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lossscale.ops.masked import MaskedSkip

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=False),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
}
BAD_STEPS = (2, 4)


def _params(n: int = 24) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(8 + 3 * i, generator=g)) for i in range(n)]


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    """The gradients of ``step``; a NaN in one of them at BAD_STEPS."""
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    if step in BAD_STEPS:
        params[len(params) // 2].grad[1] = float("nan")


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for p in opt.state for t in opt.state[p].values() if isinstance(t, torch.Tensor)]


def _masked_run(params, opt, masked: MaskedSkip, steps: int = 6) -> list[bool]:
    """Step 0 plainly (it creates the state), then masked steps; returns whether each masked step moved the
    parameters."""
    _grads(params, 0)
    opt.step()
    moved = []
    for step in range(1, steps):
        _grads(params, step)
        before = [p.detach().clone() for p in params]
        masked.step(opt, torch.tensor(float(step in BAD_STEPS)))
        moved.append(not all(torch.equal(p, q) for p, q in zip(params, before)))
    return moved


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_in_chunks_equals_one_whole_snapshot_bit_for_bit(name):
    ours, ref = _params(), _params()
    opt, ref_opt = OPTIMIZERS[name](ours), OPTIMIZERS[name](ref)
    moved = _masked_run(ours, opt, MaskedSkip())
    assert moved == _masked_run(ref, ref_opt, MaskedSkip(budget=None)) == [s not in BAD_STEPS for s in range(1, 6)]
    assert all(torch.equal(p, q) for p, q in zip(ours, ref))
    ours_state, ref_state = _state(opt), _state(ref_opt)
    assert len(ours_state) == len(ref_state) and all(torch.equal(s, t) for s, t in zip(ours_state, ref_state))
    assert all(torch.isfinite(t).all() for t in ours_state + list(ours))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_chunks_snapshot_holds_a_quarter_of_the_parameters_bytes(name):
    params = _params(40)
    masked = MaskedSkip()
    _masked_run(params, OPTIMIZERS[name](params), masked, steps=3)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params) * 4  # one parameter and its state, at most
    assert 0 < masked.extra_bytes <= 0.25 * param_bytes + largest


def test_with_a_step_hook_the_snapshot_is_whole_and_the_hook_fires_once_per_step():
    params = _params(8)
    inner = torch.optim.Adam(params, lr=1e-2)
    calls = []
    inner.register_step_post_hook(lambda *a: calls.append(1))
    masked = MaskedSkip()
    assert _masked_run(params, inner, masked, steps=4) == [True, False, True]
    assert len(calls) == 4  # the plain first step and three masked ones
    assert masked.extra_bytes >= 3 * sum(p.numel() * 4 for p in params)  # params + two moments


class DeviceCrossings(TorchDispatchMode):
    """Records, before it runs, every op that moves data from one device to another (``_to_copy``, ``copy_``) and
    every host read of a tensor that is not in host memory (``_local_scalar_dense``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_to_copy" and kwargs.get("device") is not None:
            source, target = args[0].device, torch.device(kwargs["device"])
        elif name == "copy_":
            source, target = args[1].device, args[0].device
        elif name == "_local_scalar_dense":
            source, target = args[0].device, torch.device("cpu")
        else:
            return func(*args, **kwargs)
        if source != target or (name == "_local_scalar_dense" and source.type != "cpu"):
            self.seen.append((name, str(source), str(target)))
        return func(*args, **kwargs)


def _on(device: str, n: int = 6) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(8, device=device)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(8, device=device)
    return params


# The meta device stands in for an accelerator here: its values never reach the host, as a CUDA tensor's reach it
# only through a synchronisation. The same rule on a real GPU, counted with torch.cuda.set_sync_debug_mode:
# tests/cuda/test_syncs.py.


@pytest.mark.parametrize("budget", [0.25, None])
def test_state_on_the_flags_device_is_restored_without_moving_the_flag(budget):
    params = _on("meta")
    opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    opt.step()  # creates the momentum buffers, on meta
    with DeviceCrossings() as crossings:
        MaskedSkip(budget).step(opt, torch.ones((), device="meta"))
    assert crossings.seen == []


@pytest.mark.parametrize("budget", [0.25, None])
def test_a_step_counter_in_host_memory_beside_an_accelerators_flag_is_refused_before_anything_moves(budget):
    params = _on("meta")
    opt = torch.optim.Adam(params, lr=1e-2)  # capturable=False: state["step"] is a CPU tensor
    opt.step()
    assert opt.state[params[0]]["step"].device.type == "cpu"
    with DeviceCrossings() as crossings, pytest.raises(ValueError) as err:
        MaskedSkip(budget).step(opt, torch.ones((), device="meta"))
    assert crossings.seen == []
    message = str(err.value)
    for needle in (
        "skip_mode='masked'",
        "Adam keeps state 'step' of param_groups[0][0] in host memory (cpu)",
        "found_inf is on meta",
        "capturable=True",
        "skip_mode='host'",
    ):
        assert needle in message, needle


@pytest.mark.parametrize("budget", [0.25, None])
def test_the_flag_goes_to_each_other_device_once_per_step_not_once_per_tensor(budget):
    params = _on("meta")
    opt = torch.optim.Adam(params, lr=1e-2)  # step counters on the CPU, beside the flag; moments on meta
    opt.step()
    with DeviceCrossings() as crossings:
        MaskedSkip(budget).step(opt, torch.zeros(()))
    assert crossings.seen == [("_to_copy", "cpu", "meta")]
