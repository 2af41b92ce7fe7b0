"""Structure of the fast paths, checked without timing: passes over the gradients counted by a dispatch
mode, masked skip in chunks bit-identical to a whole snapshot and within its memory budget."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from lossscale import FixedScale, GradScaler, LossScaleOptimizer
from lossscale.ops.masked import MaskedSkip

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _passes import count_passes  # noqa: E402

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=False),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
}


def _params(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(8 + 3 * i, generator=g)) for i in range(n)]


def _grads(params, step, bad):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 2.0**10
    if bad:
        params[len(params) // 2].grad[1] = float("nan")


def _state(opt):
    return [t.clone() for p in opt.state for t in opt.state[p].values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_masked_in_chunks_equals_the_whole_snapshot_bit_for_bit(name):
    ours, ref = _params(), _params()
    opt = LossScaleOptimizer(OPTIMIZERS[name](ours), policy=FixedScale(2.0**10), skip_mode="masked")
    whole = LossScaleOptimizer(OPTIMIZERS[name](ref), policy=FixedScale(2.0**10), skip_mode="masked")
    whole._masked = MaskedSkip(budget=None)
    for step in range(6):
        for ps in (ours, ref):
            _grads(ps, step, bad=step in (2, 4))
        a, b = opt.step(), whole.step()
        assert bool(a.stepped) == bool(b.stepped) == (step not in (2, 4))
    assert all(torch.equal(p, q) for p, q in zip(ours, ref))
    assert all(torch.equal(s, t) for s, t in zip(_state(opt.inner), _state(whole.inner)))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_masked_snapshot_memory_is_a_quarter_of_the_parameters(name):
    params = _params(40)
    opt = LossScaleOptimizer(OPTIMIZERS[name](params), policy=FixedScale(1.0), skip_mode="masked")
    for step in range(3):
        _grads(params, step, bad=False)
        opt.step()
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params) * 4  # one parameter and its state, at most
    assert 0 < opt._masked.extra_bytes <= 0.25 * param_bytes + largest


def test_masked_with_a_step_hook_snapshots_whole_and_fires_the_hook_once():
    params = _params(8)
    inner = torch.optim.Adam(params, lr=1e-2)
    calls = []
    inner.register_step_post_hook(lambda *a: calls.append(1))
    opt = LossScaleOptimizer(inner, policy=FixedScale(1.0), skip_mode="masked")
    for step in range(3):
        _grads(params, step, bad=False)
        opt.step()
    assert len(calls) == 3
    assert opt._masked.extra_bytes >= 3 * sum(p.numel() * 4 for p in params)  # params + two moments


@pytest.mark.parametrize("fused", [True, False])
def test_no_pass_over_the_gradients_between_accumulation_boundaries(fused):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    params = list(model.parameters())
    opt = LossScaleOptimizer(torch.optim.AdamW(params, lr=1e-3, fused=fused), policy=FixedScale(2.0**8),
                             accumulation_steps=4, clip_grad_norm=1.0)
    x = torch.randn(8, 16)
    for micro in range(8):
        opt.zero_grad()
        opt.backward(model(x).square().mean())
        counter = count_passes(params, opt.step)
        boundary = micro % 4 == 3
        assert (counter.read > 0) == boundary, (micro, counter.ops)
        assert counter.written == 0 or boundary, (micro, counter.ops)


def _counted(front, fused, clip, numel=None):
    """Passes over the gradients beyond the bare step, per front end (read, write), in whole passes; by
    default over six tensors of 256K elements."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel or 1 << 18)) for _ in range(6)]
    make = (lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)) if fused else (
        lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9))
    base = [torch.randn_like(p) * 256 for p in params]

    def put():
        for p, g in zip(params, base):
            p.grad = g.clone()

    bare = make(params)
    if front == "LSO":
        opt = LossScaleOptimizer(make(params), policy=FixedScale(256.0), clip_grad_norm=1.0 if clip else None)
        run = opt.step
    else:
        inner, scaler = make(params), GradScaler("cpu", init_scale=256.0)
        scaler.scale(torch.ones(()))

        def run():
            if clip:
                scaler.unscale_(inner)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(inner)
            scaler.update()
    put(); bare.step(); put(); run()  # noqa: E702  (creates state on both)
    put(); b = count_passes(params, bare.step)
    put(); c = count_passes(params, run)
    n = sum(p.numel() for p in params)
    return round((c.read - b.read) / n, 2), round((c.written - b.written) / n, 2)


@pytest.mark.parametrize("front,fused,clip,expected", [
    ("LSO", True, True, (1, 0)), ("LSO", True, False, (1, 1)), ("LSO", False, False, (1, 1)),
    ("LSO", False, True, (2, 1)), ("GS", True, False, (1, 1)), ("GS", False, False, (1, 1)),
])
def test_passes_over_the_gradients_are_what_the_docs_claim(front, fused, clip, expected):
    assert _counted(front, fused, clip) == expected


def test_run_all_only_replaces_its_sections_and_keeps_the_others(tmp_path):
    import run_all

    old = tmp_path / "RESULTS.md"
    old.write_text("# Benchmark results\n\nMachine: cpu=Old\n\n## A\n\n`python a.py`\n\nold a\n\n## B\n\n`python b.py`\n\nold b\n")
    merged = run_all._merge(old, {"B": "## B\n\nnew b\n", "C": "## C\n\nnew c\n"})
    assert [m.split("\n", 1)[0] for m in merged] == ["## A", "## B", "## C"]
    assert "old a" in merged[0] and "Machine: cpu=Old" in merged[0]  # the header's machine moves into it
    assert merged[1] == "## B\n\nnew b\n"
