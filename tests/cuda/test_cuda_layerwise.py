"""Per-layer scales on a GPU (issue 31): GPT-2 with tied input and output embeddings (transformers, built from a
config, random init), float16 autocast on CUDA, ``LossScaleOptimizer(layerwise=model)``: every parameter's unscaled
gradient within 1% of a float32 backward's at the same weights, at every step that was taken (the CPU twin:
tests/test_layerwise.py)."""

from __future__ import annotations

import pytest
import torch

from lossscale import LossScaleOptimizer

VOCAB, CONTEXT = 256, 128


def gpt2(layers, width, heads):
    transformers = pytest.importorskip("transformers", reason="the GPT-2 model comes from transformers")
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=CONTEXT,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).cuda()
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def loss_of(model, ids, half):
    with torch.autocast("cuda", dtype=torch.float16, enabled=half):
        return model(ids, labels=ids).loss


@pytest.mark.parametrize("units", ["model", "blocks", "model, checkpointed"])
def test_gpt2_with_tied_embeddings_unscales_within_a_percent_of_float32_on_cuda(units):
    """Also with transformers' activation checkpointing: the blocks' forwards run again inside the backward pass,
    on the autograd engine's CUDA thread, where the hooks must see a recomputation."""
    model, ref = gpt2(6, 256, 8), gpt2(6, 256, 8)
    if units.endswith("checkpointed"):
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.24 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layerwise = list(model.transformer.h) if units == "blocks" else model
    opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), layerwise=layerwise)
    generator = torch.Generator(device="cuda").manual_seed(0)
    taken = 0
    for step in range(6):
        ids = torch.randint(0, VOCAB, (8, CONTEXT), device="cuda", generator=generator)
        ref.load_state_dict(model.state_dict())
        ref.zero_grad(set_to_none=True)
        loss_of(ref, ids, half=False).backward()
        opt.zero_grad()
        opt.backward(loss_of(model, ids, half=True))
        result = opt.step()
        if not bool(result.stepped):  # a skipped step's gradients hold the overflow
            continue
        taken += 1
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            error = float((p.grad.float() - q.grad).norm() / q.grad.norm())
            assert error < 0.01, f"step {step}: {name} is {error:.3%} from float32's"
    assert taken >= 4, f"only {taken} of 6 steps taken"


def test_the_per_layer_unscale_launches_a_few_kernels_not_one_per_gradient():
    """4 units of 50 Linear layers (400 gradients): each unit's gradients divided by ``scale * 2**e[unit]``, exactly,
    by one multi-tensor multiply per unit and the maxima gathered (a multiply per gradient, as a list of per-gradient
    factors takes on CUDA, would launch 400 kernels). The host-op count of the same: tests/test_host_ops.py."""
    from torch.profiler import ProfilerActivity, profile

    from lossscale.layerwise import LayerScales

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(50)]) for _ in range(4)]
    ).cuda()
    layers = LayerScales(list(model))
    scale = torch.tensor(256.0, device="cuda")
    for step in range(3):  # the factors move from the first backward on; the last backward's gradients are checked
        model.zero_grad()
        layers.backward_from(model(torch.randn(8, 16, device="cuda")).square().mean() * scale).backward()
        if step < 2:
            layers.update(*layers.unscale_(scale), scale)
    exponent = layers.exponent.clone()
    expected = [[p.grad / (scale * 2.0 ** exponent[u]) for p in unit.parameters()] for u, unit in enumerate(model)]
    maxima = torch.stack([torch.stack([p.grad.abs().max() for p in unit.parameters()]).max() for unit in model])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        found, amax = layers.unscale_(scale)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) <= 100, len(kernels)
    assert torch.equal(amax, maxima) and not found.any()
    for unit, wanted in zip(model, expected):
        for p, want in zip(unit.parameters(), wanted):
            assert torch.equal(p.grad, want)
