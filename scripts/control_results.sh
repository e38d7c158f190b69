#!/usr/bin/env bash
# Replays every shipped workload over every shipped trace with every policy, without drift and
# with each injected drift, on the shipped default profile; writes one JSON per run to
# docs/results/control/ (WORKLOAD_TRACE_DRIFT.json) and a summary table (docs/results/control.md).
# A benchmark run, not part of the tests (a minute or so).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh > /dev/null
out=docs/results/control
mkdir -p "$out"
rm -f "$out"/*.json
for workload in bench/workloads/*.csv; do
  wname=$(basename "$workload" .csv)
  for drift in none codec:1.5@100 link:2@100; do
    for trace in bench/traces/*.csv; do
      name=$(basename "$trace" .csv)
      args=()
      [ "$drift" = none ] || args=(--drift "$drift")
      tag=${drift%%@*}
      tag=${tag/:/-}
      build/kvserve control simulate --trace "$trace" --workload "$workload" --policy all "${args[@]}" --json \
        > "$out/${wname}_${name}_${tag}.json"
    done
  done
done
python3 scripts/control_summary.py "$out" > docs/results/control.md
echo "wrote $out/*.json and docs/results/control.md"
