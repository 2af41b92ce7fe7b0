"""Deterministic overflow patterns and the JSON writer shared by every recorder.

Kept compatible with Python 3.7 (the TF 1.15 recorder runs there): no walrus,
no builtin generics, no f-string '=' specifier.

An overflow pattern is a list of bools, one per update call: True means "this
step's gradients were non-finite".
"""

import json
import math
import os
import platform
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN_DIR = os.path.dirname(HERE)


def clean(n=300):
    return [False] * n


def periodic(n=300, every=7):
    # overflow on the 7th, 14th, ... call (1-based)
    return [(i + 1) % every == 0 for i in range(n)]


def bursts(window, target=300):
    """Bursts of 1, 2, 3, 4 consecutive overflows separated by clean runs whose
    lengths are window, window-1, window+1, 2*window, 1, 2*window+1, 3*window-1,
    2, window (cycled), so growth right at / just before / just after the
    interval is exercised after every burst size."""
    w = int(window)
    runs = [w, max(w - 1, 0), w + 1, 2 * w, 1, 2 * w + 1, 3 * w - 1, 2, w]
    out = []
    k = 0
    while len(out) < target:
        out.extend([False] * runs[k % len(runs)])
        out.extend([True] * (k % 4 + 1))
        k += 1
    out.extend([False] * (w + 2))  # end on a clean run long enough to grow
    return out


def bernoulli(p, n, seed):
    rng = random.Random(seed)
    return [rng.random() < p for _ in range(n)]


def random_p01():
    return bernoulli(0.1, 400, 1234)


def random_p05():
    return bernoulli(0.5, 200, 5678)


def all_overflow(n=200):
    return [True] * n


def long_default(window):
    """For large default windows: a clean run of ~2.5 windows with a single
    overflow at 1.25 windows, so the first growth (from the initial state), the
    overflow, and the first growth after an overflow are all captured."""
    w = int(window)
    n = int(2.5 * w) + 10
    ov = int(1.25 * w)
    return [i == ov for i in range(n)]


def cap(n=400):
    """Use with a large initial scale (2**120) and window 2."""
    return [False] * n


def after_inf_recover():
    """Use with initial scale 2**120 and window 2: clean until the scale hits
    float32 inf (if it does), then 5 overflows, then 40 clean steps."""
    return [False] * 30 + [True] * 5 + [False] * 40


def standard_patterns(window, long_window=False, with_all_overflow=True):
    """(name, pattern) pairs for one config. With long_window (the peer's big
    default window) the window-relative patterns are replaced by long_default.
    with_all_overflow=False drops the 200-overflow run (recorders keep it for
    the configs where the window or hysteresis could change it)."""
    pats = []
    if long_window:
        pats.append(("long", long_default(window)))
    else:
        pats.append(("clean", clean()))
        pats.append(("bursts", bursts(window)))
    pats.append(("periodic", periodic()))
    pats.append(("random_p0.1", random_p01()))
    pats.append(("random_p0.5", random_p05()))
    if with_all_overflow:
        pats.append(("all_overflow", all_overflow()))
    return pats


# ---------------------------------------------------------------- JSON output


def _num(x):
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _rle(values):
    out = []
    for v in values:
        if out and out[-1][0] == v and type(out[-1][0]) is type(v):
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def _size(x):
    return len(json.dumps(x, separators=(",", ":")))


def _pack(values, chain_after=None):
    """The shortest of the encodings golden_data.expand() understands."""
    values = list(values)
    options = [values, {"rle": _rle(values)}]
    if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        deltas = [b - a for a, b in zip(values, values[1:])]
        options.append({"rle_delta": [values[0], _rle(deltas)]})
    if chain_after is not None and values and list(chain_after[:-1]) == values[1:]:
        options.append({"chain_from": values[0]})
    best = min(options, key=_size)
    assert expand(best, chain_after) == values
    return best


def expand(packed, scale_after=None):
    sys.path.insert(0, GOLDEN_DIR)
    import golden_data

    return golden_data.expand(packed, scale_after)


def make_case(name, config, overflow, scale_before, scale_after, **extra):
    assert len(overflow) == len(scale_before) == len(scale_after), name
    case = {
        "name": name,
        "config": config,
        "overflow": [bool(o) for o in overflow],
        "scale_before": [_num(s) for s in scale_before],
        "scale_after": [_num(s) for s in scale_after],
    }
    for k, v in extra.items():
        case[k] = v
    return case


def _pack_case(c):
    after = c.get("scale_after")
    for key in ("overflow", "scale_before", "scale_after", "update_calls", "raised"):
        if key in c and isinstance(c[key], list):
            c[key] = _pack(c[key], chain_after=after if key == "scale_before" else None)
    return c


def write(peer, framework, version, cases, extra=None, path=None):
    doc = {
        "peer": peer,
        "framework": framework,
        "version": version,
        "python": "%d.%d" % tuple(int(p) for p in platform.python_version_tuple()[:2]),
        "encoding": "per-call lists are plain lists or compacted; "
        "tests/golden/golden_data.py expands them (see README.md)",
        "cases": [],
    }
    for c in cases:
        c = dict(c)
        _pack_case(c)
        doc["cases"].append(c)
    if extra:
        for key, val in extra.items():
            if key.endswith("_cases"):
                val = [_pack_case(dict(c)) for c in val]
            doc[key] = val
    if path is None:
        path = os.path.join(GOLDEN_DIR, peer + ".json")
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"), allow_nan=False)
        f.write("\n")
    print("wrote %s (%d cases, %d bytes)" % (path, len(doc["cases"]), os.path.getsize(path)))
    return path
