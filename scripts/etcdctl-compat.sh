#!/usr/bin/env bash
# etcdctl compatibility check for ferry.
#
# Runs the stock etcdctl (v3 API) against a running ferry endpoint and checks
# that each command behaves as it does against etcd. Installs nothing: it
# expects `etcdctl` on PATH (Debian: apt-get install etcd-client) and the
# endpoints in $ENDPOINTS (comma-separated, default 127.0.0.1:2379).
# Every key it writes is under a fresh prefix, so it can run against a
# cluster that already holds data. Ends with "N passed, N failed" and exits
# non-zero if anything failed.
set -uo pipefail

ENDPOINTS="${ENDPOINTS:-127.0.0.1:2379}"
export ETCDCTL_API=3
FIRST_ENDPOINT="${ENDPOINTS%%,*}"
PREFIX="ferry-compat/$$-$(date +%s)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"; jobs -p | xargs -r kill 2>/dev/null' EXIT

passed=0
failed=0

if ! command -v etcdctl >/dev/null 2>&1; then
  echo "etcdctl-compat: etcdctl is not on PATH (Debian: apt-get install etcd-client)" >&2
  exit 2
fi

ctl() { etcdctl --endpoints="$ENDPOINTS" --command-timeout=10s "$@"; }
ctl1() { etcdctl --endpoints="$FIRST_ENDPOINT" --command-timeout=10s "$@"; }

# check NAME EXPECTED ACTUAL: passes when ACTUAL equals EXPECTED.
check() {
  local name="$1" expected="$2" actual="$3"
  if [[ "$actual" == "$expected" ]]; then
    echo "ok   $name"
    passed=$((passed + 1))
  else
    echo "FAIL $name"
    echo "     expected: $(printf '%q' "$expected")"
    echo "     actual:   $(printf '%q' "$actual")"
    failed=$((failed + 1))
  fi
}

# check_contains NAME NEEDLE HAYSTACK
check_contains() {
  local name="$1" needle="$2" haystack="$3"
  if [[ "$haystack" == *"$needle"* ]]; then
    echo "ok   $name"
    passed=$((passed + 1))
  else
    echo "FAIL $name"
    echo "     expected to contain: $(printf '%q' "$needle")"
    echo "     actual:              $(printf '%q' "$haystack")"
    failed=$((failed + 1))
  fi
}

revision_of() { sed -n 's/.*"revision":\([0-9][0-9]*\).*/\1/p' | head -n1; }

echo "etcdctl-compat: $(etcdctl version | head -n1) against $ENDPOINTS, prefix $PREFIX"

# put / get
check "put" "OK" "$(ctl put "$PREFIX/a" "apple" 2>&1)"
check "get" "$(printf '%s\n%s' "$PREFIX/a" apple)" "$(ctl get "$PREFIX/a" 2>&1)"
check "get --print-value-only" "apple" "$(ctl get "$PREFIX/a" --print-value-only 2>&1)"
check "get missing key" "" "$(ctl get "$PREFIX/missing" 2>&1)"

# --prefix, ranges, limits, counts
ctl put "$PREFIX/b" "banana" >/dev/null
ctl put "$PREFIX/c" "cherry" >/dev/null
check "get --prefix --keys-only" "$(printf '%s\n%s\n%s' "$PREFIX/a" "$PREFIX/b" "$PREFIX/c")" \
  "$(ctl get "$PREFIX/" --prefix --keys-only 2>&1 | sed '/^$/d')"
check "get --prefix -w json count" "3" \
  "$(ctl get "$PREFIX/" --prefix -w json 2>&1 | sed -n 's/.*"count":\([0-9][0-9]*\).*/\1/p')"
check "get range [a, c)" "$(printf '%s\n%s' "$PREFIX/a" "$PREFIX/b")" \
  "$(ctl get "$PREFIX/a" "$PREFIX/c" --keys-only 2>&1 | sed '/^$/d')"
check "get --prefix --limit --sort-by descending" "$PREFIX/c" \
  "$(ctl get "$PREFIX/" --prefix --limit=1 --order=DESCEND --keys-only 2>&1 | sed '/^$/d')"
check "get --from-key" "$PREFIX/c" \
  "$(ctl get "$PREFIX/c" --from-key --keys-only 2>&1 | sed '/^$/d' | grep -F "$PREFIX/" | head -n1)"

# --rev: a historical read
rev_old="$(ctl put "$PREFIX/versioned" "v1" -w json 2>&1 | revision_of)"
ctl put "$PREFIX/versioned" "v2" >/dev/null
check "get --rev reads the past" "v1" "$(ctl get "$PREFIX/versioned" --rev="$rev_old" --print-value-only 2>&1)"
check "get reads the present" "v2" "$(ctl get "$PREFIX/versioned" --print-value-only 2>&1)"
check "put --prev-kv" "$(printf 'OK\n%s\n%s' "$PREFIX/versioned" v2)" "$(ctl put "$PREFIX/versioned" v3 --prev-kv 2>&1)"

# del
check "del" "1" "$(ctl del "$PREFIX/versioned" 2>&1)"
check "del --prefix --prev-kv" "$(printf '3\n%s\n%s\n%s\n%s\n%s\n%s' "$PREFIX/a" apple "$PREFIX/b" banana "$PREFIX/c" cherry)" \
  "$(ctl del "$PREFIX/" --prefix --prev-kv 2>&1)"
check "get after del" "" "$(ctl get "$PREFIX/" --prefix 2>&1)"

# errors as etcd
check_contains "empty key refused" "key is not provided" "$(ctl get "" 2>&1)"
check_contains "future revision refused" "required revision is a future revision" \
  "$(ctl get "$PREFIX/x" --rev=999999999 2>&1)"

# txn
ctl put "$PREFIX/txn" "1" >/dev/null
txn_out="$(printf 'value("%s") = "1"\n\nput %s 2\nput %s yes\n\nput %s no\n\n' \
  "$PREFIX/txn" "$PREFIX/txn" "$PREFIX/txn-result" "$PREFIX/txn-result" | ctl txn 2>&1)"
check "txn success branch" "$(printf 'SUCCESS\n\nOK\n\nOK')" "$txn_out"
check "txn effect" "yes" "$(ctl get "$PREFIX/txn-result" --print-value-only 2>&1)"
txn_out="$(printf 'value("%s") = "1"\n\nput %s 3\n\nput %s no\n\n' \
  "$PREFIX/txn" "$PREFIX/txn" "$PREFIX/txn-result" | ctl txn 2>&1)"
check "txn failure branch" "$(printf 'FAILURE\n\nOK')" "$txn_out"
check "txn failure effect" "no" "$(ctl get "$PREFIX/txn-result" --print-value-only 2>&1)"

# watch: live, then historical
# etcdctl itself in the background (not through a shell function), so that
# killing $! stops the watcher.
etcdctl --endpoints="$ENDPOINTS" watch "$PREFIX/w" --prefix --prev-kv >"$WORK/watch.out" 2>&1 &
watch_pid=$!
sleep 1
ctl put "$PREFIX/w/1" "first" >/dev/null
ctl put "$PREFIX/w/1" "second" >/dev/null
ctl del "$PREFIX/w/1" >/dev/null
for _ in $(seq 1 50); do
  grep -q DELETE "$WORK/watch.out" 2>/dev/null && break
  sleep 0.1
done
kill "$watch_pid" 2>/dev/null
wait "$watch_pid" 2>/dev/null
check "watch --prefix --prev-kv" "$(printf 'PUT\n%s\nfirst\nPUT\n%s\nfirst\n%s\nsecond\nDELETE\n%s\nsecond\n%s' \
  "$PREFIX/w/1" "$PREFIX/w/1" "$PREFIX/w/1" "$PREFIX/w/1" "$PREFIX/w/1")" "$(cat "$WORK/watch.out")"
watch_rev="$(ctl put "$PREFIX/h" "old" -w json 2>&1 | revision_of)"
ctl put "$PREFIX/h" "new" >/dev/null
timeout 3 etcdctl --endpoints="$ENDPOINTS" watch "$PREFIX/h" --rev="$watch_rev" >"$WORK/history.out" 2>&1
check "watch --rev replays history" "$(printf 'PUT\n%s\nold\nPUT\n%s\nnew' "$PREFIX/h" "$PREFIX/h")" \
  "$(cat "$WORK/history.out")"

# lease grant / keep-alive / timetolive / revoke
grant_out="$(ctl lease grant 60 2>&1)"
lease_id="$(echo "$grant_out" | sed -n 's/^lease \([0-9a-f]*\) granted with TTL(60s)$/\1/p')"
check_contains "lease grant" "granted with TTL(60s)" "$grant_out"
check "put --lease" "OK" "$(ctl put "$PREFIX/leased" "v" --lease="$lease_id" 2>&1)"
check_contains "lease timetolive --keys" "attached keys([$PREFIX/leased])" \
  "$(ctl lease timetolive "$lease_id" --keys 2>&1)"
check "lease keep-alive --once" "lease $lease_id keepalived with TTL(60)" \
  "$(ctl1 lease keep-alive --once "$lease_id" 2>&1)"
check_contains "lease list" "$lease_id" "$(ctl lease list 2>&1)"
check "lease revoke" "lease $lease_id revoked" "$(ctl lease revoke "$lease_id" 2>&1)"
check "revoke deleted the attached key" "" "$(ctl get "$PREFIX/leased" 2>&1)"
check "timetolive after revoke" "lease $lease_id already expired" "$(ctl lease timetolive "$lease_id" 2>&1)"
check_contains "revoke of an unknown lease" "requested lease not found" "$(ctl lease revoke "$lease_id" 2>&1)"

# cluster and maintenance
members="$(ctl member list 2>&1)"
check_contains "member list" "started" "$members"
status="$(ctl endpoint status -w fields 2>&1)"
check_contains "endpoint status reports a leader" '"Leader" :' "$status"
check_contains "endpoint status reports the raft term" '"RaftTerm" :' "$status"
check_contains "endpoint health" "is healthy" "$(ctl endpoint health 2>&1)"
check_contains "endpoint hashkv" "$FIRST_ENDPOINT, " "$(ctl1 endpoint hashkv 2>&1)"

ctl del "$PREFIX/" --prefix >/dev/null 2>&1

echo "etcdctl-compat: $passed passed, $failed failed"
[[ "$failed" -eq 0 ]]
