"""Record tf_keras (Keras 2) mixed_precision.LossScaleOptimizer trajectories.

Run in a venv with tensorflow-cpu + tf-keras:  python record_tf_keras2.py
Writes tests/golden/tf_keras2.json.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import patterns as P
import tensorflow as tf
import tf_keras


def run(config, overflow, inner="SGD"):
    if inner == "legacy.SGD":
        sgd = tf_keras.optimizers.legacy.SGD(learning_rate=1.0)
    else:
        sgd = tf_keras.optimizers.SGD(learning_rate=1.0)
    opt = tf_keras.mixed_precision.LossScaleOptimizer(sgd, **config)
    var = tf.Variable([0.0])
    before, after = [], []
    for ov in overflow:
        s0 = float(opt.loss_scale.numpy())
        v0 = float(var.numpy()[0])
        # gradients as returned by get_unscaled_gradients(): 1.0, or inf
        g = tf.constant([float("inf") if ov else 1.0])
        opt.apply_gradients([(g, var)])
        s1 = float(opt.loss_scale.numpy())
        assert (float(var.numpy()[0]) != v0) == (not ov)
        before.append(s0)
        after.append(s1)
    return before, after


def main():
    cases = []
    configs = [("default", {"initial_scale": 2.0**15, "dynamic_growth_steps": 2000}, True)]
    for w in (1, 2, 3, 5):
        configs.append(("w%d" % w, {"initial_scale": 2.0**15, "dynamic_growth_steps": w}, False))
    for label, cfg, long_w in configs:
        pats = P.standard_patterns(
            cfg["dynamic_growth_steps"], long_window=long_w, with_all_overflow=label in ("default", "w2")
        )
        for pname, pat in pats:
            b, a = run(cfg, pat)
            cases.append(P.make_case("%s-%s" % (pname, label), dict(cfg, inner="SGD"), pat, b, a))
    # the OptimizerV2 (legacy) path shares the same state class: confirm on two patterns
    cfg = {"initial_scale": 2.0**15, "dynamic_growth_steps": 3}
    for pname, pat in (("bursts", P.bursts(3)), ("random_p0.5", P.random_p05())):
        b, a = run(cfg, pat, inner="legacy.SGD")
        cases.append(P.make_case("%s-w3_legacy" % pname, dict(cfg, inner="legacy.SGD"), pat, b, a))
    cfg = {"initial_scale": 2.0**120, "dynamic_growth_steps": 2}
    for pname, pat in (("cap", P.cap()), ("after_inf_recover", P.after_inf_recover())):
        b, a = run(cfg, pat)
        cases.append(P.make_case("%s-init2p120_w2" % pname, dict(cfg, inner="SGD"), pat, b, a))
    P.write("tf_keras2", "tf-keras", tf_keras.__version__, cases, extra={"tensorflow": tf.__version__})


if __name__ == "__main__":
    main()
