#!/usr/bin/env bash
# Installs every Debian package kvserve's build, tests, fuzzing and plots need, and the npm client the tests drive. Idempotent:
# when all are present it changes nothing and needs no network. Run as root on Debian 12.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git
  libgtest-dev libgmock-dev libbenchmark-dev
  libzstd-dev libxxhash-dev libeigen3-dev libnlopt-cxx-dev nlohmann-json3-dev libcli11-dev nettle-dev
  libasio-dev libboost1.81-dev libcpp-httplib-dev iproute2 curl wrk prometheus
  libhiredis-dev redis-server redis-tools libucx-dev ucx-utils
  clang libclang-rt-14-dev
  gnuplot-nox
  python3-dev python3-pybind11 python3-numpy python3-pytest
  qemu-user debootstrap dpkg-dev file
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
# The official `openai` npm client the tests drive a live router with (tests/npm/package.json),
# installed with the machine's Node.js; no lockfile is written. Skipped when that version is there.
install_npm_tests() {
  local dir want have
  dir="$(cd "$(dirname "$0")/.." && pwd)/tests/npm"
  want=$(sed -n 's/.*"openai": "\(.*\)".*/\1/p' "$dir/package.json")
  have=$(sed -n 's/^  "version": "\(.*\)".*/\1/p' "$dir/node_modules/openai/package.json" 2>/dev/null || true)
  if [ "$have" = "$want" ]; then
    echo "setup: npm openai $have present"
    return 0
  fi
  if ! command -v npm >/dev/null; then
    # A fresh Debian 12 has no Node.js: Debian's own (18) runs the client.
    echo "setup: installing nodejs npm"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends nodejs npm
  fi
  echo "setup: npm install openai@$want in tests/npm"
  (cd "$dir" && npm install --no-package-lock --no-audit --no-fund --loglevel=error)
}
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  install_npm_tests
  exit 0
fi
echo "setup: installing ${missing[*]}"
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
install_npm_tests
