#!/usr/bin/env bash
# Tests the enclave runner (docker/k8s/overlays/nitro/run-enclaves.sh), which
# the Kubernetes nitro overlay and scripts/run-nitro.sh both use. It needs no
# Nitro hardware and takes about 40 s. A stub nitro-cli
# (scripts/testdata/nitro-cli-stub.sh) keeps enclaves as state files and
# prints describe-enclaves in nitro-cli's own format (the fields of
# src/common/json_output.rs, pretty-printed); a stub gateway's host-proxy
# only sleeps. The test checks:
#   - DRY_RUN=1 prints the run-enclave and host-proxy commands and starts
#     nothing;
#   - bad settings are refused before anything starts: a host-proxy route
#     on the parent's vsock port 9000 (nitro-cli's boot heartbeat), no EIF,
#     an enclave below 4 x the EIF, a runner memory limit below the EIF +
#     256 MiB, a back-off cap below its start;
#   - both enclaves are started with the right arguments, each with its own
#     memory from a comma list, and an enclave left at one of the CIDs by an
#     earlier run is replaced;
#   - READY_FILE appears;
#   - an enclave that is killed, or that is left in a state other than
#     RUNNING, is restarted within a few CHECK_SECS=1 rounds, READY_FILE
#     goes away meanwhile and then comes back, and LOG_DIR says why;
#   - a host proxy that is killed is restarted;
#   - TERM to the runner terminates its enclaves and the proxy, and leaves
#     another runner's enclave alone;
#   - with DEBUG_MODE=1: each enclave's console is kept (the previous one's
#     too); an enclave that dies after every start is restarted with
#     exponential back-off up to its cap (gaps of 2, 4, 4 s with 1 s and a
#     4 s cap); a start that fails keeps nitro-cli's answer and the error log
#     it names in stage-I.last-error; the back-off resets once the enclave
#     runs for STABLE_SECS;
#   - two runners sharing START_LOCK start their four enclaves one at a time
#     (the stub fails a run-enclave that overlaps another), and without the
#     lock they collide.
# Env: RUNNER (default the overlay's run-enclaves.sh); RUNNER_SHELL (default
# sh; dash, `busybox sh` and bash also work).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RUNNER="${RUNNER:-docker/k8s/overlays/nitro/run-enclaves.sh}"
read -ra RUNNER_SHELL <<<"${RUNNER_SHELL:-sh}"
tmp="$(mktemp -d)"
runner_pid=""
cleanup() {
  if [[ -n "$runner_pid" ]]; then kill -9 "$runner_pid" 2>/dev/null || true; fi
  # Stub proxies the runner under test might have left behind.
  if [[ -f "$tmp/stub/proxy.pids" ]]; then
    while read -r p; do kill "$p" 2>/dev/null || true; done <"$tmp/stub/proxy.pids"
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  if [[ -f "$tmp/runner.log" ]]; then echo "--- runner log:" >&2; cat "$tmp/runner.log" >&2; fi
  if [[ -f "$tmp/stub/calls" ]]; then echo "--- nitro-cli calls:" >&2; cat "$tmp/stub/calls" >&2; fi
  exit 1
}
# wait_for SECONDS WHAT COMMAND...: polls COMMAND every 0.05 s.
wait_for() {
  local secs=$1 what=$2 i
  shift 2
  for ((i = 0; i < secs * 20; i++)); do
    if "$@"; then return 0; fi
    sleep 0.05
  done
  fail "$what (not within ${secs}s)"
}

mkdir -p "$tmp/bin" "$tmp/stub"
export NITRO_STUB_DIR="$tmp/stub"
# The stub nitro-cli (its header says what it does and how a test steers it).
cp scripts/testdata/nitro-cli-stub.sh "$tmp/bin/nitro-cli"
cp scripts/testdata/gateway-stub.sh "$tmp/bin/gateway"
ROUTES="tcp://0.0.0.0:9000=vsock://16:9000 tcp://0.0.0.0:9001=vsock://17:9000 vsock://any:8001=vsock://17:9000"

echo "== DRY_RUN=1: the commands, nothing started"
# The stubs are on PATH under the default names: a dry run must call neither.
PATH="$tmp/bin:$PATH" DRY_RUN=1 EIF=/eif/test.eif ENCLAVE_MEMORY_MIB=1024,2048 DEBUG_MODE=1 \
  ROUTES="$ROUTES" "${RUNNER_SHELL[@]}" "$RUNNER" >"$tmp/dry.out" 2>"$tmp/dry.err" \
  || { cat "$tmp/dry.err" >&2; fail "DRY_RUN=1 exited non-zero"; }
cat >"$tmp/dry.want" <<'EOF'
nitro-cli run-enclave --eif-path /eif/test.eif --cpu-count 2 --memory 1024 --enclave-cid 16 --debug-mode
nitro-cli run-enclave --eif-path /eif/test.eif --cpu-count 2 --memory 2048 --enclave-cid 17 --debug-mode
gateway host-proxy --route tcp://0.0.0.0:9000=vsock://16:9000 --route tcp://0.0.0.0:9001=vsock://17:9000 --route vsock://any:8001=vsock://17:9000
EOF
diff -u "$tmp/dry.want" "$tmp/dry.out" >&2 || fail "DRY_RUN=1 output"
PATH="$tmp/bin:$PATH" DRY_RUN=1 STAGES=3 CID_BASE=20 ENCLAVE_CPUS=4 ENCLAVE_MEMORY_MIB=1536 \
  "${RUNNER_SHELL[@]}" "$RUNNER" >"$tmp/dry3.out" 2>&1 || fail "DRY_RUN=1 with 3 stages"
cat >"$tmp/dry3.want" <<'EOF'
nitro-cli run-enclave --eif-path /eif/stage.eif --cpu-count 4 --memory 1536 --enclave-cid 20
nitro-cli run-enclave --eif-path /eif/stage.eif --cpu-count 4 --memory 1536 --enclave-cid 21
nitro-cli run-enclave --eif-path /eif/stage.eif --cpu-count 4 --memory 1536 --enclave-cid 22
EOF
diff -u "$tmp/dry3.want" "$tmp/dry3.out" >&2 || fail "DRY_RUN=1 with 3 stages, no ROUTES: no host proxy"
[[ ! -e "$tmp/stub/calls" && ! -e "$tmp/stub/proxy-calls" ]] || fail "DRY_RUN=1 ran nitro-cli or gateway"

echo "== bad settings refused before anything starts"
# A small EIF for the runs below, and one of 100 MiB (sparse) for the
# memory rules: enclaves of at least 4 x 100 MiB, a runner limit of at
# least 100 + 256 MiB.
head -c 1048576 /dev/zero >"$tmp/stage.eif"
truncate -s 100M "$tmp/big.eif"
echo "max" >"$tmp/no-limit"
refused() { # WHAT MESSAGE ENV...
  local what=$1 msg=$2
  shift 2
  if env NITRO_CLI="$tmp/bin/nitro-cli" GATEWAY="$tmp/bin/gateway" READY_FILE="$tmp/ready" \
    HEARTBEAT_FILE="$tmp/heartbeat" EIF="$tmp/stage.eif" LOG_DIR="$tmp/logs" START_LOCK="$tmp/start.lock" \
    MEMORY_LIMIT_FILE="$tmp/no-limit" "$@" "${RUNNER_SHELL[@]}" "$RUNNER" >/dev/null 2>"$tmp/err"; then
    fail "$what was accepted"
  fi
  grep -q "$msg" "$tmp/err" || { cat "$tmp/err" >&2; fail "$what: no message '$msg'"; }
}
refused "a host-proxy route on the parent's vsock port 9000" "nitro-cli's boot heartbeat port" \
  ENCLAVE_MEMORY_MIB=1024 ROUTES="vsock://any:8001=vsock://17:9000 vsock://any:9000=vsock://18:9000"
refused "no EIF" "no EIF at $tmp/none.eif" ENCLAVE_MEMORY_MIB=1024 EIF="$tmp/none.eif"
refused "an enclave below 4 x the EIF" "stage 1: ENCLAVE_MEMORY_MIB 256 is below 4 x the EIF .* give at least 400" \
  ENCLAVE_MEMORY_MIB=400,256 EIF="$tmp/big.eif"
echo $((300 * 1048576)) >"$tmp/limit-300"
refused "a runner memory limit below EIF + 256 MiB" "memory limit is 300 MiB, .* at least 356 MiB" \
  ENCLAVE_MEMORY_MIB=512 EIF="$tmp/big.eif" MEMORY_LIMIT_FILE="$tmp/limit-300"
refused "BACKOFF_MAX_SECS below BACKOFF_MIN_SECS" "BACKOFF_MAX_SECS must be" \
  ENCLAVE_MEMORY_MIB=1024 BACKOFF_MIN_SECS=10 BACKOFF_MAX_SECS=5
refused "no ENCLAVE_MEMORY_MIB" "ENCLAVE_MEMORY_MIB is not set" ENCLAVE_MEMORY_MIB=
refused "three memory sizes for two stages" "has 3 entries for 2 stages" ENCLAVE_MEMORY_MIB=1024,1024,1024
refused "a memory size that is no number" "'1G' is not a number" ENCLAVE_MEMORY_MIB=1024,1G
refused "CID_BASE 3" "CID_BASE must be" CID_BASE=3 ENCLAVE_MEMORY_MIB=1024
refused "fewer enclave CPUs than the enclaves need" "given 2 enclave CPUs" NITRO_ENCLAVES_CPUS=2 ENCLAVE_MEMORY_MIB=1024
[[ ! -e "$tmp/stub/calls" ]] || fail "a refused setting still ran nitro-cli"

echo "== start: both enclaves, per-stage memory, host proxy, READY_FILE"
# An enclave that an earlier run left at CID 16, and another runner's enclave
# at CID 20.
echo "i-0left00000000000000-enc00000000000000ff RUNNING 2 1024 NONE" >"$tmp/stub/enclave-16"
echo "i-0other0000000000000-enc00000000000000ee RUNNING 2 1024 NONE" >"$tmp/stub/enclave-20"
echo $((400 * 1048576)) >"$tmp/limit-400"
NITRO_CLI="$tmp/bin/nitro-cli" GATEWAY="$tmp/bin/gateway" EIF="$tmp/stage.eif" CID_BASE=16 STAGES=2 \
  ENCLAVE_CPUS=2 ENCLAVE_MEMORY_MIB=1024,2048 ROUTES="$ROUTES" CHECK_SECS=1 BACKOFF_MIN_SECS=1 \
  READY_FILE="$tmp/ready" HEARTBEAT_FILE="$tmp/heartbeat" NITRO_ENCLAVES_CPUS=4 LOG_DIR="$tmp/logs" \
  START_LOCK="$tmp/start.lock" MEMORY_LIMIT_FILE="$tmp/limit-400" \
  "${RUNNER_SHELL[@]}" "$RUNNER" >"$tmp/runner.out" 2>"$tmp/runner.log" &
runner_pid=$!
wait_for 5 "READY_FILE after the start" test -e "$tmp/ready"
grep -qx "terminate-enclave --enclave-id i-0left00000000000000-enc00000000000000ff" "$tmp/stub/calls" \
  || fail "the enclave left at CID 16 was not terminated before the start"
runs() { grep -c "^run-enclave .*--enclave-cid $1\$" "$tmp/stub/calls" || true; }
grep -qx "run-enclave --eif-path $tmp/stage.eif --cpu-count 2 --memory 1024 --enclave-cid 16" "$tmp/stub/calls" \
  || fail "stage 0 not started with 2 CPUs, 1024 MiB, CID 16"
grep -qx "run-enclave --eif-path $tmp/stage.eif --cpu-count 2 --memory 2048 --enclave-cid 17" "$tmp/stub/calls" \
  || fail "stage 1 not started with 2 CPUs, 2048 MiB, CID 17"
[[ $(runs 16) == 1 && $(runs 17) == 1 && $(runs 20) == 0 ]] || fail "run-enclave calls: 16 x$(runs 16), 17 x$(runs 17), 20 x$(runs 20)"
grep -qx "host-proxy --route tcp://0.0.0.0:9000=vsock://16:9000 --route tcp://0.0.0.0:9001=vsock://17:9000 --route vsock://any:8001=vsock://17:9000" \
  "$tmp/stub/proxy-calls" || fail "host-proxy arguments"
[[ -s "$tmp/heartbeat" ]] || fail "no heartbeat"
beat=$(cat "$tmp/heartbeat")
(( $(date +%s) - beat < 5 )) || fail "heartbeat $beat is stale"

# watch_restart CID RUNS: the enclave at CID is started for the RUNS-th time
# within a few rounds; READY_FILE goes away meanwhile and comes back.
watch_restart() {
  local cid=$1 want=$2 gone=0 i
  for ((i = 0; i < 100; i++)); do
    [[ -e "$tmp/ready" ]] || gone=1
    [[ $(runs "$cid") -ge $want ]] && break
    sleep 0.05
  done
  [[ $(runs "$cid") -ge $want ]] || fail "the enclave at CID $cid was not restarted within 5 rounds"
  wait_for 5 "READY_FILE back after the restart of CID $cid" test -e "$tmp/ready"
  [[ $gone == 1 ]] || fail "READY_FILE stayed while the enclave at CID $cid was down"
}

echo "== an enclave killed: restarted, readiness follows"
rm "$tmp/stub/enclave-17"
watch_restart 17 2
grep -q "stage 1: its enclave at CID 17 was gone, .* after its start" "$tmp/runner.log" || fail "the restart is not logged"
grep -q "stage 1: its enclave at CID 17 was gone" "$tmp/logs/stage-1.last-error" || fail "stage-1.last-error does not say the enclave was gone"
[[ $(runs 16) == 1 ]] || fail "stage 0 was restarted too"

echo "== an enclave not RUNNING: terminated, then restarted"
read -r id16 _ <"$tmp/stub/enclave-16"
sed -i 's/ RUNNING / TERMINATING /' "$tmp/stub/enclave-16"
watch_restart 16 2
grep -qx "terminate-enclave --enclave-id $id16" "$tmp/stub/calls" || fail "the TERMINATING enclave was not terminated first"
grep -q "stage 0: enclave $id16 at CID 16 is TERMINATING" "$tmp/runner.log" || fail "the state is not logged"

echo "== the host proxy killed: restarted"
old_proxy=$(cat "$tmp/stub/proxy.pid")
kill "$old_proxy"
proxy_restarted() { [[ $(wc -l <"$tmp/stub/proxy-calls") -ge 2 ]]; }
wait_for 5 "the host proxy restarted" proxy_restarted
new_proxy=$(cat "$tmp/stub/proxy.pid")
if [[ "$new_proxy" == "$old_proxy" ]] || ! kill -0 "$new_proxy"; then fail "no new host proxy running"; fi
wait_for 5 "READY_FILE back after the proxy restart" test -e "$tmp/ready"
grep -q "host proxy (pid $old_proxy) exited" "$tmp/runner.log" || fail "the proxy restart is not logged"

echo "== TERM: the runner's enclaves and proxy stop, another runner's enclave stays"
read -r id16 _ <"$tmp/stub/enclave-16"
read -r id17 _ <"$tmp/stub/enclave-17"
kill -TERM "$runner_pid"
for ((i = 0; i < 100; i++)); do kill -0 "$runner_pid" 2>/dev/null || break; sleep 0.05; done
kill -0 "$runner_pid" 2>/dev/null && fail "the runner did not exit within 5 s of TERM"
rc=0
wait "$runner_pid" || rc=$?
runner_pid=""
[[ $rc != 0 ]] || fail "the runner exited 0 on TERM"
grep -qx "terminate-enclave --enclave-id $id16" "$tmp/stub/calls" || fail "stage 0's enclave not terminated on TERM"
grep -qx "terminate-enclave --enclave-id $id17" "$tmp/stub/calls" || fail "stage 1's enclave not terminated on TERM"
[[ ! -e "$tmp/stub/enclave-16" && ! -e "$tmp/stub/enclave-17" ]] || fail "enclaves left running after TERM"
[[ -e "$tmp/stub/enclave-20" ]] || fail "another runner's enclave (CID 20) was terminated"
grep -q "00000000000000ee" "$tmp/stub/calls" && fail "the runner touched CID 20's enclave"
for ((i = 0; i < 40; i++)); do kill -0 "$new_proxy" 2>/dev/null || break; sleep 0.05; done
kill -0 "$new_proxy" 2>/dev/null && fail "the host proxy still runs after TERM"
[[ ! -e "$tmp/ready" ]] || fail "READY_FILE left after TERM"

# A second runner for what a first bring-up meets: DEBUG_MODE=1 (consoles
# kept), an enclave that dies at once after every start (restarts back off
# exponentially up to the cap), one that does not boot (nitro-cli's error
# and the error log it names kept), and back-off reset once it runs.
echo "== back-off, last error and consoles (DEBUG_MODE=1, one stage at CID 30)"
starts_of() { awk -v c="$1" '$1 == c && $4 == "" {print $2}' "$tmp/stub/starts"; }
NITRO_CLI="$tmp/bin/nitro-cli" GATEWAY="$tmp/bin/gateway" EIF="$tmp/stage.eif" CID_BASE=30 STAGES=1 \
  ENCLAVE_MEMORY_MIB=1024 DEBUG_MODE=1 CHECK_SECS=1 BACKOFF_MIN_SECS=1 BACKOFF_MAX_SECS=4 STABLE_SECS=2 \
  READY_FILE="$tmp/ready2" HEARTBEAT_FILE="$tmp/heartbeat2" LOG_DIR="$tmp/logs2" \
  START_LOCK="$tmp/start.lock" MEMORY_LIMIT_FILE="$tmp/no-limit" \
  "${RUNNER_SHELL[@]}" "$RUNNER" >/dev/null 2>"$tmp/runner.log" &
runner_pid=$!
wait_for 5 "READY_FILE of the debug runner" test -e "$tmp/ready2"
grep -qx "run-enclave --eif-path $tmp/stage.eif --cpu-count 2 --memory 1024 --enclave-cid 30 --debug-mode" "$tmp/stub/calls" \
  || fail "the debug runner did not start CID 30 with --debug-mode"
grep -q "DEBUG MODE: the enclaves' PCRs read zero" "$tmp/runner.log" || fail "debug mode is not announced"
read -r id30 _ <"$tmp/stub/enclave-30"
console_has() { grep -qs "$1" "$2"; }
wait_for 5 "the console of $id30 in stage-0.console" console_has "stub console of $id30: booted" "$tmp/logs2/stage-0.console"
# From now on every start of CID 30 dies at once.
touch "$tmp/stub/crash-30"
rm "$tmp/stub/enclave-30"
more_starts() { [[ $(starts_of 30 | wc -l) -ge $1 ]]; }
wait_for 25 "five restarts of the crashing enclave" more_starts 6
# Restart n waits 2^(n-1) s (at most 4) from start n-1: gaps of at least
# 2, 4, 4 (less a second of rounding to whole seconds) between restarts 1 to
# 4, and the cap holds (at most 4 s + a round and the start's own second).
mapfile -t t < <(starts_of 30)
for n in 2 3 4 5; do
  want=$(( n == 2 ? 2 : 4 ))
  python3 -c 'import sys; g = float(sys.argv[2]) - float(sys.argv[1]); w = int(sys.argv[3]); sys.exit(0 if w - 1 <= g <= w + 2.5 else 1)' \
    "${t[n-1]}" "${t[n]}" "$want" \
    || fail "restart $n came $(python3 -c "print(round(${t[n]} - ${t[n-1]}, 2))") s after restart $((n - 1)), not ${want} s (back-off 1, 2, 4, 4 s)"
done
grep -q "next start in .* (back-off: 4 s" "$tmp/runner.log" || fail "the back-off wait is not logged"
grep -q "stage 0: its enclave at CID 30 was gone" "$tmp/logs2/stage-0.last-error" || fail "stage-0.last-error: the crash"
# The enclave before the last one: its console kept as stage-0.console.1.
grep -q "stub console of .*: enclave gone" "$tmp/logs2/stage-0.console.1" || fail "the previous enclave's console is not kept"
# A start that fails: nitro-cli's answer and the error log it names.
rm "$tmp/stub/crash-30"
touch "$tmp/stub/fail-30"
failed_once() { grep -q "E36" "$tmp/logs2/stage-0.last-error" 2>/dev/null; }
wait_for 10 "a failed start in stage-0.last-error" failed_once
grep -q "nitro-cli run-enclave failed (exit status 1) for CID 30" "$tmp/logs2/stage-0.last-error" || fail "last-error: the failure"
grep -q "Failed to receive the ready signal" "$tmp/logs2/stage-0.last-error" || fail "last-error: the nitro-cli error log it names"
# It boots again: running, ready, and after STABLE_SECS the back-off resets.
rm "$tmp/stub/fail-30"
wait_for 10 "READY_FILE after the enclave boots again" test -e "$tmp/ready2"
reset_logged() { grep -q "stage 0: RUNNING 2 s after its start: back-off reset" "$tmp/runner.log"; }
wait_for 5 "the back-off reset" reset_logged
kill -TERM "$runner_pid"
wait "$runner_pid" || true
runner_pid=""
[[ ! -e "$tmp/stub/enclave-30" ]] || fail "CID 30 left running after TERM"

echo "== two runners on one parent: their starts take turns (START_LOCK)"
# Each run-enclave takes 0.4 s; the stub fails one that starts while
# another runs (as nitro-cli does: both wait on vsock port 9000).
two_runners() { # LOCK
  local lock=$1 p1 p2
  : >"$tmp/stub/starts"
  for base in 40 50; do
    NITRO_CLI="$tmp/bin/nitro-cli" NITRO_STUB_RUN_SECS=0.4 EIF="$tmp/stage.eif" CID_BASE=$base STAGES=2 \
      ENCLAVE_MEMORY_MIB=1024 CHECK_SECS=1 READY_FILE="$tmp/ready-$base" HEARTBEAT_FILE="$tmp/heartbeat-$base" \
      LOG_DIR="$tmp/logs-$base" START_LOCK="$lock" MEMORY_LIMIT_FILE="$tmp/no-limit" \
      "${RUNNER_SHELL[@]}" "$RUNNER" >/dev/null 2>>"$tmp/runner.log" &
    if [[ $base == 40 ]]; then p1=$!; else p2=$!; fi
  done
  runner_pid=$p1
  both_ready() { [[ -e "$tmp/ready-40" && -e "$tmp/ready-50" ]]; }
  local ok=0
  for ((i = 0; i < 200; i++)); do
    if both_ready; then ok=1; break; fi
    kill -0 "$p1" 2>/dev/null && kill -0 "$p2" 2>/dev/null || break
    sleep 0.05
  done
  kill -TERM "$p1" "$p2" 2>/dev/null || true
  wait "$p1" "$p2" 2>/dev/null || true
  runner_pid=""
  rm -f "$tmp/ready-40" "$tmp/ready-50"
  [[ $ok == 1 ]]
}
: >"$tmp/runner.log"
two_runners "$tmp/start.lock" || fail "two runners sharing START_LOCK did not both get ready"
! grep -q overlap "$tmp/stub/starts" || fail "two run-enclave ran at once despite START_LOCK"
[[ $(wc -l <"$tmp/stub/starts") == 4 ]] || fail "expected 4 starts, got $(cat "$tmp/stub/starts")"
# Without the lock the same two runners collide (the check above can fail).
if two_runners ""; then fail "two runners without START_LOCK both started: the stub did not see them overlap"; fi
grep -q overlap "$tmp/stub/starts" || fail "no overlapping start without START_LOCK"
echo "PASS enclave runner (${RUNNER_SHELL[*]}): start, readiness, enclave and proxy restarts, TERM, dry run, refusals, back-off, last error and consoles, start lock"
