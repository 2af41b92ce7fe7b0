"""Record tf.compat.v1.mixed_precision.DynamicLossScale trajectories (TF 2.x, eager).

Run in a venv with tensorflow-cpu:  python record_tf_v1.py
Writes tests/golden/tf_v1.json.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import patterns as P
import tensorflow as tf


def run(config, overflow):
    ls = tf.compat.v1.mixed_precision.DynamicLossScale(**config)
    before, after = [], []
    for ov in overflow:
        s0 = float(ls().numpy())
        g = tf.constant([float("inf") if ov else 1.0])
        _, should_apply = ls.update([g])
        assert bool(should_apply) == (not ov)
        before.append(s0)
        after.append(float(ls().numpy()))
    return before, after


def main():
    cases = []
    configs = [("default", {"initial_loss_scale": 2.0**15, "increment_period": 2000, "multiplier": 2.0}, True)]
    for w in (1, 2, 3, 5):
        configs.append(("w%d" % w, {"initial_loss_scale": 2.0**15, "increment_period": w, "multiplier": 2.0}, False))
    configs.append(("w3_m3", {"initial_loss_scale": 1000.0, "increment_period": 3, "multiplier": 3.0}, False))
    for label, cfg, long_w in configs:
        pats = P.standard_patterns(
            cfg["increment_period"], long_window=long_w, with_all_overflow=label in ("default", "w2", "w3_m3")
        )
        for pname, pat in pats:
            b, a = run(cfg, pat)
            cases.append(P.make_case("%s-%s" % (pname, label), cfg, pat, b, a))
    cfg = {"initial_loss_scale": 2.0**120, "increment_period": 2, "multiplier": 2.0}
    for pname, pat in (("cap", P.cap()), ("after_inf_recover", P.after_inf_recover())):
        b, a = run(cfg, pat)
        cases.append(P.make_case("%s-init2p120_w2" % pname, cfg, pat, b, a))
    P.write(
        "tf_v1", "tensorflow-cpu", tf.__version__, cases, extra={"api": "tf.compat.v1.mixed_precision.DynamicLossScale"}
    )


if __name__ == "__main__":
    main()
