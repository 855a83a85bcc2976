#!/bin/sh
# The enclave runner. It starts the stage enclaves of one pipeline from one
# EIF, starts the vsock relay (`gateway host-proxy`), and then supervises
# both: an enclave that is gone or not RUNNING is restarted, and so is a host
# proxy that exited. Both deployments use this one script:
#   - Kubernetes (docker/k8s/overlays/nitro): the runner container's entry
#     point, with one runner pod per node. Its readiness probe tests
#     READY_FILE and its liveness probe tests HEARTBEAT_FILE.
#   - a parent instance (scripts/run-nitro.sh): started there, beside the
#     gateway.
# NEVER RUN on Nitro hardware. It is written against nitro-cli's source
# (aws-nitro-enclaves-cli: src/common/json_output.rs has describe-enclaves'
# fields, and src/enclave_proc_comm.rs prints them as a pretty-printed JSON
# array) and tested with a stub nitro-cli (scripts/test-enclave-runner.sh).
#
# Environment:
#   EIF                the enclave image (default /eif/stage.eif). This is the
#                      single EIF that scripts/build-eif.sh builds: every stage
#                      runs it and takes its index from its CID
#                      (`--stage-from-cid CID_BASE` is baked into its command).
#   CID_BASE           stage i runs with CID CID_BASE+i (default 16). It must
#                      be the EIF's --cid-base.
#   STAGES             how many stages, one enclave each (default 2)
#   ENCLAVE_CPUS       vCPUs per enclave (default 2). Nitro gives whole cores,
#                      so on x86 this number must be even.
#   ENCLAVE_MEMORY_MIB MiB per enclave (required): one number for every stage,
#                      or a comma list with one number per stage
#   ROUTES             host-proxy routes, separated by spaces; each one becomes
#                      `--route VALUE`. Empty: no host proxy.
#   DEBUG_MODE=1       adds --debug-mode. The console becomes readable and the
#                      PCRs read zero, so the shipped policies refuse it.
#   CHECK_SECS         seconds between supervision rounds (default 5)
#   READY_FILE         present only while every enclave is RUNNING and the
#                      host proxy is alive (default /tmp/enclaves-ready)
#   HEARTBEAT_FILE     holds the time (date +%s) of the runner's last round
#                      (default /tmp/enclave-runner-heartbeat); a liveness
#                      probe checks its age
#   NITRO_CLI, GATEWAY the commands to run (default nitro-cli and gateway;
#                      the test puts stubs here)
#   DRY_RUN=1          prints the commands that start the enclaves and the
#                      host proxy, then exits 0 without starting anything
#   NITRO_ENCLAVES_CPUS
#                      set by AWS's device plugin when the pod requests
#                      aws.ec2.nitro/nitro_enclaves_cpus: the runner refuses to
#                      start when this is less than STAGES x ENCLAVE_CPUS
# Runs under any POSIX sh and needs no jq or python3. nitro-cli's output is
# read with the shell's own `read` and `case`, which works because nitro-cli
# always pretty-prints its JSON with one key per line (serde_json's
# to_string_pretty). The runner also needs `date` and `sleep`.
set -eu

EIF="${EIF:-/eif/stage.eif}"
CID_BASE="${CID_BASE:-16}"
STAGES="${STAGES:-2}"
ENCLAVE_CPUS="${ENCLAVE_CPUS:-2}"
ENCLAVE_MEMORY_MIB="${ENCLAVE_MEMORY_MIB:-}"
ROUTES="${ROUTES:-}"
DEBUG_MODE="${DEBUG_MODE:-0}"
CHECK_SECS="${CHECK_SECS:-5}"
READY_FILE="${READY_FILE:-/tmp/enclaves-ready}"
HEARTBEAT_FILE="${HEARTBEAT_FILE:-/tmp/enclave-runner-heartbeat}"
NITRO_CLI="${NITRO_CLI:-nitro-cli}"
GATEWAY="${GATEWAY:-gateway}"
DRY_RUN="${DRY_RUN:-0}"

log() { printf 'run-enclaves: %s %s\n' "$(date -u '+%Y-%m-%dT%H:%M:%SZ')" "$*" >&2; }
die() { log "error: $*"; exit 1; }
# Whether $1 is a whole number >= $2.
at_least() {
  case "$1" in '' | *[!0-9]*) return 1 ;; esac
  [ "$1" -ge "$2" ]
}

# Memory for stage $1, from ENCLAVE_MEMORY_MIB.
mem_of() {
  _i=$1
  _ifs=$IFS; IFS=,; set -f
  # shellcheck disable=SC2086 # split on commas, on purpose
  set -- $ENCLAVE_MEMORY_MIB
  set +f; IFS=$_ifs
  if [ $# -gt 1 ]; then shift "$_i"; fi
  printf '%s\n' "$1"
}

at_least "$CID_BASE" 4 || die "CID_BASE must be a number >= 4 (CIDs 0-3 are reserved), not '$CID_BASE'"
at_least "$STAGES" 1 || die "STAGES must be a number >= 1, not '$STAGES'"
at_least "$ENCLAVE_CPUS" 1 || die "ENCLAVE_CPUS must be a number >= 1, not '$ENCLAVE_CPUS'"
at_least "$CHECK_SECS" 1 || die "CHECK_SECS must be a whole number of seconds >= 1, not '$CHECK_SECS'"
[ -n "$ENCLAVE_MEMORY_MIB" ] || die "ENCLAVE_MEMORY_MIB is not set: MiB per enclave, one number or one per stage (comma list)"
_ifs=$IFS; IFS=,; set -f
# shellcheck disable=SC2086 # split on commas, on purpose
set -- $ENCLAVE_MEMORY_MIB
set +f; IFS=$_ifs
[ $# -eq 1 ] || [ $# -eq "$STAGES" ] \
  || die "ENCLAVE_MEMORY_MIB has $# entries for $STAGES stages: give one number, or one per stage"
for m in "$@"; do
  at_least "$m" 1 || die "ENCLAVE_MEMORY_MIB: '$m' is not a number of MiB"
done
set --
if [ -n "${NITRO_ENCLAVES_CPUS:-}" ] && [ "$DRY_RUN" != 1 ]; then
  # The device plugin sets this variable to the number of
  # aws.ec2.nitro/nitro_enclaves_cpus that were given to the container
  # (pkg/nitro_enclaves_cpu_plugin/device_plugin.go, Allocate).
  at_least "$NITRO_ENCLAVES_CPUS" $((STAGES * ENCLAVE_CPUS)) \
    || die "the pod was given $NITRO_ENCLAVES_CPUS enclave CPUs (aws.ec2.nitro/nitro_enclaves_cpus) but $STAGES enclaves x $ENCLAVE_CPUS need $((STAGES * ENCLAVE_CPUS))"
fi

# Starts the enclave of stage $1. When DRY_RUN=1 it only prints the command.
run_enclave() {
  _cid=$((CID_BASE + $1))
  _mem=$(mem_of "$1")
  set -- "$NITRO_CLI" run-enclave --eif-path "$EIF" --cpu-count "$ENCLAVE_CPUS" --memory "$_mem" --enclave-cid "$_cid"
  if [ "$DEBUG_MODE" = 1 ]; then set -- "$@" --debug-mode; fi
  if [ "$DRY_RUN" = 1 ]; then printf '%s\n' "$*"; return 0; fi
  log "starting: $*"
  # nitro-cli's progress and JSON answer go to the log (stderr).
  "$@" >&2
}

# Starts the host proxy in the background and sets proxy_pid. When DRY_RUN=1
# it only prints the command.
proxy_pid=""
start_proxy() {
  [ -n "$ROUTES" ] || return 0
  set -f
  set -- "$GATEWAY" host-proxy
  for _r in $ROUTES; do set -- "$@" --route "$_r"; done
  set +f
  if [ "$DRY_RUN" = 1 ]; then printf '%s\n' "$*"; return 0; fi
  "$@" &
  proxy_pid=$!
  log "host proxy started (pid $proxy_pid): $*"
}

# Whether process $1 is running. A child that has exited but has not been
# reaped yet (a zombie) still answers kill -0, so /proc is read as well.
alive() {
  [ -n "$1" ] && kill -0 "$1" 2>/dev/null || return 1
  if [ -r "/proc/$1/stat" ]; then
    IFS= read -r _st 2>/dev/null <"/proc/$1/stat" || return 1
    _st=${_st##*) }
    case "${_st%% *}" in Z | X) return 1 ;; esac
  fi
  return 0
}

# The value in a line `"Key": value,`, without its quotes and comma.
json_value() {
  _v=${1#*:}
  _v=${_v#"${_v%%[![:space:]]*}"}
  _v=${_v%"${_v##*[![:space:]]}"}
  _v=${_v%,}
  _v=${_v#\"}
  _v=${_v%\"}
  printf '%s' "$_v"
}

# Reads nitro-cli describe-enclaves' output on stdin and prints one line
# "CID STATE ID" per enclave. The fields are EnclaveCID, State and EnclaveID,
# the top-level keys of each object. No nested object that nitro-cli prints
# has any of these keys; Measurements has HashAlgorithm and the PCRs.
parse_enclaves() {
  _cid="" _state="" _id=""
  while IFS= read -r _line || [ -n "$_line" ]; do
    case "$_line" in
      *'"EnclaveCID":'*) _cid=$(json_value "$_line") ;;
      *'"State":'*) _state=$(json_value "$_line") ;;
      *'"EnclaveID":'*) _id=$(json_value "$_line") ;;
      *) continue ;;
    esac
    if [ -n "$_cid" ] && [ -n "$_state" ] && [ -n "$_id" ]; then
      printf '%s %s %s\n' "$_cid" "$_state" "$_id"
      _cid="" _state="" _id=""
    fi
  done
}

# Sets `enclaves` to the "CID STATE ID" lines of the running enclaves.
# Returns 1 when nitro-cli printed no JSON array at all. nitro-cli exits
# non-zero when one of its enclave processes does not answer, but it still
# prints the enclaves that did answer, so its exit status is not used.
enclaves=""
describe() {
  _out=$("$NITRO_CLI" describe-enclaves) || true
  case "$_out" in *'['*) ;; *) return 1 ;; esac
  enclaves=$(printf '%s\n' "$_out" | parse_enclaves)
}

# Sets st (the state, or empty when there is no such enclave) and eid (the
# enclave's id) for CID $1, from `enclaves`.
find_cid() {
  st="" eid=""
  while read -r _fcid _fstate _fid; do
    if [ "$_fcid" = "$1" ]; then st=$_fstate eid=$_fid; fi
  done <<EOF
$enclaves
EOF
}

terminate() {
  "$NITRO_CLI" terminate-enclave --enclave-id "$1" >&2 || log "terminate-enclave --enclave-id $1 failed"
}

not_ready() {
  if [ -e "$READY_FILE" ]; then
    rm -f "$READY_FILE"
    log "not ready: $*"
  fi
}

heartbeat() { date +%s >"$HEARTBEAT_FILE" || log "cannot write $HEARTBEAT_FILE"; }

if [ "$DRY_RUN" = 1 ]; then
  i=0
  while [ "$i" -lt "$STAGES" ]; do run_enclave "$i"; i=$((i + 1)); done
  start_proxy
  exit 0
fi

sleep_pid=""
cleaned=0
# Terminates every enclave at one of this runner's CIDs (after `describe`),
# logging "$1 stage I (enclave ID, STATE, CID C)" for each.
terminate_ours() {
  _t=0
  while [ "$_t" -lt "$STAGES" ]; do
    find_cid $((CID_BASE + _t))
    if [ -n "$eid" ]; then
      log "$1 stage $_t (enclave $eid, $st, CID $((CID_BASE + _t)))"
      terminate "$eid"
    fi
    _t=$((_t + 1))
  done
}
cleanup() {
  [ "$cleaned" = 0 ] || return 0
  cleaned=1
  rm -f "$READY_FILE"
  if [ -n "$sleep_pid" ]; then kill "$sleep_pid" 2>/dev/null || true; fi
  if [ -n "$proxy_pid" ]; then
    log "stopping the host proxy (pid $proxy_pid)"
    kill "$proxy_pid" 2>/dev/null || true
    wait "$proxy_pid" 2>/dev/null || true
  fi
  # Only this runner's enclaves, found by their CIDs. On a parent instance
  # another runner's enclaves can be running too.
  if describe; then
    terminate_ours "terminating"
  else
    log "nitro-cli describe-enclaves gave no enclave list: enclaves not terminated"
  fi
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

rm -f "$READY_FILE"
heartbeat
# An enclave that an earlier run left at one of these CIDs (a runner that was
# killed, for example) holds the CID, so it is replaced.
if describe; then
  terminate_ours "replacing an enclave left by an earlier run:"
fi
# A start that fails here is a configuration error (memory below what the EIF
# needs, no hugepages, no CPUs in the pool). The runner then exits non-zero
# and the EXIT trap stops what did start: in a pod, the kubelet restarts the
# container with back-off.
i=0
while [ "$i" -lt "$STAGES" ]; do
  heartbeat
  run_enclave "$i" || die "stage $i: nitro-cli run-enclave failed (CID $((CID_BASE + i)))"
  i=$((i + 1))
done
start_proxy

# Each round checks every enclave of this runner, by CID, and the host proxy.
supervise() {
  _ok=1
  if ! describe; then
    _ok=0
    not_ready "nitro-cli describe-enclaves gave no enclave list"
    log "nitro-cli describe-enclaves gave no enclave list; checking again in ${CHECK_SECS}s"
  else
    _k=0
    while [ "$_k" -lt "$STAGES" ]; do
      _kcid=$((CID_BASE + _k))
      find_cid "$_kcid"
      case "$st" in
        RUNNING) ;;
        "")
          _ok=0
          not_ready "stage $_k has no enclave"
          log "stage $_k: no enclave at CID $_kcid: restarting it"
          run_enclave "$_k" || log "stage $_k: run-enclave failed; trying again in ${CHECK_SECS}s"
          ;;
        *)
          _ok=0
          not_ready "stage $_k's enclave is $st"
          log "stage $_k: enclave $eid at CID $_kcid is $st: terminating and restarting it"
          terminate "$eid"
          run_enclave "$_k" || log "stage $_k: run-enclave failed; trying again in ${CHECK_SECS}s"
          ;;
      esac
      _k=$((_k + 1))
    done
  fi
  if [ -n "$ROUTES" ] && ! alive "$proxy_pid"; then
    _ok=0
    not_ready "the host proxy exited"
    _rc=0
    wait "$proxy_pid" 2>/dev/null || _rc=$?
    log "host proxy (pid $proxy_pid) exited (status $_rc): restarting it"
    start_proxy
  fi
  # A restart is confirmed by the next round, not by run-enclave's answer.
  if [ "$_ok" = 1 ] && [ ! -e "$READY_FILE" ]; then
    if : >"$READY_FILE"; then
      log "ready: $STAGES enclaves RUNNING (CIDs $CID_BASE..$((CID_BASE + STAGES - 1)))${ROUTES:+, host proxy up}"
    else
      log "cannot write $READY_FILE"
    fi
  fi
}

while :; do
  supervise
  heartbeat
  # `wait` returns as soon as a trapped signal (TERM, INT) arrives.
  sleep "$CHECK_SECS" &
  sleep_pid=$!
  wait "$sleep_pid" || true
  sleep_pid=""
done
