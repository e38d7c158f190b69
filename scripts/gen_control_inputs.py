#!/usr/bin/env python3
"""Writes the shipped bandwidth traces (bench/traces) and the mixed workload (bench/workloads).
Deterministic (fixed seeds); the outputs are committed, so running this is only needed to change them."""
import math
import os
import random

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
traces = os.path.join(root, "bench", "traces")
workloads = os.path.join(root, "bench", "workloads")
os.makedirs(traces, exist_ok=True)
os.makedirs(workloads, exist_ok=True)
DURATION = 240


def write_trace(name, rows, note):
    with open(os.path.join(traces, name + ".csv"), "w") as f:
        f.write(f"# {note}\ntime_s,gbps\n")
        for t, g in rows:
            f.write(f"{t:g},{g:.3f}\n")


for g in (1, 5, 10, 25, 100):
    write_trace(f"steady_{g}gbps", [(0, g)], f"steady {g} Gbps")
write_trace("step", [(0, 25), (120, 3)], "25 Gbps, dropping to 3 Gbps at t=120 s")
rng = random.Random(7)
rows, level = [], math.log(10)
for t in range(0, DURATION + 1):
    level = min(math.log(50), max(math.log(1), level + rng.gauss(0, 0.25)))
    rows.append((t, math.exp(level)))
write_trace("random_walk", rows, "log-space random walk between 1 and 50 Gbps, a step per second (seed 7)")
rows = []
for start in range(0, DURATION, 30):
    rows += [(start, 25), (start + 20, 2)]
write_trace("congestion", rows, "25 Gbps with a 10 s congestion dip to 2 Gbps every 30 s")

# Mixed workload: Poisson arrivals at 1 request/s, log-normal prompt lengths (median ~2k tokens),
# three labels with their own floors and SLOs.
rng = random.Random(11)
t, lines = 0.0, []
labels = [("chat", 0.6, 0.97, 1.0), ("retrieval", 0.2, 0.99, 1.5), ("summarize", 0.2, 0.96, 2.0)]
while len(lines) < 200:
    t += rng.expovariate(1.0)
    tokens = int(min(16384, max(256, rng.lognormvariate(math.log(2048), 0.6))))
    u, acc = rng.random(), 0.0
    for name, share, floor, slack in labels:
        acc += share
        if u <= acc:
            break
    # SLO: prefill (20k tok/s) plus a transfer budget of 0.12 ms per token times the label's slack.
    slo = tokens / 20.0 + 100 + 0.12 * tokens * slack
    lines.append(f"{t:.3f},{tokens},{name},{slo:.0f},{floor}")
with open(os.path.join(workloads, "mixed.csv"), "w") as f:
    f.write("# 200 requests, Poisson 1/s; labels chat (floor 0.97), retrieval (0.99), summarize (0.96)\n")
    f.write("arrival_s,prompt_tokens,label,slo_ms,floor\n")
    f.write("\n".join(lines) + "\n")


def long_workload(name, seed, rate, sizes, label, slo_extra_ms, floor, header):
    """64 requests of a few long prompt sizes, Poisson at `rate`, short outputs; SLO = prefill at
    20k tokens/s plus a fixed transfer budget."""
    rng = random.Random(seed)
    lines, t = [], 0.0
    for i in range(64):
        t += rng.expovariate(rate)
        tokens = rng.choice(sizes)
        lines.append(f"{t:.3f},{tokens},{label},{tokens / 20.0 + slo_extra_ms:.0f},{floor}")
    with open(os.path.join(workloads, name), "w") as f:
        f.write(header + "\n")
        f.write("arrival_s,prompt_tokens,label,slo_ms,floor\n")
        f.write("\n".join(lines) + "\n")


# Long prompts for the end-to-end benchmark (bench e2e --workload): 2k-8k tokens, short outputs;
# the arrival times here are for the simulator, bench e2e draws its own at the offered load.
long_workload("long_prompt.csv", 8, 0.5, [2048, 3072, 4096, 6144, 8192], "summarize", 2000, 0.97,
              "# 64 requests, Poisson 0.5/s; prompts of 2k-8k tokens (long-context summarisation), floor 0.97")
# Very long prompts (retrieval over documents, agents' accumulated context): 4k-16k tokens,
# short outputs, where disaggregated serving spends most on moving KV. Same conventions.
long_workload("very_long_prompt.csv", 16, 0.25, [4096, 6144, 8192, 12288, 16384], "retrieval", 3000, 0.99,
              "# 64 requests, Poisson 0.25/s; prompts of 4k-16k tokens (retrieval over long documents), floor 0.99")
