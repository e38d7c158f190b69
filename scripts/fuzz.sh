#!/usr/bin/env bash
# Builds the libFuzzer targets with clang, AddressSanitizer and UBSan, and runs each for
# FUZZ_SECONDS (default 60) from the seeds in fuzz/seeds/: frames, strategy specs, profile and
# space JSON, GGUF model headers, trace and workload CSV, the serving parsers' JSON (HTTP
# requests, the router's forwarded body, the decode port's messages), and raw values for the
# lossless float coder's exact round trip. A crash leaves crash-* here and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${FUZZ_SECONDS:-60}"
build=build-fuzz
cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DKVSERVE_FUZZ=ON -DKVSERVE_BUILD_TESTS=OFF -DKVSERVE_BUILD_BENCH=OFF -DKVSERVE_BUILD_PYTHON=OFF -DKVSERVE_SANITIZE=ON \
  -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link" > /dev/null
targets=(frame spec profile gguf csv serve float)
cmake --build "$build" --target "${targets[@]/%/_fuzz}" -j "$(nproc)"
for target in "${targets[@]}"; do
  corpus="fuzz/corpus-$target"
  mkdir -p "$corpus"
  echo "fuzzing ${target} for ${seconds}s"
  log="$build/${target}_fuzz.log"
  if ! UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
      "$build/${target}_fuzz" "$corpus" "fuzz/seeds/$target" -max_total_time="$seconds" -max_len=65536 \
      -rss_limit_mb=2048 -print_final_stats=1 > "$log" 2>&1; then
    tail -n 60 "$log"
    echo "fuzz: ${target}_fuzz failed (log: $log)"
    exit 1
  fi
  grep -E "^stat::number_of_executed_units|DONE" "$log" || true
done
echo "fuzz: no crashes"
