#!/usr/bin/env bash
# Builds kvserve and runs every test: the tuned build and the portable package build (with its
# .deb packages), the CTest suite (GoogleTest, the codec suites at the baseline SIMD tier, and the
# Python suite under pytest: module, connector, install and packages), then the seven libFuzzer
# targets with sanitizers (FUZZ_SECONDS each, default 60).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
bash scripts/package.sh
ctest --test-dir build --output-on-failure -j "$(nproc)"
bash scripts/fuzz.sh
