"""Trajectories recorded from the real frameworks (tests/golden/*.json), replayed against presets and facades.

Every recorded case of every file present is replayed against its peer's preset in full, and the
facades replay the cases too (the optimizer-level ones on a subset, for time). A peer breaks where its
scale leaves the normal float32 range: float32 inf (Keras 3, MindSpore's cell, Megatron), past float32 max
in Python floats (nnabla, DeepSpeed, MindSpore's manager), subnormals and 0 (Keras 3, nnabla). Ours
matches every step before that and stays finite, positive and normal after it (the presets' docstrings).

The full replay of a preset checks every transition at once: a pure-Python oracle of ``DynamicScale``
proposes the hidden counters for each step, and one batched ``policy.update`` must map each recorded
state to the next one exactly. The states chain from ``policy.init()``, so this equals a sequential run
(``update`` is element-wise); a sequential run of each file's first cases checks that too.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
from pathlib import Path

import pytest
import torch

from lossscale import presets
from lossscale.policies.base import ScaleState
from lossscale.validation import FLOAT32_MAX, SMALLEST_NORMAL_FLOAT32
from oracles import DynamicOracle, f32

GOLDEN_DIR = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN_DIR))
import golden_data  # noqa: E402

#: The preset each recorded peer is replayed against.
PRESET_OF = {
    "keras": "keras",
    "tf_keras2": "tf_keras2",
    "tf_v1": "tf_v1",
    "mindspore": "mindspore",
    "nnabla": "nnabla",
    "tf1_contrib": "ascend",
    "deepspeed": "deepspeed",
    "megatron": "megatron",
    "paddle": "paddle",
}
#: Recorder config keys that are the preset's argument under another name, and keys that are not arguments.
CONFIG_ALIASES = {"loss_scale_value": "init_loss_scale"}
NOT_ARGUMENTS = {"inner"}
#: Peers whose scale is a Python float: exact where every recorded value is a float32, else within rounding.
FLOAT64_PEERS = {"nnabla", "deepspeed", "mindspore.manager"}
#: Steps of each case the sequential and facade replays run.
FACADE_STEPS = 120

DOCS = {peer: golden_data.load(peer) for peer in golden_data.peers()}


def _params(key: str = "cases", peers=None):
    return [
        pytest.param(peer, case, id=f"{peer}/{case['name']}")
        for peer, doc in DOCS.items()
        if peers is None or peer in peers
        for case in doc.get(key, [])
    ]


def preset_for(peer: str, config: dict):
    """The peer's preset built from a recorded config (the recorder's argument names)."""
    build = presets.PRESETS[PRESET_OF[peer]]
    names = inspect.signature(build).parameters
    args = {}
    for key, value in config.items():
        name = CONFIG_ALIASES.get(key, key)
        if name in names:
            args[name] = value
        else:
            assert key in NOT_ARGUMENTS, f"{peer}: config key {key!r} is not an argument of presets.{build.__name__}"
    return build(**args)


def in_range(x: float) -> bool:
    return math.isfinite(x) and SMALLEST_NORMAL_FLOAT32 <= x <= FLOAT32_MAX


def compare(peer: str, case: dict, before: list, after: list, steps: int | None = None) -> int:
    """Assert our ``before``/``after`` scales equal the recording up to the peer's breakdown; ours stay in range.

    Returns how many steps were compared."""
    n = len(after) if steps is None else steps
    rec_b, rec_a, flags = case["scale_before"][:n], case["scale_after"][:n], case["overflow"][:n]
    limit = next((i for i in range(n) if not (in_range(rec_b[i]) and in_range(rec_a[i]))), n)
    exact = peer not in FLOAT64_PEERS or all(f32(x) == x for x in rec_a[:limit])
    for i in range(limit):
        where = f"{peer}/{case['name']} step {i} (overflow={flags[i]})"
        if exact:
            assert (before[i], after[i]) == (rec_b[i], rec_a[i]), where
        else:  # float64 peer, factor not a power of two: same decisions, values within float32 rounding
            assert after[i] == pytest.approx(rec_a[i], rel=1e-5), where
            assert (after[i] > before[i]) == (rec_a[i] > rec_b[i]), where
            assert (after[i] < before[i]) == (rec_a[i] < rec_b[i]), where
    assert limit > 0, f"{peer}/{case['name']}: the recording breaks at its first step; nothing to compare"
    assert all(in_range(x) for x in before[:n] + after[:n]), f"{peer}/{case['name']}: our scale left the range"
    return limit


def oracle_chain(policy, overflow: list[bool]) -> tuple[ScaleState, ScaleState]:
    """The oracle's state before and after each step, as batched ``ScaleState`` records."""
    oracle = DynamicOracle(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})
    rows = []
    for o in overflow:
        rows.append((oracle.scale, oracle.tracker, oracle.left, oracle.floor_hits))
        oracle.step(o)
    rows.append((oracle.scale, oracle.tracker, oracle.left, oracle.floor_hits))
    cols = list(zip(*rows))
    full = ScaleState(
        torch.tensor(cols[0], dtype=torch.float32), *(torch.tensor(c, dtype=torch.int32) for c in cols[1:])
    )
    return (
        ScaleState(*(getattr(full, f.name)[:-1] for f in dataclasses.fields(full))),
        ScaleState(*(getattr(full, f.name)[1:] for f in dataclasses.fields(full))),
    )


def replay_batched(policy, overflow: list[bool]) -> tuple[list, list, list]:
    """Our scales before/after every step and the steps whose floor check raises, all transitions at once."""
    start, proposed = oracle_chain(policy, overflow)
    init = policy.init()
    for f in dataclasses.fields(init):
        assert getattr(init, f.name).item() == getattr(start, f.name)[0].item(), f"init {f.name}"
    ours = policy.update(start, torch.tensor(overflow))
    for f in dataclasses.fields(ours):
        got, want = getattr(ours, f.name), getattr(proposed, f.name)
        assert got.dtype == want.dtype and torch.equal(got, want), (
            f"{f.name} differs from the chained state at step {int((got != want).nonzero()[0])}"
        )
    raised = (ours.floor_hits > start.floor_hits).tolist()
    return start.scale.tolist(), ours.scale.tolist(), raised


def test_every_recorded_peer_has_a_preset():
    assert DOCS, "no golden files in tests/golden"
    for peer in DOCS:
        assert peer in PRESET_OF, f"tests/golden/{peer}.json has no preset to replay against; add it to PRESET_OF"


@pytest.mark.parametrize("peer,case", _params())
def test_preset_replays_recorded_trajectory(peer, case):
    policy = preset_for(peer, case["config"])
    before, after, raised = replay_batched(policy, case["overflow"])
    compare(peer, case, before, after)
    if "raised" in case:  # the peer raised at its floor exactly where our floor check raises
        assert raised == case["raised"]
    elif getattr(policy, "at_floor", "skip") == "raise":
        assert not any(raised)


@pytest.mark.parametrize("peer", sorted(DOCS))
def test_preset_sequential_replay(peer):
    """The plain 0-d path on the first case of each file (no batching, no oracle)."""
    case = DOCS[peer]["cases"][0]
    policy = preset_for(peer, case["config"])
    state = policy.init()
    before, after = [], []
    for o in case["overflow"][:FACADE_STEPS]:
        before.append(float(state.scale))
        state = policy.update(state, torch.tensor(o))
        after.append(float(state.scale))
    compare(peer, case, before, after)


# --- facades ----------------------------------------------------------------------------------


def _linear(x_value: float):
    """A one-weight model whose scaled gradient is ``scale * x``: x = inf injects an overflow."""
    w = torch.nn.Parameter(torch.ones(1))
    x = torch.ones(1)

    def loss(value: float | None = None):
        if value is not None:
            x.fill_(value)
        return (w * x).sum()

    return w, x, loss


def drive_npu_optimizer(case, steps):
    from lossscale.compat.ascend import ExponentialUpdateLossScaleManager, NPULossScaleOptimizer

    w, _, loss = _linear(1.0)
    opt = NPULossScaleOptimizer(torch.optim.SGD([w], lr=1e-3), ExponentialUpdateLossScaleManager(**case["config"]))
    before, after = [], []
    for o in case["overflow"][:steps]:
        opt.zero_grad()
        opt.backward(loss(math.inf if o else 1.0))
        result = opt.step()
        assert bool(result.stepped) == (not o)
        before.append(float(result.scale))
        after.append(float(opt.get_loss_scale()))
    return before, after


def drive_mindspore_cell(case, steps):
    from lossscale.compat.mindspore import DynamicLossScaleUpdateCell

    cell = DynamicLossScaleUpdateCell(**case["config"])
    scale = torch.tensor(float(case["config"]["loss_scale_value"]))
    before, after = [], []
    for o in case["overflow"][:steps]:
        before.append(float(scale))
        flag = torch.tensor(o)
        assert cell(scale, flag) is flag
        after.append(float(scale))
    return before, after


def drive_train_one_step(case, steps):
    from lossscale.compat.mindspore import DynamicLossScaleUpdateCell, TrainOneStepWithLossScaleCell

    w, x, _ = _linear(1.0)
    train = TrainOneStepWithLossScaleCell(
        lambda x: (w * x).sum(), torch.optim.SGD([w], lr=1e-3), DynamicLossScaleUpdateCell(**case["config"])
    )
    before, after = [], []
    for o in case["overflow"][:steps]:
        _loss, overflow, used = train(x.fill_(math.inf if o else 1.0))
        assert bool(overflow) == o
        before.append(float(used))
        after.append(float(train.scale_sense))
    return before, after


def drive_keras(case, steps):
    from lossscale.compat.keras import LossScaleOptimizer

    w = torch.nn.Parameter(torch.zeros(1))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=1.0), **case["config"])
    before, after = [], []
    for o in case["overflow"][:steps]:
        s = float(opt.dynamic_scale)
        before.append(s)
        w0 = w.detach().clone()
        opt.apply([torch.full((1,), math.inf if o else s)])  # a scaled gradient that unscales to 1
        assert torch.equal(w.detach(), w0) == o
        after.append(float(opt.dynamic_scale))
    return before, after


#: peer -> (driver, {case name: steps to run, None for all}); a name missing from the recording fails.
FACADES = {
    "tf1_contrib": [
        (drive_npu_optimizer, {"bursts-w3_n3": None, "random_p0.5-w2_r3_half": None, "cap-init2p120_w2": 60})
    ],
    "mindspore": [
        (
            drive_mindspore_cell,
            dict.fromkeys(
                (
                    "bursts-w1",
                    "bursts-w2",
                    "bursts-w3",
                    "bursts-w5",
                    "bursts-w3_f3",
                    "random_p0.5-default",
                    "random_p0.5-w3_f3",
                    "cap-init2p120_w2",
                    "after_inf_recover-init2p120_w2",
                ),
                FACADE_STEPS,
            )
            | {"all_overflow-default": None},
        ),
        (drive_train_one_step, {"bursts-w2": None, "random_p0.5-w3_f3": FACADE_STEPS, "cap-init2p120_w2": 60}),
    ],
    "keras": [
        (
            drive_keras,
            {
                "bursts-w3": None,
                "random_p0.5-w1": FACADE_STEPS,
                "all_overflow-default": 160,
                "cap-init2p120_w2": 60,
                "after_inf_recover-init2p120_w2": None,
            },
        )
    ],
}


def _facade_params():
    out = []
    for peer, drivers in FACADES.items():
        if peer not in DOCS:
            continue
        cases = {c["name"]: c for c in DOCS[peer]["cases"]}
        for driver, chosen in drivers:
            for name, steps in chosen.items():
                assert name in cases, f"tests/golden/{peer}.json has no case {name!r} for {driver.__name__}"
                out.append(pytest.param(driver, peer, cases[name], steps, id=f"{driver.__name__[6:]}-{peer}/{name}"))
    return out


@pytest.mark.parametrize("driver,peer,case,steps", _facade_params())
def test_facade_replays_recorded_trajectory(driver, peer, case, steps):
    before, after = driver(case, steps or len(case["overflow"]))
    compare(peer, case, before, after)


@pytest.mark.parametrize("peer,case", _params(peers={"tf1_contrib"}))
def test_ascend_manager_replays_every_recorded_case(peer, case):
    """Every transition through the manager's own API: a batched state loaded with ``load_state_dict``, one
    ``update_loss_scale(finite_grads)`` over all steps, the next states read back with ``state_dict``."""
    from lossscale.compat.ascend import ExponentialUpdateLossScaleManager

    manager = ExponentialUpdateLossScaleManager(**case["config"])
    start, proposed = oracle_chain(manager.policy, case["overflow"])
    as_lists = lambda s: {f.name: getattr(s, f.name).tolist() for f in dataclasses.fields(s)}  # noqa: E731
    assert manager.state_dict()["policy_state"] == {k: v[0] for k, v in as_lists(start).items()}
    manager.load_state_dict({"policy_state": as_lists(start)})
    manager.update_loss_scale(torch.tensor([not o for o in case["overflow"]]))
    assert manager.state_dict()["policy_state"] == as_lists(proposed)
    compare(peer, case, start.scale.tolist(), manager.get_loss_scale().tolist())


@pytest.mark.parametrize("peer,case", _params("manager_cases", {"mindspore"}))
def test_mindspore_manager_replays_recorded_trajectory(peer, case):
    """MindSpore's host-side manager, with its RuntimeError after 1000 overflows in a row."""
    from lossscale.compat.mindspore import DynamicLossScaleManager

    m = DynamicLossScaleManager(**case["config"])
    steps = len(case["overflow"]) if "raised" in case else 60
    before, after, raised = [], [], []
    for o in case["overflow"][:steps]:
        before.append(m.get_loss_scale())
        try:
            m.update_loss_scale(o)
            raised.append(False)
        except RuntimeError as err:
            assert "1000" in str(err)
            raised.append(True)
        after.append(m.get_loss_scale())
    compare("mindspore.manager", case, before, after, steps)
    assert raised == case.get("raised", [False] * len(case["overflow"]))[:steps]


@pytest.mark.parametrize(
    "peer,case",
    [
        p
        for p in _params(peers={"nnabla"})
        if p.values[1]["name"] in ("bursts-N1", "random_p0.5-N3_f3", "cap-init2p120_N2", "retry_limit-N3")
    ],
)
def test_nnabla_updater_replays_recorded_attempts(peer, case):
    """One ``update()`` call re-runs until a clean attempt (at most 101 attempts), as recorded per attempt."""
    from lossscale.compat.nnabla import DynamicLossScalingUpdater

    flags = case["overflow"]
    steps = len(flags) if case["name"].startswith("retry") else FACADE_STEPS
    w, x, loss = _linear(1.0)
    pos, call, before, calls = [0], [-1], [], []

    def feeder():
        o = pos[0] < len(flags) and flags[pos[0]]
        pos[0] += 1
        x.fill_(math.inf if o else 1.0)
        before.append(updater.scale)
        calls.append(call[0])

    updater = DynamicLossScalingUpdater(torch.optim.SGD([w], lr=1e-3), loss, data_feeder=feeder, **case["config"])
    while pos[0] < steps:
        call[0] += 1
        updater.update()
    n = min(steps, len(before))
    after = before[1:] + [updater.scale]
    assert calls[:n] == case["update_calls"][:n]
    compare(peer, case, before, after, n)
