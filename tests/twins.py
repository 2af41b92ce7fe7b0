"""Twin runs against torch.amp.GradScaler on any device (torch's ``_run_scaling_case`` in its CUDA tests is the model).

One small MLP, trained for ``STEPS`` steps under float16 autocast on the same batches, with an inf or a NaN written
into a gradient at the steps of ``INJECT``: once by torch's scaler and once by a lossscale front end, each over its
own optimizer built the same way. Used by tests/test_twins.py (the CPU cells no other test runs) and
tests/cuda/test_twins.py (every cell, on a GPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lossscale import DynamicScale, LossScaleOptimizer

STEPS = 24
INJECT = {5: math.inf, 6: math.nan, 11: math.inf, 17: math.nan, 18: math.inf}
SCALE_ARGS = {"init_scale": 2.0**16, "growth_interval": 4}
CLIP = 0.5

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "SGD": lambda ps, **kw: torch.optim.SGD(ps, lr=0.01, momentum=0.9, **kw),
    "Adam": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-3, **kw),
    "AdamW": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, **kw),
}
IMPLEMENTATIONS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}

#: (optimizer, implementation, skip mode) of the LossScaleOptimizer twins: every skip mode each optimizer takes.
LOSS_SCALE_OPTIMIZER_CELLS = [
    ("AdamW", "fused", "fused"),
    ("AdamW", "fused", "masked"),
    ("AdamW", "fused", "host"),
    ("Adam", "foreach", "masked"),
    ("Adam", "foreach", "host"),
    ("SGD", "foreach", "masked"),
    ("SGD", "foreach", "host"),
]


@dataclass
class Run:
    """What a twin run ends with: the scale after every step, the parameters and the optimizer state."""

    scales: list[float]
    params: list[torch.Tensor]
    state: dict[Any, torch.Tensor]


def make_optimizer(params: Any, name: str, implementation: str, device: str, skip_mode: str = "host"):
    """``OPTIMIZERS[name]`` with the implementation's flag; on a GPU, masked mode's Adam and AdamW keep their step
    counters there (``capturable=True``; masked mode refuses them in host memory)."""
    kwargs = dict(IMPLEMENTATIONS[implementation])
    if skip_mode == "masked" and device != "cpu" and name != "SGD" and implementation != "fused":
        kwargs["capturable"] = True
    return OPTIMIZERS[name](params, **kwargs)


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)
    ).to(device)


def _batches(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 8, generator=gen).to(device), torch.randn(16, 4, generator=gen).to(device))
        for _ in range(STEPS)
    ]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: str) -> torch.Tensor:
    with torch.autocast(torch.device(device).type, dtype=torch.float16):
        out = model(x)
    return torch.nn.functional.mse_loss(out.float(), y)


def _poison(model: torch.nn.Module, step: int) -> None:
    if step in INJECT:
        with torch.no_grad():
            model[2].weight.grad.view(-1)[3] = INJECT[step]


def _finish(model: torch.nn.Module, opt: torch.optim.Optimizer, scales: list[float]) -> Run:
    state = {
        (k, n): v.detach().clone()
        for k, s in opt.state_dict()["state"].items()
        for n, v in s.items()
        if isinstance(v, torch.Tensor)
    }
    return Run(scales, [p.detach().clone() for p in model.parameters()], state)


def run_grad_scaler(
    scaler_type: type, name: str, implementation: str, clip: bool, device: str, skip_mode: str = "host"
) -> Run:
    """torch's recipe (``scale``, ``backward``, [``unscale_``, ``clip_grad_norm_``], ``step``, ``update``) with a
    ``scaler_type`` (torch.amp.GradScaler or lossscale.GradScaler); ``skip_mode`` only picks the optimizer's
    flags as :func:`make_optimizer` does."""
    model = _model(device)
    opt = make_optimizer(model.parameters(), name, implementation, device, skip_mode)
    scaler = scaler_type(device, **SCALE_ARGS)
    scales = []
    for step, (x, y) in enumerate(_batches(device)):
        scaler.scale(_loss(model, x, y, device)).backward()
        _poison(model, step)
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad(set_to_none=True)
    return _finish(model, opt, scales)


def run_loss_scale_optimizer(name: str, implementation: str, clip: bool, device: str, skip_mode: str) -> Run:
    """The same training through ``LossScaleOptimizer(skip_mode=...)`` with torch's rule."""
    model = _model(device)
    opt = LossScaleOptimizer(
        make_optimizer(model.parameters(), name, implementation, device, skip_mode),
        policy=DynamicScale(**SCALE_ARGS),
        clip_grad_norm=CLIP if clip else None,
        skip_mode=skip_mode,
    )
    assert opt.skip_mode == skip_mode
    scales = []
    for step, (x, y) in enumerate(_batches(device)):
        opt.backward(_loss(model, x, y, device))
        _poison(model, step)
        result = opt.step()
        scales.append(float(result.next_scale))
        opt.zero_grad(set_to_none=True)
    return _finish(model, opt.inner, scales)


def assert_same_training(ours: Run, theirs: Run, exact: bool = True) -> None:
    """The same scale after every step (so the same skips); parameters and optimizer state bit for bit, or with
    ``exact=False`` within float32 rounding (a clip coefficient computed in another order)."""
    assert ours.scales == theirs.scales
    assert len(set(theirs.scales)) > 2  # the run backed off and grew
    for step in INJECT:
        assert theirs.scales[step] < (theirs.scales[step - 1] if step else SCALE_ARGS["init_scale"])
    assert ours.state.keys() == theirs.state.keys()
    pairs = list(zip(ours.params, theirs.params)) + [(ours.state[k], theirs.state[k]) for k in theirs.state]
    for a, b in pairs:
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
