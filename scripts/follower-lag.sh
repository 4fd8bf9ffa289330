#!/usr/bin/env bash
# How far a follower lags behind a write, as clients see it.
#
# Usage: scripts/follower-lag.sh PATH/TO/ferry   (needs etcdctl; uses `ferry dev`'s ports)
#
# Starts `ferry dev` in a temporary folder, finds the leader and one
# follower, then:
# - 40 times: a put through the leader, then at once a serializable get
#   through the follower; counts the gets that do not see the put yet;
# - 30 puts through the leader, 50 ms apart, with `etcdctl watch` running
#   on the follower; prints how long after each put returned the watch
#   printed its event (p50, p90, max; negative: before the put's etcdctl
#   process had exited).
# Linearizable gets are not measured: they always see the put.
set -uo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 PATH/TO/ferry" >&2
  exit 2
fi
BIN="$(realpath "$1")"
DIR="$(mktemp -d)"
trap 'rm -rf "$DIR"' EXIT
cd "$DIR" || exit 1
"$BIN" dev >dev.out 2>&1 &
DEV=$!
for _ in $(seq 1 100); do
  grep -q endpoints dev.out && break
  sleep 0.1
done
sleep 1
export ETCDCTL_API=3
ALL="127.0.0.1:2379 127.0.0.1:22379 127.0.0.1:32379"
leader=""
for ep in $ALL; do
  if etcdctl --endpoints="$ep" endpoint status 2>/dev/null | grep -q ', true, '; then leader=$ep; fi
done
if [[ -z "$leader" ]]; then
  echo "follower-lag: no leader found" >&2
  kill -TERM "$DEV"
  exit 1
fi
follower="$(for ep in $ALL; do [[ "$ep" != "$leader" ]] && echo "$ep"; done | head -1)"

stale=0
for i in $(seq 1 40); do
  etcdctl --endpoints="$leader" put lag "v$i" >/dev/null
  seen="$(etcdctl --endpoints="$follower" get lag --print-value-only --consistency=s)"
  [[ "$seen" == "v$i" ]] || stale=$((stale + 1))
done

etcdctl --endpoints="$follower" watch w --prefix | while read -r line; do
  [[ "$line" == w* ]] && date +%s%N
done >watch.times &
sleep 1
: >put.times
for i in $(seq 1 30); do
  etcdctl --endpoints="$leader" put "w$i" x >/dev/null
  date +%s%N >>put.times
  sleep 0.05
done
sleep 1
pkill -f "etcdctl --endpoints=$follower watch" 2>/dev/null
kill -TERM "$DEV"
wait "$DEV" 2>/dev/null

echo "leader $leader, follower $follower"
echo "serializable gets on the follower right after a put that missed it: $stale of 40"
paste put.times watch.times | awk '$2 > 0 { print ($2 - $1) / 1e6 }' | sort -n |
  awk '{ a[NR] = $1 } END { printf "watch event on the follower after the put returned: p50 %.1f ms, p90 %.1f ms, max %.1f ms (%d events)\n", a[int(NR * 0.5)], a[int(NR * 0.9)], a[NR], NR }'
