"""Real gloo ranks for tests/test_distributed.py: a pool of rank processes that run named scenarios.

Importing torch costs seconds per process, so the ranks are started once per test module (forked
from a fork server that imported torch once, not from the pytest process) and run one scenario per
test. A scenario is a function ``(rank, world_size, *args) -> picklable`` run on every rank at once;
the parent compares what the ranks return. A rank that raises sends its traceback; the parent fails
the test with it and closes the pool (the other rank may be stuck in a collective), which the next
test starts again. The ranks join with ``lossscale.testing.init_from_env`` on torchrun's
variables (loopback only), turn warnings into errors as pytest does in the parent, and always destroy
their process group before they exit; ``close`` joins every rank (killing one that does not exit).
"""

from __future__ import annotations

import contextlib
import copy
import os
import queue
import socket
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

INF = float("inf")
NAN = float("nan")


# --- the pool (parent side) ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torch._dynamo: HostReadCounter's first use imports it (about 3 s).
PRELOAD = ["_dist_workers", "lossscale", "torch._dynamo", "torch.distributed.fsdp", "torch.nn.parallel"]


class RankPool:
    """``world_size`` gloo ranks; ``run(name, *args)`` returns each rank's result, in rank order."""

    def __init__(self, world_size: int = 2, timeout_s: float = 90.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._procs: list[Any] = []

    def _start(self) -> None:
        # A fork server imports torch (and what the scenarios import) once; the ranks fork from it:
        # one import instead of one per rank, and no state inherited from the pytest process.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        port = free_port()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(r, self.world_size, port, self._tasks[r], self._results),
                daemon=True,
                name=f"gloo-rank-{r}",
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, scenario: str, *args: Any) -> list[Any]:
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for q in self._tasks:
            q.put((scenario, args))
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(answers) < self.world_size:
            try:
                rank, ok, payload = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [
                    f"rank {r} (exit code {p.exitcode})"
                    for r, p in enumerate(self._procs)
                    if not p.is_alive() and r not in answers
                ]
                late = time.monotonic() > deadline
                if dead or late:
                    self.close()
                    why = f"died: {', '.join(dead)}" if dead else f"gave no answer within {self.timeout_s:.0f}s"
                    raise AssertionError(f"scenario {scenario}{args!r}: {why}") from None
                continue
            if not ok:
                self.close()
                raise AssertionError(f"scenario {scenario}{args!r} failed on rank {rank}:\n{payload}")
            answers[rank] = payload
        return [answers[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Tell every rank to stop, join it (a rank stuck in a collective is killed), close the queues."""
        procs, self._procs = self._procs, []
        if not procs:
            return
        for p, q in zip(procs, self._tasks):
            if p.is_alive():
                q.put(None)
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for q in [*self._tasks, self._results]:
            q.close()
            q.join_thread()


def _serve(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    """A rank's loop: join the group as torchrun would have it, then run scenarios until told to stop."""
    warnings.simplefilter("error")  # as pyproject's filterwarnings = ["error"] in the parent
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    try:
        try:
            from lossscale.testing import init_from_env

            joined = init_from_env("gloo", timeout_s=30.0)
            if joined != (rank, world_size):
                raise AssertionError(f"init_from_env() returned {joined}, expected {(rank, world_size)}")
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
            return
        while True:
            task = tasks.get()
            if task is None:
                break
            name, args = task
            try:
                results.put((rank, True, SCENARIOS[name](rank, world_size, *args)))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()  # every group, the ranks' own ones included


# --- shared pieces (rank side) ------------------------------------------------------------------


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(step: int, rows: slice | None = None, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step (the same on every rank); ``rows`` picks a rank's part."""
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(size, 6, generator=gen), torch.randn(size, 3, generator=gen)
    return (x, y) if rows is None else (x[rows], y[rows])


def rows_of(rank: int, world_size: int, size: int = 8) -> slice:
    part = size // world_size
    return slice(rank * part, (rank + 1) * part)


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def flat(module: torch.nn.Module) -> torch.Tensor:
    """Every parameter in one vector (the full tensors of DTensors: a collective under FSDP2)."""
    parts = []
    for p in module.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(full.detach().reshape(-1).clone())
    return torch.cat(parts)


@contextlib.contextmanager
def count_all_reduces():
    """Count ``torch.distributed.all_reduce`` calls (lossscale's; DDP and FSDP2 reduce in C++/other ops)."""
    calls = [0]
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = original


def own_group(rank: int, world_size: int) -> Any:
    """A group holding only this rank (every rank must create every group, in the same order)."""
    groups = [dist.new_group([r]) for r in range(world_size)]
    return groups[rank]


def gathered(obj: Any, world_size: int) -> list[Any]:
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


OPTIMIZERS = {
    "fused_adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "fused_sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
}


# --- scenarios ------------------------------------------------------------------------------------

# Rank-local overflows written into the gradients AFTER the gradient all-reduce: only the found_inf
# reduction can make the other rank skip too. Step 6 overflows on both ranks (found_inf 1 + 1).
SCALER_INJECT = {2: {1: INF}, 5: {1: NAN}, 6: {0: INF, 1: INF}}


def helpers(rank: int, world_size: int) -> dict:
    """The lossscale.ops.distributed and lossscale.testing helpers, and the stages that agree across ranks, on real
    ranks."""
    from lossscale import stages, testing
    from lossscale.ops import distributed as ld

    out: dict[str, Any] = {
        "init_again": testing.init_from_env(),
        "main": testing.is_main_process(),
        "active": ld.active(),
    }
    # agree_: a 0/1 flag on every rank, whatever the local counts.
    out["found"] = [
        float(stages.agree_(torch.tensor(v), is_flag=False)[0])
        for v in ([0.0, 2.0][rank], [0.0, 0.0][rank], [3.0, 1.0][rank])
    ]
    # with a forward fault: both agreed in one reduction
    found, fault = stages.agree_(torch.tensor([0.0, 1.0][rank]), torch.tensor([1.0, 0.0][rank]))
    out["found_and_fault"] = [float(found), None if fault is None else float(fault)]
    alone = own_group(rank, world_size)
    out["found_alone"] = float(stages.agree_(torch.tensor([2.0, 0.0][rank]), None, alone, is_flag=False)[0])
    out["amax"] = float(stages.agree_amax_(torch.tensor([3.0, 5.0][rank])))
    out["amax_alone"] = float(stages.agree_amax_(torch.tensor([3.0, 5.0][rank]), alone))
    # all_reduce_grads_: mixed dtypes, a non-contiguous tensor and a None entry.
    a = torch.full((2, 3), float(rank + 1))
    b = torch.arange(6, dtype=torch.float64).reshape(2, 3).t() * (rank + 1)
    c = torch.tensor([rank + 1.0])
    reduced = ld.all_reduce_grads_([a, None, b, c])
    out["reduced_len"] = len(reduced)
    out["sums"] = [a.tolist(), b.tolist(), c.tolist()]
    d = torch.tensor([rank + 1.0])
    ld.all_reduce_grads_([d], average=True)
    out["average"] = d.tolist()
    return out


def scaler_plain(rank: int, world_size: int, opt_name: str, unscale_first: bool) -> dict:
    """Plain data parallel without DDP: gradients averaged by all_reduce_grads_, then GradScaler."""
    from lossscale import DynamicScale, GradScaler
    from lossscale.ops.distributed import all_reduce_grads_
    from lossscale.testing import HostReadCounter

    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    scaler = GradScaler("cpu", policy=DynamicScale(init_scale=2.0**10, growth_interval=1000))
    stepped, scales, reads, reduces = [], [], [], []
    for step in range(8):
        opt.zero_grad(set_to_none=True)
        x, y = batch(step, rows_of(rank, world_size))
        scaler.scale(loss_fn(model, x, y)).backward()
        all_reduce_grads_([p.grad for p in model.parameters()], average=True)
        if rank in SCALER_INJECT.get(step, {}):
            model[2].weight.grad[1, 2] = SCALER_INJECT[step][rank]
        before = flat(model)
        with HostReadCounter() as counter, count_all_reduces() as calls:
            if unscale_first:
                scaler.unscale_(opt)
            decision = scaler.step(opt)
            scaler.update()
        stepped.append(bool(decision.stepped))
        scales.append(scaler.get_scale())
        reads.append(counter.count)
        reduces.append(calls[0])
        if not stepped[-1] and not torch.equal(flat(model), before):
            raise AssertionError(f"step {step}: skipped, yet the parameters changed")
    return {"stepped": stepped, "scales": scales, "host_reads": reads, "all_reduces": reduces, "params": flat(model)}


# DDP runs: (rank, value) written into a gradient after backward (DDP has averaged it already), and
# steps whose input is poisoned on one rank before backward (DDP spreads it: both ranks overflow).
DDP_AFTER = {3: (1, INF), 4: (1, NAN), 11: (1, INF), 15: (0, INF)}
DDP_INPUT = {8: 1}
DDP_SKIPPED = sorted(set(DDP_AFTER) | set(DDP_INPUT))


def lso_ddp(
    rank: int, world_size: int, opt_name: str, skip_mode: str, clip: str | None, agree: bool, flat_grads: bool = False
) -> dict:
    """DDP + LossScaleOptimizer for 20 steps with rank-local overflows. ``agree=False`` reduces
    found_inf over a one-rank group: the control showing what the reduction prevents. ``flat_grads``: also
    whether the gradients were still views of the buffer after each step (DDP wrote into them in place)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lossscale import DynamicScale, LossScaleOptimizer
    from lossscale.compat.keras import _KerasStep
    from lossscale.testing import HostReadCounter

    model = DDP(make_model())
    inner = OPTIMIZERS[opt_name](model.parameters())
    clips = {None: {}, "norm": {"clip_grad_norm": 0.3}, "value": {"clip_grad_value": 0.05}, "per_param": {}}[clip]
    opt = LossScaleOptimizer(
        _KerasStep(inner, clipnorm=0.2, weight_decay=None) if clip == "per_param" else inner,
        policy=DynamicScale(init_scale=2.0**10, growth_interval=3),
        skip_mode=skip_mode,
        process_group=None if agree else own_group(rank, world_size),
        flat_grads=flat_grads,
        **clips,
    )
    stepped, scales, reduces, reads, attached = [], [], [], [], []
    for step in range(20):
        opt.zero_grad()
        x, y = batch(step, rows_of(rank, world_size))
        if DDP_INPUT.get(step) == rank:
            x[0, 0] = INF
        opt.backward(loss_fn(model, x, y))
        if step in DDP_AFTER and DDP_AFTER[step][0] == rank:
            model.module[0].weight.grad[3, 1] = DDP_AFTER[step][1]
        before = flat(model)
        with HostReadCounter() as counter, count_all_reduces() as calls:
            result = opt.step()
        stepped.append(bool(result.stepped))
        scales.append(float(result.next_scale))
        reduces.append(calls[0])
        reads.append(counter.count)
        if flat_grads:
            attached.append(opt._flat.attached(list(model.parameters())))
        if not stepped[-1] and not torch.equal(flat(model), before):
            raise AssertionError(f"step {step}: skipped, yet the parameters changed")
    return {
        "stepped": stepped,
        "scales": scales,
        "all_reduces": reduces,
        "host_reads": reads,
        "params": flat(model),
        "skip_mode": opt.skip_mode,
        "attached": attached,
    }


def accumulation(rank: int, world_size: int) -> dict:
    """DDP with accumulation_steps=2 (no_sync on the first micro-batch) against one process that
    steps on the concatenated batch; an overflow on one rank after its last backward skips the window."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lossscale import DynamicScale, LossScaleOptimizer

    micro, per = 2, 4
    size = world_size * micro * per
    model, reference = DDP(make_model()), make_model()
    policy = DynamicScale(init_scale=2.0**10, growth_interval=2)
    opt = LossScaleOptimizer(
        OPTIMIZERS["fused_adamw"](model.parameters()), policy=policy, clip_grad_norm=0.3, accumulation_steps=micro
    )
    ref = LossScaleOptimizer(OPTIMIZERS["fused_adamw"](reference.parameters()), policy=policy, clip_grad_norm=0.3)
    out: dict[str, list] = {
        "stepped": [],
        "ref_stepped": [],
        "norms": [],
        "ref_norms": [],
        "scales": [],
        "ref_scales": [],
        "micro_all_reduces": [],
        "boundary_all_reduces": [],
    }
    for boundary in range(6):
        x, y = batch(boundary, size=size)
        opt.zero_grad()
        for m in range(micro):
            rows = slice((m * world_size + rank) * per, (m * world_size + rank + 1) * per)
            with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
                opt.backward(loss_fn(model, x[rows], y[rows]))
            if m == micro - 1 and boundary == 2 and rank == 1:
                model.module[2].weight.grad[0, 0] = INF
            with count_all_reduces() as calls:
                result = opt.step()
            out["micro_all_reduces" if m < micro - 1 else "boundary_all_reduces"].append(calls[0])
        out["stepped"].append(bool(result.stepped))
        out["norms"].append(float(result.grad_norm))
        out["scales"].append(float(result.next_scale))
        ref.zero_grad()
        ref.backward(loss_fn(reference, x, y))
        if boundary == 2:
            reference[2].weight.grad[0, 0] = INF
        ref_result = ref.step()
        out["ref_stepped"].append(bool(ref_result.stepped))
        out["ref_norms"].append(float(ref_result.grad_norm))
        out["ref_scales"].append(float(ref_result.next_scale))
    out["params"], out["ref_params"] = flat(model), flat(reference)
    return out


FSDP_INJECT_STEP = 2


def fsdp2(rank: int, world_size: int, kind: str) -> dict:
    """fully_shard on a small MLP (uneven shards) against one process on the whole batch. Rank 1
    writes an overflow into its own shard of a gradient at FSDP_INJECT_STEP: every rank must skip."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lossscale import DynamicScale, GradScaler, LossScaleOptimizer
    from lossscale.compat.keras import _KerasStep
    from lossscale.ops.clip import squared_norms
    from lossscale.testing import HostReadCounter

    model = make_model()
    reference = copy.deepcopy(model)
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    opt_name = "adamw" if kind in ("lso_host", "lso_per_param", "lso_masked") else "fused_adamw"
    policy = DynamicScale(init_scale=2.0**10, growth_interval=3)
    poison = 1e5 if kind == "lso_saturation" else INF  # finite but saturated once scaled
    lso_args = {
        "lso_fused": dict(clip_grad_norm=0.3),
        "lso_host": dict(clip_grad_norm=0.3, skip_mode="host"),
        "lso_saturation": dict(clip_grad_norm=0.3, overflow_mode="saturation"),
        "lso_per_param": {},
        "lso_masked": dict(clip_grad_norm=0.3, skip_mode="masked"),
    }.get(kind)

    def trainer(module: torch.nn.Module) -> Any:
        inner = OPTIMIZERS[opt_name](module.parameters())
        if lso_args is None:
            return inner, GradScaler("cpu", policy=policy)
        if kind == "lso_per_param":
            inner = _KerasStep(inner, clipnorm=0.2, weight_decay=None)
        return LossScaleOptimizer(inner, policy=policy, module=module, **lso_args), None

    opt, scaler = trainer(model)
    ref_opt, ref_scaler = trainer(reference)
    out: dict[str, Any] = {"stepped": [], "ref_stepped": [], "norms": [], "ref_norms": [], "host_reads": []}
    for step in range(6):
        x, y = batch(step)
        runs = ((model, opt, scaler, rows_of(rank, world_size)), (reference, ref_opt, ref_scaler, None))
        for module, o, s, rows in runs:
            o.zero_grad()
            loss = loss_fn(module, x[rows] if rows else x, y[rows] if rows else y)
            (s.scale(loss) if s else o.scale_loss(loss)).backward()
            grad = module[0].weight.grad
            if step == 0 and module is model:
                out["dtensor_grads"] = all(isinstance(p.grad, DTensor) for p in module.parameters())
                out["local_rows"] = [p.grad.to_local().shape[0] for p in module.parameters()]
                out["local_sq_norms"] = squared_norms([p.grad for p in module.parameters()]).tolist()
            if step == FSDP_INJECT_STEP:
                if module is model and rank == 1:
                    grad.to_local()[0, 0] = poison  # rank 1 holds rows 8..15
                elif module is reference:
                    grad[8, 0] = poison
            with HostReadCounter() as reads:
                if s is None:
                    result = o.step()
                    stepped, norm = result.stepped, result.grad_norm
                else:
                    s.unscale_(o)
                    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), 0.3)
                    stepped = s.step(o).stepped
                    s.update()
            if module is model:
                out["host_reads"].append(reads.count)
                if step == FSDP_INJECT_STEP:  # attribution: the rank that holds the overflowing shard names it
                    out["overflowing"] = o.overflowing_parameters() if s is None else s.overflowing_parameters(o, model)
            prefix = "" if module is model else "ref_"
            out[prefix + "stepped"].append(bool(stepped))
            if norm is not None:
                norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
                out[prefix + "norms"].append(float(norm))
    out["skip_mode"] = getattr(opt, "skip_mode", None)
    out["params"], out["ref_params"] = flat(model), flat(reference)
    return out


CKPT_INJECT = {2: INF, 7: NAN}  # on rank 1, after backward; the checkpoint is taken after step 4


def checkpoint(rank: int, world_size: int, kind: str, path: str) -> dict:
    """Train 10 steps straight, and again with a checkpoint saved by rank 0 after step 4 and loaded by
    every rank into fresh objects: the two trajectories must be the same, bit for bit."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lossscale import DynamicScale, GradScaler, LossScaleOptimizer

    policy = DynamicScale(init_scale=2.0**10, growth_interval=3)

    def build(state: dict | None = None) -> tuple:
        module = make_model()
        if state is not None:
            module.load_state_dict(state["model"])
        model = DDP(module)
        inner = OPTIMIZERS["fused_adamw"](model.parameters())
        if kind == "lso":
            opt, scaler = LossScaleOptimizer(inner, policy=policy, clip_grad_norm=0.3), None
        else:
            opt, scaler = inner, GradScaler("cpu", policy=policy)
        if state is not None:
            opt.load_state_dict(state["opt"])
            if scaler is not None:
                scaler.load_state_dict(state["scaler"])
        return model, opt, scaler

    def train(objs: tuple, steps: range, scales: list) -> None:
        model, opt, scaler = objs
        for step in steps:
            opt.zero_grad()
            x, y = batch(step, rows_of(rank, world_size))
            loss = loss_fn(model, x, y)
            (scaler.scale(loss) if scaler else opt.scale_loss(loss)).backward()
            if rank == 1 and step in CKPT_INJECT:
                model.module[2].weight.grad[2, 5] = CKPT_INJECT[step]
            if scaler is None:
                scales.append(float(opt.step().next_scale))
            else:
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())

    straight: list[float] = []
    objs = build()
    train(objs, range(10), straight)
    straight_params = flat(objs[0])

    resumed: list[float] = []
    model, opt, scaler = objs = build()
    train(objs, range(5), resumed)
    scaler_state = (scaler or opt).state_dict()
    if rank == 0:
        torch.save(
            {
                "model": model.module.state_dict(),
                "opt": opt.state_dict(),
                "scaler": scaler.state_dict() if scaler else None,
            },
            path,
        )
    dist.barrier()
    objs = build(torch.load(path))
    train(objs, range(5, 10), resumed)
    policy_states = gathered(scaler_state["policy_state"], world_size)
    return {
        "straight": straight,
        "resumed": resumed,
        "straight_params": straight_params,
        "resumed_params": flat(objs[0]),
        "policy_states_agree": policy_states[0] == policy_states[1],
    }


class _Attenuate(torch.autograd.Function):
    """Identity forward; the backward signal times ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.clone()  # not a view: FSDP2 warns about a module that returns one

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class Attenuated(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Attenuate.apply(x, 2.0**-4)


def damped_net() -> torch.nn.Module:
    """8 blocks of Linear, LayerNorm, Tanh whose backward signal shrinks 2**-4 per block (test_layerwise's)."""
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(8):
        mods += [torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(), Attenuated()]
    return torch.nn.Sequential(*mods)


def layerwise(rank: int, world_size: int, kind: str) -> dict:
    """DDP (``kind`` "ddp") or FSDP2 (fully_shard per block and the whole, "fsdp2") + LossScaleOptimizer(layerwise=...)
    on the damped network, each rank its half of the batch in float16 autocast, for 4 steps: per step the factors and
    the worst relative error of the unscaled gradients against the float32 gradients of the whole batch at the same
    weights (what the ranks' average stands for)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lossscale import LossScaleOptimizer

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    model = damped_net()
    if kind == "ddp":
        ddp = DDP(model)
    else:
        for block in range(0, len(model), 4):
            fully_shard(model[block])
        ddp = fully_shard(model)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), layerwise=model)
    exponents, errors, stepped = [], [], []
    for step in range(4):
        gen = torch.Generator().manual_seed(2000 + step)
        x, y = torch.randn(16, 16, generator=gen), torch.randn(16, 16, generator=gen)
        rows = rows_of(rank, world_size, 16)
        ref = damped_net()
        ref.load_state_dict({name: full(value) for name, value in model.state_dict().items()})
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = ddp(x[rows])
        opt.backward(torch.nn.functional.mse_loss(out.float(), y[rows]))
        stepped.append(bool(opt.step().stepped))
        exponents.append(opt.state_dict()["layerwise"]["exponent"])
        errors.append(
            max(
                float((full(p.grad) - q.grad).norm() / q.grad.norm())
                for p, q in zip(model.parameters(), ref.parameters())
            )
        )
    return {"exponents": exponents, "errors": errors, "stepped": stepped, "params": flat(model)}


class Branches(torch.nn.Module):
    """Two units always, and a third that runs only where ``extra`` is True (conditional computation)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.extra = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor, extra: bool) -> torch.Tensor:
        h = self.second(torch.tanh(self.first(x)))
        return self.extra(h) if extra else h


def layerwise_uneven(rank: int, world_size: int) -> dict:
    """Per-layer scales where rank 1 runs one more unit than rank 0 in the first step: every rank must refuse (the
    error's message), where agreeing unit by unit would pair different all-reduces and hang."""
    from lossscale import LossScaleOptimizer

    model = Branches()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), layerwise=model)
    loss = model(torch.ones(2, 4), extra=rank == 1).pow(2).mean()
    try:
        opt.backward(loss)
    except RuntimeError as err:
        return {"error": str(err)}
    return {"error": None}


FAULT_STEP = 3  # rank 1's loss is inf at this step (its gradients finite: the inf is a constant term)


def forward_fault(rank: int, world_size: int, kind: str, opt_name: str) -> dict:
    """DDP with a front end that finds forward faults: at FAULT_STEP only rank 1's loss is non-finite, its gradients
    finite. Both ranks must skip that step, and neither rank's policy state may move there."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lossscale import DynamicScale, GradScaler, LossScaleOptimizer
    from lossscale.addons import AddOn

    class FindsFaults(AddOn):
        finds_forward_faults = True

    model = DDP(make_model())
    inner = OPTIMIZERS[opt_name](model.parameters())
    policy = DynamicScale(init_scale=2.0**10, growth_interval=2)
    if kind == "lso":
        opt: Any = LossScaleOptimizer(inner, policy=policy, add_ons=[FindsFaults()])
        scaler = None
    else:
        opt, scaler = inner, GradScaler("cpu", policy=policy)
        scaler.attach_add_ons([FindsFaults()])
    out: dict[str, Any] = {"stepped": [], "found_inf": [], "fault": [], "states": []}
    for step in range(6):
        x, y = batch(step, rows_of(rank, world_size))
        loss = loss_fn(model, x, y)
        if step == FAULT_STEP and rank == 1:
            loss = loss + torch.tensor(INF)  # a non-finite loss whose gradients stay finite
        opt.zero_grad()
        if scaler is None:
            opt.backward(loss)
            result = opt.step()
            state = opt.loss_scale.state_dict()
            stepped, found, fault = result.stepped, result.found_inf, result.forward_fault
        else:
            scaler.scale(loss).backward()
            decision = scaler.step(opt)
            scaler.update()
            state = scaler.loss_scale.state_dict()
            stepped, found, fault = decision.stepped, decision.found_inf, decision.forward_fault
        out["stepped"].append(bool(stepped))
        out["found_inf"].append(bool(found))
        out["fault"].append(bool(fault))
        out["states"].append(state)
    out["params"] = flat(model)
    return out


class HealChain(torch.nn.Module):
    """inp -> a -> norm_a -> b -> norm_b -> out: a norm after a and after b, so a fault healed in either stays."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.b = torch.nn.Linear(6, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.norm_a, self.norm_b, self.out = torch.nn.LayerNorm(16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm_b(self.b(self.norm_a(self.a(self.inp(x))))))


HEAL_FAULT_STEP = 3  # from this step rank 0's `a` and rank 1's `b` overflow float16 in the forward


def heal_union(rank: int, world_size: int) -> dict:
    """DDP with LossScaleOptimizer(diagnose=model, heal=True), a different module faulting on each rank: every rank
    must heal at the same step, keep the union of the modules the ranks' traces name, keep its scale, and step on."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lossscale import DynamicScale, HealWarning, LossScaleOptimizer

    inner = HealChain()
    model = DDP(inner)
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3),
        policy=DynamicScale(init_scale=2.0**10, growth_interval=1000),
        diagnose=inner,
        heal=True,
    )
    out: dict[str, Any] = {"stepped": [], "scale": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(12):
            if step == HEAL_FAULT_STEP:
                with torch.no_grad():
                    (inner.a if rank == 0 else inner.b).weight.mul_(3e5)
            x, y = batch(step, rows_of(rank, world_size))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            opt.backward(loss)
            result = opt.step()
            opt.zero_grad()
            out["stepped"].append(bool(result.stepped))
            out["scale"].append(float(result.scale))
    out["healed"] = {name: str(dtype) for name, dtype in opt.add_ons[0].healed.items()}
    out["heals"] = [str(w.message).split(" (")[0] for w in caught if issubclass(w.category, HealWarning)]
    return out


SCENARIOS = {
    f.__name__: f
    for f in (
        helpers,
        scaler_plain,
        lso_ddp,
        accumulation,
        fsdp2,
        checkpoint,
        layerwise,
        layerwise_uneven,
        forward_fault,
        heal_union,
    )
}
