"""Record Keras 3 LossScaleOptimizer scale trajectories (torch backend).

Run in a venv with keras + torch:  KERAS_BACKEND=torch python record_keras.py
Writes tests/golden/keras.json.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras
import patterns as P
import torch

assert keras.backend.backend() == "torch", keras.backend.backend()

DEFAULT_SCALE = 2.0**15
DEFAULT_GROWTH = 2000


def run(config, overflow):
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=1.0), **config)
    var = keras.Variable(torch.zeros(1), dtype="float32")
    before, after, param_changed = [], [], []
    for ov in overflow:
        s0 = float(opt.dynamic_scale.numpy()) if opt.built else float(opt.initial_scale)
        # the scaled gradient: 1.0 * scale (unscales to 1.0), or inf
        fin = s0 if 0.0 < s0 < float("inf") else 1.0
        g = torch.full((1,), float("inf") if ov else fin)
        v0 = float(var.numpy()[0])
        opt.apply([g], [var])
        s1 = float(opt.dynamic_scale.numpy())
        before.append(s0)
        after.append(s1)
        param_changed.append(float(var.numpy()[0]) != v0)
    # a clean step must update the variable, an overflow must not
    for ov, ch, s in zip(overflow, param_changed, before):
        if s not in (0.0, float("inf")):
            assert ch == (not ov), (config, ov, ch)
    return before, after


def main():
    cases = []
    configs = [("default", {"initial_scale": DEFAULT_SCALE, "dynamic_growth_steps": DEFAULT_GROWTH}, True)]
    for w in (1, 2, 3, 5):
        configs.append(("w%d" % w, {"initial_scale": DEFAULT_SCALE, "dynamic_growth_steps": w}, False))
    for label, cfg, long_w in configs:
        for pname, pat in P.standard_patterns(
            cfg["dynamic_growth_steps"], long_window=long_w, with_all_overflow=label in ("default", "w2")
        ):
            b, a = run(cfg, pat)
            cases.append(P.make_case("%s-%s" % (pname, label), cfg, pat, b, a))
    cfg = {"initial_scale": 2.0**120, "dynamic_growth_steps": 2}
    for pname, pat in (("cap", P.cap()), ("after_inf_recover", P.after_inf_recover())):
        b, a = run(cfg, pat)
        cases.append(P.make_case("%s-init2p120_w2" % pname, cfg, pat, b, a))
    P.write("keras", "keras", keras.__version__, cases, extra={"backend": "torch", "torch": torch.__version__})


if __name__ == "__main__":
    main()
