#!/usr/bin/env bash
# Regenerates the frame seeds of the fuzzer (fuzz/seeds/frame/) with the current build: small
# synthetic stories260k-shaped blocks encoded with one strategy per stage family. Seeds named
# regression_* are inputs that once crashed a parser; they are kept as they are (they need not
# decode). Run after a frame or payload format change; the artefact test names this script.
set -euo pipefail
cd "$(dirname "$0")/.."
kv=build/kvserve
out=fuzz/seeds/frame
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
levels=$(printf '3.9.1.127.2.2.5.5.%.0s' 1 2 3 4 5)
levels=${levels%.}
seed() {  # name tokens spec
  "$kv" kv synth --shape stories260k --tokens "$2" --seed 7 -o "$tmp/in.kvf" > /dev/null
  "$kv" codec encode -s "$3" -i "$tmp/in.kvf" -o "$out/$1.kvf" > /dev/null
  echo "$out/$1.kvf: $3"
}
seed none 3 'none'
seed cast 3 'cast(dtype=bf16)'
seed quant_zstd 3 'quant(kbits=3,vbits=2,residual=1)|zstd(level=3)'
seed quant_2bit_256tok__rans_ 256 'quant(kbits=2,vbits=2)|rans'
seed quant_kbits_5_vbits_3__rans_tables_part_ 24 'quant(kbits=5,vbits=3)|rans(tables=part)'
seed rotate_quant_kbits_3_vbits_2_residual_1_ 3 'rotate|quant(kbits=3,vbits=2,residual=1)|rans'
seed delta_anchor_3__mixhq_ 3 'delta(anchor=3)|mixhq'
seed mixhq_lo_frac_0_5__rans_ 24 'mixhq(lo_frac=0.5)|rans'
seed mixhq_levels__rans_ 24 "mixhq(levels=$levels)|rans"
seed prune_quant_rans 64 'prune(sink=2,recent=8,keep=0.5)|quant(kbits=3,vbits=3)|rans'
seed fpsplit 3 'fpsplit'
seed fpsplit_bf16__rans_ 24 'fpsplit(dtype=bf16)|rans'
