#!/usr/bin/env python3
"""Compare two replay results files step by step — answers, certificates and their details, gate decisions, tokens,
cells — ignoring timings; prints each differing field and a count. For showing that a refactor kept behaviour:

    python scripts/compare_results.py BEFORE/results.json AFTER/results.json
"""
import json
import math
import sys

TIMING = {"decode_ms", "prefill_ms", "wall_s", "timings"}
def load(p):
    d = json.load(open(p))
    return {(r["script"], r["policy"], r["budget"], r["seed"], r["protocol"]): r for r in d["runs"]}
def same(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
A, B = load(sys.argv[1]), load(sys.argv[2])
assert A.keys() == B.keys(), (A.keys(), B.keys())
diffs = 0
steps = 0
for key in A:
    ra, rb = A[key], B[key]
    for sa, sb in zip(ra["steps"], rb["steps"], strict=True):
        steps += 1
        for f in sorted(set(sa) | set(sb)):
            if f in TIMING:
                continue
            if not same(sa.get(f), sb.get(f)):
                diffs += 1
                print(key[1], "turn", sa["turn"], f, repr(sa.get(f))[:200], "=>", repr(sb.get(f))[:200])
    for f in ra["summary"]:
        if f in TIMING or f.endswith(("_ms", "_s")) or "wall" in f or "tok_s" in f:
            continue
        if not same(ra["summary"][f], rb["summary"].get(f)):
            print(key[1], "summary", f, ra["summary"][f], "=>", rb["summary"].get(f))
print(f"{len(A)} runs, {steps} steps compared, {diffs} differing fields")
