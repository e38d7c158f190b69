#!/usr/bin/env bash
# The main job end to end on embedded defaults: a real model writes text and its KV cache is
# scored under two strategies; then a llama3-8b-shaped KV block is synthesized, encoded, decoded,
# and the strategy table printed against memcpy and zstd; then a short Bayesian profile of
# stories260K, and the online controller replaying a bandwidth step over a request stream.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh > /dev/null
kv=build/kvserve
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
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
