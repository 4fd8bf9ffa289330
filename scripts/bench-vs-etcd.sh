#!/usr/bin/env bash
# ferry and etcd side by side, on the same machine, with the same load.
#
# Usage: scripts/bench-vs-etcd.sh PATH/TO/ferry      (a release build)
#
# For each workload (put, range-linearizable, range-serializable) and each
# round, it starts a fresh three-member cluster on 127.0.0.1 with its data in
# a temporary folder, waits until every member commits a put, runs
# `ferry bench` against all three client endpoints, stops the cluster and
# deletes its data. Rounds alternate etcd, ferry, etcd, ferry, ... so that a
# machine that gets busier or quieter over the run affects both alike; only
# one cluster runs at a time. At the end it prints, per workload, the median
# over the rounds of requests/s, p50 and p99 latency of each system and the
# ratios ferry/etcd (requests/s: above 1 means ferry is faster; latency:
# below 1 means ferry answers sooner).
#
# The load generator is `ferry bench` for both: one client process speaking
# the etcd v3 gRPC API, with its connections spread round-robin over the
# three members (so followers serve and forward as much as the leader). It
# runs on the same machine as the cluster, as etcd's own benchmark tool
# would.
#
# Both systems run with their default settings:
# - etcd 3.4 (Debian's etcd-server; installed with apt-get when missing):
#   heartbeat 100 ms, election timeout 1000 ms, a snapshot every 100000
#   entries, one fdatasync of the WAL per batch of entries before they are
#   acknowledged, bbolt backend committed every 100 ms or 10000 writes.
#   Client ports 12379, 12479, 12579; peer ports 12380, 12480, 12580.
# - ferry serve: a 100 ms tick (heartbeat every tick, election timeout 10 to
#   20 ticks), the state on disk checkpointed every 100000 entries or
#   32 MiB of writes, one fdatasync of the shared
#   log per batch of entries before they are acknowledged.
#   Client ports 13379, 13479, 13579; peer ports 13380, 13480, 13580.
# Neither clashes with `ferry dev` (2379/22379/32379, 2380/22380/32380).
#
# Environment (defaults in brackets; the defaults finish in about five
# minutes on two cores):
#   ROUNDS       rounds per system and workload [3]
#   WORKLOADS    space-separated [put range-linearizable range-serializable]
#   REQUESTS     measured requests per run [50000]
#   WARMUP       warm-up requests per run, not measured [2000]
#   SHAPES       load shapes, each CLIENTSxCONNECTIONS (requests in flight x
#                gRPC connections, round-robin over the members); every
#                workload runs in each [1x1 60x6 256x16, or
#                CLIENTSxCONNECTIONS when either of those is given]
#   REQUESTS_1X1 measured requests in the 1x1 shape, where each waits for
#                the one before [3000]
#   CLIENTS      requests in flight, for a single shape [60]
#   CONNECTIONS  gRPC connections, for a single shape [6]
#   KEY_SPACE    distinct keys [1000]
#   KEY_BYTES    key size [8]
#   VALUE_BYTES  value size [256]
#   ETCD_ARGS    more `etcd` flags, given to every member [] (for experiments)
#   FERRY_ARGS   more `ferry serve` flags, given to every member [] (for experiments)
#   MEMBER_THREADS  threads each member runs its work on, for both systems:
#                ferry's `--worker-threads` and etcd's GOMAXPROCS (the three
#                members share the machine's cores; each takes every core by
#                default) [unset: each system's default]
#   SYSTEMS      which systems to run, in order of each round [etcd ferry]
#   FLOOR        the grpc_floor example's binary (cargo build --release -p
#                ferry-server --example grpc_floor; it is then
#                target/release/examples/grpc_floor): adds the system
#                "floor", the gRPC stack alone (a map behind the KV service,
#                one process on ports 13679, 13779, 13879), and its CPU per
#                request to the cost table: what a call costs before any of
#                ferry's own work []
#   KEEP_LOGS    a folder to copy every node's log into []
#   PRELOAD_KEYS         keys put once each before the measured phase, to
#                        measure a store that holds data [0]
#   PRELOAD_VALUE_BYTES  their value size [1024]
#   PRELOAD_KEY_BYTES    their key size; keys of another size than
#                        KEY_BYTES never clash with the measured ones [16]
#   RESTART      1: after the measured phase, kill -9 every member, start
#                them again on their data and time until a put commits [0]
#   BENCH_ARGS   more flags for every `ferry bench` run, e.g.
#                "--watchers 10000 --prefix-watchers 100" for watchers open
#                during the run (their event delivery times are on each
#                run's RESULT line) []
#
# Besides requests/s and latency, every run reports what the members cost,
# summed over the three processes and divided by the measured requests:
# CPU time (utime + stime from /proc/PID/stat, before and after the
# measured phase) and bytes written to storage (write_bytes from
# /proc/PID/io); the bytes the data directory's disk received over the
# measured phase (sectors written in /proc/diskstats, after a sync on
# either side: the whole device, so every writer on the machine and the
# filesystem's journal count; write_bytes charges a process a whole
# page-cache folio per write into it, up to 64 KiB for ferry's log, while
# the disk receives only the blocks written); and each member's resident
# memory (VmRSS) after it.
# With a preload, both get --quota-backend-bytes of 8 GiB so that the
# default 2 GiB quota does not stop the fill.
#
# The disk's own latency is measured beside them, before and after the
# rounds: 1000 writes of 4 KiB, each followed by fdatasync (dd with
# oflag=dsync) in the folder the members keep their data in. A put can
# not be acknowledged sooner than one of those; the report compares the
# 1-client put latency with it.
set -uo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 PATH/TO/ferry   (build it with: cargo build --release -p ferry)" >&2
  exit 2
fi
FERRY="$(realpath "$1")"
if [[ ! -x "$FERRY" ]]; then
  echo "bench-vs-etcd: $1 is not an executable (build it first: cargo build --release -p ferry)" >&2
  exit 2
fi

ROUNDS="${ROUNDS:-3}"
WORKLOADS="${WORKLOADS:-put range-linearizable range-serializable}"
REQUESTS="${REQUESTS:-50000}"
WARMUP="${WARMUP:-2000}"
if [[ -n "${CLIENTS:-}${CONNECTIONS:-}" ]]; then
  SHAPES="${SHAPES:-${CLIENTS:-60}x${CONNECTIONS:-6}}"
fi
SHAPES="${SHAPES:-1x1 60x6 256x16}"
REQUESTS_1X1="${REQUESTS_1X1:-3000}"
CLIENTS="${CLIENTS:-60}"
CONNECTIONS="${CONNECTIONS:-6}"
KEY_SPACE="${KEY_SPACE:-1000}"
KEY_BYTES="${KEY_BYTES:-8}"
VALUE_BYTES="${VALUE_BYTES:-256}"
BENCH_ARGS="${BENCH_ARGS:-}"
ETCD_ARGS="${ETCD_ARGS:-}"
FERRY_ARGS="${FERRY_ARGS:-}"
MEMBER_THREADS="${MEMBER_THREADS:-}"
if [[ -n "$MEMBER_THREADS" && ! "$MEMBER_THREADS" =~ ^[1-9][0-9]*$ ]]; then
  echo "bench-vs-etcd: MEMBER_THREADS must be a positive number of threads, not '$MEMBER_THREADS'" >&2
  exit 2
fi
SYSTEMS="${SYSTEMS:-etcd ferry}"
FLOOR="${FLOOR:-}"
if [[ -n "$FLOOR" ]]; then
  FLOOR="$(realpath "$FLOOR")"
  SYSTEMS+=" floor"
fi
KEEP_LOGS="${KEEP_LOGS:-}"
PRELOAD_KEYS="${PRELOAD_KEYS:-0}"
PRELOAD_VALUE_BYTES="${PRELOAD_VALUE_BYTES:-1024}"
PRELOAD_KEY_BYTES="${PRELOAD_KEY_BYTES:-16}"
RESTART="${RESTART:-0}"
if [[ "$PRELOAD_KEYS" -gt 0 ]]; then
  ETCD_ARGS="--quota-backend-bytes=8589934592 $ETCD_ARGS"
  FERRY_ARGS="--quota-backend-bytes=8589934592 $FERRY_ARGS"
fi
CLK_TCK="$(getconf CLK_TCK)"

if ! command -v etcd >/dev/null 2>&1; then
  echo "bench-vs-etcd: etcd is missing; installing Debian's etcd-server"
  if ! apt-get install -y etcd-server >/dev/null; then
    apt-get update >/dev/null && apt-get install -y etcd-server >/dev/null
  fi
  if ! command -v etcd >/dev/null 2>&1; then
    echo "bench-vs-etcd: could not install etcd (apt-get install -y etcd-server)" >&2
    exit 1
  fi
fi

ETCD_CLIENT_PORTS=(12379 12479 12579)
ETCD_PEER_PORTS=(12380 12480 12580)
FERRY_CLIENT_PORTS=(13379 13479 13579)
FERRY_PEER_PORTS=(13380 13480 13580)
FLOOR_PORTS=(13679 13779 13879)

DIR="$(mktemp -d)"
RESULTS="$DIR/results"
: >"$RESULTS"
PIDS=()

stop_cluster() {
  local pid
  for pid in "${PIDS[@]}"; do
    kill -TERM "$pid" 2>/dev/null
  done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      echo "bench-vs-etcd: process $pid did not stop within 10 s of SIGTERM; killing it"
      kill -KILL "$pid" 2>/dev/null
    fi
    wait "$pid" 2>/dev/null
  done
  PIDS=()
}

cleanup() {
  stop_cluster
  rm -rf "$DIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

port_in_use() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

check_ports_free() {
  local port
  for port in "$@"; do
    if port_in_use "$port"; then
      echo "bench-vs-etcd: port $port is already in use" >&2
      return 1
    fi
  done
}

start_etcd() {
  local data="$1" cluster="" i
  # One token for the whole cluster: members with different tokens refuse
  # each other.
  local token="bench-$$-$RANDOM"
  for i in 0 1 2; do
    cluster+="${cluster:+,}e$((i + 1))=http://127.0.0.1:${ETCD_PEER_PORTS[$i]}"
  done
  # ETCD_ARGS is a list of flags: split on purpose.
  for i in 0 1 2; do
    env -u ETCD_DATA_DIR -u ETCD_NAME ${MEMBER_THREADS:+GOMAXPROCS=$MEMBER_THREADS} etcd \
      --name "e$((i + 1))" \
      --data-dir "$data/e$((i + 1))" \
      --listen-client-urls "http://127.0.0.1:${ETCD_CLIENT_PORTS[$i]}" \
      --advertise-client-urls "http://127.0.0.1:${ETCD_CLIENT_PORTS[$i]}" \
      --listen-peer-urls "http://127.0.0.1:${ETCD_PEER_PORTS[$i]}" \
      --initial-advertise-peer-urls "http://127.0.0.1:${ETCD_PEER_PORTS[$i]}" \
      --initial-cluster "$cluster" \
      --initial-cluster-token "$token" \
      --initial-cluster-state new \
      --logger zap --log-outputs stderr \
      $ETCD_ARGS \
      >"$data/e$((i + 1)).log" 2>&1 &
    PIDS+=($!)
  done
}

start_ferry() {
  local data="$1" i
  local members=()
  for i in 0 1 2; do
    members+=(--member "$((i + 1))=127.0.0.1:${FERRY_PEER_PORTS[$i]},http://127.0.0.1:${FERRY_CLIENT_PORTS[$i]}")
  done
  # FERRY_ARGS is a list of flags: split on purpose.
  for i in 0 1 2; do
    "$FERRY" serve \
      --id "$((i + 1))" \
      --data-dir "$data/f$((i + 1))" \
      --listen-client "127.0.0.1:${FERRY_CLIENT_PORTS[$i]}" \
      --listen-peer "127.0.0.1:${FERRY_PEER_PORTS[$i]}" \
      "${members[@]}" \
      ${MEMBER_THREADS:+--worker-threads "$MEMBER_THREADS"} \
      $FERRY_ARGS \
      >"$data/f$((i + 1)).log" 2>&1 &
    PIDS+=($!)
  done
}

start_floor() {
  local ports="${FLOOR_PORTS[*]}"
  "$FLOOR" hyper multi "${ports// /,}" >"$1/floor.log" 2>&1 &
  PIDS+=($!)
}

# Waits until a one-request put through every endpoint succeeds (so there is
# a leader and every member reaches it). WAIT_READY_S seconds at most [60].
wait_ready() {
  local endpoint deadline=$((SECONDS + ${WAIT_READY_S:-60})) output
  for endpoint in "$@"; do
    while true; do
      output="$("$FERRY" bench --endpoints "$endpoint" --connections 1 --clients 1 \
        --requests 1 --warmup-requests 0 --timeout-ms 2000 --key-space 1 2>&1)"
      if grep -q '^RESULT .* errors=0 ' <<<"$output"; then
        break
      fi
      if ((SECONDS > deadline)); then
        echo "bench-vs-etcd: $endpoint did not commit a put within ${WAIT_READY_S:-60} s:"
        echo "$output"
        return 1
      fi
      sleep 0.05
    done
  done
}

# CPU time of every running member, in clock ticks (utime + stime; the
# fields after the command name, which may hold spaces).
members_cpu_ticks() {
  local pid total=0 stat fields
  for pid in "${PIDS[@]}"; do
    stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || continue
    read -r -a fields <<<"${stat##*) }"
    total=$((total + fields[11] + fields[12]))
  done
  echo "$total"
}

# Bytes every running member caused to be written to storage.
members_written_bytes() {
  local pid total=0 bytes
  for pid in "${PIDS[@]}"; do
    bytes="$(sed -n 's/^write_bytes: //p' "/proc/$pid/io" 2>/dev/null)"
    total=$((total + ${bytes:-0}))
  done
  echo "$total"
}

# The block device the data directory is on, as /proc/diskstats names it;
# empty if it is not one there (tmpfs, a device-mapper name).
DISK_DEVICE="$(basename "$(df --output=source "$DIR" 2>/dev/null | tail -n 1)")"
if ! awk -v d="$DISK_DEVICE" '$3 == d { found = 1 } END { exit !found }' /proc/diskstats; then
  DISK_DEVICE=""
fi

# Bytes the data directory's disk has received so far, from every writer,
# after a sync so that what was written to the page cache is counted
# now; "-" if the disk is unknown.
disk_written_bytes() {
  if [[ -z "$DISK_DEVICE" ]]; then
    echo -
    return
  fi
  sync
  awk -v d="$DISK_DEVICE" '$3 == d { printf "%.0f\n", $10 * 512 }' /proc/diskstats
}

# Resident memory of each running member in MiB, as "a/b/c".
members_rss_mib() {
  local pid list="" kib
  for pid in "${PIDS[@]}"; do
    kib="$(sed -n 's/^VmRSS:[[:space:]]*\([0-9]*\) kB/\1/p' "/proc/$pid/status" 2>/dev/null)"
    list+="${list:+/}$(( ${kib:-0} / 1024 ))"
  done
  echo "$list"
}

# Milliseconds since the epoch.
now_ms() {
  echo $(( $(date +%s%N) / 1000000 ))
}

# Starts the cluster of SYSTEM on DATA (fresh or not).
start_system() {
  case "$1" in
    etcd) start_etcd "$2" ;;
    floor) start_floor "$2" ;;
    *) start_ferry "$2" ;;
  esac
}

# The value of KEY in a RESULT line.
field() {
  sed -n "s/.* $2=\([^ ]*\).*/\1/p" <<<" $1"
}

# Fills the store of the running cluster with PRELOAD_KEYS keys; prints
# the seconds it took.
preload() {
  local endpoints="$1" output line
  output="$("$FERRY" bench --endpoints "$endpoints" --workload fill \
    --key-space "$PRELOAD_KEYS" --key-bytes "$PRELOAD_KEY_BYTES" \
    --value-bytes "$PRELOAD_VALUE_BYTES" --clients "$CLIENTS" \
    --connections "$CONNECTIONS" --timeout-ms 60000 2>&1)"
  line="$(grep '^RESULT ' <<<"$output")"
  if [[ -z "$line" || "$(field "$line" errors)" != 0 ]]; then
    echo "bench-vs-etcd: the preload failed:" >&2
    echo "$output" >&2
    return 1
  fi
  field "$line" elapsed_s
}

# One run: SYSTEM WORKLOAD ROUND LABEL (the workload and its shape, as the
# results name it). Appends "system label round rps p50 p99
# errors load_errors max_us cpu_us_per_request written_bytes_per_request
# rss_mib_max restart_ms preload_s disk_bytes_per_request" to the results.
run_one() {
  local system="$1" workload="$2" round="$3" label="$4"
  local data="$DIR/$system-$workload-$round" ports endpoints="" port
  mkdir -p "$data"
  if [[ "$system" == etcd ]]; then
    ports=("${ETCD_CLIENT_PORTS[@]}")
    check_ports_free "${ETCD_CLIENT_PORTS[@]}" "${ETCD_PEER_PORTS[@]}" || return 1
  elif [[ "$system" == floor ]]; then
    ports=("${FLOOR_PORTS[@]}")
    check_ports_free "${FLOOR_PORTS[@]}" || return 1
  else
    ports=("${FERRY_CLIENT_PORTS[@]}")
    check_ports_free "${FERRY_CLIENT_PORTS[@]}" "${FERRY_PEER_PORTS[@]}" || return 1
  fi
  start_system "$system" "$data"
  for port in "${ports[@]}"; do
    endpoints+="${endpoints:+,}127.0.0.1:$port"
  done
  local status=0 output line preload_s=0 restart_ms=- cpu_before written_before disk_before
  if wait_ready ${endpoints//,/ }; then
    if [[ "$PRELOAD_KEYS" -gt 0 ]]; then
      preload_s="$(preload "$endpoints")" || status=1
    fi
  else
    status=1
  fi
  if [[ $status -eq 0 ]]; then
    cpu_before="$(members_cpu_ticks)"
    written_before="$(members_written_bytes)"
    disk_before="$(disk_written_bytes)"
    # shellcheck disable=SC2086 # BENCH_ARGS is a list of flags
    output="$("$FERRY" bench --endpoints "$endpoints" --workload "$workload" \
      --requests "$RUN_REQUESTS" --warmup-requests "$WARMUP" --clients "$CLIENTS" \
      --connections "$CONNECTIONS" --key-space "$KEY_SPACE" --key-bytes "$KEY_BYTES" \
      --value-bytes "$VALUE_BYTES" $BENCH_ARGS 2>&1)"
    status=$?
    local cpu_ticks=$(($(members_cpu_ticks) - cpu_before))
    local written=$(($(members_written_bytes) - written_before))
    local disk_after
    disk_after="$(disk_written_bytes)"
    local rss
    rss="$(members_rss_mib)"
    line="$(grep '^RESULT ' <<<"$output")"
    if [[ $status -ne 0 || -z "$line" ]]; then
      echo "bench-vs-etcd: ferry bench failed against $system:"
      echo "$output"
      status=1
    else
      # The warm-up ran inside the measured window too: count its requests.
      local requests=$(( $(field "$line" requests) + $(field "$line" warmup_requests) ))
      local cpu_us written_per rss_max disk_per=-
      cpu_us="$(awk -v t="$cpu_ticks" -v hz="$CLK_TCK" -v n="$requests" 'BEGIN { printf "%.1f", t * 1e6 / hz / n }')"
      written_per="$(awk -v b="$written" -v n="$requests" 'BEGIN { printf "%.0f", b / n }')"
      rss_max="$(tr '/' '\n' <<<"$rss" | sort -n | tail -n 1)"
      if [[ "$disk_before" != - && "$disk_after" != - ]]; then
        disk_per="$(awk -v b="$((disk_after - disk_before))" -v n="$requests" 'BEGIN { printf "%.0f", b / n }')"
      fi
      if [[ "$RESTART" == 1 ]]; then
        local pid
        for pid in "${PIDS[@]}"; do
          kill -KILL "$pid" 2>/dev/null
        done
        for pid in "${PIDS[@]}"; do
          wait "$pid" 2>/dev/null
        done
        PIDS=()
        local restarted
        restarted="$(now_ms)"
        start_system "$system" "$data"
        if WAIT_READY_S=600 wait_ready "127.0.0.1:${ports[0]}"; then
          restart_ms=$(($(now_ms) - restarted))
        else
          status=1
        fi
      fi
      echo "$system round $round: $line"
      echo "$system round $round: cpu_us_per_request=$cpu_us written_bytes_per_request=$written_per" \
        "disk_bytes_per_request=$disk_per rss_mib=$rss preload_s=$preload_s restart_ms=$restart_ms"
      echo "$system $label $round $(field "$line" requests_per_s) $(field "$line" p50_us)" \
        "$(field "$line" p99_us) $(field "$line" errors) $(field "$line" load_errors)" \
        "$(field "$line" max_us) $cpu_us $written_per $rss_max $restart_ms $preload_s $disk_per" >>"$RESULTS"
    fi
  fi
  stop_cluster
  if [[ -n "$KEEP_LOGS" ]]; then
    mkdir -p "$KEEP_LOGS/$system-${label/@/-}-$round"
    cp "$data"/*.log "$KEEP_LOGS/$system-${label/@/-}-$round/" 2>/dev/null
  elif [[ $status -ne 0 ]]; then
    for log in "$data"/*.log; do
      echo "---- $log (last 10 lines)"
      tail -n 10 "$log"
    done
  fi
  rm -rf "$data"
  return $status
}

echo "bench-vs-etcd: $(etcd --version 2>/dev/null | head -n 1); ferry $("$FERRY" --version 2>/dev/null)"
echo "bench-vs-etcd: machine: $(nproc) CPUs, $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1)"
echo "bench-vs-etcd: load before: $(uptime)"
echo "bench-vs-etcd: $ROUNDS rounds of: $WORKLOADS; $REQUESTS requests (+$WARMUP warm-up)," \
  "shapes (clients x connections) $SHAPES, $KEY_SPACE keys of $KEY_BYTES bytes," \
  "values of $VALUE_BYTES bytes${BENCH_ARGS:+; bench flags: $BENCH_ARGS}" \
  "${ETCD_ARGS:+; etcd flags: $ETCD_ARGS}${FERRY_ARGS:+; ferry serve flags: $FERRY_ARGS}${MEMBER_THREADS:+; $MEMBER_THREADS thread(s) per member}"
if [[ "$PRELOAD_KEYS" -gt 0 ]]; then
  echo "bench-vs-etcd: each run first puts $PRELOAD_KEYS keys of $PRELOAD_KEY_BYTES bytes with values of" \
    "$PRELOAD_VALUE_BYTES bytes (about $((PRELOAD_KEYS * PRELOAD_VALUE_BYTES / 1000000)) MB)"
fi

# The mean time of one 4 KiB write + fdatasync on the data's disk, in us.
fsync_probe_us() {
  local out seconds
  out="$(LC_ALL=C dd if=/dev/zero of="$DIR/fsync-probe" bs=4k count=1000 oflag=dsync 2>&1)"
  rm -f "$DIR/fsync-probe"
  seconds="$(sed -n 's/.* copied, \([0-9.e-]*\) s,.*/\1/p' <<<"$out")"
  awk -v s="${seconds:-0}" 'BEGIN { printf "%.0f", s * 1e6 / 1000 }'
}
FSYNC_BEFORE_US="$(fsync_probe_us)"
echo "bench-vs-etcd: disk: one 4 KiB write + fdatasync takes $FSYNC_BEFORE_US us (mean of 1000, before the rounds)"

failures=0
LABELS=""
for workload in $WORKLOADS; do
  for shape in $SHAPES; do
    CLIENTS="${shape%x*}"
    CONNECTIONS="${shape#*x}"
    RUN_REQUESTS="$REQUESTS"
    if [[ "$shape" == 1x1 ]]; then
      RUN_REQUESTS="$REQUESTS_1X1"
    fi
    label="$workload@$shape"
    LABELS+="${LABELS:+ }$label"
    echo "== $workload, $CLIENTS clients on $CONNECTIONS connections"
    for round in $(seq 1 "$ROUNDS"); do
      for system in $SYSTEMS; do
        run_one "$system" "$workload" "$round" "$label" || failures=$((failures + 1))
      done
    done
  done
done
echo "bench-vs-etcd: load after: $(uptime)"
FSYNC_AFTER_US="$(fsync_probe_us)"
FSYNC_US="$(( (FSYNC_BEFORE_US + FSYNC_AFTER_US) / 2 ))"
echo "bench-vs-etcd: disk: one 4 KiB write + fdatasync takes $FSYNC_AFTER_US us after the rounds" \
  "($FSYNC_BEFORE_US before; $FSYNC_US on average)"

# The median of the numbers on stdin (the mean of the middle two for an
# even count).
median() {
  sort -g | awk '{ v[NR] = $1 } END {
    if (NR == 0) { print "-"; exit }
    if (NR % 2) { print v[(NR + 1) / 2] } else { print (v[NR / 2] + v[NR / 2 + 1]) / 2 }
  }'
}

ratio() {
  awk -v a="$1" -v b="$2" 'BEGIN { if (a == "-" || b == "-" || b == 0) print "-"; else printf "%.2f", a / b }'
}

column_of() {
  awk -v s="$1" -v w="$2" -v c="$3" '$1 == s && $2 == w { print $c }' "$RESULTS"
}

echo
echo "Medians over $ROUNDS rounds ($REQUESTS requests each, $REQUESTS_1X1 in 1x1; workload@CLIENTSxCONNECTIONS," \
  "$VALUE_BYTES-byte values); ratio = ferry/etcd"
printf '%-30s %11s %11s %6s | %9s %9s %6s | %9s %9s %6s | %s\n' \
  workload "etcd req/s" "ferry req/s" ratio "etcd p50" "ferry p50" ratio "etcd p99" "ferry p99" ratio errors
for workload in $LABELS; do
  e_rps="$(column_of etcd "$workload" 4 | median)"
  f_rps="$(column_of ferry "$workload" 4 | median)"
  e_p50="$(column_of etcd "$workload" 5 | median)"
  f_p50="$(column_of ferry "$workload" 5 | median)"
  e_p99="$(column_of etcd "$workload" 6 | median)"
  f_p99="$(column_of ferry "$workload" 6 | median)"
  e_err="$(column_of etcd "$workload" 7 | awk '{ s += $1 } END { print s + 0 }')"
  f_err="$(column_of ferry "$workload" 7 | awk '{ s += $1 } END { print s + 0 }')"
  printf '%-30s %11s %11s %6s | %7s us %7s us %6s | %7s us %7s us %6s | etcd %s, ferry %s\n' \
    "$workload" "$e_rps" "$f_rps" "$(ratio "$f_rps" "$e_rps")" \
    "$e_p50" "$f_p50" "$(ratio "$f_p50" "$e_p50")" \
    "$e_p99" "$f_p99" "$(ratio "$f_p99" "$e_p99")" "$e_err" "$f_err"
done
echo "(req/s ratio above 1: ferry serves more; latency ratio below 1: ferry answers sooner;" \
  "errors: failed requests summed over the rounds)"
echo
echo "What the members cost, medians over the rounds: server CPU and bytes written per request" \
  "(all three members: wr as /proc/PID/io charges them, disk as the disk received them)," \
  "the largest member's resident memory, the slowest request," \
  "the time to the first put after kill -9 of every member (RESTART=1)"
printf '%-30s %9s %9s %6s | %9s %9s | %9s %9s | %7s %7s | %9s %9s | %9s %9s\n' \
  workload "etcd cpu" "ferry cpu" ratio "etcd wr" "ferry wr" "etcd disk" "ferry disk" "etcd rss" "ferry" \
  "etcd max" "ferry max" "etcd rst" "ferry rst"
for workload in $LABELS; do
  e_cpu="$(column_of etcd "$workload" 10 | median)"
  f_cpu="$(column_of ferry "$workload" 10 | median)"
  printf '%-30s %6s us %6s us %6s | %7s B %7s B | %7s B %7s B | %3s MiB %3s MiB | %6s ms %6s ms | %6s ms %6s ms\n' \
    "$workload" "$e_cpu" "$f_cpu" "$(ratio "$f_cpu" "$e_cpu")" \
    "$(column_of etcd "$workload" 11 | median)" "$(column_of ferry "$workload" 11 | median)" \
    "$(column_of etcd "$workload" 15 | grep -v -- - | median)" \
    "$(column_of ferry "$workload" 15 | grep -v -- - | median)" \
    "$(column_of etcd "$workload" 12 | median)" "$(column_of ferry "$workload" 12 | median)" \
    "$(column_of etcd "$workload" 9 | median | awk '{ if ($1 == "-") print "-"; else printf "%.0f", $1 / 1000 }')" \
    "$(column_of ferry "$workload" 9 | median | awk '{ if ($1 == "-") print "-"; else printf "%.0f", $1 / 1000 }')" \
    "$(column_of etcd "$workload" 13 | grep -v -- - | median)" \
    "$(column_of ferry "$workload" 13 | grep -v -- - | median)"
done
if [[ -n "$FLOOR" ]]; then
  echo
  echo "The gRPC stack alone (grpc_floor: hyper's HTTP/2 server and tonic's KV service over a map," \
    "one process), server CPU per request, medians:"
  for workload in $LABELS; do
    f_cpu="$(column_of ferry "$workload" 10 | median)"
    g_cpu="$(column_of floor "$workload" 10 | median)"
    printf '%-30s floor %6s us   ferry %6s us   ferry/floor %s\n' \
      "$workload" "$g_cpu" "$f_cpu" "$(ratio "$f_cpu" "$g_cpu")"
  done
fi
if [[ " $LABELS " == *" put@1x1 "* && "$FSYNC_US" -gt 0 ]]; then
  e_p50="$(column_of etcd put@1x1 5 | median)"
  f_p50="$(column_of ferry put@1x1 5 | median)"
  echo "1-client put, p50 over one 4 KiB write + fdatasync ($FSYNC_US us):" \
    "etcd $e_p50 us = $(ratio "$e_p50" "$FSYNC_US")x, ferry $f_p50 us = $(ratio "$f_p50" "$FSYNC_US")x"
  if [[ -n "$FLOOR" ]]; then
    # What no member can go below on this machine: the gRPC round trip
    # alone plus one durable write, before any replication.
    g_p50="$(column_of floor put@1x1 5 | median)"
    if [[ "$g_p50" != - ]]; then
      g_sync="$(awk -v a="$g_p50" -v b="$FSYNC_US" 'BEGIN { printf "%.0f", a + b }')"
      echo "  floor: the gRPC stack alone answers it in $g_p50 us; with one write + fdatasync" \
        "$g_sync us = $(ratio "$g_sync" "$FSYNC_US")x, before any replication"
    fi
  fi
fi
if [[ "$PRELOAD_KEYS" -gt 0 ]]; then
  echo "(preloaded: $PRELOAD_KEYS keys of $PRELOAD_KEY_BYTES bytes with values of $PRELOAD_VALUE_BYTES bytes;" \
    "fill time, median: etcd $(column_of etcd "${LABELS%% *}" 14 | median) s," \
    "ferry $(column_of ferry "${LABELS%% *}" 14 | median) s)"
fi

if [[ "$failures" -ne 0 ]]; then
  echo "bench-vs-etcd: $failures run(s) failed"
  exit 1
fi
