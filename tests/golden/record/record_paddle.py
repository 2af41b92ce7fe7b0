"""Record PaddlePaddle dygraph paddle.amp.GradScaler trajectories on the CPU.

The full public flow runs each step: scaler.scale(loss).backward(),
scaler.step(optimizer) (unscale + inf/nan check + skipped or applied SGD step),
scaler.update(). The model is a 1x1 paddle.nn.Linear fed x = inf (inject an
overflow) or x = 1.0.

Two CPU work-arounds, both only at construction / scale time:
* GradScaler.__init__ disables itself unless the tracer's place is a GPU/XPU/
  custom place: the recorder hands it a tracer proxy whose place claims to be a
  GPU place while the constructor runs (everything still runs on the CPU).
* scale() disables dynamic scaling unless the AMP dtype is float16: the
  recorder sets amp_global_state().amp_dtype = 'float16' (what auto_cast does on
  a GPU).
The recorded "overflow" is what step() found (scaler._cache_found_inf); it can
differ from the injected pattern when scale * grad overflows float32 by itself
("natural_overflow" counts those calls).

Run in a venv with paddlepaddle==3.3.1 "numpy<2.4":  python record_paddle.py
Writes tests/golden/paddle.json.
"""

import contextlib
import io
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import patterns as P  # noqa: E402
from paddle.amp import grad_scaler as _gs  # noqa: E402
from paddle.amp.auto_cast import amp_global_state  # noqa: E402

paddle.set_device("cpu")


class _GpuLikePlace:
    def __init__(self, place):
        self._place = place

    def is_gpu_place(self):
        return True

    def __getattr__(self, name):
        return getattr(self._place, name)


class _TracerProxy:
    def __init__(self, tracer):
        self._tracer = tracer

    @property
    def _expected_place(self):
        return _GpuLikePlace(self._tracer._expected_place)

    def __getattr__(self, name):
        return getattr(self._tracer, name)


def make_scaler(config):
    real = _gs._dygraph_tracer
    _gs._dygraph_tracer = lambda: _TracerProxy(real())
    try:
        sc = paddle.amp.GradScaler(**config)
    finally:
        _gs._dygraph_tracer = real
    assert sc.is_enable() and sc.is_use_dynamic_loss_scaling()
    return sc


def run(config, pattern):
    paddle.seed(0)
    amp_global_state().amp_dtype = "float16"
    lin = paddle.nn.Linear(1, 1)
    opt = paddle.optimizer.SGD(learning_rate=1e-3, parameters=lin.parameters())
    sc = make_scaler(config)
    before, after, found, natural = [], [], [], 0
    for inject in pattern:
        x = paddle.to_tensor(np.array([[np.inf if inject else 1.0]], np.float32))
        w0 = lin.weight.numpy().copy()
        s0 = float(sc._scale.numpy()[0])
        loss = lin(x).sum()
        sc.scale(loss).backward()
        sc.step(opt)
        ov = bool(sc._cache_found_inf)
        with contextlib.redirect_stdout(io.StringIO()):  # update() prints on backoff
            sc.update()
        opt.clear_grad()
        changed = bool((lin.weight.numpy() != w0).any())
        # a skipped step never changes the weight (a clean step at a scale >= 2**126
        # may leave it unchanged too: 1/scale is a float32 subnormal there)
        assert not (ov and changed), (config, len(before), s0, inject)
        assert ov or not inject
        natural += int(ov and not inject)
        before.append(s0)
        after.append(float(sc._scale.numpy()[0]))
        found.append(ov)
    return found, before, after, natural


def cfg_of(
    init_loss_scaling=2.0**16, incr_ratio=2.0, decr_ratio=0.5, incr_every_n_steps=2000, decr_every_n_nan_or_inf=1
):
    return dict(
        init_loss_scaling=init_loss_scaling,
        incr_ratio=incr_ratio,
        decr_ratio=decr_ratio,
        incr_every_n_steps=incr_every_n_steps,
        decr_every_n_nan_or_inf=decr_every_n_nan_or_inf,
    )


def add(cases, name, cfg, pat):
    found, b, a, natural = run(cfg, pat)
    extra = {"natural_overflow": natural} if natural else {}
    cases.append(P.make_case(name, cfg, found, b, a, **extra))


def main():
    cases = []
    cfg = cfg_of()  # paddle.amp.GradScaler defaults
    for pname, pat in P.standard_patterns(2000, long_window=True):
        add(cases, "%s-default" % pname, cfg, pat)
    for w in (1, 2, 3, 5):
        cfg = cfg_of(init_loss_scaling=2.0**15, incr_every_n_steps=w)
        for pname, pat in P.standard_patterns(w, with_all_overflow=False):
            add(cases, "%s-w%d_n1" % (pname, w), cfg, pat)
    for n in (2, 3):
        cfg = cfg_of(init_loss_scaling=2.0**15, incr_every_n_steps=3, decr_every_n_nan_or_inf=n)
        for pname, pat in P.standard_patterns(3):
            add(cases, "%s-w3_n%d" % (pname, n), cfg, pat)
    cfg = cfg_of(
        init_loss_scaling=1000.0, incr_ratio=3.0, decr_ratio=0.8, incr_every_n_steps=2, decr_every_n_nan_or_inf=2
    )
    for pname, pat in (("bursts", P.bursts(2)), ("random_p0.5", P.random_p05()), ("all_overflow", P.all_overflow())):
        add(cases, "%s-w2_n2_r3_d0.8" % pname, cfg, pat)
    cfg = cfg_of(init_loss_scaling=2.0**120, incr_every_n_steps=2)
    for pname, pat in (("cap", P.cap()), ("after_inf_recover", P.after_inf_recover())):
        add(cases, "%s-init2p120_w2_n1" % pname, cfg, pat)
    P.write(
        "paddle",
        "paddlepaddle",
        paddle.__version__,
        cases,
        extra={"mode": "dygraph, CPU (place check and amp dtype worked around, see recorder)"},
    )


if __name__ == "__main__":
    main()
