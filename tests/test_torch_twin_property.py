"""lossscale.GradScaler and torch.amp.GradScaler, side by side, under random call sequences.

Hypothesis draws torch's constructor arguments (valid values) and a run: iterations of
zero_grad / scale(loss).backward() / inf, -inf or NaN written into a gradient / unscale_ (optional) /
step / update() or update(new_scale), with state_dict round trips (own format, or the other scaler's)
between iterations. After every call the two runs must agree exactly: the scale, whether the step was
skipped, every parameter and the optimizer state. The runs stay above the 2**-126 floor, where
lossscale stops and torch goes on into subnormals (an intended difference).
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossscale

SCALES = st.one_of(st.sampled_from([2.0**k for k in range(-8, 40)]),
                   st.floats(min_value=2.0**-8, max_value=2.0**40, allow_nan=False, allow_infinity=False))
INJECT = st.one_of(st.none(), st.tuples(st.sampled_from([math.inf, -math.inf, math.nan]), st.integers(0, 7)))
ITERATION = st.fixed_dictionaries({
    "inject": INJECT,
    "unscale_first": st.booleans(),
    "new_scale": st.one_of(st.none(), st.none(), SCALES, SCALES.map(torch.tensor)),
    "round_trip": st.sampled_from([None, None, "own", "torch_into_lossscale", "lossscale_into_torch"]),
})
CONFIG = st.fixed_dictionaries({
    "init_scale": SCALES,
    "growth_factor": st.sampled_from([2.0, 1.5, 3.0, 1.25]),
    "backoff_factor": st.sampled_from([0.5, 0.25, 0.8, 0.125]),
    "growth_interval": st.integers(1, 4),
})


class Run:
    """One model, its SGD-with-momentum optimizer and a scaler; every run starts from the same weights."""

    def __init__(self, scaler_cls: type, config: dict) -> None:
        gen = torch.Generator().manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=2.0**-6, momentum=0.5)
        self.scaler_cls, self.config = scaler_cls, config
        self.scaler = scaler_cls("cpu", **config)

    def backward(self, x: torch.Tensor, inject: tuple[float, int] | None) -> None:
        self.opt.zero_grad()
        self.scaler.scale(self.model(x).square().mean()).backward()
        if inject is not None:
            value, index = inject
            grads = [p.grad for p in self.model.parameters()]
            grad = grads[index % len(grads)]
            grad.view(-1)[index % grad.numel()] = value

    def step(self, unscale_first: bool) -> bool:
        """Returns whether the optimizer's step was applied (torch: found_inf read before update())."""
        if unscale_first:
            self.scaler.unscale_(self.opt)
        result = self.scaler.step(self.opt)
        if isinstance(self.scaler, lossscale.GradScaler):
            return bool(result.stepped)
        return sum(float(v) for v in self.scaler._found_inf_per_device(self.opt).values()) == 0.0

    def reload(self, state: dict) -> None:
        self.scaler = self.scaler_cls("cpu", **self.config)
        self.scaler.load_state_dict(state)


def check_twins(ours: Run, theirs: Run, where: str) -> None:
    assert ours.scaler.get_scale() == theirs.scaler.get_scale(), where
    for p, q in zip(ours.model.parameters(), theirs.model.parameters()):
        assert torch.equal(p, q), where
    for p, q in zip(ours.model.parameters(), theirs.model.parameters()):
        a, b = ours.opt.state[p], theirs.opt.state[q]
        assert a.keys() == b.keys(), where
        assert all(torch.equal(a[k], b[k]) for k in a), where


@settings(max_examples=60, deadline=None)
@given(config=CONFIG, iterations=st.lists(ITERATION, min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_lossscale_and_torch_gradscaler_agree_step_by_step(config, iterations, seed):
    ours, theirs = Run(lossscale.GradScaler, config), Run(torch.amp.GradScaler, config)
    gen = torch.Generator().manual_seed(seed)
    for i, it in enumerate(iterations):
        x = torch.randn(5, 3, generator=gen)
        for run in (ours, theirs):
            run.backward(x, it["inject"])
        applied = [run.step(it["unscale_first"]) for run in (ours, theirs)]
        assert applied[0] == applied[1] == (it["inject"] is None), f"iteration {i}: skip decision"
        for run in (ours, theirs):
            run.scaler.update(new_scale=it["new_scale"].clone() if isinstance(it["new_scale"], torch.Tensor)
                              else it["new_scale"])
        check_twins(ours, theirs, f"iteration {i}: after update")
        assert ours.scaler.get_scale() >= 2.0**-126
        if it["round_trip"] == "own":
            ours.reload(ours.scaler.state_dict())
            theirs.reload(theirs.scaler.state_dict())
        elif it["round_trip"] == "torch_into_lossscale":
            ours.reload(theirs.scaler.state_dict())
        elif it["round_trip"] == "lossscale_into_torch":
            theirs.reload({k: v for k, v in ours.scaler.state_dict().items() if k != "policy_state"})
        check_twins(ours, theirs, f"iteration {i}: after the round trip {it['round_trip']}")
