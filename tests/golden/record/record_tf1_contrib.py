"""Record TF 1.15 tf.contrib.mixed_precision.ExponentialUpdateLossScaleManager
trajectories (graph mode, one Session.run per update). This is the manager that
Huawei Ascend's npu_bridge ExponentialUpdateLossScaleManager reproduces.

Run in a Python 3.7 venv with tensorflow==1.15.5 and protobuf<3.21:
    python record_tf1_contrib.py
Writes tests/golden/tf1_contrib.json.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import patterns as P
import tensorflow as tf
from tensorflow.contrib.mixed_precision import ExponentialUpdateLossScaleManager

tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)


def run(config, overflow):
    graph = tf.Graph()
    with graph.as_default():
        mgr = ExponentialUpdateLossScaleManager(**config)
        finite = tf.compat.v1.placeholder(tf.bool, shape=())
        update = mgr.update_loss_scale(finite)
        scale = mgr.get_loss_scale()
        init = tf.compat.v1.global_variables_initializer()
    before, after = [], []
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        for ov in overflow:
            s0 = float(sess.run(scale))
            sess.run(update, feed_dict={finite: not ov})
            before.append(s0)
            after.append(float(sess.run(scale)))
    return before, after


def main():
    cases = []
    configs = [
        # the arguments Ascend's docs use in their examples
        (
            "ascend_example",
            dict(init_loss_scale=2.0**32, incr_every_n_steps=1000, decr_every_n_nan_or_inf=2, decr_ratio=0.5),
            True,
        ),
        ("w1000", dict(init_loss_scale=2.0**15, incr_every_n_steps=1000), True),
    ]
    for w in (1, 2, 3, 5):
        configs.append(("w%d" % w, dict(init_loss_scale=2.0**15, incr_every_n_steps=w), False))
    for n in (1, 3):
        configs.append(
            ("w3_n%d" % n, dict(init_loss_scale=2.0**15, incr_every_n_steps=3, decr_every_n_nan_or_inf=n), False)
        )
    configs.append(
        ("w2_r3_half", dict(init_loss_scale=1000.0, incr_every_n_steps=2, incr_ratio=3, decr_ratio=0.5), False)
    )
    for label, cfg, long_w in configs:
        full = dict(decr_every_n_nan_or_inf=2, incr_ratio=2, decr_ratio=0.8)
        full.update(cfg)
        pats = P.standard_patterns(
            full["incr_every_n_steps"],
            long_window=long_w,
            with_all_overflow=label in ("w1000", "w2", "w3_n1", "w3_n3", "w2_r3_half"),
        )
        for pname, pat in pats:
            b, a = run(full, pat)
            cases.append(P.make_case("%s-%s" % (pname, label), full, pat, b, a))
    full = dict(init_loss_scale=2.0**120, incr_every_n_steps=2, decr_every_n_nan_or_inf=2, incr_ratio=2, decr_ratio=0.8)
    for pname, pat in (("cap", P.cap()), ("after_inf_recover", P.after_inf_recover())):
        b, a = run(full, pat)
        cases.append(P.make_case("%s-init2p120_w2" % pname, full, pat, b, a))
    P.write(
        "tf1_contrib",
        "tensorflow",
        tf.__version__,
        cases,
        extra={"api": "tf.contrib.mixed_precision.ExponentialUpdateLossScaleManager"},
    )


if __name__ == "__main__":
    main()
