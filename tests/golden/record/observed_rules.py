"""Plain-Python models of the update rule each peer was OBSERVED to follow.

Each model replays the recorded overflow pattern and must reproduce the
recorded scale_before / scale_after exactly (bit for bit, with the peer's own
float width). `python observed_rules.py` checks every tests/golden/*.json that
exists. Needs only the standard library (struct for float32 rounding).
"""
import json
import math
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import patterns as P  # noqa: E402

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
    s = f32(cfg.get("initial_scale", 2.0 ** 15))
    w = cfg.get("dynamic_growth_steps", 2000)
    g = 0
    before, after = [], []
    for ov in overflow:
        before.append(s)
        if ov:
            g = 0
            s = f32(s * 0.5)
        elif g == w - 1:          # grows on the W-th consecutive clean step
            g = 0
            s = f32(s * 2.0)      # no cap: float32 overflow to inf is kept
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
            s = f32(max(f32(s / m), 1.0))    # floor 1
        elif g + 1 >= w:                     # grows on the W-th consecutive clean step
            g = 0
            new = f32(s * m)
            if not math.isinf(new):          # growth to inf is refused (scale stays)
                s = new
        else:
            g += 1
        after.append(s)
    return before, after


MODELS = {
    "keras": lambda case: keras(case["config"], case["overflow"]),
    "tf_v1": lambda case: tf2_dynamic(case["config"]["initial_loss_scale"],
                                      case["config"]["increment_period"],
                                      case["config"]["multiplier"], case["overflow"]),
    "tf_keras2": lambda case: tf2_dynamic(case["config"]["initial_scale"],
                                          case["config"]["dynamic_growth_steps"], 2.0,
                                          case["overflow"]),
}


def _same(a, b):
    if isinstance(a, str) or isinstance(b, str):
        return str(a) == str(b)
    return a == b


def check(peer, path=None):
    path = path or os.path.join(P.GOLDEN_DIR, peer + ".json")
    doc = json.load(open(path))
    model = MODELS[peer]
    bad = 0
    for case in doc["cases"]:
        c = dict(case)
        for k in ("overflow", "scale_before", "scale_after", "update_calls"):
            if k in c:
                c[k] = P.expand(c[k])
        res = model(c)
        exp_b = c["scale_before"]
        exp_a = c["scale_after"]
        got_b = [P._num(x) for x in res[0]]
        got_a = [P._num(x) for x in res[1]]
        for i in range(len(exp_a)):
            if not (_same(got_b[i], exp_b[i]) and _same(got_a[i], exp_a[i])):
                print("  MISMATCH %s/%s at call %d: overflow=%s expected %s->%s, model %s->%s"
                      % (peer, c["name"], i, c["overflow"][i], exp_b[i], exp_a[i], got_b[i], got_a[i]))
                bad += 1
                break
        if len(got_a) != len(exp_a):
            print("  LENGTH %s/%s: %d vs %d" % (peer, c["name"], len(got_a), len(exp_a)))
            bad += 1
    print("%-12s %3d cases, %d mismatching" % (peer, len(doc["cases"]), bad))
    return bad


def main(argv):
    peers = argv or sorted(MODELS)
    bad = 0
    for peer in peers:
        if os.path.exists(os.path.join(P.GOLDEN_DIR, peer + ".json")):
            bad += check(peer)
        else:
            print("%-12s (no json)" % peer)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
