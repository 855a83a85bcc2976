#!/usr/bin/env bash
# Tests the enclave runner (docker/k8s/overlays/nitro/run-enclaves.sh), which
# the Kubernetes nitro overlay and scripts/run-nitro.sh both use. It needs no
# Nitro hardware and takes a few seconds. A stub nitro-cli keeps enclaves as
# state files and prints describe-enclaves in nitro-cli's own format (the
# fields of src/common/json_output.rs, pretty-printed). A stub gateway's
# host-proxy only sleeps. The test checks:
#   - DRY_RUN=1 prints the run-enclave and host-proxy commands and starts
#     nothing;
#   - bad settings are refused before anything starts;
#   - both enclaves are started with the right arguments, each with its own
#     memory from a comma list, and an enclave left at one of the CIDs by an
#     earlier run is replaced;
#   - READY_FILE appears;
#   - an enclave that is killed, or that is left in a state other than
#     RUNNING, is restarted within a few CHECK_SECS=1 rounds, and READY_FILE
#     goes away meanwhile and then comes back;
#   - a host proxy that is killed is restarted;
#   - TERM to the runner terminates its enclaves and the proxy, and leaves
#     another runner's enclave alone.
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
# The stub nitro-cli: enclave-CID files hold "ID STATE CPUS MEMORY FLAGS".
cat >"$tmp/bin/nitro-cli" <<'STUB'
#!/usr/bin/env bash
set -euo pipefail
d="$NITRO_STUB_DIR"
echo "$*" >>"$d/calls"
cmd="$1"; shift
case "$cmd" in
  run-enclave)
    eif="" cpus="" mem="" cid="" flags=NONE
    while [[ $# -gt 0 ]]; do
      case "$1" in
        --eif-path) eif="$2"; shift 2 ;;
        --cpu-count) cpus="$2"; shift 2 ;;
        --memory) mem="$2"; shift 2 ;;
        --enclave-cid) cid="$2"; shift 2 ;;
        --debug-mode) flags=DEBUG_MODE; shift ;;
        *) echo "stub nitro-cli: unexpected argument $1" >&2; exit 2 ;;
      esac
    done
    [[ -n "$eif" && -n "$cpus" && -n "$mem" && -n "$cid" ]] || { echo "stub nitro-cli: missing arguments" >&2; exit 2; }
    if [[ -e "$d/enclave-$cid" ]]; then
      echo "[ E21 ] Enclave CID $cid is in use (stub)" >&2
      exit 1
    fi
    n=$(( $(cat "$d/counter" 2>/dev/null || echo 0) + 1 ))
    echo "$n" >"$d/counter"
    id="$(printf 'i-0stub%012d-enc%016x' "$n" "$n")"
    echo "$id RUNNING $cpus $mem $flags" >"$d/enclave-$cid"
    echo "Start allocating memory..."
    echo "Started enclave with enclave-cid: $cid, memory: $mem MiB, cpu-ids: [1, 5]"
    printf '{\n  "EnclaveName": "stage",\n  "EnclaveID": "%s",\n  "ProcessID": %d,\n  "EnclaveCID": %s,\n  "NumberOfCPUs": %s,\n  "CPUIDs": [\n    1,\n    5\n  ],\n  "MemoryMiB": %s\n}\n' \
      "$id" "$$" "$cid" "$cpus" "$mem"
    ;;
  describe-enclaves)
    shopt -s nullglob
    files=("$d"/enclave-*)
    if [[ ${#files[@]} -eq 0 ]]; then echo "[]"; exit 0; fi
    echo "["
    sep=""
    for f in "${files[@]}"; do
      cid="${f##*/enclave-}"
      read -r id state cpus mem flags <"$f"
      printf '%s  {\n' "$sep"
      printf '    "EnclaveName": "stage",\n    "EnclaveID": "%s",\n    "ProcessID": %d,\n' "$id" "$((1000 + cid))"
      printf '    "EnclaveCID": %s,\n    "NumberOfCPUs": %s,\n    "CPUIDs": [\n      1,\n      5\n    ],\n' "$cid" "$cpus"
      printf '    "MemoryMiB": %s,\n    "State": "%s",\n    "Flags": "%s",\n' "$mem" "$state" "$flags"
      printf '    "Measurements": {\n      "HashAlgorithm": "Sha384 { ... }",\n'
      printf '      "PCR0": "%096d",\n      "PCR1": "%096d",\n      "PCR2": "%096d"\n    }\n  }' 0 1 2
      sep=$',\n'
    done
    printf '\n]\n'
    ;;
  terminate-enclave)
    [[ "${1:-}" == --enclave-id && -n "${2:-}" ]] || { echo "stub nitro-cli: terminate-enclave needs --enclave-id ID" >&2; exit 2; }
    for f in "$d"/enclave-*; do
      [[ -e "$f" ]] || continue
      read -r id _ <"$f"
      if [[ "$id" == "$2" ]]; then
        rm -f "$f"
        printf '{\n  "EnclaveName": "stage",\n  "EnclaveID": "%s",\n  "Terminated": true\n}\n' "$id"
        exit 0
      fi
    done
    echo "[ E?? ] no enclave $2 (stub)" >&2
    exit 1
    ;;
  *) echo "stub nitro-cli: unexpected command $cmd" >&2; exit 2 ;;
esac
STUB
cat >"$tmp/bin/gateway" <<'STUB'
#!/usr/bin/env bash
[[ "$1" == host-proxy ]] || { echo "stub gateway: unexpected command $1" >&2; exit 2; }
echo "$$" >>"$NITRO_STUB_DIR/proxy.pids"
echo "$$" >"$NITRO_STUB_DIR/proxy.pid"
echo "$*" >>"$NITRO_STUB_DIR/proxy-calls"
exec sleep 1000
STUB
chmod +x "$tmp/bin/nitro-cli" "$tmp/bin/gateway"
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
refused() { # WHAT MESSAGE ENV...
  local what=$1 msg=$2
  shift 2
  if env NITRO_CLI="$tmp/bin/nitro-cli" GATEWAY="$tmp/bin/gateway" READY_FILE="$tmp/ready" \
    HEARTBEAT_FILE="$tmp/heartbeat" "$@" "${RUNNER_SHELL[@]}" "$RUNNER" >/dev/null 2>"$tmp/err"; then
    fail "$what was accepted"
  fi
  grep -q "$msg" "$tmp/err" || { cat "$tmp/err" >&2; fail "$what: no message '$msg'"; }
}
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
NITRO_CLI="$tmp/bin/nitro-cli" GATEWAY="$tmp/bin/gateway" EIF=/eif/stage.eif CID_BASE=16 STAGES=2 \
  ENCLAVE_CPUS=2 ENCLAVE_MEMORY_MIB=1024,2048 ROUTES="$ROUTES" CHECK_SECS=1 \
  READY_FILE="$tmp/ready" HEARTBEAT_FILE="$tmp/heartbeat" NITRO_ENCLAVES_CPUS=4 \
  "${RUNNER_SHELL[@]}" "$RUNNER" >"$tmp/runner.out" 2>"$tmp/runner.log" &
runner_pid=$!
wait_for 5 "READY_FILE after the start" test -e "$tmp/ready"
grep -qx "terminate-enclave --enclave-id i-0left00000000000000-enc00000000000000ff" "$tmp/stub/calls" \
  || fail "the enclave left at CID 16 was not terminated before the start"
runs() { grep -c "^run-enclave .*--enclave-cid $1\$" "$tmp/stub/calls" || true; }
grep -qx "run-enclave --eif-path /eif/stage.eif --cpu-count 2 --memory 1024 --enclave-cid 16" "$tmp/stub/calls" \
  || fail "stage 0 not started with 2 CPUs, 1024 MiB, CID 16"
grep -qx "run-enclave --eif-path /eif/stage.eif --cpu-count 2 --memory 2048 --enclave-cid 17" "$tmp/stub/calls" \
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
grep -q "stage 1: no enclave at CID 17: restarting it" "$tmp/runner.log" || fail "the restart is not logged"
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
echo "PASS enclave runner (${RUNNER_SHELL[*]}): start, readiness, enclave and proxy restarts, TERM, dry run"
