#!/usr/bin/env bash
# Two ferry builds side by side: the same load against a fresh
# `ferry dev` cluster of each, rounds alternating A, B, A, B, ... so that a
# machine that gets busier or quieter affects both alike.
#
# Usage: scripts/bench-ab.sh PATH/TO/ferry-A PATH/TO/ferry-B   (release builds)
#
# Prints per round the requests/s and latency of `ferry bench` (run with
# build B's binary for both, unless CLIENT=own) and the server CPU per
# request: user + system time of the three member processes from
# /proc/PID/stat over the whole `ferry bench` run (a range workload's load
# phase and the warm-up included), divided by the measured requests; at
# the end, each build's median CPU per request. Environment: ROUNDS [3],
# REQUESTS [20000], WORKLOAD (`ferry bench --workload`) [put], BENCH_ARGS
# (more `ferry bench` flags, e.g. "--clients 256 --connections 16") [],
# CLIENT (`B`: build B's `ferry bench` loads both clusters; `own`: each
# build's own, to compare a change of the client; a path: that ferry's) [B],
# A_ARGS and B_ARGS (more `ferry dev` flags for build A or B) []. A build
# from before `ferry dev --worker-threads` runs each member on one thread
# per CPU, a newer one on its share of the CPUs: to compare the two at the
# same threads, give the newer one `--worker-threads` with that count.
set -euo pipefail
A=$(realpath "$1")
B=$(realpath "$2")
ROUNDS=${ROUNDS:-3}
REQUESTS=${REQUESTS:-20000}
WORKLOAD=${WORKLOAD:-put}
TICKS_PER_S=$(getconf CLK_TCK)
# Each round's CPU per request, for the medians at the end.
SUMMARY=$(mktemp)

# CPU ticks used so far by the children of process $1.
cpu_ticks() {
    local total=0
    for pid in $(pgrep -P "$1"); do
        local used
        used=$(cut -d')' -f2 "/proc/$pid/stat" | awk '{print $12 + $13}')
        total=$((total + used))
    done
    echo "$total"
}

# A cluster left on the ports would be measured instead of the build (its
# members are not children of this script's `ferry dev`: CPU 0).
ports_free() {
    for port in 2379 22379 32379 2380 22380 32380; do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "bench-ab: port $port is in use (a cluster left running?)" >&2
            return 1
        fi
    done
}

for round in $(seq "$ROUNDS"); do
    for name in A B; do
        ports_free || exit 1
        bin=$A
        [ "$name" = B ] && bin=$B
        dir=$(mktemp -d)
        args=${A_ARGS:-}
        [ "$name" = B ] && args=${B_ARGS:-}
        # shellcheck disable=SC2086 # A_ARGS and B_ARGS are lists of flags
        (cd "$dir" && exec "$bin" dev $args >dev.log 2>&1) &
        dev=$!
        # A failed step must not leave the cluster holding the ports.
        # SIGTERM, not SIGINT: a script run in the background starts its
        # own background jobs with SIGINT ignored, and the cluster would
        # never stop.
        trap 'kill -TERM "$dev" 2>/dev/null || true' EXIT
        # Every member must take clients, and a leader be elected.
        for port in 2379 22379 32379; do
            for _ in $(seq 100); do
                (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
                sleep 0.2
            done
        done
        sleep 3
        before=$(cpu_ticks "$dev")
        # shellcheck disable=SC2086 # BENCH_ARGS is a list of flags
        case "${CLIENT:-B}" in
            B) client=$B ;;
            own) client=$bin ;;
            *) client=$(realpath "$CLIENT") ;;
        esac
        result=$("$client" bench --requests "$REQUESTS" --workload "$WORKLOAD" ${BENCH_ARGS:-} | grep '^RESULT')
        after=$(cpu_ticks "$dev")
        kill -TERM "$dev"
        wait "$dev" 2>/dev/null || true
        rm -rf "$dir"
        # In tenths of a microsecond, printed with one decimal: changes of
        # a few percent are lost in whole microseconds.
        tenths=$(( (after - before) * 10000000 / TICKS_PER_S / REQUESTS ))
        us_per_request="$((tenths / 10)).$((tenths % 10))"
        echo "$name $us_per_request" >>"$SUMMARY"
        rps=$(echo "$result" | grep -o 'requests_per_s=[0-9.]*')
        p50=$(echo "$result" | grep -o ' p50_us=[0-9]*' | tr -d ' ')
        p99=$(echo "$result" | grep -o ' p99_us=[0-9]*' | tr -d ' ')
        echo "round $round $name: $rps $p50 $p99 server_cpu_us_per_request=$us_per_request"
    done
done

# The median of each build's rounds (the mean of the middle two for an
# even count).
for name in A B; do
    echo "median $name: server_cpu_us_per_request=$(awk -v n="$name" '$1 == n {print $2}' "$SUMMARY" |
        sort -n | awk '{v[NR] = $1} END {m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.1f", m}')"
done
rm -f "$SUMMARY"
