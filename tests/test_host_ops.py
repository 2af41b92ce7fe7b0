"""Host-side ops per step against the number of tensors, counted structurally (benchmarks/_host_ops.py: the aten ops
the host dispatches outside torch's multi-tensor kernels; no timing).

With many small tensors a step is bound by the host, so what grows with the number of tensors is what matters: an op
per tensor is a launch or a view per tensor on CUDA. The rule: lossscale adds no op per tensor beyond what torch's own
pipeline (torch.amp.GradScaler + clip_grad_norm_) adds around the same optimizer. Where it adds any, the test names
them. Pass counts (bytes read and written): test_passes.py. Host syncs on CUDA: tests/cuda/test_syncs.py.
"""

import sys
from pathlib import Path

import pytest
import torch

import lossscale.ops.clip
from lossscale import DynamicScale, GradScaler, LossScaleOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _host_ops import dispatched_ops, growth_per_tensor, host_ops, kernel_tensors

SMALL, LARGE = 10, 200
OPTIMIZERS = {
    "fused AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "foreach Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
    "foreach SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True),
}
STACK_VIEWS = {"aten::unsqueeze", "aten::as_strided"}  # torch.stack of per-tensor norms: one view per tensor


def _counted(contender: str, opt_name: str, n: int, clip: bool, skip_mode: str = "auto", count=host_ops):
    """``count`` (host ops) of one steady step of ``contender`` over ``n`` tensors of 64 values."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(n)]
    grads = [torch.randn(64) * 256 for _ in params]
    opt = OPTIMIZERS[opt_name](params)
    if contender == "bare":
        run = opt.step
    elif contender.startswith("LossScaleOptimizer"):
        run = LossScaleOptimizer(
            opt,
            policy=DynamicScale(init_scale=256.0, growth_interval=10**9),
            clip_grad_norm=1.0 if clip else None,
            skip_mode=skip_mode,
            flat_grads=contender.endswith("flat"),
        ).step
    else:
        scaler = (torch.amp.GradScaler if contender == "torch" else GradScaler)(
            "cpu", init_scale=256.0, growth_interval=10**9
        )
        scaler.scale(torch.ones(()))

        def run():
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()

    def put_grads():  # in place where a gradient exists (flat gradients stay views of their buffer)
        for p, g in zip(params, grads):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    for _ in range(2):  # the first steps create the optimizer state (and masked mode decides them on the host)
        put_grads()
        run()
    put_grads()
    return count(run)


def _extra_growth(
    contender: str,
    opt_name: str,
    clip: bool,
    skip_mode: str = "auto",
    sizes: tuple[int, int] = (SMALL, LARGE),
    count=host_ops,
) -> dict[str, float]:
    """Ops (or what ``count`` counts) per extra tensor that ``contender`` adds to the bare optimizer step."""

    def growth(who):
        return growth_per_tensor(
            _counted(who, opt_name, sizes[0], clip, skip_mode, count),
            _counted(who, opt_name, sizes[1], clip, skip_mode, count),
            *sizes,
        )

    ours, bare = growth(contender), growth("bare")
    extra = {name: ours.get(name, 0.0) - bare.get(name, 0.0) for name in set(ours) | set(bare)}
    return {name: rate for name, rate in extra.items() if rate}


@pytest.mark.parametrize("opt_name", ["fused AdamW", "foreach Adam"])
@pytest.mark.parametrize("clip", [True, False])
def test_grad_scaler_adds_no_op_per_tensor_to_torchs_pipeline(opt_name, clip):
    ours, torchs = _extra_growth("GradScaler", opt_name, clip), _extra_growth("torch", opt_name, clip)
    assert ours == torchs
    # torch's own clip_grad_norm_: one .to() per norm and torch.stack of the norms; nothing without a clip
    assert torchs == ({"aten::to": 1.0, "aten::unsqueeze": 1.0, "aten::as_strided": 1.0} if clip else {})


@pytest.mark.parametrize("opt_name", ["fused AdamW", "foreach Adam"])
@pytest.mark.parametrize("clip", [True, False])
def test_loss_scale_optimizer_adds_fewer_ops_per_tensor_than_torchs_pipeline(opt_name, clip):
    ours, torchs = _extra_growth("LossScaleOptimizer", opt_name, clip), _extra_growth("torch", opt_name, clip)
    assert sum(ours.values()) <= sum(torchs.values())
    # With a clip: the squared norm of the scaled gradients stacks the per-tensor norms of one _foreach_norm (a
    # view per tensor, no launch); torch's clip_grad_norm_ does the same and adds a .to() per norm.
    assert ours == (dict.fromkeys(STACK_VIEWS, 1.0) if clip else {})


@pytest.mark.parametrize("opt_name", ["fused AdamW", "foreach Adam"])
def test_with_the_gpus_gather_the_clip_adds_no_op_per_tensor(monkeypatch, opt_name):
    """On a GPU the per-tensor norms are gathered by one multi-tensor copy (ops.clip.norms), not stacked: the CPU made
    to take that path."""
    monkeypatch.setattr(lossscale.ops.clip, "STACK_ON", frozenset())
    sizes = (2 * lossscale.ops.clip.MIN_COUNT, LARGE)  # both gathered (fewer values are stacked)
    assert _extra_growth("LossScaleOptimizer", opt_name, clip=True, sizes=sizes) == {}


@pytest.mark.parametrize("opt_name,selects", [("foreach SGD momentum", 2), ("foreach Adam", 4)])
def test_masked_skip_adds_one_select_per_parameter_and_state_tensor(opt_name, selects):
    # 8 and 80 SGD tensors pack into the same number of chunks; Adam's chunks differ by a few between the sizes
    # (its 0-d step counters), and each chunk's optimizer step adds its own fixed ops: under one per tensor.
    sizes = (8, 80)
    extra = _extra_growth("LossScaleOptimizer", opt_name, False, "masked", sizes)
    assert extra.pop("aten::where") == selects  # torch has no multi-tensor select: one where per restored tensor
    assert all(rate < 1 for rate in extra.values()), extra
    if opt_name == "foreach SGD momentum":
        assert extra == {}


@pytest.mark.parametrize("opt_name", ["fused AdamW", "foreach Adam"])
@pytest.mark.parametrize("clip", [True, False])
def test_with_flat_gradients_the_optimizer_adds_nothing_per_tensor(opt_name, clip):
    # Neither an op nor a tensor handed to a kernel per extra parameter: every pass of ours is one kernel over the
    # buffer. What is left is the fused optimizer's own: given found_inf, torch's fused AdamW takes its step
    # counters back (_foreach_sub_ of the counters and found_inf once per counter), under torch's scaler too.
    own = {"aten._foreach_sub_": 2.0} if opt_name == "fused AdamW" else {}
    assert _extra_growth("LossScaleOptimizer flat", opt_name, clip) == {}
    assert _extra_growth("LossScaleOptimizer flat", opt_name, clip, count=kernel_tensors) == own
    # Without the buffer the same step hands its kernels every gradient (and stacks per-tensor norms), as torch's
    # pipeline does with one more pass.
    per_gradient = (
        {"aten._foreach_norm": 1.0, "aten.stack": 1.0}
        if clip
        else {"aten._amp_foreach_non_finite_check_and_unscale_": 1.0}
    )
    if clip and opt_name == "foreach Adam":
        per_gradient["aten._foreach_mul_"] = 1.0  # the unscale x clip pass (a fused kernel folds it in)
    assert _extra_growth("LossScaleOptimizer", opt_name, clip, count=kernel_tensors) == {**per_gradient, **own}


def _layer_unscale(units: int, per_unit: int, count):
    """``count`` of one ``LayerScales.unscale_`` over ``units`` units of ``per_unit`` Linear layers each."""
    from lossscale.layerwise import LayerScales

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(per_unit)]) for _ in range(units)]
    )
    layers = LayerScales(list(model))
    scale = torch.tensor(256.0)
    for step in range(3):  # the factors move from the first backward on; the last backward is the one counted
        model.zero_grad()
        layers.backward_from(model(torch.randn(3, 4)).square().mean() * scale).backward()
        if step < 2:
            layers.update(*layers.unscale_(scale), scale)
    return count(lambda: layers.unscale_(scale))


@pytest.mark.parametrize("gather_on_cpu", [False, True])
def test_per_layer_unscale_adds_no_op_per_tensor(monkeypatch, gather_on_cpu):
    """The per-unit maxima and factors cost nothing per gradient: the maxima are gathered (on the CPU: stacked, a
    view per tensor, as torch's clip_grad_norm_ does), and each unit's gradients are multiplied by its factor in one
    multi-tensor call that is handed each gradient once (a list of per-gradient factors would hand two tensors per
    gradient, and on CUDA leave torch's multi-tensor fast path for one kernel per gradient)."""
    if gather_on_cpu:
        monkeypatch.setattr(lossscale.ops.clip, "STACK_ON", frozenset())
    tensors = (4 * 2 * 5, 4 * 2 * 50)  # 4 units of 5 and 50 Linear layers (weight and bias)
    ops = growth_per_tensor(_layer_unscale(4, 5, host_ops), _layer_unscale(4, 50, host_ops), *tensors)
    assert ops == ({} if gather_on_cpu else dict.fromkeys(STACK_VIEWS, 1.0))
    handed = growth_per_tensor(_layer_unscale(4, 5, kernel_tensors), _layer_unscale(4, 50, kernel_tensors), *tensors)
    assert handed["aten._foreach_mul_"] == 1.0 and handed["aten._foreach_norm"] == 1.0
    calls = _layer_unscale(4, 50, dispatched_ops)
    assert calls["aten._foreach_mul_"] == 4  # one per unit
