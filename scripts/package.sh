#!/usr/bin/env bash
# Builds the portable configuration (no -march=native: baseline x86-64 code, SIMD kernels chosen
# at run time) into build-pkg/ and makes the Debian packages of it with CPack:
# build-pkg/packages/{libkvserve-dev,kvserve,python3-kvserve}_VERSION_amd64.deb.
# The packaging tests (tests/python/test_packaging.py) install them in a clean Debian 12 root.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-pkg -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVSERVE_NATIVE=OFF -DCMAKE_INSTALL_PREFIX=/usr \
  -DKVSERVE_BUILD_TESTS=ON -DKVSERVE_BUILD_BENCH=OFF > /dev/null
cmake --build build-pkg -j "$(nproc)" --target kvserve kvserve_shared kvserve_python kvserve_python_files kvserve_tests
rm -rf build-pkg/packages
(cd build-pkg && cpack -G DEB > /dev/null)
ls build-pkg/packages/*.deb
