#!/usr/bin/env bash
# The main job end to end on embedded defaults: a real model writes text and its KV cache is
# scored under two strategies; then a llama3-8b-shaped KV block is synthesized, encoded, decoded,
# and the strategy table printed against memcpy and zstd; then a short Bayesian profile of
# stories260K, the online controller replaying a bandwidth step over a request stream, and the
# serving system itself: a decode node, a prefill node with the shipped profile and a router as
# processes on free loopback ports, answering OpenAI-API requests over two link rates.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== building kvserve (first time: several minutes on 2 cores)"
# Progress as the build goes: one line per 10% step.
bash scripts/build.sh 2>&1 | awk '
  match($0, /^\[ *[0-9]+\/[0-9]+\]/) { split(substr($0, 2, RLENGTH - 2), a, "/"); p = int(100 * a[1] / a[2] / 10) * 10;
    if (p > last) { printf "   build %d%%\n", p; fflush(); last = p } next }
  /error|Error|FAILED/ { print }'
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "build failed" >&2; exit 1; }
kv=build/kvserve
tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

# Starts a serving process in the background and sets the variable named first to the address
# from its first line ("ROLE listening on HOST:PORT").
start() {
  local var=$1 out="$tmp/$1.$RANDOM"
  shift
  "$kv" "$@" > "$out" 2>/dev/null &
  pids+=($!)
  for _ in $(seq 100); do
    if grep -q "listening on" "$out" 2>/dev/null; then
      printf -v "$var" '%s' "$(sed -n 's/.*listening on //p' "$out" | head -1)"
      return 0
    fi
    sleep 0.1
  done
  echo "demo: $* did not start" >&2
  exit 1
}
echo "== stories260K writes a story (greedy)"
$kv generate -m stories260K -p "Once upon a time" -n 60
echo
echo "== quality of its KV cache under two strategies (relative accuracy on ~8,000 positions)"
$kv eval -m stories260K -s 'quant(kbits=4,vbits=4)' -s 'prune(keep=0.5,recent=32)|quant(kbits=3,vbits=2,vaxis=channel,group=64)|rans'
echo
echo "== synthesize a llama3-8b KV block (256 tokens, fp16)"
$kv kv synth --shape llama3-8b --tokens 256 --seed 1 -o "$tmp/x.kvf"
echo "== encode with KIVI-style 2-bit quantisation + zstd, decode, compare"
$kv codec encode -s 'quant(kbits=2,vbits=2,kaxis=channel,vaxis=token,group=32,residual=64)|zstd(level=3)' \
  -i "$tmp/x.kvf" -o "$tmp/y.kvf"
$kv codec decode -i "$tmp/y.kvf" -o "$tmp/z.kvf"
$kv codec compare "$tmp/x.kvf" "$tmp/z.kvf"
echo
echo "== strategy table on a 1024-token llama3-8b block (128 MiB fp16), single thread"
$kv codec bench --runs 5
echo
echo "== Bayesian profiling of stories260K: 12 quality evaluations over the built-in space (~200 strategies)"
$kv profile run -m stories260K --budget 12 --speed-runs 1 --speed-tokens 64 -o "$tmp/profile.json"
echo
echo "== the controller on a 25 -> 3 Gbps step, shipped babyllama105 profile, codec 1.5x slower from t=100 s"
$kv control simulate --trace bench/traces/step.csv --policy all --drift codec:1.5@100
echo
echo "== serving: a decode node, a prefill node with the shipped profile and a router (stories260K, loopback)"
start decode serve decode -m stories260K --listen 127.0.0.1:0 --log-level quiet
echo "   decode node  $decode"
long="Once upon a time"
for _ in $(seq 18); do long="$long, the little dog ran to the park and played with a red ball"; done
for gbps in 10 0.05; do
  start prefill serve prefill -m stories260K --listen 127.0.0.1:0 --peer "$decode" \
    --profile bench/profiles/default.json --shape-gbps "$gbps" --log-level quiet
  start router serve router --listen 127.0.0.1:0 --peer "$prefill" --log-level quiet
  echo "-- link paced to $gbps Gbit/s in process (a token bucket whose 1 MiB burst lets small requests through at once; the controller plans on the rate) — prefill node $prefill, router $router"
  for prompt in "Once upon a time" "$long"; do
    curl -s "http://$router/v1/completions" \
      -d "{\"model\":\"stories260K\",\"prompt\":\"$prompt\",\"max_tokens\":24,\"slo_ms\":100}" > "$tmp/answer.json"
    python3 scripts/demo_answer.py < "$tmp/answer.json"
  done
  echo "   streamed (server-sent events, token by token):"
  curl -sN "http://$router/v1/completions" \
    -d '{"model":"stories260K","prompt":"Once upon a time","max_tokens":16,"stream":true,"stream_options":{"include_usage":true}}' \
    | python3 scripts/demo_answer.py --stream
  curl -s "http://$prefill/metrics" > "$tmp/metrics.txt"
  python3 scripts/demo_answer.py --metrics < "$tmp/metrics.txt"
  # This rate's prefill node and router stop; the decode node serves the next.
  n=${#pids[@]}
  kill "${pids[n-1]}" "${pids[n-2]}"
  wait "${pids[n-1]}" "${pids[n-2]}" 2>/dev/null || true
  pids=("${pids[@]:0:n-2}")
done
