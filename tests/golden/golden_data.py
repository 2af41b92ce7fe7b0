"""Load the recorded peer trajectories in tests/golden/*.json, fully expanded.

    from golden_data import load, peers
    doc = load("keras")           # the JSON document, every case expanded
    for case in doc["cases"]:
        case["overflow"], case["scale_before"], case["scale_after"]   # plain lists

Scales come back as Python floats (the strings "inf"/"nan" of the files become
float("inf")/float("nan")). Standard library only; Python >= 3.7.

On-disk compaction (see README.md, "File format"): each of the per-call
lists may be stored as
  * a plain JSON list;
  * {"rle": [[value, count], ...]}                run-length encoded;
  * {"chain_from": x}  (scale_before only)        [x] + scale_after[:-1];
  * {"rle_delta": [first, [[step, count], ...]]}  (integer lists) first value,
    then run-length encoded differences between consecutive values.
"""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
LIST_KEYS = ("overflow", "scale_before", "scale_after", "update_calls", "raised")
CASE_LISTS = ("cases", "manager_cases")


def _scalar(v):
    if isinstance(v, str):
        return float(v)  # "inf", "-inf", "nan"
    return v


def expand(packed, scale_after=None):
    """Expand one stored list (scale_after is needed for {"chain_from": x})."""
    if isinstance(packed, list):
        return list(packed)
    if "rle" in packed:
        out = []
        for v, n in packed["rle"]:
            out.extend([v] * n)
        return out
    if "chain_from" in packed:
        if scale_after is None:
            raise ValueError("chain_from needs the expanded scale_after list")
        return [packed["chain_from"]] + list(scale_after[:-1])
    if "rle_delta" in packed:
        first, runs = packed["rle_delta"]
        out = [first]
        for d, n in runs:
            for _ in range(n):
                out.append(out[-1] + d)
        return out
    raise ValueError(f"unknown list encoding: {sorted(packed)!r}")


def expand_case(case, numeric=True):
    c = dict(case)
    if "scale_after" in c:
        c["scale_after"] = expand(c["scale_after"])
    for k in LIST_KEYS:
        if k in c and k != "scale_after":
            c[k] = expand(c[k], scale_after=c.get("scale_after"))
    if numeric:
        for k in ("scale_before", "scale_after"):
            if k in c:
                c[k] = [_scalar(v) for v in c[k]]
    return c


def load(peer, numeric=True, directory=HERE):
    """The document for one peer with every case list expanded."""
    with open(os.path.join(directory, peer + ".json")) as f:
        doc = json.load(f)
    for key in CASE_LISTS:
        if key in doc:
            doc[key] = [expand_case(c, numeric=numeric) for c in doc[key]]
    return doc


def peers(directory=HERE):
    return sorted(n[:-5] for n in os.listdir(directory) if n.endswith(".json"))
