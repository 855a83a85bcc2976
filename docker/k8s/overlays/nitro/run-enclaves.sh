#!/bin/sh
# The enclave runner. It starts the stage enclaves of one pipeline from one
# EIF, starts the vsock relay (`gateway host-proxy`), and then supervises
# both: an enclave that is gone or not RUNNING is restarted (with exponential
# back-off while it keeps failing), and so is a host proxy that exited. Both
# deployments use this one script:
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
#                      or a comma list with one number per stage. Each must be
#                      at least 4 x the EIF's size (nitro-cli's E26), checked
#                      at start.
#   ROUTES             host-proxy routes, separated by spaces; each one becomes
#                      `--route VALUE`. Empty: no host proxy. A route that
#                      listens on vsock port 9000 is refused: that port on the
#                      parent is nitro-cli's boot heartbeat (an enclave that
#                      boots reports to CID 3, port 9000).
#   DEBUG_MODE=1       adds --debug-mode. The console becomes readable and the
#                      PCRs read zero, so only a policy written by
#                      `build-eif.sh --debug-policy` accepts the enclaves. The
#                      runner keeps each enclave's console (below).
#   CHECK_SECS         seconds between supervision rounds (default 5)
#   BACKOFF_MIN_SECS, BACKOFF_MAX_SECS, STABLE_SECS
#                      restart back-off (defaults 5, 300, 600): the n-th
#                      restart of a stage in a row waits BACKOFF_MIN_SECS x
#                      2^(n-1) after its previous start, at most
#                      BACKOFF_MAX_SECS; an enclave RUNNING for STABLE_SECS
#                      after its start resets the count.
#   LOG_DIR            where an operator finds what failed (default
#                      /tmp/enclave-runner): stage-I.last-error (the last
#                      failed start's nitro-cli output and the nitro-cli error
#                      log it names, or how the enclave was found gone), and
#                      with DEBUG_MODE=1 stage-I.console (the running
#                      enclave's console, `nitro-cli console`) and
#                      stage-I.console.1 (the previous enclave's)
#   START_LOCK         lock file that serialises `nitro-cli run-enclave` on
#                      this parent (default /tmp/nitro-enclave-start.lock;
#                      flock(1)): nitro-cli cannot start two enclaves at once
#                      (both wait for the boot heartbeat on port 9000), so
#                      every runner of the parent must use the same file.
#                      Empty: no lock (one runner per parent only).
#   START_LOCK_WAIT_SECS
#                      how long a start waits for the lock (default 900)
#   MEMORY_LIMIT_FILE  the container's memory limit (default: the cgroup's,
#                      /sys/fs/cgroup/memory.max or, cgroup v1,
#                      memory/memory.limit_in_bytes). nitro-cli run-enclave
#                      holds the EIF in its own memory while it loads it, so
#                      the runner refuses to start below EIF + RUNNER_MIB
#                      (default 256: nitro-cli, the host proxy, the shell).
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
# to_string_pretty). The runner also needs `date`, `sleep`, `stat` and
# util-linux's `flock` (for START_LOCK; busybox's has no -w).
set -eu

EIF="${EIF:-/eif/stage.eif}"
CID_BASE="${CID_BASE:-16}"
STAGES="${STAGES:-2}"
ENCLAVE_CPUS="${ENCLAVE_CPUS:-2}"
ENCLAVE_MEMORY_MIB="${ENCLAVE_MEMORY_MIB:-}"
ROUTES="${ROUTES:-}"
DEBUG_MODE="${DEBUG_MODE:-0}"
CHECK_SECS="${CHECK_SECS:-5}"
BACKOFF_MIN_SECS="${BACKOFF_MIN_SECS:-5}"
BACKOFF_MAX_SECS="${BACKOFF_MAX_SECS:-300}"
STABLE_SECS="${STABLE_SECS:-600}"
LOG_DIR="${LOG_DIR:-/tmp/enclave-runner}"
START_LOCK="${START_LOCK-/tmp/nitro-enclave-start.lock}"
START_LOCK_WAIT_SECS="${START_LOCK_WAIT_SECS:-900}"
MEMORY_LIMIT_FILE="${MEMORY_LIMIT_FILE:-}"
RUNNER_MIB="${RUNNER_MIB:-256}"
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
at_least "$BACKOFF_MIN_SECS" 1 || die "BACKOFF_MIN_SECS must be a whole number of seconds >= 1, not '$BACKOFF_MIN_SECS'"
at_least "$BACKOFF_MAX_SECS" "$BACKOFF_MIN_SECS" \
  || die "BACKOFF_MAX_SECS must be a whole number of seconds >= BACKOFF_MIN_SECS ($BACKOFF_MIN_SECS), not '$BACKOFF_MAX_SECS'"
at_least "$STABLE_SECS" 1 || die "STABLE_SECS must be a whole number of seconds >= 1, not '$STABLE_SECS'"
at_least "$START_LOCK_WAIT_SECS" 1 || die "START_LOCK_WAIT_SECS must be a whole number of seconds >= 1, not '$START_LOCK_WAIT_SECS'"
at_least "$RUNNER_MIB" 0 || die "RUNNER_MIB must be a number of MiB, not '$RUNNER_MIB'"
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
# Port 9000 on the parent is nitro-cli's: every enclave reports that it
# booted by connecting to CID 3, port 9000 (ENCLAVE_READY_VSOCK_PORT in
# nitro-cli's source), where run-enclave listens while it waits. A host
# proxy listening there makes run-enclave fail, or takes the heartbeat.
set -f
for _r in $ROUTES; do
  case "${_r%%=*}" in
    vsock://*:9000)
      die "route $_r listens on vsock port 9000 of the parent, nitro-cli's boot heartbeat port (enclaves report to CID 3 port 9000 when they boot): give the host proxy other ports (scripts/run-nitro.sh --proxy-port-base)"
      ;;
  esac
done
set +f
if [ -n "${NITRO_ENCLAVES_CPUS:-}" ] && [ "$DRY_RUN" != 1 ]; then
  # The device plugin sets this variable to the number of
  # aws.ec2.nitro/nitro_enclaves_cpus that were given to the container
  # (pkg/nitro_enclaves_cpu_plugin/device_plugin.go, Allocate).
  at_least "$NITRO_ENCLAVES_CPUS" $((STAGES * ENCLAVE_CPUS)) \
    || die "the pod was given $NITRO_ENCLAVES_CPUS enclave CPUs (aws.ec2.nitro/nitro_enclaves_cpus) but $STAGES enclaves x $ENCLAVE_CPUS need $((STAGES * ENCLAVE_CPUS))"
fi

# The container's memory limit in bytes, or nothing when there is none.
memory_limit() {
  _f=$MEMORY_LIMIT_FILE
  if [ -z "$_f" ]; then
    for _c in /sys/fs/cgroup/memory.max /sys/fs/cgroup/memory/memory.limit_in_bytes; do
      if [ -r "$_c" ]; then _f=$_c; break; fi
    done
  fi
  [ -n "$_f" ] && [ -r "$_f" ] || return 0
  IFS= read -r _lim <"$_f" || return 0
  # cgroup v2 says "max"; v1 says a number near 2^63 (no limit).
  case "$_lim" in '' | max | *[!0-9]*) return 0 ;; esac
  [ "${#_lim}" -lt 18 ] || return 0
  printf '%s\n' "$_lim"
}

# What the EIF's size requires, checked before anything starts (and in a dry
# run when the EIF exists): every enclave at least 4 x the EIF (nitro-cli
# refuses less with E26), and the runner's own memory limit above the EIF
# (nitro-cli run-enclave holds the EIF in memory while it loads it).
eif_mib=""
if [ -f "$EIF" ]; then
  _bytes=$(stat -L -c %s "$EIF") || die "cannot read the size of $EIF"
  eif_mib=$(((_bytes + 1048575) / 1048576))
  _s=0
  while [ "$_s" -lt "$STAGES" ]; do
    _m=$(mem_of "$_s")
    [ "$_m" -ge $((4 * eif_mib)) ] \
      || die "stage $_s: ENCLAVE_MEMORY_MIB $_m is below 4 x the EIF ($EIF, $eif_mib MiB): nitro-cli refuses an enclave smaller than 4 x its EIF (E26); give at least $((4 * eif_mib)) (scripts/run-nitro.sh --dry-run prints the sizing)"
    _s=$((_s + 1))
  done
  _lim=$(memory_limit)
  if [ -n "$_lim" ]; then
    _need=$((eif_mib + RUNNER_MIB))
    [ $((_lim / 1048576)) -ge "$_need" ] \
      || die "this container's memory limit is $((_lim / 1048576)) MiB, but nitro-cli run-enclave holds the whole EIF ($eif_mib MiB) in memory while it loads it: give the runner at least $_need MiB (EIF + $RUNNER_MIB; resources.limits.memory: ${_need}Mi)"
  fi
elif [ "$DRY_RUN" != 1 ]; then
  die "no EIF at $EIF (scripts/build-eif.sh builds it)"
fi
if [ -n "$START_LOCK" ] && [ "$DRY_RUN" != 1 ]; then
  command -v flock >/dev/null \
    || die "flock not found: it serialises enclave starts on this parent (START_LOCK=$START_LOCK); install util-linux, or set START_LOCK= when this is the parent's only runner"
fi

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

# Writes $LOG_DIR/stage-$1.last-error: the time, what failed ($2), the file
# $3 if given (nitro-cli's output), and the nitro-cli error log that output
# names ("If you open a support ticket, please provide the error log found
# at \"/var/log/nitro_enclaves/err<time>.log\"").
last_error() {
  _f="$LOG_DIR/stage-$1.last-error"
  if {
    printf '%s stage %s: %s\n' "$(date -u '+%Y-%m-%dT%H:%M:%SZ')" "$1" "$2"
    if [ -n "${3:-}" ] && [ -s "$3" ]; then
      printf -- '--- nitro-cli output:\n'
      cat "$3"
      while IFS= read -r _line; do
        case "$_line" in
          *'error log found at "'*)
            _e=${_line#*error log found at \"}
            _e=${_e%%\"*}
            if [ -r "$_e" ]; then
              printf -- '--- %s:\n' "$_e"
              cat "$_e"
            fi
            ;;
        esac
      done <"$3"
    fi
  } >"$_f.tmp" 2>/dev/null && mv -f "$_f.tmp" "$_f"; then
    log "stage $1: $2 (kept in $_f)"
  else
    log "stage $1: $2 (cannot write $_f)"
  fi
}

# DEBUG_MODE=1: copies the console of enclave $2 (stage $1) into
# $LOG_DIR/stage-$1.console until the enclave is gone; the previous
# enclave's console moves to stage-$1.console.1. Boot messages printed
# before the console attaches are not in it (docs/deploy-nitro.md).
console_pids=""
attach_console() {
  _c="$LOG_DIR/stage-$1.console"
  if [ -e "$_c" ]; then mv -f "$_c" "$_c.1"; fi
  "$NITRO_CLI" console --enclave-id "$2" >"$_c" 2>&1 </dev/null &
  console_pids="$console_pids $!"
  log "stage $1: console of enclave $2 in $_c"
}

# Starts the enclave of stage $1. When DRY_RUN=1 it only prints the command.
# Otherwise the start waits for START_LOCK, nitro-cli's answer goes to the
# log (stderr) and to $LOG_DIR/stage-$1.start, a failure to
# stage-$1.last-error, and in debug mode the console is attached.
run_enclave() {
  _stage=$1
  _cid=$((CID_BASE + _stage))
  _mem=$(mem_of "$_stage")
  set -- "$NITRO_CLI" run-enclave --eif-path "$EIF" --cpu-count "$ENCLAVE_CPUS" --memory "$_mem" --enclave-cid "$_cid"
  if [ "$DEBUG_MODE" = 1 ]; then set -- "$@" --debug-mode; fi
  if [ "$DRY_RUN" = 1 ]; then printf '%s\n' "$*"; return 0; fi
  if [ -n "$START_LOCK" ]; then
    # -E 75: a lock not taken in time is told apart from nitro-cli's
    # failures. -o: nitro-cli's enclave process, which lives as long as the
    # enclave, must not inherit the lock (flock itself holds it until
    # run-enclave returns).
    set -- flock -o -w "$START_LOCK_WAIT_SECS" -E 75 "$START_LOCK" "$@"
  fi
  log "starting stage $_stage: $*"
  _out="$LOG_DIR/stage-$_stage.start"
  # In the background, so that the heartbeat goes on while the start waits
  # for the lock or for the enclave to boot (the liveness probe reads it).
  "$@" >"$_out" 2>&1 </dev/null &
  _pid=$!
  while alive "$_pid"; do
    heartbeat
    sleep 1
  done
  _rc=0
  wait "$_pid" || _rc=$?
  cat "$_out" >&2
  if [ "$_rc" != 0 ]; then
    if [ -n "$START_LOCK" ] && [ "$_rc" = 75 ]; then
      last_error "$_stage" "no start lock ($START_LOCK) within ${START_LOCK_WAIT_SECS} s: another runner on this parent holds it"
    else
      last_error "$_stage" "nitro-cli run-enclave failed (exit status $_rc) for CID $_cid" "$_out"
    fi
    return 1
  fi
  _id=""
  while IFS= read -r _line; do
    case "$_line" in *'"EnclaveID":'*) _id=$(json_value "$_line") ;; esac
  done <"$_out"
  if [ "$DEBUG_MODE" = 1 ] && [ -n "$_id" ]; then attach_console "$_stage" "$_id"; fi
  return 0
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
mkdir -p "$LOG_DIR" || die "cannot create LOG_DIR $LOG_DIR"

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
  for _p in $console_pids; do kill "$_p" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

rm -f "$READY_FILE"
heartbeat
if [ "$DEBUG_MODE" = 1 ]; then
  log "DEBUG MODE: the enclaves' PCRs read zero and the parent can read their memory; only a policy written by build-eif.sh --debug-policy accepts them. For a first bring-up only, never for clients' data. Consoles in $LOG_DIR"
fi
# An enclave that an earlier run left at one of these CIDs (a runner that was
# killed, for example) holds the CID, so it is replaced.
if describe; then
  terminate_ours "replacing an enclave left by an earlier run:"
fi
# A start that fails here is a configuration error (memory below what the EIF
# needs, no hugepages, no CPUs in the pool, an image that does not boot). The
# runner then exits non-zero, its last error kept in LOG_DIR, and the EXIT
# trap stops what did start: in a pod, the kubelet restarts the container
# with its own back-off.
i=0
while [ "$i" -lt "$STAGES" ]; do
  heartbeat
  eval "started_$i=$(date +%s) fails_$i=0 down_$i=0"
  run_enclave "$i" || die "stage $i: nitro-cli run-enclave failed (CID $((CID_BASE + i))); see $LOG_DIR/stage-$i.last-error"
  i=$((i + 1))
done
start_proxy

# The wait before restart number $1 + 1 in a row of a stage, from its
# previous start: BACKOFF_MIN_SECS doubled $1 times, at most BACKOFF_MAX_SECS.
backoff() {
  _d=$BACKOFF_MIN_SECS _n=$1
  while [ "$_n" -gt 0 ] && [ "$_d" -lt "$BACKOFF_MAX_SECS" ]; do
    _d=$((_d * 2)) _n=$((_n - 1))
  done
  [ "$_d" -le "$BACKOFF_MAX_SECS" ] || _d=$BACKOFF_MAX_SECS
  printf '%s\n' "$_d"
}

# Stage $1 (CID $2) has no RUNNING enclave ($3: its state, empty when it is
# gone): says so once, then restarts it when its back-off has passed. The
# state per stage: started_I (its last start), fails_I (restarts in a row),
# down_I (0: running; 1: found down, said; 2: the wait said too).
restart() {
  _k=$1
  eval "_started=\$started_$_k _fails=\$fails_$_k _down=\$down_$_k"
  _now=$(date +%s)
  if [ "$_down" = 0 ]; then
    if [ -n "$3" ]; then
      last_error "$_k" "its enclave at CID $2 was $3, $((_now - _started)) s after its start"
    else
      last_error "$_k" "its enclave at CID $2 was gone, $((_now - _started)) s after its start"
    fi
    _down=1
    eval "down_$_k=1"
  fi
  _delay=$(backoff "$_fails")
  if [ $((_now - _started)) -lt "$_delay" ]; then
    if [ "$_down" = 1 ]; then
      log "stage $_k: next start in $((_started + _delay - _now)) s (back-off: ${_delay} s from the previous start after $_fails restarts in a row)"
      eval "down_$_k=2"
    fi
    return 0
  fi
  log "stage $_k: restarting it (restart $((_fails + 1)) in a row)"
  eval "started_$_k=$_now fails_$_k=$((_fails + 1)) down_$_k=0"
  run_enclave "$_k" || log "stage $_k: run-enclave failed; the next start waits $(backoff $((_fails + 1))) s from this one"
}

# Each round checks every enclave of this runner, by CID, and the host proxy.
supervise() {
  _ok=1
  if ! describe; then
    _ok=0
    not_ready "nitro-cli describe-enclaves gave no enclave list"
    log "nitro-cli describe-enclaves gave no enclave list; checking again in ${CHECK_SECS}s"
  else
    _s=0
    while [ "$_s" -lt "$STAGES" ]; do
      _scid=$((CID_BASE + _s))
      find_cid "$_scid"
      case "$st" in
        RUNNING)
          eval "_started=\$started_$_s _fails=\$fails_$_s"
          if [ "$_fails" -gt 0 ] && [ $(($(date +%s) - _started)) -ge "$STABLE_SECS" ]; then
            log "stage $_s: RUNNING ${STABLE_SECS} s after its start: back-off reset"
            eval "fails_$_s=0"
          fi
          ;;
        "")
          _ok=0
          not_ready "stage $_s has no enclave"
          restart "$_s" "$_scid" ""
          ;;
        *)
          _ok=0
          not_ready "stage $_s's enclave is $st"
          log "stage $_s: enclave $eid at CID $_scid is $st: terminating it"
          terminate "$eid"
          restart "$_s" "$_scid" "$st"
          ;;
      esac
      _s=$((_s + 1))
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
