"""Plain-Python models of the update rule each peer was OBSERVED to follow.

Each model replays the recorded overflow pattern and must reproduce the
recorded scale_before / scale_after exactly (bit for bit, with the peer's own
float width). `python observed_rules.py` checks every tests/golden/*.json that
exists. Needs only the standard library (struct for float32 rounding).
"""

import math
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import patterns as P

sys.path.insert(0, P.GOLDEN_DIR)
import golden_data

INF = float("inf")


def f32(x):
    """Round a Python float to float32 (overflow -> inf), like a float32 tensor op."""
    if math.isinf(x) or math.isnan(x):
        return x
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(INF, x)


# ------------------------------------------------------------------ models
# Each model: model(config, overflow_list) -> (scale_before, scale_after)


def keras(cfg, overflow):
    s = f32(cfg.get("initial_scale", 2.0**15))
    w = cfg.get("dynamic_growth_steps", 2000)
    g = 0
    before, after = [], []
    for ov in overflow:
        before.append(s)
        if ov:
            g = 0
            s = f32(s * 0.5)
        elif g == w - 1:  # grows on the W-th consecutive clean step
            g = 0
            s = f32(s * 2.0)  # no cap: float32 overflow to inf is kept
        else:
            g += 1
        after.append(s)
    return before, after


def tf2_dynamic(s, w, m, overflow):
    """tf.compat.v1 DynamicLossScale and tf_keras 2 _DynamicLossScaleState."""
    s = f32(s)
    g = 0
    before, after = [], []
    for ov in overflow:
        before.append(s)
        if ov:
            g = 0
            s = f32(max(f32(s / m), 1.0))  # floor 1
        elif g + 1 >= w:  # grows on the W-th consecutive clean step
            g = 0
            new = f32(s * m)
            if not math.isinf(new):  # growth to inf is refused (scale stays)
                s = new
        else:
            g += 1
        after.append(s)
    return before, after


def tf1_contrib(cfg, overflow):
    """TF1 contrib ExponentialUpdateLossScaleManager (float32 variables)."""
    s = f32(cfg["init_loss_scale"])
    w = cfg["incr_every_n_steps"]
    n = cfg.get("decr_every_n_nan_or_inf", 2)
    up = f32(cfg.get("incr_ratio", 2))
    down = f32(cfg.get("decr_ratio", 0.8))
    good = bad = 0
    before, after = [], []
    for ov in overflow:
        before.append(s)
        if ov:
            if bad + 1 >= n:  # bad counts overflows since the last scale change
                s = max(1.0, f32(s * down))  # floor 1
                good = bad = 0
            else:
                bad += 1
                good = 0
        else:
            if good + 1 >= w:  # grows on the W-th consecutive clean step
                new = f32(s * up)
                if not math.isinf(new):  # refuses to grow to inf (keeps S, still resets)
                    s = new
                good = bad = 0  # a growth attempt resets bad too
            else:
                good += 1  # a clean step does NOT reset bad
        after.append(s)
    return before, after


def mindspore_cell(cfg, overflow):
    """nn.DynamicLossScaleUpdateCell: float32 scale, int32 iteration counters."""
    s = f32(cfg["loss_scale_value"])
    f = f32(cfg["scale_factor"])
    recip = f32(1.0 / f)  # backoff multiplies by float32 1/f
    w = cfg["scale_window"]
    cur, last = 1, 0
    before, after = [], []
    for ov in overflow:
        before.append(s)
        on_ov = max(f32(s * recip), 1.0) if ov else s
        should_inc = (cur - last) >= w
        if ov or should_inc:
            last = cur
        s = f32(on_ov * f) if (should_inc and not ov) else on_ov
        cur += 1
        after.append(s)
    return before, after


def mindspore_manager(cfg, overflow):
    """amp.DynamicLossScaleManager: Python floats; raises after 1000 consecutive overflows."""
    s = cfg["init_loss_scale"]
    f = cfg["scale_factor"]
    w = cfg["scale_window"]
    cur, last, bad = 1, 0, 0
    before, after, raised = [], [], []
    for ov in overflow:
        before.append(float(s))
        r = False
        if ov:
            s = max(s * (1 / f), 1)
            last = cur
            bad += 1
        else:
            if (cur - last) % w == 0:
                s *= f
            bad = 0
        if bad > 1000:
            r = True  # RuntimeError; cur_iter is NOT advanced
        else:
            cur += 1
        after.append(float(s))
        raised.append(r)
    return before, after, raised


def deepspeed(cfg, overflow):
    """runtime.fp16.loss_scaler.DynamicLossScaler: Python floats, factor 2 fixed."""
    s = cfg["init_scale"]
    w = cfg["scale_window"]
    lo = cfg["min_scale"]
    ds = cfg["delayed_shift"]
    cons = cfg["consecutive_hysteresis"]
    rz = cfg["raise_error_at_min_scale"]
    cur, last, h = 0, -1, ds
    before, after, raised = [], [], []
    for ov in overflow:
        before.append(s)
        r = False
        if ov:
            if ds == 1 or h == 1:
                if s == lo and rz:
                    r = True  # raises before any state change (cur_iter too)
                else:
                    s = max(s / 2.0, lo)  # h stays 1: the next overflow backs off again
            else:
                h -= 1
            if not r:
                last = cur
        else:
            if cons:
                h = ds  # every clean step refills hysteresis
            stable = cur - last - 1
            if stable > 0 and stable % w == 0:  # grows on the (W+1)-th clean step
                if not cons:
                    h = ds  # non-consecutive: refilled only on growth
                s *= 2.0
        if not r:
            cur += 1
        after.append(s)
        raised.append(r)
    return before, after, raised


def megatron(cfg, overflow):
    """core.optimizer.grad_scaler.DynamicGradScaler: float32 tensor scale."""
    s = f32(cfg["initial_scale"])
    lo = f32(cfg["min_scale"])
    up = f32(cfg["growth_factor"])
    down = f32(cfg["backoff_factor"])
    w = cfg["growth_interval"]
    hyst = cfg["hysteresis"]
    g, h = 0, hyst
    before, after = [], []
    for ov in overflow:
        before.append(s)
        if ov:
            g = 0
            h -= 1  # never refilled by a clean step
            if h <= 0:
                s = max(f32(s * down), lo)
        else:
            g += 1
            if g == w:  # grows on the W-th consecutive clean step
                g = 0
                h = hyst  # hysteresis refilled only here
                s = f32(s * up)  # no cap: float32 inf is kept
        after.append(s)
    return before, after


def nnabla(cfg, overflow):
    """experimental.mixed_precision_training.DynamicLossScalingUpdater, per ATTEMPT.

    Returns (scale_before, scale_after, update_calls) for the given per-attempt
    overflow list."""
    s = cfg["scale"]
    f = cfg["scaling_factor"]
    n = cfg["N"]
    counter, rc, call = 0, 0, 0
    before, after, calls = [], [], []
    for ov in overflow:
        before.append(s)
        calls.append(call)
        if ov:
            s /= f  # Python float, no floor
            counter = 0
            rc += 1
            if rc > 100:  # 101 attempts: give up, skip silently
                rc = 0
                call += 1
            # else: update() re-runs itself (new batch) within the same call
        else:
            rc = 0
            if counter > n:  # grows on the (N+2)-th clean attempt from the
                s *= f  # start / an overflow, then every N+1
                counter = 0
            counter += 1
            call += 1
        after.append(s)
    return before, after, calls


def paddle(cfg, overflow):
    """paddle.amp.GradScaler (dygraph) _update(): float32 tensor scale."""
    s = f32(cfg["init_loss_scaling"])
    up = f32(cfg["incr_ratio"])
    down = f32(cfg["decr_ratio"])
    w = cfg["incr_every_n_steps"]
    n = cfg["decr_every_n_nan_or_inf"]
    incr = decr = 0
    before, after = [], []
    for ov in overflow:
        before.append(s)
        if ov:
            incr = 0
            decr += 1
            if decr == n:  # n-th CONSECUTIVE overflow backs off
                s = f32(s * down)  # no floor
                decr = 0
        else:
            decr = 0  # a clean step resets the overflow count
            incr += 1
            if incr == w:  # grows on the W-th consecutive clean step
                s = f32(s * up)  # no cap: float32 inf is kept
                incr = 0
        after.append(s)
    return before, after


MODELS = {
    "keras": lambda case: keras(case["config"], case["overflow"]),
    "paddle": lambda case: paddle(case["config"], case["overflow"]),
    "megatron": lambda case: megatron(case["config"], case["overflow"]),
    "nnabla": lambda case: nnabla(case["config"], case["overflow"]),
    "deepspeed": lambda case: deepspeed(case["config"], case["overflow"]),
    "tf1_contrib": lambda case: tf1_contrib(case["config"], case["overflow"]),
    "mindspore": lambda case: mindspore_cell(case["config"], case["overflow"]),
    "mindspore.manager": lambda case: mindspore_manager(case["config"], case["overflow"]),
    "tf_v1": lambda case: tf2_dynamic(
        case["config"]["initial_loss_scale"],
        case["config"]["increment_period"],
        case["config"]["multiplier"],
        case["overflow"],
    ),
    "tf_keras2": lambda case: tf2_dynamic(
        case["config"]["initial_scale"], case["config"]["dynamic_growth_steps"], 2.0, case["overflow"]
    ),
}


def _same(a, b):
    if isinstance(a, str) or isinstance(b, str):
        return str(a) == str(b)
    return a == b


def check(peer):
    fname, _, sub = peer.partition(".")
    doc = golden_data.load(fname, numeric=False)
    model = MODELS[peer]
    bad = 0
    cases = doc[sub + "_cases"] if sub else doc["cases"]
    for c in cases:
        res = model(c)
        if "update_calls" in c and c["update_calls"] != res[2]:
            print("  MISMATCH %s/%s in 'update_calls'" % (peer, c["name"]))
            bad += 1
        elif "update_calls" not in c and len(res) > 2 and (c.get("raised") or any(res[2])):
            if c.get("raised", [False] * len(res[2])) != res[2]:
                print("  MISMATCH %s/%s in 'raised'" % (peer, c["name"]))
                bad += 1
        exp_b = c["scale_before"]
        exp_a = c["scale_after"]
        got_b = [P._num(x) for x in res[0]]
        got_a = [P._num(x) for x in res[1]]
        for i in range(len(exp_a)):
            if not (_same(got_b[i], exp_b[i]) and _same(got_a[i], exp_a[i])):
                print(
                    "  MISMATCH %s/%s at call %d: overflow=%s expected %s->%s, model %s->%s"
                    % (peer, c["name"], i, c["overflow"][i], exp_b[i], exp_a[i], got_b[i], got_a[i])
                )
                bad += 1
                break
        if len(got_a) != len(exp_a):
            print("  LENGTH %s/%s: %d vs %d" % (peer, c["name"], len(got_a), len(exp_a)))
            bad += 1
    print("%-18s %3d cases, %d mismatching" % (peer, len(cases), bad))
    return bad


def main(argv):
    peers = argv or sorted(MODELS)
    bad = 0
    for peer in peers:
        if os.path.exists(os.path.join(P.GOLDEN_DIR, peer.partition(".")[0] + ".json")):
            bad += check(peer)
        else:
            print("%-18s (no json)" % peer)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
