#!/usr/bin/env python3
"""Summarises `kvserve control simulate --policy all --json` runs (a folder of them) as Markdown."""
import glob
import json
import os
import sys

folder = sys.argv[1]
rows = []
for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
    j = json.load(open(path))
    p = {x["policy"]: x for x in j["policies"]}
    statics = [x for k, x in p.items() if k.startswith("static:")]
    best = min(statics, key=lambda x: x["mean_ms"])
    a, ma, o, n = p["adaptive"], p["adaptive-ma"], p["oracle"], p["none"]
    drift = ",".join(j["drift"]) or "-"
    rows.append((drift, os.path.basename(j["trace"]), a, ma, o, n, best, j["recovery_requests"], j["recovery_requests_ma"]))
rows.sort(key=lambda r: (r[0] != "-", r[0], r[1]))
print("| drift | trace | adaptive mean ms | adaptive-ma | oracle | none | best static | adaptive/oracle | adaptive/best static | SLO (adaptive) | floor violations | recovery (bandit / MA) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for d, t, a, ma, o, n, b, rec, rec_ma in rows:
    rc = "-" if d == "-" else f"{rec if rec is not None else 'never'} / {rec_ma if rec_ma is not None else 'never'}"
    print(f"| {d} | {t} | {a['mean_ms']:.1f} | {ma['mean_ms']:.1f} | {o['mean_ms']:.1f} | {n['mean_ms']:.1f} | {b['mean_ms']:.1f} | "
          f"{a['mean_ms'] / o['mean_ms']:.3f} | {a['mean_ms'] / b['mean_ms']:.3f} | {a['slo_attainment']:.3f} | "
          f"{a['floor_violations'] + ma['floor_violations'] + o['floor_violations']} | {rc} |")
