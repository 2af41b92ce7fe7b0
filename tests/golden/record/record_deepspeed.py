"""Record DeepSpeed DynamicLossScaler trajectories.

deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler(init_scale, scale_window,
min_scale, delayed_shift, consecutive_hysteresis, raise_error_at_min_scale,
dtype=torch.half).update_scale(overflow); the scale is .cur_scale (a Python float).
update_scale calls deepspeed.comm.get_rank(), so a 1-rank gloo group on
127.0.0.1 is initialised first.

A call that raised (raise_error_at_min_scale at the minimum) is recorded with
raised[i] = true; DeepSpeed raises before touching any state, so scale_after
equals scale_before there. Later calls continue on the same object.

Run in a venv with deepspeed + torch==2.13.0:  python record_deepspeed.py
Writes tests/golden/deepspeed.json.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29517")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")

import deepspeed
import patterns as P
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
from deepspeed.utils import logger

logger.setLevel(logging.WARNING)


def run(config, overflow):
    sc = DynamicLossScaler(dtype=torch.half, **config)
    before, after, raised = [], [], []
    message = None
    for ov in overflow:
        s0 = float(sc.cur_scale)
        r = False
        try:
            sc.update_scale(ov)
        except Exception as e:  # raise_error_at_min_scale
            r = True
            if message is None:
                message = "%s: %s" % (type(e).__name__, e)
        before.append(s0)
        after.append(float(sc.cur_scale))
        raised.append(r)
    return before, after, raised, message


def cfg_of(
    init_scale=2.0**16,
    scale_window=1000,
    min_scale=1.0,
    delayed_shift=2,
    consecutive_hysteresis=False,
    raise_error_at_min_scale=True,
):
    return dict(
        init_scale=init_scale,
        scale_window=scale_window,
        min_scale=min_scale,
        delayed_shift=delayed_shift,
        consecutive_hysteresis=consecutive_hysteresis,
        raise_error_at_min_scale=raise_error_at_min_scale,
    )


def add(cases, name, cfg, pat):
    b, a, raised, msg = run(cfg, pat)
    extra = {}
    if any(raised):
        extra = {"raised": raised, "raise_message": msg, "first_raise_call": raised.index(True)}
    cases.append(P.make_case(name, cfg, pat, b, a, **extra))


def main():
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    cases = []
    # DeepSpeed's config defaults: 2**16, window 1000, hysteresis 2, not consecutive, min 1
    cfg = cfg_of()
    for pname, pat in P.standard_patterns(1000, long_window=True):
        add(cases, "%s-default" % pname, cfg, pat)
    # hysteresis 1, 2, 3 x consecutive True/False at window 3
    for h in (1, 2, 3):
        for cons in (False, True):
            label = "w3_h%d_%s" % (h, "cons" if cons else "noncons")
            cfg = cfg_of(scale_window=3, delayed_shift=h, consecutive_hysteresis=cons, raise_error_at_min_scale=False)
            for pname, pat in P.standard_patterns(3):
                add(cases, "%s-%s" % (pname, label), cfg, pat)
    # other windows, hysteresis 1 and 2
    for w in (1, 2, 5):
        for h in (1, 2):
            cfg = cfg_of(scale_window=w, delayed_shift=h, raise_error_at_min_scale=False)
            for pname, pat in P.standard_patterns(w, with_all_overflow=False):
                add(cases, "%s-w%d_h%d_noncons" % (pname, w, h), cfg, pat)
    # min scale and raise_error_at_min_scale
    for h in (1, 2):
        for rz in (True, False):
            cfg = cfg_of(init_scale=2.0**4, scale_window=3, delayed_shift=h, raise_error_at_min_scale=rz)
            pat = [True] * 12 + [False] * 4 + [True] * 4
            add(cases, "min_scale-init16_w3_h%d_raise%s" % (h, rz), cfg, pat)
    cfg = cfg_of(init_scale=3.0, scale_window=2, min_scale=1.0, delayed_shift=1)
    add(cases, "min_scale_inexact-init3_w2_h1_raiseTrue", cfg, [True] * 5 + [False] * 3 + [True] * 3)
    cfg = cfg_of(init_scale=2.0**16, scale_window=1000, min_scale=0.25, delayed_shift=2)
    add(cases, "all_overflow-default_min0.25", cfg, P.all_overflow())
    # no cap: Python floats, so 2**120 keeps doubling (no float32 inf)
    cfg = cfg_of(init_scale=2.0**120, scale_window=2, delayed_shift=2)
    for pname, pat in (("cap", P.cap()), ("after_inf_recover", P.after_inf_recover())):
        add(cases, "%s-init2p120_w2_h2" % pname, cfg, pat)
    P.write(
        "deepspeed",
        "deepspeed",
        deepspeed.__version__,
        cases,
        extra={"torch": torch.__version__, "dtype": "torch.half"},
    )


if __name__ == "__main__":
    main()
