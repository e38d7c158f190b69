#!/usr/bin/env python3
"""Summarises `kvserve control simulate --policy all --json` runs (a folder of them) as Markdown:
per workload, trace and drift, the policies' mean latency, adaptive against the per-request oracle
and the best static strategy, and how every workload x trace fares against issue 32's goals."""
import glob
import json
import os
import sys

folder = sys.argv[1]
rows = []
for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
    j = json.load(open(path))
    p = {x["policy"]: x for x in j["policies"]}
    statics = [x for k, x in p.items() if k.startswith("static:")] + [p["none"]]
    best = min(statics, key=lambda x: x["mean_ms"])
    drift = ",".join(j["drift"]) or "-"
    rows.append((os.path.basename(j["workload"]), drift, os.path.basename(j["trace"]), p, best,
                 j["recovery_requests"], j["recovery_requests_ma"]))
rows.sort(key=lambda r: (r[0], r[1] != "-", r[1], r[2]))
print("| workload | drift | trace | adaptive mean ms | adaptive-bandit | adaptive-ma | oracle | none | best static |"
      " adaptive/oracle | adaptive/best static | adaptive-ma/best static | SLO (adaptive) | floor violations |"
      " recovery (adaptive / MA) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
worst = {}
for w, d, t, p, b, rec, rec_ma in rows:
    a, ab, ma, o, n = p["adaptive"], p["adaptive-bandit"], p["adaptive-ma"], p["oracle"], p["none"]
    rc = "-" if d == "-" else f"{rec if rec is not None else 'never'} / {rec_ma if rec_ma is not None else 'never'}"
    fv = sum(x["floor_violations"] for x in (a, ab, ma, o))
    print(f"| {w} | {d} | {t} | {a['mean_ms']:.1f} | {ab['mean_ms']:.1f} | {ma['mean_ms']:.1f} | {o['mean_ms']:.1f} | "
          f"{n['mean_ms']:.1f} | {b['mean_ms']:.1f} | {a['mean_ms'] / o['mean_ms']:.3f} | {a['mean_ms'] / b['mean_ms']:.3f} | "
          f"{ma['mean_ms'] / b['mean_ms']:.3f} | {a['slo_attainment']:.3f} | {fv} | {rc} |")
    if d == "-":
        k = worst.setdefault(w, [0, 0, 0, 0, 0])
        k[0] = max(k[0], a["mean_ms"] / b["mean_ms"])
        k[1] = max(k[1], a["mean_ms"] / o["mean_ms"])
        k[2] += a["floor_violations"]
        k[3] = max(k[3], ma["mean_ms"] / b["mean_ms"])
        k[4] = max(k[4], ma["mean_ms"] / o["mean_ms"])
print()
print("Without drift, worst over the traces (issue 32's goals: adaptive <= 1.02 x best static, <= 1.05 x oracle, 0 floor violations):")
print()
print("| workload | adaptive / best static | adaptive / oracle | adaptive floor violations | adaptive-ma / best static | adaptive-ma / oracle |")
print("| --- | --- | --- | --- | --- | --- |")
for w, k in sorted(worst.items()):
    print(f"| {w} | {k[0]:.3f} | {k[1]:.3f} | {k[2]} | {k[3]:.3f} | {k[4]:.3f} |")
