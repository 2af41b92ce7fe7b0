"""lossscale.integrations.lightning.MixedPrecision in a real Lightning Trainer on CPU, side by side with
Lightning's own MixedPrecision plugin driving torch.amp.GradScaler."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from torch import nn

import lossscale
from lossscale.integrations.lightning import MixedPrecision

pytestmark = [
    # torch 2.13 deprecates LeafSpec, which Lightning 2.6's pytree helper still builds for every batch.
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"),
    # a 12-sample TensorDataset needs no loader workers.
    pytest.mark.filterwarnings(r"ignore:The '\w+' does not have many workers"),
]

TORCH_ARGS = dict(init_scale=2.0**10, growth_interval=2)
INF_AT = {(0, 1), (0, 6), (1, 3)}  # (epoch, micro-batch) whose loss is inf: steps 0, 3 and 5 overflow (4 steps an epoch)


def data(batches: int = 8) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4 * batches, 4, generator=g), 10 * torch.randn(4 * batches, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


class Tiny(pl.LightningModule):
    """Two linear layers; the loss is inf at the micro-batches in ``inf_at``."""

    def __init__(self, inf_at: set[tuple[int, int]] = INF_AT, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.inf_at = inf_at
        self.automatic_optimization = not manual
        self.step_returns: list[Any] = []

    def loss(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y)
        return loss * float("inf") if (self.current_epoch, batch_idx) in self.inf_at else loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        loss = self.loss(batch, batch_idx)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        self.step_returns.append(opt.step())
        opt.zero_grad()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Recorder(pl.Callback):
    """The scale after every micro-batch and each new ``last_result``."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.results: list[lossscale.StepResult] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        plugin = trainer.precision_plugin
        self.scales.append(plugin.scaler.get_scale())
        result = getattr(plugin, "last_result", None)
        if result is not None and (not self.results or result is not self.results[-1]):
            self.results.append(result)


def fit(plugin: Any, module: Tiny | None = None, ckpt: str | None = None, manual: bool = False,
        epochs: int = 2, **trainer_args: Any) -> tuple[Tiny, Recorder, pl.Trainer]:
    module = module or Tiny(manual=manual)
    recorder = Recorder()
    auto = {} if manual else dict(accumulate_grad_batches=2, gradient_clip_val=1.0)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, plugins=[plugin], callbacks=[recorder], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         **auto, **trainer_args)
    trainer.fit(module, data(), ckpt_path=ckpt)
    return module, recorder, trainer


def torch_plugin() -> LightningMixedPrecision:
    return LightningMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **TORCH_ARGS))


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_automatic_optimization_matches_lightning_with_torch_scaler_bit_for_bit() -> None:
    ref, ref_rec, ref_trainer = fit(torch_plugin())
    ours, rec, trainer = fit(MixedPrecision("16-mixed", "cpu", **TORCH_ARGS))
    assert rec.scales == ref_rec.scales
    assert len(set(rec.scales)) > 2  # the scale both backed off and grew
    assert_same_weights(ours, ref)
    assert trainer.global_step == ref_trainer.global_step == 8  # attempted steps, skipped ones included
    skipped = [r.step for r in rec.results if bool(r.found_inf)]
    assert skipped == [0, 3, 5]
    assert [r.step for r in rec.results] == list(range(8))
    for r in rec.results:  # clipping by norm records the unscaled norm (inf where the step overflowed)
        assert r.grad_norm is not None and bool(torch.isfinite(r.grad_norm)) != bool(r.found_inf)
        if bool(r.found_inf):
            assert float(r.next_scale) == float(r.scale) / 2


def test_manual_optimization_matches_lightning_with_torch_scaler() -> None:
    ref, ref_rec, _ = fit(torch_plugin(), manual=True, epochs=1)
    ours, rec, _ = fit(MixedPrecision("16-mixed", "cpu", **TORCH_ARGS), manual=True, epochs=1)
    assert rec.scales == ref_rec.scales
    assert_same_weights(ours, ref)
    assert ours.step_returns == ref.step_returns  # what opt.step() returns: the inner step's value, as torch's
    assert [bool(r.found_inf) for r in rec.results] == [b in (1, 6) for b in range(8)]


@pytest.mark.parametrize("first,second", [("torch", "ours"), ("ours", "torch")])
def test_checkpoint_resumes_across_torch_and_lossscale_plugins(tmp_path: Any, first: str, second: str) -> None:
    make = {"torch": torch_plugin, "ours": lambda: MixedPrecision("16-mixed", "cpu", **TORCH_ARGS)}
    ref, ref_rec, _ = fit(make[first](), epochs=2)
    _, rec1, trainer = fit(make[first](), epochs=1)
    path = str(tmp_path / "mid.ckpt")
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert saved["MixedPrecision"]["scale"] == rec1.scales[-1]  # Lightning's key: the plugin's class name
    resumed, rec2, _ = fit(make[second](), ckpt=path, epochs=2)
    assert rec1.scales + rec2.scales == ref_rec.scales
    assert_same_weights(resumed, ref)


def test_constructor_refuses_what_it_cannot_honour() -> None:
    with pytest.raises(ValueError, match=r"MixedPrecision\(precision='bf16-mixed'\): precision must be '16-mixed'"):
        MixedPrecision("bf16-mixed", "cpu")
    with pytest.raises(TypeError, match=r"scaler must be a lossscale.GradScaler; got torch.amp.grad_scaler"):
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"MixedPrecision\(scaler=..., init_scale=...\): pass either"):
        MixedPrecision("16-mixed", "cpu", scaler=lossscale.GradScaler("cpu"), init_scale=8.0)
    with pytest.raises(TypeError, match=r"device must be a device type string"):
        MixedPrecision("16-mixed", torch.device("cpu"))  # type: ignore[arg-type]
    plugin = MixedPrecision("16-mixed", "cpu", policy=lossscale.DynamicScale(init_scale=8.0))
    assert isinstance(plugin, LightningMixedPrecision) and plugin.scaler.get_scale() == 8.0
