"""Record Megatron-core DynamicGradScaler trajectories.

megatron.core.optimizer.grad_scaler.DynamicGradScaler(initial_scale, min_scale,
growth_factor, backoff_factor, growth_interval, hysteresis).update(found_inf);
the scale is .scale (a float32 tensor of shape [1]). The module hard-codes
device='cuda' for its tensors: the recorder gives the module a torch proxy whose
tensor() puts them on the CPU instead (nothing else changes).

Run in a venv with torch==2.13.0 + megatron-core (--no-deps):  python record_megatron.py
Writes tests/golden/megatron.json.
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import megatron.core  # noqa: E402
import patterns as P  # noqa: E402
import torch  # noqa: E402
from megatron.core.optimizer import grad_scaler  # noqa: E402


class _TorchOnCPU:
    """torch, except that tensor(..., device=...) always builds on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, **kwargs):
        kwargs["device"] = "cpu"
        return torch.tensor(*args, **kwargs)


grad_scaler.torch = _TorchOnCPU()


def run(config, overflow):
    sc = grad_scaler.DynamicGradScaler(**config)
    before, after = [], []
    for ov in overflow:
        s0 = float(sc.scale.item())
        sc.update(torch.tensor(bool(ov)))
        before.append(s0)
        after.append(float(sc.scale.item()))
    return before, after


def cfg_of(
    initial_scale=2.0**32, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000, hysteresis=2
):
    return dict(
        initial_scale=initial_scale,
        min_scale=min_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
    )


def main():
    cases = []
    # Megatron's training-argument defaults: 2**32, min 1, x2, x0.5, window 1000, hysteresis 2
    cfg = cfg_of()
    for pname, pat in P.standard_patterns(1000, long_window=True):
        b, a = run(cfg, pat)
        cases.append(P.make_case("%s-default" % pname, cfg, pat, b, a))
    for w in (1, 2, 3, 5):
        for h in (1, 2, 3):
            if w in (1, 5) and h == 3:
                continue
            cfg = cfg_of(initial_scale=2.0**16, growth_interval=w, hysteresis=h)
            for pname, pat in P.standard_patterns(w, with_all_overflow=(w == 3)):
                b, a = run(cfg, pat)
                cases.append(P.make_case("%s-w%d_h%d" % (pname, w, h), cfg, pat, b, a))
    # non-power-of-two factors and a min_scale that is not a power of two
    cfg = cfg_of(
        initial_scale=1000.0, min_scale=3.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=2, hysteresis=2
    )
    for pname, pat in (("bursts", P.bursts(2)), ("random_p0.5", P.random_p05()), ("all_overflow", P.all_overflow())):
        b, a = run(cfg, pat)
        cases.append(P.make_case("%s-w2_h2_g3_b0.3_min3" % pname, cfg, pat, b, a))
    cfg = cfg_of(initial_scale=2.0**120, growth_interval=2, hysteresis=2)
    for pname, pat in (("cap", P.cap()), ("after_inf_recover", P.after_inf_recover())):
        b, a = run(cfg, pat)
        cases.append(P.make_case("%s-init2p120_w2_h2" % pname, cfg, pat, b, a))
    P.write(
        "megatron",
        "megatron-core",
        megatron.core.__version__,
        cases,
        extra={"torch": torch.__version__, "patched": "device='cuda' -> 'cpu' for the scaler's tensors"},
    )


if __name__ == "__main__":
    main()
