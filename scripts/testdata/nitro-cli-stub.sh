#!/usr/bin/env bash
# A stand-in for AWS's nitro-cli, for scripts/test-enclave-runner.sh and
# scripts/test-nitro-scripts.sh (no Nitro hardware here). It keeps enclaves
# as files in $NITRO_STUB_DIR (enclave-CID holds "ID STATE CPUS MEMORY
# FLAGS") and answers in nitro-cli's formats: describe-enclaves pretty-prints
# the fields of nitro-cli's src/common/json_output.rs, errors look like
# nitro-cli's ("[ E36 ] ...", the error log named on the last line).
# Every call is appended to $NITRO_STUB_DIR/calls.
#
# Files a test puts in $NITRO_STUB_DIR to steer it:
#   fail-CID   run-enclave at CID fails as nitro-cli does when an enclave
#              does not boot (E36), naming an error log it writes
#   crash-CID  run-enclave at CID succeeds, but the enclave is gone at once
#              (as one that panics right after its boot)
# and in the environment: NITRO_STUB_RUN_SECS, how long run-enclave takes
# (default 0). run-enclave appends "CID START END" (seconds, with
# fractions) to $NITRO_STUB_DIR/starts, and fails like nitro-cli when
# another run-enclave is running (both would wait on port 9000).
set -euo pipefail
d="$NITRO_STUB_DIR"
echo "$*" >>"$d/calls"
cmd="$1"
shift
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
    start=$(date +%s.%N)
    # Two run-enclave at once: the second cannot listen on port 9000.
    if ! mkdir "$d/starting" 2>/dev/null; then
      echo "[ E11 ] Socket error. (stub: another run-enclave is waiting on vsock port 9000)" >&2
      echo "$cid $start $(date +%s.%N) overlap" >>"$d/starts"
      exit 1
    fi
    sleep "${NITRO_STUB_RUN_SECS:-0}"
    rmdir "$d/starting"
    echo "$cid $start $(date +%s.%N)" >>"$d/starts"
    if [[ -e "$d/enclave-$cid" ]]; then
      echo "[ E21 ] Enclave CID $cid is in use (stub)" >&2
      exit 1
    fi
    n=$(($(cat "$d/counter" 2>/dev/null || echo 0) + 1))
    echo "$n" >"$d/counter"
    if [[ -e "$d/fail-$cid" ]]; then
      log="$d/err-$n.log"
      printf 'Action: Run Enclave\nSubactions:\n    Failed to receive the ready signal (stub, start %s)\n' "$n" >"$log"
      echo "Start allocating memory..."
      printf '[ E36 ] Enclave boot failure. Such error appears when attempting to receive the `ready` signal from a freshly booted enclave. (stub)\n\nFor more details, please visit https://docs.aws.amazon.com/enclaves/latest/user/cli-errors.html#E36\n\nIf you open a support ticket, please provide the error log found at "%s"\n' "$log" >&2
      exit 1
    fi
    id="$(printf 'i-0stub%012d-enc%016x' "$n" "$n")"
    [[ -e "$d/crash-$cid" ]] || echo "$id RUNNING $cpus $mem $flags" >"$d/enclave-$cid"
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
  console)
    # The console of a debug-mode enclave, until the enclave is gone.
    [[ "${1:-}" == --enclave-id && -n "${2:-}" ]] || { echo "stub nitro-cli: console needs --enclave-id ID" >&2; exit 2; }
    echo "stub console of $2: booted"
    echo "stub console of $2: stage log line"
    here() { grep -qs "^$2 " "$d"/enclave-*; }
    for ((i = 0; i < 600; i++)); do
      here "$@" || break
      sleep 0.1
    done
    echo "stub console of $2: enclave gone"
    ;;
  *) echo "stub nitro-cli: unexpected command $cmd" >&2; exit 2 ;;
esac
