#!/usr/bin/env bash
# Installs every Debian package kvserve's build, tests, fuzzing and plots need. Idempotent:
# when all are present it changes nothing and needs no network. Run as root on Debian 12.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git
  libgtest-dev libgmock-dev libbenchmark-dev
  libzstd-dev libxxhash-dev libeigen3-dev libnlopt-cxx-dev nlohmann-json3-dev libcli11-dev nettle-dev
  libasio-dev libcpp-httplib-dev iproute2 curl
  libhiredis-dev redis-server redis-tools
  clang libclang-rt-14-dev
  gnuplot-nox
  python3-dev python3-pybind11 python3-numpy python3-pytest
  qemu-user debootstrap dpkg-dev file
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi
echo "setup: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
