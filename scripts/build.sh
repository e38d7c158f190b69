#!/usr/bin/env bash
# Configures and builds kvserve (Release, tests and benchmarks) into build/.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVSERVE_BUILD_TESTS=ON -DKVSERVE_BUILD_BENCH=ON > /dev/null
cmake --build build -j "$(nproc)"
