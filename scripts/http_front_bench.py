#!/usr/bin/env python3
"""The HTTP front under slow and many clients (issue 33's goals), measured in one run.

Starts a decode node, a prefill node and a router on stories260K (free loopback ports), then:
  1. latency of a normal /v1/completions request (40 tokens) through the router, alone and with
     200 slow connections on the router and 200 on the prefill node (a header line every 3 s);
  2. 1,000 connections opened at once on the router: time until every one got its /health answer;
  3. wrk -t2 -c64 on the path (40 tokens).
The set runs for /v1/completions and /generate, and with --baseline-cli for an older build's /generate.
Prints a table and writes JSON (--json PATH). Every loop is bounded; every process is stopped.

    python3 scripts/http_front_bench.py --cli build/kvserve [--json out.json] [--seconds 10]
"""
import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request


def start(cli, args):
    def limits():
        resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))
    p = subprocess.Popen([cli] + args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, preexec_fn=limits)
    line = p.stdout.readline()
    if "listening on" not in line:
        p.kill()
        sys.exit(f"{args[:2]} did not start: {line!r}")
    return p, line.strip().split("listening on ")[1]


def post(address, path, body, timeout=8):
    req = urllib.request.Request(f"http://{address}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()
    return time.perf_counter() - t0


def latencies(address, n, path, body):
    """n requests one after another, each given 8 s; failures (timeouts included) are counted."""
    times, failed = [], 0
    for i in range(n + 1):
        try:
            t = post(address, path, body)
            if i > 0:  # the first warms
                times.append(t)
        except OSError:
            failed += 1
    return times, failed


def summary(sample):
    xs, failed = sample
    xs = sorted(xs)
    if not xs:
        return {"n": 0, "failed": failed, "median_ms": None, "p10_ms": None, "p90_ms": None}
    q = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]
    return {"n": len(xs), "failed": failed, "median_ms": statistics.median(xs) * 1e3, "p10_ms": q(0.1) * 1e3, "p90_ms": q(0.9) * 1e3}


class SlowClients:
    """Connections that send a request header a line at a time, one line every 3 s."""

    def __init__(self, address, n):
        host, port = address.rsplit(":", 1)
        self.socks = []
        for _ in range(n):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            self.socks.append(s)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.drip, daemon=True)
        self.thread.start()

    def drip(self):
        for _ in range(100):  # bounded: at most 300 s
            if self.stop.wait(3):
                return
            for s in self.socks:
                try:
                    s.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    pass

    def close(self):
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            s.close()


def thousand_at_once(address, n=1000):
    """Opens n connections without waiting, sends GET /health on each as it connects, and times
    until every one has its answer (bounded by 30 s)."""
    import select
    host, port = address.rsplit(":", 1)
    t0 = time.perf_counter()
    socks = {}
    poller = select.poll()
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect((host, int(port)))
        except BlockingIOError:
            pass
        socks[s.fileno()] = s
        poller.register(s.fileno(), select.POLLOUT)
    sent, answered = set(), 0
    deadline = t0 + 30
    while socks and time.perf_counter() < deadline:
        for fd, ev in poller.poll(50):
            s = socks.get(fd)
            if s is None:
                continue
            if fd not in sent and ev & select.POLLOUT:
                try:
                    s.send(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    sent.add(fd)
                    poller.modify(fd, select.POLLIN)
                except OSError:
                    pass
                continue
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            answered += data.startswith(b"HTTP/1.1 200")
            poller.unregister(fd)
            s.close()
            del socks[fd]
    elapsed = time.perf_counter() - t0
    for s in socks.values():
        s.close()
    return {"connections": n, "answered_200": answered, "seconds": elapsed}


def wrk(address, path, body, seconds, connections):
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n')
        f.write("wrk.body = %s\n" % json.dumps(json.dumps(body)))
        f.write("done = function(summary, latency, requests)\n"
                "  io.write(string.format('JSON {\"requests\":%d,\"seconds\":%f,\"p50_ms\":%f,\"p99_ms\":%f,"
                "\"errors\":%d,\"non2xx\":%d}\\n', summary.requests, summary.duration/1e6, latency:percentile(50)/1e3,"
                " latency:percentile(99)/1e3, summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,"
                " summary.errors.status))\nend\n")
        script = f.name
    out = subprocess.run(["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "-s", script, f"http://{address}{path}"],
                         capture_output=True, text=True, timeout=seconds + 60).stdout
    os.unlink(script)
    line = [l for l in out.splitlines() if l.startswith("JSON ")][0]
    r = json.loads(line[5:])
    r["requests_per_s"] = r["requests"] / r["seconds"]
    return r


def measure(cli, openai, seconds, repeats):
    """Every measurement on one build's processes (started and stopped here)."""
    procs = []
    path, body = ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 40}) if openai else \
        ("/generate", {"prompt": "Once upon a time", "max_new_tokens": 40})
    try:
        d, daddr = start(cli, ["serve", "decode", "-m", "stories260K", "--listen", "127.0.0.1:0", "--log-level", "quiet"])
        procs.append(d)
        p, paddr = start(cli, ["serve", "prefill", "-m", "stories260K", "--listen", "127.0.0.1:0", "--peer", daddr,
                                "--strategy", "quant(kbits=4,vbits=4)", "--log-level", "quiet"])
        procs.append(p)
        r, raddr = start(cli, ["serve", "router", "--listen", "127.0.0.1:0", "--peer", paddr, "--log-level", "quiet"])
        procs.append(r)
        res = {"cli": cli, "path": path}
        print(f"[{cli}] a normal {path} request, alone ...", flush=True)
        res["alone"] = summary(latencies(raddr, repeats, path, body))
        print(f"[{cli}] with 200 slow connections on the router and 200 on the prefill node ...", flush=True)
        slow = [SlowClients(raddr, 200), SlowClients(paddr, 200)]
        time.sleep(1)
        res["with_slow"] = summary(latencies(raddr, min(repeats, 10) if not openai else repeats, path, body))
        for s in slow:
            s.close()
        time.sleep(1)
        res["alone_again"] = summary(latencies(raddr, repeats, path, body))
        print(f"[{cli}] 1,000 connections at once ...", flush=True)
        res["thousand"] = thousand_at_once(raddr)
        print(f"[{cli}] wrk -c64 {seconds} s on {path} ...", flush=True)
        res["wrk"] = wrk(raddr, path, body, seconds, 64)
        w = res["with_slow"]["median_ms"]
        res["slow_added_median_ms"] = None if w is None else w - (res["alone"]["median_ms"] + res["alone_again"]["median_ms"]) / 2
        return res
    finally:
        for pr in procs:
            pr.send_signal(signal.SIGTERM)
        for pr in procs:
            try:
                pr.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pr.kill()


def report(res):
    print(f"\n{res['cli']} ({res['path']}, 40 tokens):")
    a, w, b = res["alone"], res["with_slow"], res["alone_again"]
    ms = lambda v: "-" if v is None else f"{v:.2f} ms"
    added = res["slow_added_median_ms"]
    print(f"  normal request median: alone {ms(a['median_ms'])}, with 400 slow connections {ms(w['median_ms'])} "
          f"({w['n']} answered, {w['failed']} failed within 8 s), alone again {ms(b['median_ms'])}: "
          f"added {'-' if added is None else f'{added:+.2f} ms'}")
    t = res["thousand"]
    print(f"  1,000 connections at once: {t['answered_200']} answered 200 in {t['seconds']:.2f} s")
    k = res["wrk"]
    print(f"  wrk -t2 -c64: {k['requests_per_s']:.0f} requests/s, P50 {k['p50_ms']:.1f} ms, P99 {k['p99_ms']:.1f} ms, "
          f"errors {k['errors']}, non-2xx {k['non2xx']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cli", default="build/kvserve")
    ap.add_argument("--baseline-cli", help="an older build measured in the same run (its /generate)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--seconds", type=int, default=10, help="each wrk run")
    ap.add_argument("--repeats", type=int, default=40, help="requests per latency sample")
    a = ap.parse_args()
    resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))
    out = {"machine": os.uname().nodename, "cores": os.cpu_count(), "runs": []}
    out["runs"].append(measure(a.cli, True, a.seconds, a.repeats))
    out["runs"].append(measure(a.cli, False, a.seconds, a.repeats))
    if a.baseline_cli:
        out["runs"].append(measure(a.baseline_cli, False, a.seconds, a.repeats))
    for r in out["runs"]:
        report(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
