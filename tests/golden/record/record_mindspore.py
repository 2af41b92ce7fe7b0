"""Record MindSpore loss-scale trajectories (PyNative mode, CPU).

* "cases": mindspore.nn.DynamicLossScaleUpdateCell(loss_scale_value, scale_factor,
  scale_window), called as cell(loss_scale_parameter, overflow_tensor); the scale is
  the float32 Parameter the cell updates in place.
* "manager_cases": mindspore.amp.DynamicLossScaleManager(init_loss_scale,
  scale_factor, scale_window).update_loss_scale(overflow) (pure Python floats).
  Cases whose update raised carry a "raised" list (one bool per call) and
  "raise_message"; a call that raised still has its scale_after recorded (the
  manager changes the scale before it raises).

Run in a venv with mindspore:  python record_mindspore.py
Writes tests/golden/mindspore.json.
"""

import os
import sys

os.environ.setdefault("GLOG_v", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mindspore as ms
import patterns as P
from mindspore import Parameter, Tensor, nn

ms.set_context(mode=ms.PYNATIVE_MODE)
try:
    ms.set_device("CPU")
except Exception:  # older API
    ms.set_context(device_target="CPU")

TRUE = Tensor(True, ms.bool_)
FALSE = Tensor(False, ms.bool_)


def run_cell(config, overflow):
    cell = nn.DynamicLossScaleUpdateCell(**config)
    scale = Parameter(Tensor(config["loss_scale_value"], ms.float32), name="loss_scale")
    before, after = [], []
    for ov in overflow:
        s0 = float(scale.asnumpy())
        out = cell(scale, TRUE if ov else FALSE)
        assert bool(out.asnumpy()) == ov
        before.append(s0)
        after.append(float(scale.asnumpy()))
    return before, after


def run_manager(config, overflow):
    mgr = ms.amp.DynamicLossScaleManager(**config)
    before, after, raised = [], [], []
    message = None
    for ov in overflow:
        s0 = float(mgr.get_loss_scale())
        r = False
        try:
            mgr.update_loss_scale(ov)
        except RuntimeError as e:  # the bad_step_max guard
            r = True
            if message is None:
                message = str(e)
        before.append(s0)
        after.append(float(mgr.get_loss_scale()))
        raised.append(r)
    return before, after, raised, message


def main():
    cases = []
    mcases = []
    configs = [("default", {"loss_scale_value": 2.0**24, "scale_factor": 2, "scale_window": 2000}, True)]
    for w in (1, 2, 3, 5):
        configs.append(("w%d" % w, {"loss_scale_value": 2.0**24, "scale_factor": 2, "scale_window": w}, False))
    configs.append(("w3_f3", {"loss_scale_value": 1000.0, "scale_factor": 3, "scale_window": 3}, False))
    for label, cfg, long_w in configs:
        pats = P.standard_patterns(
            cfg["scale_window"], long_window=long_w, with_all_overflow=label in ("default", "w2", "w3_f3")
        )
        for pname, pat in pats:
            b, a = run_cell(cfg, pat)
            cases.append(P.make_case("%s-%s" % (pname, label), cfg, pat, b, a))
            if label in ("w3", "w5"):
                continue  # the manager is plain Python: fewer configs keep the file small
            mcfg = {
                "init_loss_scale": cfg["loss_scale_value"],
                "scale_factor": cfg["scale_factor"],
                "scale_window": cfg["scale_window"],
            }
            b, a, raised, msg = run_manager(mcfg, pat)
            assert not any(raised)
            mcases.append(P.make_case("%s-%s" % (pname, label), mcfg, pat, b, a))
    cfg = {"loss_scale_value": 2.0**120, "scale_factor": 2, "scale_window": 2}
    for pname, pat in (("cap", P.cap()), ("after_inf_recover", P.after_inf_recover())):
        b, a = run_cell(cfg, pat)
        cases.append(P.make_case("%s-init2p120_w2" % pname, cfg, pat, b, a))
        mcfg = {"init_loss_scale": 2.0**120, "scale_factor": 2, "scale_window": 2}
        b, a, raised, msg = run_manager(mcfg, pat)
        mcases.append(P.make_case("%s-init2p120_w2" % pname, mcfg, pat, b, a))
    # the manager's "continuous overflow" guard: 1100 overflows, 3 clean, 1002 overflows
    mcfg = {"init_loss_scale": 2.0**24, "scale_factor": 2, "scale_window": 2000}
    pat = [True] * 1100 + [False] * 3 + [True] * 1002
    b, a, raised, msg = run_manager(mcfg, pat)
    first = raised.index(True) if any(raised) else None
    mcases.append(
        P.make_case("many_overflows-default", mcfg, pat, b, a, raised=raised, raise_message=msg, first_raise_call=first)
    )
    P.write(
        "mindspore", "mindspore", ms.__version__, cases, extra={"manager_cases": mcases, "mode": "PYNATIVE_MODE, CPU"}
    )


if __name__ == "__main__":
    main()
