"""Seeded synthetic gradient streams: what a loss-scale policy sees, and what its choice costs.

A stream is one record per training step, in powers of two (log2 units):

    body_t   the median log2 |g| of the step's gradient values; the values are log-normal around it,
             log2 |g| ~ Normal(body_t, BODY_SIGMA), which fixes the share that float16 rounds to zero
    amax_t   log2 of the step's largest |g|: body_t + AMAX_ABOVE_BODY + noise_t (+ an outlier)

and a policy that picks the scale S for step t (before seeing it) pays:

    overflow (the step is skipped)   when  amax_t + log2 S >= log2 65504
    underflow share (applied steps)  P(log2 |g| + log2 S <= -25) = Phi((-25 - log2 S - body_t) / BODY_SIGMA)

The kinds (``KINDS``), all over ``steps`` steps from one ``random.Random(seed)``:

    stationary    body fixed; noise_t ~ Normal(0, 0.35)
    drifting      body falls by 6 powers of two over the run, plus a swing of +-2 with period 5,000 steps
                  (an LR warm-up and decay seen from the gradients); noise_t ~ Normal(0, 0.35)
    heavy-tailed  body falls by 2 over the run (slow drift); noise_t ~ Laplace(0, 0.35) (heavier than
                  normal); with probability 1/10,000 a step carries an outlier 1 + Exponential(mean 1.5)
                  powers of two above it (a bad batch, a loss spike)
    iid-max       body fixed; amax_t is the maximum of 2**20 independent log-normal values (a Gumbel
                  tail, noise of about 0.85 powers of two): no step-to-step structure a predictor can use,
                  the hard case for any rule that is not trial and error

The body sits where the scale that just avoids overflow (about 2**13) leaves ~1e-4 of the values
underflowing.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

import torch

__all__ = ["KINDS", "LOG2_LIMIT", "Outcome", "Stream", "make_stream", "run_policy", "run_torch_rule", "underflow_share"]

LOG2_LIMIT = math.log2(65504.0)  # float16's largest finite value
LOG2_FLUSH = -25.0  # float16 rounds magnitudes at or below 2**-25 to zero
BODY_SIGMA = 4.7  # log2 spread of the gradient values around the body
AMAX_ABOVE_BODY = 5.0 * BODY_SIGMA  # the largest of ~2**20 values sits ~5 standard deviations up
BODY_START = LOG2_LIMIT - 13.5 - AMAX_ABOVE_BODY  # so that amax * 2**13 is just below the limit
KINDS = ("stationary", "drifting", "heavy-tailed", "iid-max")
_NORMAL = statistics.NormalDist()


@dataclass(frozen=True)
class Stream:
    """One synthetic run: per-step log2 body and log2 amax (unscaled), and how it was made."""

    kind: str
    seed: int
    body: tuple[float, ...]
    amax: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.amax)


def _laplace(rng: random.Random, b: float) -> float:
    return rng.choice((-1.0, 1.0)) * rng.expovariate(1.0 / b)


def _gumbel_max_z(rng: random.Random, n: int) -> float:
    """The largest of ``n`` standard normals, drawn exactly by inverting the CDF of the maximum."""
    p_above = -math.expm1(math.log(1.0 - rng.random()) / n)
    return -_NORMAL.inv_cdf(p_above)


def make_stream(kind: str, steps: int = 20_000, seed: int = 0) -> Stream:
    """The ``kind`` stream of ``steps`` steps from ``seed`` (same arguments, same stream)."""
    if kind not in KINDS:
        raise ValueError(f"make_stream(kind={kind!r}): kind must be one of {', '.join(KINDS)}; got {kind!r}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"make_stream(steps={steps!r}): steps must be an integer >= 1; got {steps!r}.")
    rng = random.Random(f"{kind}:{seed}")
    body, amax = [], []
    for t in range(steps):
        b = BODY_START
        if kind == "drifting":
            b += -6.0 * t / steps + 2.0 * math.sin(2 * math.pi * t / 5000)
        elif kind == "heavy-tailed":
            b += -2.0 * t / steps
        if kind == "iid-max":
            a = b + BODY_SIGMA * _gumbel_max_z(rng, 2**20)
        elif kind == "heavy-tailed":
            a = b + AMAX_ABOVE_BODY + _laplace(rng, 0.35)
            if rng.random() < 1 / 10_000:
                a += 1.0 + rng.expovariate(1 / 1.5)
        else:
            a = b + AMAX_ABOVE_BODY + rng.gauss(0.0, 0.35)
        body.append(b)
        amax.append(a)
    return Stream(kind, seed, tuple(body), tuple(amax))


def underflow_share(body: float, log2_scale: float) -> float:
    """Share of a step's gradient values that float16 rounds to zero at scale ``2**log2_scale``."""
    return _NORMAL.cdf((LOG2_FLUSH - log2_scale - body) / BODY_SIGMA)


@dataclass(frozen=True)
class Outcome:
    """What a rule paid on one stream: skipped steps, and the mean underflow share of applied steps."""

    skipped: int
    underflow: float
    final_scale: float


def account(stream: Stream, log2_scales: list[float]) -> Outcome:
    """The cost of playing ``log2_scales`` (one per step) on ``stream``."""
    skipped, share = 0, 0.0
    for a, b, s in zip(stream.amax, stream.body, log2_scales):
        if a + s >= LOG2_LIMIT:
            skipped += 1
        else:
            share += underflow_share(b, s)
    return Outcome(skipped, share / max(1, len(stream) - skipped), 2.0 ** log2_scales[-1])


def run_torch_rule(stream: Stream) -> Outcome:
    """torch.amp.GradScaler's defaults, advanced by torch's own kernel (``torch._amp_update_scale_``)."""
    scale, tracker = torch.full((1,), 2.0**16), torch.zeros((1,), dtype=torch.int32)
    log2_scales = []
    for a in stream.amax:
        s = math.log2(float(scale))
        log2_scales.append(s)
        found = torch.full((1,), float(a + s >= LOG2_LIMIT))
        torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 2000)
    return account(stream, log2_scales)


def run_policy(policy, streams: list[Stream], amax_on_overflow: float = math.inf) -> list[Outcome]:
    """Any policy over several equal-length streams at once.

    A policy whose update is element-wise (``PredictiveScale``) runs all streams as one batch: its
    state fields get a leading dimension. Others run one stream at a time. On an overflowing step the
    policy sees ``amax_on_overflow`` (inf: what the overflow pass reports), else the scaled amax.
    """
    state = policy.init()
    batched = bool(getattr(policy, "observes_amax", False))
    if not batched:
        return [_run_one(policy, s) for s in streams]
    n = len(streams)
    state = type(state)(*(getattr(state, f).expand(n).clone() for f in state.__dataclass_fields__))
    amax = torch.tensor([s.amax for s in streams], dtype=torch.float64).T  # [steps, n]
    logs = []
    for row in amax:
        log2_scale = torch.log2(state.scale.double())
        logs.append(log2_scale)
        over = row + log2_scale >= LOG2_LIMIT
        seen = torch.where(over, torch.full_like(row, amax_on_overflow), torch.exp2(row + log2_scale))
        state = policy.update(state, over, amax=seen.float())
    log2_scales = torch.stack(logs).T.tolist()
    return [account(s, ls) for s, ls in zip(streams, log2_scales)]


def _run_one(policy, stream: Stream) -> Outcome:
    state = policy.init()
    log2_scales = []
    for a in stream.amax:
        s = math.log2(float(state.scale))
        log2_scales.append(s)
        state = policy.update(state, torch.tensor(a + s >= LOG2_LIMIT))
    return account(stream, log2_scales)
