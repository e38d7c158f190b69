#!/usr/bin/env python3
"""Writes a KV pool report (docs/results/e2e_pool.md and its kind) from a `kvserve bench e2e --mode pool --json`
result: the testbed, the calibration, every point with its intervals, the paired ratios of mean TTFT, and each goal
of the KV pool issue computed from the numbers.

    python3 scripts/e2e_pool_report.py docs/results/e2e_pool.json "COMMAND" "MACHINE, DATE" [SVG] > docs/results/e2e_pool.md
"""
import json
import sys

path, command, where = sys.argv[1], sys.argv[2], sys.argv[3]
svg = sys.argv[4] if len(sys.argv) > 4 else None
j = json.load(open(path))
by = {}
for p in j["points"]:
    by.setdefault(p["gbps"], {})[p["policy"]] = p
repeats = j.get("repeats", 1)
out = []
w = out.append


def ci(p, key, fmt=".1f"):
    """A figure with its 95% interval where the result has repeats."""
    half = p.get("ci95", {}).get(key, 0)
    return f"{p[key]:{fmt}} ± {half:{fmt}}" if repeats > 1 else f"{p[key]:{fmt}}"


def ratio(r):
    return f"{r['mean']:.2f} ± {r['ci95']:.2f}" if r.get("n", 1) > 1 else f"{r['mean']:.2f}"


def nodes_text():
    cores = j.get("codec", {}).get("cores", {})
    if j.get("nodes") != "process":
        return "the pool node in the benchmark process"
    parts = [f"pool node on core {cores.get('pool_node', '?')}"]
    if "redis_server" in cores:
        parts.append(f"its own redis-server on core {cores['redis_server']}")
    parts.append(f"router {cores.get('router', '?')}")
    return "separate processes (" + ", ".join(parts) + "), driven over HTTP by the benchmark as a client"


w("# KV pool end to end (bench e2e --mode pool)\n")
w(f"Command ({where}):\n")
w("```\n" + command + "\n```\n")
cm = j["compute_model"]
w(f"{j['kv_shape']}-shaped synthetic KV ({j['kv_bytes_per_token'] // 1024} KiB/token fp16), {j['requests']} requests per "
  f"point: a {j['prefix_tokens']}-token shared document plus {j['suffix_tokens']} tokens of its own, reuse {j['reuse']}, "
  f"{j['arrival']} arrivals at the rate that loads the uncompressed pool link to {j['load']} with hits, chunks of "
  f"{j['chunk_tokens']} tokens, backend `{j['backend']}`, floor {j['floor']}, {j['codec_threads']} codec threads. Nodes: "
  f"{nodes_text()}; pool link: {j['pool_link']}. Compute is modelled (prefill {cm['prefill_tokens_per_second']:.0f} "
  "tokens/s one prompt at a time, on a " + str(cm.get("gpu", "?")) + "); the codec, the pool, the link and the node's "
  "decisions are real. TTFT: scheduled arrival to the first token, at the client. Hit TTFT: requests that fetched a "
  "prefix." + (f" Plot: [{svg}]({svg})." if svg else "") + "\n")

cal = j.get("calibration")
if cal:
    w(f"**Calibration**: each policy stores its prefix with one request, then one request alone with that prefix is "
      f"checked against its parts (its chunks fetched at the link rate and decoded as measured, pipelined, plus prefill of "
      f"the tokens it computed); tolerance {100 * cal['tolerance']['relative']:.0f}% or {cal['tolerance']['absolute_ms']:.0f} "
      f"ms; payload share of the link {cal['wire_payload_share']:.3f}. "
      + ("Every check passed." if cal["valid"] else "A policy that failed has its points marked invalid below.") + "\n")
    w("| Gbit/s | policy | strategy | measured TTFT ms | predicted ms | ratio | fetch measured / predicted ms | fault |")
    w("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in cal["checks"]:
        f = c["stages"].get("fetch", {"measured_ms": 0, "predicted_ms": 0})
        strategy = c["strategy"] if len(c["strategy"]) < 40 else c["strategy"][:37] + "..."
        w(f"| {c['gbps']:g} | {c['policy']} | {strategy} | {c['measured_ms']:.1f} | {c['predicted_ms']:.1f} | {c['ratio']:.2f} | "
          f"{f['measured_ms']:.1f} / {f['predicted_ms']:.1f} | {'' if c['valid'] else c.get('fault', '?')} |")
    w("")

w("| Gbit/s | policy | hit rate | TTFT mean ms | TTFT p99 ms | hit TTFT ms | none / this (TTFT) | quality | floor violations | choices |")
w("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
for g in sorted(by):
    for name, p in by[g].items():
        ch = ", ".join(f"{k} {v}" for k, v in sorted(p["choices"].items()))
        hit = ci(p, "hit_ttft_mean_ms") if p["hit_rate"] > 0 else "–"
        vs = ratio(p["vs_none"]) if "vs_none" in p else ""
        mark = "" if p.get("valid", True) else " (invalid)"
        w(f"| {g:g} | {name}{mark} | {100 * p['hit_rate']:.0f}% | {ci(p, 'ttft_mean_ms')} | {p['ttft_p99_ms']:.1f} | {hit} | "
          f"{vs} | {p['quality']:.4f} | {p['floor_violations']} | {ch} |")
if repeats > 1:
    w(f"\nEach point is the mean of {repeats} repeats (fresh nodes and pool, policies in rotating order, the same "
      "arrivals), ± the half-width of its 95% Student-t interval; ratios of mean TTFT are paired by repeat. Link ceiling "
      "readings: " + ", ".join(f"{g:.1f}" for g in j.get("link_ceiling_readings_gbps", [])) + " Gbit/s.")
if j.get("ratios"):
    w("\n| Gbit/s | none / adaptive | best other | best other / adaptive |")
    w("| --- | --- | --- | --- |")
    for r in j["ratios"]:
        w(f"| {r['gbps']:g} | {ratio(r['none_over_adaptive'])} | {r.get('best_other', '–')} | "
          f"{ratio(r['best_other_over_adaptive']) if 'best_other_over_adaptive' in r else '–'} |")

w("\n## Goals\n")
g_top = max(by)
pts = by[g_top]
none_hit = pts["none"]["hit_ttft_mean_ms"]
hits = [(p["hit_ttft_mean_ms"], n) for n, p in pts.items() if p["hit_rate"] > 0 and n != "none"]
ad = pts["adaptive"]
ad_hit = ad["hit_ttft_mean_ms"] if ad["hit_rate"] > 0 else None
line = f"- **Hit TTFT at {g_top:g} Gbit/s ≥ 20× lower than the uncompressed pool.** Uncompressed pool: {none_hit:.1f} ms on hits. "
if hits:
    best_hit = min(hits)
    line += f"The fastest hit of any policy there is {best_hit[1]} at {best_hit[0]:.1f} ms ({none_hit / best_hit[0]:.1f}×). "
line += (f"Adaptive's hits take {ad_hit:.1f} ms ({none_hit / ad_hit:.1f}×)" if ad_hit else "Adaptive fetched nothing")
line += (f"; adaptive's mean TTFT over all requests is {ad['ttft_mean_ms']:.1f} ms "
         f"({pts['none']['ttft_mean_ms'] / ad['ttft_mean_ms']:.1f}× lower than the uncompressed pool's). ")
line += "Met." if ad_hit and none_hit / ad_hit >= 20 else "Not met."
w(line)
w("- **Adaptive ≥ 1.0× the best of {uncompressed pool, recompute, each static} at every bandwidth (2% tolerance), mean TTFT:**")
ratios = {r["gbps"]: r for r in j.get("ratios", [])}
for g in sorted(by):
    others = {n: p["ttft_mean_ms"] for n, p in by[g].items() if n != "adaptive"}
    bn = min(others, key=others.get)
    r = others[bn] / by[g]["adaptive"]["ttft_mean_ms"]
    paired = ratios.get(g, {}).get("best_other_over_adaptive")
    interval = f" (paired by repeat: {ratio(paired)})" if paired and paired.get("n", 1) > 1 else ""
    w(f"  - {g:g} Gbit/s: best other {bn} {others[bn]:.1f} ms, adaptive {by[g]['adaptive']['ttft_mean_ms']:.1f} ms: "
      f"{r:.2f}×{interval} — {'met' if r >= 0.98 else 'not met'}")
viol = sum(p["floor_violations"] for g in by for n, p in by[g].items() if n == "adaptive")
w(f"- **Every served request at or above its floor:** adaptive floor violations over all points: {viol}.")
print("\n".join(out))
