#!/usr/bin/env bash
# Builds kvserve and runs every test: the CTest suite, then the five libFuzzer targets with
# sanitizers (FUZZ_SECONDS each, default 60).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)"
bash scripts/fuzz.sh
