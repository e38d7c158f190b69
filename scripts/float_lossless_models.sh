#!/usr/bin/env bash
# Lossless coding of the shipped models' real KV (docs/results/float_lossless.md): captures each
# model's KV of evaluation contexts 0-3 (192-token prompts) in f16, bf16 and FP8 E4M3 (unscaled,
# as an engine's FP8 cache holds it when its scale is 1), encodes it with the
# lossless float coder and with zstd as the baseline, checks that every frame decodes to the exact
# input bytes, and prints ratio (input file bytes over frame bytes) per model, dtype and coder.
# Usage: bash scripts/float_lossless_models.sh [build/kvserve]
set -euo pipefail
kv="${1:-build/kvserve}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '%-13s %-5s %-28s %10s %10s %7s\n' model dtype coder "in bytes" "out bytes" ratio
for model in stories260K babyllama105; do
  for dtype in f16 bf16 e4m3; do
    for coder in "fpsplit(dtype=$dtype)|rans" "fpsplit(dtype=$dtype)|zstd" "cast(dtype=$dtype)|zstd"; do
      in_total=0 out_total=0
      for context in 0 1 2 3; do
        "$kv" kv capture -m "$model" --context "$context" --prompt-len 192 --dtype "$dtype" -o "$tmp/in.kvf" > /dev/null
        "$kv" codec encode -s "$coder" -i "$tmp/in.kvf" -o "$tmp/frame.kvf" > /dev/null
        "$kv" codec decode -i "$tmp/frame.kvf" -o "$tmp/back.kvf" > /dev/null
        cmp -s "$tmp/in.kvf" "$tmp/back.kvf" || { echo "$model $dtype $coder context $context: not exact" >&2; exit 1; }
        in_total=$((in_total + $(stat -c %s "$tmp/in.kvf")))
        out_total=$((out_total + $(stat -c %s "$tmp/frame.kvf")))
      done
      printf '%-13s %-5s %-28s %10d %10d %6.3fx\n' "$model" "$dtype" "$coder" "$in_total" "$out_total" \
        "$(awk "BEGIN { print $in_total / $out_total }")"
    done
  done
done
