"""Record nnabla DynamicLossScalingUpdater trajectories, per forward/backward ATTEMPT.

The graph is loss = sum(w * x) with w a (1,) parameter, so dloss/dw = x and the
scaled gradient is scale * x. The data feeder pops the next element of the
overflow pattern on every call and sets x = inf (inject an overflow) or 1.0.
The updater re-runs the whole forward/backward (calling the feeder again) after
each overflow, so one update() call can consume several pattern elements.
When the pattern runs out in the middle of an update() call, further attempts
are fed clean data. The recorded "overflow" list is what the updater's own
check (solver.check_inf_or_nan_grad) returned for each attempt; it can differ
from the injected pattern when scale * 1.0 overflows float32 by itself
("natural_overflow" counts those attempts).

Run in a Python 3.10 venv with nnabla:  python record_nnabla.py
Writes tests/golden/nnabla.json.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nnabla as nn
import nnabla.functions as F
import nnabla.solvers as S
import numpy as np
import patterns as P
from nnabla.experimental.mixed_precision_training import DynamicLossScalingUpdater


def run(config, pattern):
    nn.clear_parameters()
    x = nn.Variable((1,))
    w = nn.parameter.get_parameter_or_create("w", (1,), initializer=np.ones((1,), np.float32))
    loss = F.sum(w * x)
    solver = S.Sgd(lr=1e-3)
    solver.set_parameters(nn.get_parameters())

    state = {"pos": 0, "call": -1}
    rec = {"before": [], "after": [], "overflow": [], "calls": [], "injected": []}
    updater = None

    def feeder():
        inject = state["pos"] < len(pattern) and bool(pattern[state["pos"]])
        state["pos"] += 1
        x.d = np.array([np.inf if inject else 1.0], np.float32)
        rec["before"].append(float(updater.scale))
        rec["calls"].append(state["call"])
        rec["injected"].append(inject)

    class RecordingSolver:
        """Delegates to the real solver; records what its inf/nan check returns."""

        def __getattr__(self, name):
            return getattr(solver, name)

        def check_inf_or_nan_grad(self):
            r = bool(solver.check_inf_or_nan_grad())
            rec["overflow"].append(r)
            return r

    updater = DynamicLossScalingUpdater(RecordingSolver(), loss, data_feeder=feeder, **config)

    while state["pos"] < len(pattern):
        state["call"] += 1
        start = len(rec["before"])
        updater.update()
        # scale after each attempt of this call: the next attempt's scale, and for
        # the last attempt the scale update() left behind
        for i in range(start, len(rec["before"])):
            rec["after"].append(rec["before"][i + 1] if i + 1 < len(rec["before"]) else float(updater.scale))
    assert len(rec["overflow"]) == len(rec["before"]) == len(rec["after"])
    natural = sum(1 for o, j in zip(rec["overflow"], rec["injected"]) if o and not j)
    missed = sum(1 for o, j in zip(rec["overflow"], rec["injected"]) if j and not o)
    assert missed == 0
    return rec, natural


def main():
    cases = []
    configs = [("default", {"scale": 8.0, "scaling_factor": 2.0, "N": 2000}, True)]
    for n in (1, 2, 3, 5):
        configs.append(("N%d" % n, {"scale": 8.0, "scaling_factor": 2.0, "N": n}, False))
    configs.append(("N3_f3", {"scale": 1000.0, "scaling_factor": 3.0, "N": 3}, False))
    for label, cfg, long_w in configs:
        pats = P.standard_patterns(cfg["N"], long_window=long_w, with_all_overflow=label in ("default", "N3_f3"))
        for pname, pat in pats:
            rec, natural = run(cfg, pat)
            cases.append(
                P.make_case(
                    "%s-%s" % (pname, label),
                    cfg,
                    rec["overflow"],
                    rec["before"],
                    rec["after"],
                    update_calls=rec["calls"],
                    natural_overflow=natural,
                )
            )
    cfg = {"scale": 2.0**120, "scaling_factor": 2.0, "N": 2}
    for pname, pat in (("cap", P.cap()), ("after_inf_recover", P.after_inf_recover())):
        rec, natural = run(cfg, pat)
        cases.append(
            P.make_case(
                "%s-init2p120_N2" % pname,
                cfg,
                rec["overflow"],
                rec["before"],
                rec["after"],
                update_calls=rec["calls"],
                natural_overflow=natural,
            )
        )
    # retry limit: 250 overflows in a row, then clean
    cfg = {"scale": 8.0, "scaling_factor": 2.0, "N": 3}
    pat = [True] * 250 + [False] * 10
    rec, natural = run(cfg, pat)
    cases.append(
        P.make_case(
            "retry_limit-N3",
            cfg,
            rec["overflow"],
            rec["before"],
            rec["after"],
            update_calls=rec["calls"],
            natural_overflow=natural,
        )
    )
    P.write(
        "nnabla",
        "nnabla",
        nn.__version__,
        cases,
        extra={
            "attempt_level": True,
            "note": "overflow/scale_before/scale_after are per forward/backward attempt; "
            "update_calls[i] is the 0-based update() call attempt i belonged to",
        },
    )


if __name__ == "__main__":
    main()
