#!/usr/bin/env bash
# A real, kernel-shaped link between two network namespaces, for serving benchmarks and tests:
#   scripts/netns-link.sh up RATE_GBIT [DELAY_MS [JITTER_MS]]   build it (replacing an old one);
#                                   RATE 0: not rate-shaped (what the veth itself carries)
#   scripts/netns-link.sh down                                   remove it (always safe to run)
#   scripts/netns-link.sh run RATE_GBIT [DELAY_MS [JITTER_MS]] -- CMD...
#                                   build it, run CMD (which uses `ip netns exec`), tear it down
#                                   whatever CMD does — also on error or Ctrl-C
# Namespaces kvs-a (10.77.0.1) and kvs-b (10.77.0.2) are joined by a veth pair; each end is
# shaped with tbf at RATE (and netem delay/jitter when given). KVSERVE_NETNS_PREFIX renames the
# pair (tests use their own). Needs CAP_NET_ADMIN: without it, says so and exits 77 (skip).
set -euo pipefail
prefix="${KVSERVE_NETNS_PREFIX:-kvs}"
a="${prefix}-a" b="${prefix}-b"

usage() { sed -n '2,10p' "$0" >&2; exit 2; }

# Tries what the script will do, not a part of it: make a namespace, enter it (`ip netns exec`
# remounts / and /sys, which a container may refuse even where `ip netns add` works), and make a
# veth pair across it. Says why on failure; `why` is set for the skip message.
why=""
have_privilege() {
  local probe="${prefix}-probe$$" out
  if ! out=$(ip netns add "$probe" 2>&1); then
    why="creating network namespaces needs CAP_NET_ADMIN (${out:-refused})"
    return 1
  fi
  if ! out=$(ip netns exec "$probe" true 2>&1); then
    ip netns del "$probe" 2> /dev/null || true
    why="this machine lets a namespace be made but not entered: ip netns exec said '${out//$'\n'/ }'"
    return 1
  fi
  if ! out=$(ip link add "kvpv$$" netns "$probe" type veth peer name "kvpw$$" netns "$probe" 2>&1); then
    ip netns del "$probe" 2> /dev/null || true
    why="this machine cannot make a veth pair: ${out//$'\n'/ }"
    return 1
  fi
  ip netns del "$probe" 2> /dev/null || true
  return 0
}

down() {
  ip netns del "$a" 2> /dev/null || true
  ip netns del "$b" 2> /dev/null || true
}

up() {
  local rate="$1" delay="${2:-0}" jitter="${3:-0}"
  [[ "$rate" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "netns-link: RATE '$rate' is not a number of Gbit/s" >&2; exit 2; }
  [[ "$delay" =~ ^[0-9]+([.][0-9]+)?$ && "$jitter" =~ ^[0-9]+([.][0-9]+)?$ ]] ||
    { echo "netns-link: DELAY and JITTER are milliseconds" >&2; exit 2; }
  down
  # Whatever fails below, nothing half-built stays behind.
  trap 'rc=$?; down; exit $rc' ERR
  ip netns add "$a"
  ip netns add "$b"
  ip link add "${prefix}-va" netns "$a" type veth peer name "${prefix}-vb" netns "$b"
  ip -n "$a" addr add 10.77.0.1/24 dev "${prefix}-va"
  ip -n "$b" addr add 10.77.0.2/24 dev "${prefix}-vb"
  for ns in "$a" "$b"; do
    ip -n "$ns" link set lo up
  done
  ip -n "$a" link set "${prefix}-va" up
  ip -n "$b" link set "${prefix}-vb" up
  # tbf: the rate, a burst of at least one 64 KiB GSO segment, and a queue of ~50 ms at the rate.
  local rate_kbit burst limit
  rate_kbit=$(awk -v r="$rate" 'BEGIN { printf "%d", r * 1000000 }')
  burst=$(awk -v r="$rate" 'BEGIN { b = r * 1e9 / 8 / 250; if (b < 262144) b = 262144; printf "%d", b }')
  limit=$(awk -v r="$rate" 'BEGIN { l = r * 1e9 / 8 * 0.05; if (l < 1048576) l = 1048576; printf "%d", l }')
  local shaped=1
  awk -v r="$rate" 'BEGIN { exit !(r == 0) }' && shaped=0
  for pair in "$a ${prefix}-va" "$b ${prefix}-vb"; do
    set -- $pair
    if [ "$shaped" = 0 ]; then
      if awk -v d="$delay" 'BEGIN { exit !(d > 0) }' &&
        ! tc -n "$1" qdisc add dev "$2" root netem delay "${delay}ms" "${jitter}ms" 2> /dev/null; then
        down
        echo "netns-link: skipped: this kernel has no netem qdisc (sch_netem), so DELAY/JITTER cannot be shaped; use DELAY 0" >&2
        exit 77
      fi
    elif awk -v d="$delay" 'BEGIN { exit !(d > 0) }'; then
      if ! tc -n "$1" qdisc add dev "$2" root handle 1: netem delay "${delay}ms" "${jitter}ms" 2> /dev/null; then
        down
        echo "netns-link: skipped: this kernel has no netem qdisc (sch_netem), so DELAY/JITTER cannot be shaped; use DELAY 0" >&2
        exit 77
      fi
      tc -n "$1" qdisc add dev "$2" parent 1:1 handle 10: tbf rate "${rate_kbit}kbit" burst "$burst" limit "$limit"
    else
      tc -n "$1" qdisc add dev "$2" root tbf rate "${rate_kbit}kbit" burst "$burst" limit "$limit"
    fi
  done
  trap - ERR
  local at="at ${rate} Gbit/s"
  [ "$shaped" = 0 ] && at="not rate-shaped"
  echo "netns-link: $a (10.77.0.1) <-> $b (10.77.0.2) $at, delay ${delay} ms, jitter ${jitter} ms"
}

[ $# -ge 1 ] || usage
cmd="$1"
shift
if ! have_privilege; then
  echo "netns-link: skipped: $why (run as root where namespaces can be entered, or use the in-process shaper: --shape-gbps)" >&2
  exit 77
fi
case "$cmd" in
  up) [ $# -ge 1 ] || usage; up "$@" ;;
  down) down ;;
  run)
    args=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do args+=("$1"); shift; done
    [ $# -ge 2 ] || usage
    shift
    trap down EXIT INT TERM
    up "${args[@]}"
    "$@"
    ;;
  *) usage ;;
esac
