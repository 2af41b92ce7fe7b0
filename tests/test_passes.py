"""Passes over the gradients, counted structurally by the dispatch mode of benchmarks/_passes.py (no timing): what
each front end adds to the bare optimizer step, as LossScaleOptimizer's docstring states it, and none between
accumulation boundaries."""

import sys
from pathlib import Path

import pytest
import torch

from lossscale import FixedScale, GradScaler, LossScaleOptimizer, PredictiveScale

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _passes import count_passes


@pytest.mark.parametrize("fused", [True, False])
def test_no_pass_over_the_gradients_between_accumulation_boundaries(fused):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    params = list(model.parameters())
    opt = LossScaleOptimizer(
        torch.optim.AdamW(params, lr=1e-3, fused=fused),
        policy=FixedScale(2.0**8),
        accumulation_steps=4,
        clip_grad_norm=1.0,
    )
    x = torch.randn(8, 16)
    for micro in range(8):
        opt.zero_grad()
        opt.backward(model(x).square().mean())
        counter = count_passes(params, opt.step)
        boundary = micro % 4 == 3
        assert (counter.read > 0) == boundary, (micro, counter.ops)
        assert counter.written == 0 or boundary, (micro, counter.ops)


def _counted(front, fused, clip, policy=None):
    """Passes over the gradients beyond the bare step, per front end (read, write), in whole passes, over six
    tensors (the count is structural: it does not depend on their size)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1 << 12)) for _ in range(6)]
    make = (
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True))
        if fused
        else (lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9))
    )
    base = [torch.randn_like(p) * 256 for p in params]

    def put():
        for p, g in zip(params, base):
            p.grad = g.clone()

    bare = make(params)
    if front == "LSO":
        opt = LossScaleOptimizer(make(params), policy=policy or FixedScale(256.0), clip_grad_norm=1.0 if clip else None)
        run = opt.step
    else:
        inner = make(params)
        scaler = GradScaler("cpu", policy=policy) if policy else GradScaler("cpu", init_scale=256.0)
        scaler.scale(torch.ones(()))

        def run():
            if clip:
                scaler.unscale_(inner)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(inner)
            scaler.update()

    put()
    bare.step()
    put()
    run()
    put()
    b = count_passes(params, bare.step)
    put()
    c = count_passes(params, run)
    n = sum(p.numel() for p in params)
    return round((c.read - b.read) / n, 2), round((c.written - b.written) / n, 2)


# (read, write) passes beyond the bare step. LossScaleOptimizer's docstring: fused without clipping one read + write
# (the check), fused with global-norm clipping one read (the norm is the check), otherwise one read + write to
# unscale and check plus one read for the norm when clipping. GradScaler without clipping: torch's passes.
@pytest.mark.parametrize(
    "front,fused,clip,expected",
    [
        ("LSO", True, True, (1, 0)),
        ("LSO", True, False, (1, 1)),
        ("LSO", False, False, (1, 1)),
        ("LSO", False, True, (2, 1)),
        ("GS", True, False, (1, 1)),
        ("GS", False, False, (1, 1)),
    ],
)
def test_passes_over_the_gradients_are_what_the_docs_claim(front, fused, clip, expected):
    assert _counted(front, fused, clip) == expected


# A policy that observes the gradients' maximum (PredictiveScale): with a fused optimizer and no clipping the
# largest magnitude is the check (1 read, no write: less than the rows above); elsewhere it is one read more than
# a DynamicScale's passes, as neither the L2 norm nor torch's unscale kernel yields a maximum.
@pytest.mark.parametrize(
    "front,fused,clip,expected",
    [
        ("LSO", True, False, (1, 0)),
        ("LSO", True, True, (2, 0)),
        ("LSO", False, False, (2, 1)),
        ("LSO", False, True, (3, 1)),
        ("GS", True, False, (1, 0)),
        ("GS", False, False, (2, 1)),
    ],
)
def test_a_policy_that_observes_amax_reads_it_from_the_check(front, fused, clip, expected):
    assert _counted(front, fused, clip, PredictiveScale(init_scale=256.0)) == expected
