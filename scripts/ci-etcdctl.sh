#!/usr/bin/env bash
# CI: Debian's etcdctl against `ferry dev`.
#
# Usage: scripts/ci-etcdctl.sh PATH/TO/ferry
#
# Builds nothing. Starts `ferry dev` (three `ferry serve` processes on
# 127.0.0.1, client ports 2379, 22379, 32379) with its data in a fresh
# temporary folder, waits for it to report a leader, runs
# scripts/etcdctl-compat.sh once against each endpoint alone (so that
# followers, which forward to the leader, are exercised as much as the
# leader) and once against all three, then stops `ferry dev` with SIGINT
# and checks that it, and every node it started, exits cleanly.
# Exits non-zero on any failure, printing the node logs.
set -uo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 PATH/TO/ferry" >&2
  exit 2
fi
FERRY="$(realpath "$1")"
if [[ ! -x "$FERRY" ]]; then
  echo "ci-etcdctl: $1 is not an executable (build it first: cargo build --release -p ferry)" >&2
  exit 2
fi
if ! command -v etcdctl >/dev/null 2>&1; then
  echo "ci-etcdctl: etcdctl is not on PATH (Debian: apt-get install -y etcd-client)" >&2
  exit 2
fi
SCRIPTS="$(cd "$(dirname "$0")" && pwd)"
DIR="$(mktemp -d)"
DEV_PID=""
NODE_PIDS=""
failures=0

dump_logs() {
  for log in "$DIR"/dev.out "$DIR"/ferry-dev/node*.log "$DIR"/dev-tls.out "$DIR"/ferry-dev-tls/node*.log "$DIR"/quota.log; do
    [[ -f "$log" ]] || continue
    echo "---- $log (last 40 lines)"
    tail -n 40 "$log"
  done
}

cleanup() {
  if [[ -n "$DEV_PID" ]] && kill -0 "$DEV_PID" 2>/dev/null; then
    kill -KILL "$DEV_PID" 2>/dev/null
  fi
  # The nodes this run's `ferry dev` started, by their process ids.
  for pid in $NODE_PIDS; do
    kill -KILL "$pid" 2>/dev/null
  done
  rm -rf "$DIR"
}
trap cleanup EXIT

fail() {
  echo "ci-etcdctl: FAIL: $*"
  failures=$((failures + 1))
}

for port in 2379 22379 32379 2380 22380 32380; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "ci-etcdctl: port $port is already in use; ferry dev needs it" >&2
    exit 1
  fi
done

cd "$DIR" || exit 1
"$FERRY" dev --dir "$DIR/ferry-dev" >"$DIR/dev.out" 2>&1 &
DEV_PID=$!

# Wait for `ferry dev` to print its endpoints (it does so once there is a leader).
ready=0
for _ in $(seq 1 300); do
  if grep -q "endpoints" "$DIR/dev.out" 2>/dev/null; then
    ready=1
    break
  fi
  if ! kill -0 "$DEV_PID" 2>/dev/null; then
    break
  fi
  sleep 0.1
done
if [[ "$ready" -ne 1 ]] || ! grep -q "is the leader" "$DIR/dev.out"; then
  echo "ci-etcdctl: ferry dev did not come up with a leader"
  dump_logs
  exit 1
fi
cat "$DIR/dev.out"
NODE_PIDS="$(pgrep -P "$DEV_PID" | tr '\n' ' ')"
if [[ "$(wc -w <<<"$NODE_PIDS")" -ne 3 ]]; then
  fail "ferry dev should run three node processes, found: $NODE_PIDS"
fi

for endpoints in 127.0.0.1:2379 127.0.0.1:22379 127.0.0.1:32379 127.0.0.1:2379,127.0.0.1:22379,127.0.0.1:32379; do
  echo "== etcdctl-compat against $endpoints"
  if ! ENDPOINTS="$endpoints" "$SCRIPTS/etcdctl-compat.sh"; then
    fail "etcdctl-compat against $endpoints"
  fi
done

echo "== member list and endpoint status over every endpoint"
ALL=127.0.0.1:2379,127.0.0.1:22379,127.0.0.1:32379
members="$(ETCDCTL_API=3 etcdctl --endpoints="$ALL" member list 2>&1)"
echo "$members"
if [[ "$(grep -c started <<<"$members")" -ne 3 ]]; then
  fail "member list should show three started members"
fi
status="$(ETCDCTL_API=3 etcdctl --endpoints="$ALL" endpoint status 2>&1)"
echo "$status"
if [[ "$(grep -c '^127.0.0.1:' <<<"$status")" -ne 3 ]]; then
  fail "endpoint status should answer for all three endpoints"
fi
# Exactly one endpoint says it is the leader (column IS LEADER = true).
if [[ "$(grep -c ', true, ' <<<"$status")" -ne 1 ]]; then
  fail "endpoint status should show exactly one leader"
fi

echo "== defrag and move-leader"
defrag="$(ETCDCTL_API=3 etcdctl --endpoints="$ALL" defrag 2>&1)"
echo "$defrag"
if [[ "$(grep -c 'Finished defragmenting' <<<"$defrag")" -ne 3 ]]; then
  fail "defrag should finish on all three members"
fi
follower_id="$(awk -F', ' '$5 == "false" { print $2; exit }' <<<"$status")"
moved="$(ETCDCTL_API=3 etcdctl --endpoints="$ALL" move-leader "$follower_id" 2>&1)"
echo "$moved"
if ! grep -q "Leadership transferred" <<<"$moved"; then
  fail "move-leader to $follower_id should transfer leadership"
fi
after="$(ETCDCTL_API=3 etcdctl --endpoints="$ALL" endpoint status 2>&1)"
if [[ "$(awk -F', ' -v id="$follower_id" '$2 == id { print $5 }' <<<"$after")" != "true" ]]; then
  echo "$after"
  fail "after move-leader, $follower_id should lead"
fi

# etcdctl 3.4 dials these calls by the members' client URLs and sends the
# URL as the HTTP/2 authority; the server must answer them all the same.
echo "== endpoint status and hashkv --cluster, and by URL"
cluster_status="$(ETCDCTL_API=3 etcdctl --endpoints=127.0.0.1:22379 endpoint status --cluster 2>&1)"
echo "$cluster_status"
if [[ "$(grep -c '^http://127.0.0.1:[0-9]*, ' <<<"$cluster_status")" -ne 3 ]]; then
  fail "endpoint status --cluster should answer for all three members"
fi
if [[ "$(grep -c ', true, ' <<<"$cluster_status")" -ne 1 ]]; then
  fail "endpoint status --cluster should show exactly one leader"
fi
# Every member holds the same history, so the hashes agree (a follower may
# be an instant behind: ask again a few times).
for attempt in 1 2 3 4 5; do
  hashes="$(ETCDCTL_API=3 etcdctl --endpoints=127.0.0.1:2379 endpoint hashkv --cluster 2>&1)"
  distinct="$(sed -n 's/^http:\/\/127.0.0.1:[0-9]*, \([0-9]*\)$/\1/p' <<<"$hashes" | sort -u | wc -l)"
  answered="$(grep -c '^http://127.0.0.1:[0-9]*, [0-9]*$' <<<"$hashes")"
  [[ "$answered" -eq 3 && "$distinct" -eq 1 ]] && break
  sleep 0.5
done
echo "$hashes"
if [[ "$answered" -ne 3 || "$distinct" -ne 1 ]]; then
  fail "endpoint hashkv --cluster should give one hash from all three members"
fi
by_url="$(ETCDCTL_API=3 etcdctl --endpoints=http://127.0.0.1:32379 endpoint status 2>&1)"
echo "$by_url"
if ! grep -q '^http://127.0.0.1:32379, ' <<<"$by_url"; then
  fail "endpoint status with an http:// endpoint"
fi

echo "== snapshot save (a backup), checked with ferry snapshot status"
saved="$(ETCDCTL_API=3 etcdctl --endpoints=127.0.0.1:22379 --command-timeout=30s snapshot save "$DIR/backup.db" 2>&1)"
echo "$saved"
if ! grep -q "Snapshot saved at" <<<"$saved"; then
  fail "snapshot save"
fi
backup_status="$("$FERRY" snapshot status "$DIR/backup.db" 2>&1)"
echo "$backup_status"
backup_revision="$(sed -n 's/^REVISION *\([0-9]*\)$/\1/p' <<<"$backup_status")"
if [[ -z "$backup_revision" || "$backup_revision" -lt 2 ]]; then
  fail "ferry snapshot status should read the saved backup and print its revision"
fi
if ! "$FERRY" snapshot restore "$DIR/backup.db" --data-dir "$DIR/restored"; then
  fail "ferry snapshot restore of the saved backup"
fi

echo "== member add --learner / member remove at run time"
added="$(ETCDCTL_API=3 etcdctl --endpoints=127.0.0.1:22379 member add ferry-4 --peer-urls=http://127.0.0.1:42380 --learner 2>&1)"
echo "$added"
new_id="$(sed -n 's/^Member *\([0-9a-f]*\) added to cluster.*/\1/p' <<<"$added")"
if [[ -z "$new_id" ]]; then
  fail "member add --learner"
else
  listed="$(ETCDCTL_API=3 etcdctl --endpoints="$ALL" member list 2>&1)"
  echo "$listed"
  if ! grep -q "^$new_id, unstarted, , http://127.0.0.1:42380, , true" <<<"$listed"; then
    fail "member list should show the new learner as unstarted"
  fi
  removed="$(ETCDCTL_API=3 etcdctl --endpoints="$ALL" member remove "$new_id" 2>&1)"
  echo "$removed"
  if ! grep -Eq "^Member +$new_id removed from cluster" <<<"$removed"; then
    fail "member remove of the learner"
  fi
  if [[ "$(ETCDCTL_API=3 etcdctl --endpoints="$ALL" member list 2>&1 | wc -l)" -ne 3 ]]; then
    fail "member list should be back to three members"
  fi
fi

echo "== auth: user add, role add, grant-permission --prefix, auth enable, --user"
# Through a follower-or-leader endpoint alone and then all three: the auth
# state is replicated, simple tokens are per member (etcdctl authenticates
# on the endpoint it dials).
# expect NAME PATTERN OUTPUT: passes when OUTPUT matches the regex PATTERN.
expect() {
  if grep -Eq -- "$2" <<<"$3"; then
    echo "ok   $1"
  else
    fail "$1: expected /$2/, got: $3"
  fi
}
# auth_flow LABEL ANONYMOUS: etcdctl's auth flow through the functions
# `one` and `other` (two endpoints), `every` (all three) and `first` (the
# first), which the caller defines for plaintext or TLS. ANONYMOUS is what
# a request without --user gets once auth is on.
auth_flow() {
  local l="$1" anonymous="$2"
  expect "$l user add root" "^User root created" "$(one user add root:rootpw 2>&1)"
  expect "$l user add alice" "^User alice created" "$(one user add alice:alicepw 2>&1)"
  expect "$l role add app" "^Role app created" "$(one role add app 2>&1)"
  expect "$l role grant-permission --prefix" "^Role app updated" \
    "$(one role grant-permission app --prefix=true readwrite auth-app/ 2>&1)"
  expect "$l user grant-role" "^Role app is granted to user alice" "$(one user grant-role alice app 2>&1)"
  # etcdctl 3.4 adds the root role and grants it to root when AuthEnable
  # answers that root lacks it.
  expect "$l auth enable" "^Authentication Enabled" "$(one auth enable 2>&1)"
  expect "$l no user" "$anonymous" "$(one get auth-app/k 2>&1)"
  expect "$l put within the grant" "^OK" "$(one --user alice:alicepw put auth-app/k v1 2>&1)"
  expect "$l get within the grant" "^v1$" "$(one --user alice:alicepw get auth-app/k --print-value-only 2>&1)"
  expect "$l put outside the grant" "etcdserver: permission denied" "$(one --user alice:alicepw put elsewhere v 2>&1)"
  expect "$l get --prefix wider than the grant" "etcdserver: permission denied" \
    "$(one --user alice:alicepw get auth --prefix 2>&1)"
  expect "$l wrong password" "authentication failed, invalid user ID or password" \
    "$(one --user alice:wrong get auth-app/k 2>&1)"
  expect "$l alice is not root" "etcdserver: permission denied" "$(one --user alice:alicepw user list 2>&1)"
  expect "$l role get as root" "auth-app/" "$(one --user root:rootpw role get app 2>&1)"
  expect "$l user list as root" "alice" "$(one --user root:rootpw user list 2>&1)"
  expect "$l user get as root" "Roles: app" "$(one --user root:rootpw user get alice 2>&1)"
  expect "$l every endpoint enforces it" "etcdserver: permission denied" \
    "$(every --user alice:alicepw put elsewhere v 2>&1)"
  expect "$l another endpoint reads it" "^v1$" \
    "$(other --user alice:alicepw get auth-app/k --print-value-only 2>&1)"
  expect "$l endpoint health with auth on" "is healthy" \
    "$(first --user alice:alicepw endpoint health 2>&1)"
  expect "$l role revoke-permission" "Permission .*auth-app/.* revoked from role app" \
    "$(one --user root:rootpw role revoke-permission app --prefix=true auth-app/ 2>&1)"
  expect "$l revoked: denied" "etcdserver: permission denied" "$(one --user alice:alicepw get auth-app/k 2>&1)"
  expect "$l auth disable" "^Authentication Disabled" "$(one --user root:rootpw auth disable 2>&1)"
  expect "$l auth off: everyone is served" "^v1$" "$(one get auth-app/k --print-value-only 2>&1)"
  expect "$l user delete" "^User alice deleted" "$(one user delete alice 2>&1)"
}
one() { ETCDCTL_API=3 etcdctl --endpoints=127.0.0.1:22379 --command-timeout=10s "$@"; }
other() { ETCDCTL_API=3 etcdctl --endpoints=127.0.0.1:32379 --command-timeout=10s "$@"; }
every() { ETCDCTL_API=3 etcdctl --endpoints="$ALL" --command-timeout=10s "$@"; }
first() { ETCDCTL_API=3 etcdctl --endpoints=127.0.0.1:2379 --command-timeout=10s "$@"; }
auth_flow "" "etcdserver: user name is empty"

echo "== alarm list and disarm with no alarm raised"
expect "alarm list is empty" "^$" "$(every alarm list 2>&1)"
expect "alarm disarm with nothing raised" "^$" "$(every alarm disarm 2>&1)"

echo "== stopping ferry dev with SIGINT"
kill -INT "$DEV_PID"
stopped=0
for _ in $(seq 1 300); do
  if ! kill -0 "$DEV_PID" 2>/dev/null; then
    stopped=1
    break
  fi
  sleep 0.1
done
if [[ "$stopped" -ne 1 ]]; then
  fail "ferry dev did not stop within 30 s of SIGINT"
else
  wait "$DEV_PID"
  status_code=$?
  DEV_PID=""
  if [[ "$status_code" -ne 0 ]]; then
    fail "ferry dev exited with status $status_code after SIGINT"
  fi
fi
for pid in $NODE_PIDS; do
  if kill -0 "$pid" 2>/dev/null; then
    fail "node process $pid is still running after ferry dev stopped"
  fi
done
for n in 1 2 3; do
  if ! grep -q "node stopped cleanly" "$DIR/ferry-dev/node$n.log"; then
    fail "node $n did not log a clean stop"
  fi
done
tail -n 3 "$DIR/dev.out"

echo "== ferry dev --tls: etcdctl with --cacert/--cert/--key over https"
"$FERRY" dev --tls --dir "$DIR/ferry-dev-tls" >"$DIR/dev-tls.out" 2>&1 &
DEV_PID=$!
ready=0
for _ in $(seq 1 300); do
  if grep -q "endpoints" "$DIR/dev-tls.out" 2>/dev/null; then
    ready=1
    break
  fi
  kill -0 "$DEV_PID" 2>/dev/null || break
  sleep 0.1
done
cat "$DIR/dev-tls.out"
NODE_PIDS="$(pgrep -P "$DEV_PID" | tr '\n' ' ')"
if [[ "$ready" -ne 1 ]] || ! grep -q "is the leader" "$DIR/dev-tls.out"; then
  fail "ferry dev --tls did not come up with a leader"
else
  T="$DIR/ferry-dev-tls/tls"
  TLS_ALL=https://127.0.0.1:2379,https://127.0.0.1:22379,https://127.0.0.1:32379
  expect "dev --tls prints the etcdctl line" "etcdctl --cacert $T/ca.crt --cert $T/client.crt --key $T/client.key --endpoints $TLS_ALL" \
    "$(cat "$DIR/dev-tls.out")"
  tctl() { ETCDCTL_API=3 etcdctl --cacert "$T/ca.crt" --cert "$T/client.crt" --key "$T/client.key" --command-timeout=10s "$@"; }
  expect "put over TLS" "^OK" "$(tctl --endpoints="$TLS_ALL" put tls-k tls-v 2>&1)"
  expect "get over TLS from a follower" "^tls-v$" \
    "$(tctl --endpoints=https://127.0.0.1:32379 get tls-k --print-value-only 2>&1)"
  expect "endpoint status --cluster over TLS" "^https://127.0.0.1:32379, " \
    "$(tctl --endpoints=https://127.0.0.1:2379 endpoint status --cluster 2>&1)"
  plain="$(ETCDCTL_API=3 etcdctl --endpoints=127.0.0.1:2379 --dial-timeout=2s --command-timeout=3s get tls-k 2>&1)"
  if grep -q "tls-v" <<<"$plain"; then
    fail "a plaintext client was served on a TLS port: $plain"
  else
    echo "ok   a plaintext client on the TLS port fails"
  fi
  nocert="$(ETCDCTL_API=3 etcdctl --cacert "$T/ca.crt" --endpoints=https://127.0.0.1:2379 --dial-timeout=2s --command-timeout=3s get tls-k 2>&1)"
  if grep -q "tls-v" <<<"$nocert"; then
    fail "a client without a certificate was served with --client-cert-auth: $nocert"
  else
    echo "ok   a client without a certificate is refused"
  fi
  # The client certificate's common name is root: with auth on, a request
  # without a token acts as root.
  # The whole auth flow over TLS. A request without --user carries the
  # client certificate, whose CN (root) is then the user: served.
  one() { tctl --endpoints=https://127.0.0.1:22379 "$@"; }
  other() { tctl --endpoints=https://127.0.0.1:32379 "$@"; }
  every() { tctl --endpoints="$TLS_ALL" "$@"; }
  first() { tctl --endpoints=https://127.0.0.1:2379 "$@"; }
  auth_flow "tls:" "^$"
  expect "tls: auth enable again" "^Authentication Enabled" "$(one auth enable 2>&1)"
  expect "tls: the certificate's CN is the user" "^tls-v$" \
    "$(tctl --endpoints=https://127.0.0.1:22379 get tls-k --print-value-only 2>&1)"
  expect "tls: a token wins over the CN" "authentication failed" \
    "$(tctl --endpoints=https://127.0.0.1:22379 --user nobody:nopw get tls-k 2>&1)"
  expect "tls: auth disable as the CN's root" "^Authentication Disabled" \
    "$(tctl --endpoints=https://127.0.0.1:22379 auth disable 2>&1)"
fi
# This one is stopped with SIGTERM (plain `kill`): it must take its nodes
# down as SIGINT does, not leave them serving on the ports.
kill -TERM "$DEV_PID" 2>/dev/null
for _ in $(seq 1 300); do
  kill -0 "$DEV_PID" 2>/dev/null || break
  sleep 0.1
done
if kill -0 "$DEV_PID" 2>/dev/null; then
  fail "ferry dev --tls did not stop within 30 s of SIGTERM"
else
  wait "$DEV_PID"
  code=$?
  DEV_PID=""
  [[ "$code" -eq 0 ]] || fail "ferry dev --tls exited with status $code after SIGTERM"
fi
for pid in $NODE_PIDS; do
  if kill -0 "$pid" 2>/dev/null; then
    fail "node process $pid is still running after ferry dev --tls stopped"
  fi
done

echo "== quota: NOSPACE past --quota-backend-bytes, then compact, defrag, alarm disarm"
# One member with a 2 MB quota, on ports of its own.
"$FERRY" serve --id 1 --data-dir "$DIR/quota" --listen-client 127.0.0.1:42379 \
  --listen-peer 127.0.0.1:42380 --member 1=127.0.0.1:42380,http://127.0.0.1:42379 \
  --quota-backend-bytes 2000000 >"$DIR/quota.log" 2>&1 &
QUOTA_PID=$!
NODE_PIDS="$QUOTA_PID"
qctl() { ETCDCTL_API=3 etcdctl --endpoints=127.0.0.1:42379 --command-timeout=10s "$@"; }
for _ in $(seq 1 100); do
  qctl put quota-probe v >/dev/null 2>&1 && break
  sleep 0.1
done
head -c 60000 /dev/zero | tr '\0' v >"$DIR/value"
# The same three keys written over and over: the history fills the quota.
filled=""
for i in $(seq 1 100); do
  if ! out="$(qctl put "quota-k$((i % 3))" <"$DIR/value" 2>&1)"; then
    filled="$out"
    break
  fi
done
expect "a put past the quota is refused with etcd's error" "etcdserver: mvcc: database space exceeded" "$filled"
expect "alarm list shows NOSPACE" "^memberID:1 alarm:NOSPACE" "$(qctl alarm list 2>&1)"
expect "endpoint status lists the alarm" "alarm:NOSPACE" "$(qctl endpoint status 2>&1)"
expect "reads are still served" "^quota-k1$" "$(qctl get quota-k1 --keys-only 2>&1)"
expect "a put is refused while the alarm is raised" "database space exceeded" "$(qctl put small v 2>&1)"
revision="$(qctl endpoint status -w json 2>/dev/null | sed -n 's/.*"revision":\([0-9]*\).*/\1/p')"
expect "compact is served" "^compacted revision $revision" "$(qctl compact "$revision" 2>&1)"
expect "defrag gives the space back" "Finished defragmenting" "$(qctl defrag 2>&1)"
expect "alarm disarm clears it" "^memberID:1 alarm:NOSPACE" "$(qctl alarm disarm 2>&1)"
expect "alarm list is empty again" "^$" "$(qctl alarm list 2>&1)"
expect "a put is served again" "^OK" "$(qctl put small v 2>&1)"
kill -TERM "$QUOTA_PID" 2>/dev/null
wait "$QUOTA_PID" 2>/dev/null
NODE_PIDS=""

if [[ "$failures" -ne 0 ]]; then
  dump_logs
  echo "ci-etcdctl: $failures failure(s)"
  exit 1
fi
echo "ci-etcdctl: all checks passed"
