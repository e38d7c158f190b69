#!/usr/bin/env python3
"""Prints what scripts/demo.sh's serving requests got back, one short block per request.

  demo_answer.py            < completion.json   the text, the strategy, why, stage timings
  demo_answer.py --stream   < sse               tokens as they arrive, then the usage chunk's extras
  demo_answer.py --metrics  < metrics.txt       a few series of the prefill node's /metrics
"""
import json
import sys


def extras(k):
    t = k.get("timings_ms", {})
    print(f"     strategy  {k.get('strategy', '?')}")
    print(f"     why       {k.get('explanation', '')}")
    print("     timings   " + ", ".join(f"{s} {t[s]:.2f} ms" for s in ("prefill", "encode", "wire", "decode", "generate", "total") if s in t))
    print(f"     bytes     {k.get('kv_bytes', 0)} KV -> {k.get('wire_bytes', 0)} on the wire (x{k.get('ratio', 0):.2f})")


def whole():
    a = json.load(sys.stdin)
    if "error" in a:
        print(f"   error: {a['error']}")
        return
    t = a["choices"][0]["text"]
    print(f"   {a['usage']['prompt_tokens']} prompt tokens -> text: {t!r}")
    extras(a["kvserve"])


def stream():
    sys.stdout.write("     ")
    for line in sys.stdin:
        if not line.startswith("data: "):
            continue
        data = line[6:].strip()
        if data == "[DONE]":
            print("\n     [DONE]")
            break
        c = json.loads(data)
        if c.get("choices"):
            sys.stdout.write(c["choices"][0].get("text", "") + "|")
            sys.stdout.flush()
        elif "usage" in c:
            print(f"\n     usage {c['usage']['prompt_tokens']} prompt + {c['usage']['completion_tokens']} completion tokens")
            extras(c["kvserve"])
            sys.stdout.write("    ")


def metrics():
    want = ("kvserve_requests_total", "kvserve_decisions_total", "kvserve_time_to_first_token_seconds_count",
            "kvserve_time_to_first_token_seconds_sum", "kvserve_bandwidth_estimate_gbps", "kvserve_wire_bytes_total")
    print("   /metrics (prefill node):")
    for line in sys.stdin:
        if line.startswith(want):
            print("     " + line.strip())


if __name__ == "__main__":
    {"--stream": stream, "--metrics": metrics}.get(sys.argv[1] if len(sys.argv) > 1 else "", whole)()
