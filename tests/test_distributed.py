"""Every rank takes the same decision: real gloo processes (loopback), DDP, FSDP2, accumulation, checkpoints, and the
docs' example under torchrun; lossscale.ops.distributed in one process.

The multi-process tests run scenarios of ``tests/_dist_workers.py`` on two gloo ranks (started once for the module)
and compare what the ranks return. The docs' example starts under torchrun with the module, in the background, and
is checked by the last of them.
"""

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _dist_workers import CKPT_INJECT, DDP_SKIPPED, FAULT_STEP, FSDP_INJECT_STEP, SCALER_INJECT, RankPool
from _torch_versions import needs_torch
from lossscale import stages, testing
from lossscale.ops import distributed as ld

# FSDP2 (fully_shard) on CPU processes with gloo: torch 2.6 has no Stream.record_event on the CPU stream FSDP2 uses,
# and under torch 2.7.1 and 2.8.0 the gradients came out twice the one-process reference (summed, not averaged, over
# the two ranks). 2.9.1, 2.10.0 and 2.13.0 pass (2026-11-28).
FSDP2_ON_CPU = needs_torch((2, 9), "FSDP2 on CPU with gloo averages the sharded gradients")

DOCS = Path(__file__).resolve().parents[1] / "docs" / "distributed.md"
DOCS_TEST = "test_docs_example_runs_under_torchrun"


@pytest.fixture(scope="module")
def ranks():
    pool = RankPool(world_size=2)
    try:
        yield pool
    finally:
        pool.close()


def example_script() -> str:
    text = DOCS.read_text()
    match = re.search(r"<!-- example: train_ddp\.py -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"{DOCS} has no python block after '<!-- example: train_ddp.py -->'"
    return match.group(1)


@pytest.fixture(scope="module", autouse=True)
def torchrun_example(request, tmp_path_factory):
    """The docs' example under ``torchrun --standalone --nproc_per_node=2``, started when the module starts (when
    its test is selected) so that its three processes import torch while the other tests run; killed if unread."""
    if not any(
        item.name == DOCS_TEST and getattr(item, "module", None) is request.module for item in request.session.items
    ):
        yield None
        return
    where = tmp_path_factory.mktemp("torchrun")
    script = where / "train_ddp.py"
    script.write_text(example_script())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    # its own session: the launcher and its two workers can be stopped together
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=where, start_new_session=True
    )
    try:
        yield cmd, proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> tuple[str, str]:
    """The launcher's output; if it still runs, its process group is terminated first (the launcher stops its
    workers), then killed."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate()


def same_everywhere(results, key):
    values = [r[key] for r in results]
    if isinstance(values[0], torch.Tensor):
        assert all(torch.equal(values[0], v) for v in values[1:]), f"{key} differs across ranks"
    else:
        assert all(v == values[0] for v in values[1:]), f"{key} differs across ranks: {values}"
    return values[0]


# --- multi-process ---------------------------------------------------------------------------------


@pytest.mark.distributed
def test_helpers_on_two_ranks(ranks):
    results = ranks.run("helpers")
    for rank, out in enumerate(results):
        assert out["init_again"] == (rank, 2)
        assert out["main"] is (rank == 0)
        assert out["active"] is True
        assert out["found"] == [1.0, 0.0, 1.0]  # local counts (0, 2), (0, 0), (3, 1): a 0/1 flag everywhere
        assert out["found_alone"] == [1.0, 0.0][rank]  # a one-rank group: clamped, not reduced
        assert out["found_and_fault"] == [1.0, 1.0]  # each agreed over the ranks in one reduction
        assert out["amax"] == 5.0 and out["amax_alone"] == [3.0, 5.0][rank]
        assert out["reduced_len"] == 3
        a, b, c = out["sums"]
        assert a == [[3.0] * 3] * 2
        assert b == (torch.arange(6, dtype=torch.float64).reshape(2, 3).t() * 3).tolist()
        assert c == [3.0]
        assert out["average"] == [1.5]


@pytest.mark.distributed
@pytest.mark.parametrize("opt_name,unscale_first", [("fused_adamw", False), ("fused_adamw", True), ("sgd", False)])
def test_scaler_without_ddp_skips_on_every_rank_when_one_overflows(ranks, opt_name, unscale_first):
    results = ranks.run("scaler_plain", opt_name, unscale_first)
    stepped = same_everywhere(results, "stepped")
    scales = same_everywhere(results, "scales")
    same_everywhere(results, "params")
    assert stepped == [s not in SCALER_INJECT for s in range(8)]
    assert scales == [1024.0, 1024.0, 512.0, 512.0, 512.0, 256.0, 128.0, 128.0]
    for out in results:
        assert out["all_reduces"] == [1] * 8  # one small all-reduce per step
        # no host read with a fused optimizer; the non-fused step pays torch's one read of found_inf
        assert out["host_reads"] == [0 if opt_name.startswith("fused") else 1] * 8


DDP_CASES = [
    ("fused_adamw", "auto", "norm"),
    ("sgd", "host", None),
    ("adam", "masked", "value"),
    ("adamw", "host", "per_param"),
]


@pytest.mark.distributed
@pytest.mark.parametrize("opt_name,skip_mode,clip", DDP_CASES)
def test_ddp_ranks_stay_bit_identical_through_rank_local_overflows(ranks, opt_name, skip_mode, clip):
    results = ranks.run("lso_ddp", opt_name, skip_mode, clip, True)
    stepped = same_everywhere(results, "stepped")
    scales = same_everywhere(results, "scales")
    same_everywhere(results, "params")
    assert stepped == [s not in DDP_SKIPPED for s in range(20)]
    assert len(set(scales)) > 2  # grew and backed off
    for out in results:
        assert out["all_reduces"] == [1] * 20
        if out["skip_mode"] == "fused":
            assert out["host_reads"] == [0] * 20


@pytest.mark.distributed
def test_ddp_with_flat_gradients_writes_into_the_buffer_and_takes_the_same_steps(ranks):
    per_tensor = ranks.run("lso_ddp", "fused_adamw", "auto", "norm", True)
    flat = ranks.run("lso_ddp", "fused_adamw", "auto", "norm", True, True)
    assert same_everywhere(flat, "stepped") == same_everywhere(per_tensor, "stepped")
    assert same_everywhere(flat, "scales") == same_everywhere(per_tensor, "scales")
    torch.testing.assert_close(same_everywhere(flat, "params"), per_tensor[0]["params"], rtol=1e-5, atol=1e-7)
    assert all(out["attached"] == [True] * 20 for out in flat)  # DDP copied the reduced gradients in place


@pytest.mark.distributed
def test_ddp_control_without_the_reduction_the_replicas_fork(ranks):
    # found_inf reduced over a one-rank group: each rank decides alone, and the replicas diverge.
    results = ranks.run("lso_ddp", "fused_adamw", "auto", "norm", False)
    assert results[0]["stepped"] != results[1]["stepped"]
    assert not torch.equal(results[0]["params"], results[1]["params"])
    assert results[0]["all_reduces"] == [0] * 20


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["ddp", pytest.param("fsdp2", marks=FSDP2_ON_CPU)])
def test_per_layer_scales_set_the_same_factors_on_every_rank(ranks, kind):
    """Each rank's first backward pass sees only its own data; its factors are agreed (one MAX per group of units)
    so that DDP and FSDP2 average gradients that carry the same factors. Without it the ranks set different factors
    in the first backward pass, kept different ones after it, and under DDP their parameters forked at the first
    step. Under FSDP2 the gradients are shards (DTensors): each rank unscales its own (before, a DTensor error)."""
    first, second = ranks.run("layerwise", kind)
    assert first["exponents"] == second["exponents"]
    assert first["exponents"][0][0] >= 24  # the first block's factor, from the first backward pass
    assert torch.equal(first["params"], second["params"])
    assert all(first["stepped"]) and max(first["errors"]) < 0.02, first["errors"]


def test_per_layer_scales_refuse_ranks_that_ran_different_units_in_the_first_step(ranks):
    for result in ranks.run("layerwise_uneven"):
        assert result["error"] is not None and re.search(
            r"the ranks ran different units \(1 ran on some ranks only: 'extra'\).*mixture-of-experts layer\) one "
            r"unit",
            result["error"],
        ), result["error"]


def test_accumulation_on_two_ranks_equals_one_process_on_the_concatenated_batch(ranks):
    results = ranks.run("accumulation")
    same_everywhere(results, "params")
    for out in results:
        assert out["stepped"] == out["ref_stepped"] == [b != 2 for b in range(6)]
        assert out["scales"] == out["ref_scales"]
        assert out["micro_all_reduces"] == [0] * 6  # nothing is reduced inside a window
        assert out["boundary_all_reduces"] == [1] * 6
        finite = [(n, r) for n, r in zip(out["norms"], out["ref_norms"]) if math.isfinite(r)]
        assert max(r for _, r in finite) > 0.3  # clipping engaged
        for n, r in finite:
            assert n == pytest.approx(r, rel=1e-5)
        torch.testing.assert_close(out["params"], out["ref_params"], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
@FSDP2_ON_CPU
@pytest.mark.parametrize(
    "kind", ["lso_fused", "lso_host", "lso_saturation", "lso_per_param", "lso_masked", "scaler_fused"]
)
def test_fsdp2_every_rank_skips_and_clips_by_the_global_norm(ranks, kind):
    results = ranks.run("fsdp2", kind)
    same_everywhere(results, "params")
    for rank, out in enumerate(results):
        assert out["dtensor_grads"] is True
        assert out["local_rows"] == [[8, 8, 2, 2], [8, 8, 1, 1]][rank]  # shards, uneven in the last layer
        assert out["stepped"] == out["ref_stepped"] == [s != FSDP_INJECT_STEP for s in range(6)]
        assert out["overflowing"] == [[], ["0.weight"]][rank]
        if kind in ("lso_fused", "lso_saturation"):
            assert out["skip_mode"] == "fused"
            assert out["host_reads"] == [0] * 6
        if kind != "lso_per_param":
            finite = [(n, r) for n, r in zip(out["norms"], out["ref_norms"]) if math.isfinite(r)]
            assert len(finite) >= 5 and max(r for _, r in finite) > 0.3  # clipping engaged
            for n, r in finite:
                assert n == pytest.approx(r, rel=1e-5)  # a rank's own shard would give about 1/sqrt(2) of it
        torch.testing.assert_close(out["params"], out["ref_params"], rtol=1e-5, atol=1e-6)
    local = [sum(out["local_sq_norms"]) for out in results]
    assert all(v > 0 for v in local)


@pytest.mark.distributed
@pytest.mark.parametrize("kind, opt_name", [("lso", "fused_adamw"), ("lso", "sgd"), ("scaler", "fused_adamw")])
def test_a_forward_fault_on_one_rank_skips_the_step_on_both_and_moves_neither_policy(ranks, kind, opt_name):
    """Only rank 1's loss is non-finite (its gradients finite): the verdict is agreed with found_inf, every rank skips
    that step, and no rank's policy state moves there."""
    results = ranks.run("forward_fault", kind, opt_name)
    same_everywhere(results, "params")
    step = FAULT_STEP
    for out in results:
        assert out["stepped"] == [s != step for s in range(6)]
        assert out["fault"] == [s == step for s in range(6)]
        assert not any(out["found_inf"])  # found_inf keeps meaning a gradient overflow
        assert out["states"][step] == out["states"][step - 1]  # the policy did not see the step
        assert out["states"][step + 1] != out["states"][step]  # and sees the next one
    assert results[0]["states"] == results[1]["states"]


@pytest.mark.distributed
def test_healing_keeps_the_union_of_the_ranks_faulting_modules_on_every_rank_at_the_same_step(ranks):
    """Rank 0's `a` and rank 1's `b` overflow from step 3: both ranks trace at the same step (the trigger is acted on
    one step after it fires, on every rank), keep {a, b}, keep the scale, and step on in lockstep."""
    results = ranks.run("heal_union")  # the ranks' parameters differ by their planted weights
    for rank, out in enumerate(results):
        assert out["healed"] == {"a": "torch.float32", "b": "torch.float32"}
        assert out["heals"] == [f"rank {rank}: healed at step 6: 'a', 'b' now run in float32, outputs in float32"]
        assert out["stepped"] == [not 3 <= s <= 6 for s in range(12)]
        assert set(out["scale"]) == {2.0**10}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["lso", "scaler"])
def test_checkpoint_saved_on_rank0_and_loaded_everywhere_resumes_the_same_trajectory(ranks, kind, tmp_path):
    results = ranks.run("checkpoint", kind, str(tmp_path / "ckpt.pt"))
    same_everywhere(results, "resumed_params")
    straight = same_everywhere(results, "straight")
    for out in results:
        assert out["policy_states_agree"] is True
        assert out["resumed"] == out["straight"]
        assert torch.equal(out["resumed_params"], out["straight_params"])
    assert straight[5] > straight[4]  # grew right after the resume: the growth tracker was restored
    assert straight[max(CKPT_INJECT)] < straight[max(CKPT_INJECT) - 1]  # an overflow after the resume backed off


@pytest.mark.distributed
def test_docs_example_runs_under_torchrun(torchrun_example):
    cmd, proc = torchrun_example
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        out, err = stop(proc)
        pytest.fail(f"{' '.join(cmd)} gave no answer within 180 s:\n{out}\n{err}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{out}\n{err}"
    lines = [ln for ln in out.splitlines() if ln.startswith("loss ")]
    assert len(lines) == 1, out  # printed by rank 0 only


# --- one process -----------------------------------------------------------------------------------


def test_outside_torch_distributed_the_helpers_are_local():
    assert not dist.is_initialized()
    assert ld.active() is False
    assert testing.is_main_process() is True
    found = torch.tensor(3.0)
    assert stages.agree_(found, is_flag=False) == (found, None) and float(found) == 1.0  # still a 0/1 flag
    fault = torch.tensor(1.0)
    agreed = stages.agree_(torch.tensor(0.0), fault)
    assert agreed[1] is fault and float(agreed[0]) == 0.0
    g = torch.ones(3)
    assert ld.all_reduce_grads_([None, g]) == [g] and torch.equal(g, torch.ones(3))
    assert ld.local_shard(g) is g and ld.is_shard(g) is False


def test_all_reduce_grads_refuses_sparse_gradients():
    sparse = torch.eye(2).to_sparse()
    with pytest.raises(TypeError, match=r"all_reduce_grads_\(grads=\[\.\.\., sparse of shape \(2, 2\).*dense plain"):
        ld.all_reduce_grads_([torch.ones(2), sparse])


def test_init_from_env_alone_is_a_single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert testing.init_from_env() == (0, 1)
    assert not dist.is_initialized()
    testing.shutdown()  # nothing to destroy: a no-op


def test_init_from_env_names_the_missing_torchrun_variables(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match=r"init_from_env\(backend='gloo'\).*MASTER_ADDR, MASTER_PORT are missing"):
        testing.init_from_env()
    assert not dist.is_initialized()
