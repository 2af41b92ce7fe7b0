"""A tiny LightningModule, its data and a Trainer runner shared by the Lightning integration tests."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from torch import nn

import lossscale

# Lightning warnings these tests expect (pytest turns warnings into errors); used as `pytestmark`.
LIGHTNING_WARNINGS = [
    # torch 2.13 deprecates LeafSpec, which Lightning 2.6's pytree helper still builds for every batch.
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning",
    # a 32-sample TensorDataset needs no loader workers.
    r"ignore:The '\w+' does not have many workers",
]

TORCH_ARGS = dict(init_scale=2.0**10, growth_interval=2)
# (epoch, micro-batch) whose loss is inf: optimizer steps 0, 3 and 5 overflow (4 steps an epoch)
INF_AT = {(0, 1), (0, 6), (1, 3)}


def data(batches: int = 8) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4 * batches, 4, generator=g), 10 * torch.randn(4 * batches, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


class Tiny(pl.LightningModule):
    """Two linear layers; the loss is inf at the micro-batches in ``inf_at``. ``wrap``: return
    ``LossScaleOptimizer(SGD, policy=DynamicScale(**TORCH_ARGS), **wrap)`` from configure_optimizers (``layerwise``
    True: per-layer scales on its network).
    ``own_backward``: in manual optimization call ``self.optimizers().backward(loss)`` (through Lightning's proxy)."""

    def __init__(
        self,
        inf_at: set[tuple[int, int]] = INF_AT,
        manual: bool = False,
        wrap: dict | None = None,
        own_backward: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.inf_at = inf_at
        self.automatic_optimization = not manual
        self.wrap = wrap
        self.own_backward = own_backward
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
        if self.own_backward:
            opt.backward(loss)
        else:
            self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        self.step_returns.append(opt.step())
        opt.zero_grad()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        sgd = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if self.wrap is None:
            return sgd
        wrap = {**self.wrap, "layerwise": self.net} if self.wrap.get("layerwise") is True else self.wrap
        return lossscale.LossScaleOptimizer(sgd, policy=lossscale.DynamicScale(**TORCH_ARGS), **wrap)


class Healable(Tiny):
    """Tiny whose ``net.big`` Linear overflows float16 in the forward at every step (its weights x3e5, still below
    65504), a LayerNorm after it: healing keeps ``net.big`` in float32 and the run goes on."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(inf_at=set(), **kwargs)
        torch.manual_seed(0)
        self.net = nn.Sequential()
        for name, layer in (("inp", nn.Linear(4, 8)), ("big", nn.Linear(8, 8)), ("norm", nn.LayerNorm(8))):
            self.net.add_module(name, layer)
        self.net.add_module("out", nn.Linear(8, 1))
        with torch.no_grad():
            self.net.big.weight.mul_(3e5)


class Recorder(pl.Callback):
    """The scale after every micro-batch (where there is one) and each new ``last_result``."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.results: list[lossscale.StepResult] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        plugin = trainer.precision_plugin
        if not isinstance(plugin, LightningMixedPrecision):  # LossScalePrecision: the wrapper's scale
            self.scales.append(float(trainer.optimizers[0].scale))
        elif plugin.scaler is not None:  # none under "bf16-mixed"
            self.scales.append(plugin.scaler.get_scale())
        result = getattr(plugin, "last_result", None)
        if result is not None and (not self.results or result is not self.results[-1]):
            self.results.append(result)


def fit(
    plugin: Any,
    module: Tiny | None = None,
    ckpt: str | None = None,
    manual: bool = False,
    epochs: int = 2,
    **trainer_args: Any,
) -> tuple[Tiny, Recorder, pl.Trainer]:
    module = module or Tiny(manual=manual)
    recorder = Recorder()
    auto = {} if manual else dict(accumulate_grad_batches=2, gradient_clip_val=1.0)
    settings = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    settings.update(auto, **trainer_args)
    callbacks = [recorder] + settings.pop("callbacks", [])
    trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, plugins=[plugin], callbacks=callbacks, **settings)
    trainer.fit(module, data(), ckpt_path=ckpt)
    return module, recorder, trainer


def torch_plugin() -> LightningMixedPrecision:
    return LightningMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **TORCH_ARGS))


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


class Amplify(nn.Module):
    """Multiplies by ``factor``: 1 is healthy; 1e6 makes the float16 output of the Tanh before it inf (a planted
    forward overflow, persistent: every step overflows)."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Planted(Tiny):
    """Tiny with ``net.amplify`` between its Tanh and its last Linear, multiplying by ``factor`` (no infs injected
    into the loss)."""

    def __init__(self, factor: float, **kwargs: Any) -> None:
        super().__init__(inf_at=set(), **kwargs)
        torch.manual_seed(0)
        self.net = nn.Sequential()
        self.net.add_module("inp", nn.Linear(4, 8))
        self.net.add_module("act", nn.Tanh())
        self.net.add_module("amplify", Amplify(factor))
        self.net.add_module("out", nn.Linear(8, 1))
