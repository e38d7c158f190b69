#!/usr/bin/env python3
"""Writes docs/results/e2e_pd.md from a `kvserve bench e2e --json` result: the table of every
point, the pipelining check and each goal of the PD serving issue, computed from the numbers.

    python3 scripts/e2e_report.py docs/results/e2e_pd.json "COMMAND" "MACHINE, DATE, TIME" > docs/results/e2e_pd.md
"""
import json
import sys

path, command, where = sys.argv[1], sys.argv[2], sys.argv[3]
j = json.load(open(path))
points = j["points"]
by = {}
for p in points:
    by.setdefault(p["gbps"], {})[p["policy"]] = p
gbps_list = sorted(by)

out = []
w = out.append
w("# PD serving end to end (bench e2e)\n")
w(f"Command ({where}):\n")
w("```\n" + command + "\n```\n")
cm = j["compute_model"]
w(f"{j['kv_shape']}-shaped synthetic KV ({j['kv_bytes_per_token'] // 1024} KiB/token fp16, "
  f"{j['mean_prompt_tokens']:.0f}-token prompts), {j['requests']} {j['arrival']} arrivals per point at the rate that loads the "
  f"uncompressed link to {j['load']}, {j['max_new_tokens']} generated tokens, TTFT objective {j['slo_ms']:.0f} ms, floor "
  f"{j['floor']}, {j['codec_threads']} codec threads. Compute is modelled (prefill {cm['prefill_tokens_per_second']:.0f} "
  f"tokens/s one prompt at a time, decode {cm['decode_tokens_per_second']:.0f} tokens/s; see [../SERVING.md](../SERVING.md)); "
  "the codec, TCP transport, in-process link shaping and the controller are real. The link ceiling measured in the run was "
  f"{j['link_ceiling_gbps']:.1f} Gbit/s (loopback, both ends in one process); points above 90% of it are the simulator's "
  "prediction from the measured stage speeds (`modelled`). Capacity (the highest Poisson rate whose P99 TTFT meets the "
  "objective) is the simulator's for every point. Quality: the relative accuracy the profile (adaptive) or the strategy "
  "table (static) measured on babyllama105. Plot: [e2e_pd.svg](e2e_pd.svg).\n")
w("| Gbit/s | policy | kind | mean JCT ms | p50 | p99 | TTFT p99 | SLO | quality | MiB on wire | vs none | capacity req/s (modelled) |")
w("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
def ci(p, key, fmt=".0f"):
    """A figure with its 95% interval where the result has repeats (older results have none)."""
    half = p.get("ci95", {}).get(key, 0)
    return f"{p[key]:{fmt}} ± {half:{fmt}}" if p.get("repeats", 1) > 1 else f"{p[key]:{fmt}}"


for p in points:
    n = by[p["gbps"]]["none"]
    if "vs_none" in p and p.get("repeats", 1) > 1:
        vs = f"{p['vs_none']['mean']:.2f} ± {p['vs_none']['ci95']:.2f}×"
    else:
        vs = f"{n['mean_ms'] / p['mean_ms']:.2f}×"
    kind = ('measured' if p['measured'] else 'modelled') + ('' if p.get('valid', True) else ', invalid')
    w(f"| {p['gbps']:g} | {p['policy']} | {kind} | {ci(p, 'mean_ms')} | {ci(p, 'p50_ms')} | "
      f"{ci(p, 'p99_ms')} | {ci(p, 'ttft_p99_ms')} | {100 * p['slo_attainment']:.0f}% | {p['quality']:.4f} | "
      f"{p['wire_bytes'] / 2**20:.0f} | {vs} | {p['capacity_rps_modelled']:.3g} |")
if j.get("repeats", 1) > 1:
    w(f"\nEach measured point is the mean of {j['repeats']} repeats (fresh nodes, policies in rotating order, the same "
      "arrivals), ± the half-width of its 95% Student-t interval; ratios are paired by repeat. Link ceiling readings: "
      + ", ".join(f"{g:.1f}" for g in j.get("link_ceiling_readings_gbps", [])) + " Gbit/s (the lowest decides what is measured).")
cal = j.get("calibration")
w("")
if cal:
    w(f"Calibration: each policy's request alone on each measured link, against its parts (prefill and generation at the "
      f"modelled rates, its frames pipelined with the link at its rate); tolerance {100 * cal['tolerance']['relative']:.0f}% or "
      f"{cal['tolerance']['absolute_ms']:.0f} ms. {'Every check passed.' if cal['valid'] else 'Points of a policy that failed say valid: false: they measure the testbed, not the system.'}\n")
    w("| Gbit/s | policy | measured ms | predicted ms | ratio | valid |")
    w("| --- | --- | --- | --- | --- | --- |")
    for c in cal["checks"]:
        w(f"| {c['gbps']:g} | {c['policy']} | {c['measured_ms']:.0f} | {c['predicted_ms']:.0f} | {c['ratio']:.2f} | "
          f"{'yes' if c['valid'] else 'no (' + c.get('fault', '?') + ')'} |")
    w("")
else:
    w("This result predates the calibration check (no `calibration` section): its points were not checked against a lone "
      "request's parts.\n")
pl = j["pipelining"]
if pl:
    w(f"Pipelining, one request alone at {pl['gbps']:g} Gbit/s with `{pl['strategy']}`: encode {pl['encode_ms']:.0f} + wire "
      f"{pl['wire_ms']:.0f} + decode {pl['decode_ms']:.0f} = {pl['sum_ms']:.0f} ms; the slowest stage {pl['max_ms']:.0f} ms; "
      f"observed {pl['observed_ms']:.0f} ms ({pl['observed_ms'] / pl['max_ms']:.2f}× the slowest; goal ≤ 1.3×).\n")
w("## Against the goals (computed from the points above)\n")
if 5.0 in by:
    a, n = by[5.0]["adaptive"], by[5.0]["none"]
    w(f"- **5 Gbit/s, JCT**: adaptive {n['mean_ms'] / a['mean_ms']:.2f}× lower than none (goal ≥ 9×), "
      f"{a['floor_violations']} floor violations, mean quality {a['quality']:.4f}.")
    cap = a["capacity_rps_modelled"] / max(1e-12, n["capacity_rps_modelled"])
    w(f"- **5 Gbit/s, capacity (modelled)**: adaptive {a['capacity_rps_modelled']:.3g} req/s, none "
      f"{n['capacity_rps_modelled']:.3g}: {cap:.1f}× (goal ≥ 5×).")
for g in gbps_list:
    a, n = by[g]["adaptive"], by[g]["none"]
    statics = {k: v for k, v in by[g].items() if k.startswith("static:")}
    best = min(statics.items(), key=lambda kv: kv[1]["mean_ms"]) if statics else None
    vs_best = best[1]["mean_ms"] / a["mean_ms"] if best else float("nan")
    verdict = "meets" if vs_best >= 0.98 and n["mean_ms"] / a["mean_ms"] >= 0.98 else "misses"
    w(f"- **{g:g} Gbit/s ({'measured' if a['measured'] else 'modelled'})**: adaptive {a['mean_ms']:.0f} ms; none "
      f"{n['mean_ms']:.0f} ({n['mean_ms'] / a['mean_ms']:.2f}×); best static {best[0]} {best[1]['mean_ms']:.0f} "
      f"({vs_best:.2f}×) — {verdict} the ≥ 1.0× (2% tolerance) goal.")
print("\n".join(out))
