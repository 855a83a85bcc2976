#!/usr/bin/env bash
# Starts a pipeline on a Nitro parent instance (docs/deploy-nitro.md): one
# enclave per stage from the EIF that scripts/build-eif.sh built, the
# `gateway host-proxy` relaying stage i-1 -> stage i (and, for completions,
# the exit stage's feedback to the entry stage), and the gateway with
# config/gateway-nitro.toml (vsock addresses and the PCR policy set here).
# The enclaves and the proxy are started and supervised (a dead enclave or
# proxy is restarted) by the one enclave runner that the Kubernetes overlay
# uses too, docker/k8s/overlays/nitro/run-enclaves.sh; the gateway starts
# once every enclave runs, and stopping this script stops them all.
# One gateway per parent: a second run (a second pipeline) starts its
# enclaves and host proxy with --no-gateway, and the first run's gateway
# serves both (docs/deploy-nitro.md, two pipelines); a second run without it
# is refused while the first one's gateway holds GATEWAY_LOCK. The runners
# of one parent take turns to start enclaves (START_LOCK).
#
# Usage: scripts/run-nitro.sh [--build DIR] [options] [--dry-run]
#   --build DIR            target/eif/NAME from build-eif.sh (reads its eif.env;
#                          default target/eif/all-minilm-l6-v2)
#   --eif FILE --policy FILE --model DIR --layers LIST --cid-base N --port N
#                          instead of / over eif.env
#   --proxy-port-base N    host-proxy vsock ports: N+i reaches stage i (default 8000;
#                          the range must not hold 9000, nitro-cli's boot
#                          heartbeat port on the parent)
#   --kv-cache-tokens N    generation KV budget per stage (default 16384)
#   --debug-mode           nitro-cli --debug-mode (console readable, PCRs zero):
#                          only with a policy from build-eif.sh --debug-policy
#                          (refused otherwise: the pipeline could never form);
#                          the consoles are kept in LOG_DIR. First bring-up only.
#   --no-gateway           start the enclaves and host proxy only (a second
#                          pipeline on a parent whose gateway already runs)
#   --config FILE          gateway config (default config/gateway-nitro.toml)
#   --dry-run              print the sizing and every command, start nothing
# Environment: WEIGHTS (q4_1 | q8_0 | f32: the stages' --weights, for the
# memory sizing), MEMORY_MIB, CPU_COUNT, KV_BYTES_PER_TOKEN_LAYER (below);
# START_WAIT_SECS (how long to wait for the enclaves, default sized to the
# EIF, below); GATEWAY_LOCK (default /tmp/nitro-gateway.lock: held while this
# run's gateway lives); START_LOCK, LOG_DIR, BACKOFF_MIN_SECS,
# BACKOFF_MAX_SECS (passed to the enclave runner: see its header);
# GATEWAY_BIN (default target/release/gateway).
#
# Sizing, per stage, in MiB (printed; every term rounded up):
#   memory = max(roundup_256(eif + weights + kv + activations + 512),
#                roundup_256(4 x eif))
#     (nitro-cli refuses an enclave smaller than 4 x its EIF: error E26)
#     eif          the EIF file (its initramfs, binary and all model files,
#                  lives in enclave memory; estimated as model folder + 64
#                  when the EIF does not exist yet, e.g. in a dry run)
#     weights      resident weights: weight files (*.safetensors, *.gguf) x
#                  expansion (safetensors: 1, assumed f32; GGUF: held bits /
#                  file bits, held bits by WEIGHTS, env, the stages'
#                  --weights, default q4_1 as the stage's own default: q4_1
#                  6 (4-bit blocks with f32 scale and min), q8_0 9 (8-bit
#                  blocks with an f32 scale), f32 32; file bits per weight
#                  from the file name, Q4_1 5, Q4_0 4.5, Q8_0 8.5, F16 16,
#                  else 8); the whole model, as an upper bound for any stage.
#                  For a GGUF, when target/release/gateway exists (cargo
#                  build --release): `gateway plan --layers LIST` instead, each
#                  stage's own weights as it holds them (its layers, the
#                  embedding at the entry, the head at the exit)
#     kv           generation models: with `gateway plan`, its KV bytes for
#                  the stage at kv-cache-tokens (from the file's heads and
#                  widths); else kv-cache-tokens x stage layers x
#                  KV_BYTES_PER_TOKEN_LAYER (env, default 1536 = K and V x 3
#                  KV heads x 64 dims x 4 bytes, SmolLM2-135M)
#     activations  embedding models: the stage's --memory-budget-mib, 192
#     512          kernel, runtime, channel buffers
#   cpus = 2 if weights < 1024 MiB, 4 if < 4096, else 8 (override with
#          CPU_COUNT): even, because an enclave gets whole cores (two vCPUs
#          each on x86)
# The parent: the allocator (/etc/nitro_enclaves/allocator.yaml) reserves the
# sum over the stages, printed as the file to write; it keeps CPU 0 and its
# sibling for the parent, so the instance needs that many vCPUs plus 2, and
# the memory plus 4 GiB for the parent (gateway, host proxy, page cache); the
# smallest m6i size that fits is printed. The Kubernetes runner container's
# memory limit: eif + 256 (nitro-cli run-enclave holds the EIF in memory
# while it loads it; the runner refuses to start below it).
# The wait for the enclaves: per stage (they start one at a time) nitro-cli's
# own boot timeout, 60 s per started 6 GiB of EIF, + 30 s + 1 s per 100 MiB
# of EIF to load it, plus 10 s for the runner's rounds; START_WAIT_SECS
# overrides (another runner of the parent starting first adds its time).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUILD=target/eif/all-minilm-l6-v2
EIF="" POLICY="" MODEL_DIR="" LAYERS="" CID_BASE="" PORT=""
PROXY_BASE=8000
KV_TOKENS=16384
DEBUG_MODE=0
NO_GATEWAY=0
CONFIG=config/gateway-nitro.toml
DRY_RUN=0
declare -A SET=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) BUILD="$2"; shift 2 ;;
    --eif) SET[EIF]="$2"; shift 2 ;;
    --policy) SET[POLICY]="$2"; shift 2 ;;
    --model) SET[MODEL_DIR]="$2"; shift 2 ;;
    --layers) SET[LAYERS]="$2"; shift 2 ;;
    --cid-base) SET[CID_BASE]="$2"; shift 2 ;;
    --port) SET[PORT]="$2"; shift 2 ;;
    --proxy-port-base) PROXY_BASE="$2"; shift 2 ;;
    --kv-cache-tokens) KV_TOKENS="$2"; shift 2 ;;
    --debug-mode) DEBUG_MODE=1; shift ;;
    --no-gateway) NO_GATEWAY=1; shift ;;
    --config) CONFIG="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,81p' "$0"; exit 0 ;;
    *) echo "run-nitro: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -f "$BUILD/eif.env" ]]; then
  # shellcheck disable=SC1091
  source "$BUILD/eif.env"
fi
for k in "${!SET[@]}"; do printf -v "$k" '%s' "${SET[$k]}"; done
EIF="${EIF:-$BUILD/stage.eif}"
POLICY="${POLICY:-$BUILD/policy.toml}"
MODEL_DIR="${MODEL_DIR:-models/all-minilm-l6-v2}"
LAYERS="${LAYERS:-0..3,3..6}"
CID_BASE="${CID_BASE:-16}"
PORT="${PORT:-9000}"
[[ -f "$MODEL_DIR/manifest.json" ]] || { echo "run-nitro: no $MODEL_DIR/manifest.json" >&2; exit 1; }
ARCH="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["architecture"])' "$MODEL_DIR/manifest.json")"
TASK="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["task"])' "$MODEL_DIR/manifest.json")"
IFS=',' read -ra RANGES <<<"$LAYERS"
N=${#RANGES[@]}
# The host proxy listens on the parent's vsock ports PROXY_BASE..+N-1.
# Port 9000 there is nitro-cli's: a booting enclave reports to CID 3 port
# 9000, where run-enclave waits for it.
[[ "$PROXY_BASE" =~ ^[0-9]+$ ]] || { echo "run-nitro: --proxy-port-base takes a port number, not $PROXY_BASE" >&2; exit 2; }
if (( PROXY_BASE <= 9000 && 9000 <= PROXY_BASE + N - 1 )); then
  echo "run-nitro: --proxy-port-base $PROXY_BASE gives the host proxy vsock ports $PROXY_BASE..$(( PROXY_BASE + N - 1 )), which hold 9000: nitro-cli's boot heartbeat port on the parent (every enclave reports to CID 3 port 9000 when it boots); choose a base whose $N ports avoid it (default 8000)" >&2
  exit 2
fi
if (( PROXY_BASE + N - 1 > 4294967294 )); then
  echo "run-nitro: --proxy-port-base $PROXY_BASE: the ports pass the largest vsock port" >&2
  exit 2
fi

mib_up() { echo $(( ($1 + 1048575) / 1048576 )); }
# Bits per weight of a GGUF file, from its name.
gguf_bits() {
  case "$1" in
    *Q4_0*) echo 4.5 ;; *Q4_1*) echo 5 ;; *Q5_0*) echo 5.5 ;; *Q5_1*) echo 6 ;;
    *Q8_0*) echo 8.5 ;; *F16*|*f16*) echo 16 ;; *) echo 8 ;;
  esac
}
files_bytes=$(du -sbL "$MODEL_DIR" | cut -f1)
weights_bytes=0
shopt -s nullglob
for f in "$MODEL_DIR"/*.safetensors; do weights_bytes=$(( weights_bytes + $(stat -L -c %s "$f") )); done
WEIGHTS="${WEIGHTS:-q4_1}"
case "$WEIGHTS" in
  q4_1) held_bits=6 ;; q8_0) held_bits=9 ;; f32) held_bits=32 ;;
  *) echo "WEIGHTS must be q4_1, q8_0 or f32 (the stages' --weights), not $WEIGHTS" >&2; exit 2 ;;
esac
for f in "$MODEL_DIR"/*.gguf; do
  weights_bytes=$(python3 -c "import math,sys; print($weights_bytes + math.ceil(int(sys.argv[1]) * float(sys.argv[3]) / float(sys.argv[2])))" "$(stat -L -c %s "$f")" "$(gguf_bits "$f")" "$held_bits")
done
if [[ -f "$EIF" ]]; then
  eif_mib=$(mib_up "$(stat -L -c %s "$EIF")"); eif_how="EIF size"
else
  eif_mib=$(( $(mib_up "$files_bytes") + 64 )); eif_how="estimated: model folder + 64"
fi
weights_mib=$(mib_up "$weights_bytes")
KV_BYTES_PER_TOKEN_LAYER="${KV_BYTES_PER_TOKEN_LAYER:-1536}"
if [[ -n "${CPU_COUNT:-}" ]]; then cpus=$CPU_COUNT
elif (( weights_mib < 1024 )); then cpus=2
elif (( weights_mib < 4096 )); then cpus=4
else cpus=8; fi
if ! [[ "$cpus" =~ ^[0-9]+$ ]] || (( cpus < 2 || cpus % 2 != 0 )); then
  echo "run-nitro: CPU_COUNT must be even and at least 2: an enclave gets whole cores (2 vCPUs each)" >&2
  exit 2
fi

run() {
  if [[ $DRY_RUN == 1 ]]; then printf '+'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}
RUNNER=docker/k8s/overlays/nitro/run-enclaves.sh
GATEWAY="${GATEWAY_BIN:-target/release/gateway}"
GATEWAY_LOCK="${GATEWAY_LOCK:-/tmp/nitro-gateway.lock}"
if [[ $DRY_RUN == 0 ]]; then
  command -v nitro-cli >/dev/null || {
    echo "run-nitro: nitro-cli is not installed: run this on an AWS Nitro Enclaves parent instance (docs/deploy-nitro.md); --dry-run prints the commands" >&2
    exit 1
  }
  [[ -f "$EIF" ]] || { echo "run-nitro: no EIF at $EIF (scripts/build-eif.sh)" >&2; exit 1; }
  [[ -f "$POLICY" ]] || { echo "run-nitro: no policy at $POLICY (scripts/build-eif.sh)" >&2; exit 1; }
fi
# Debug mode zeroes the PCRs: only a policy that allows debug enclaves (from
# build-eif.sh --debug-policy) lets the gateway attest them.
if [[ -f "$POLICY" ]] && grep -q '^allow_debug = true' "$POLICY"; then
  policy_debug=1
else
  policy_debug=0
fi
if [[ $DEBUG_MODE == 1 && $policy_debug == 0 ]]; then
  echo "run-nitro: --debug-mode zeroes the enclaves' PCRs, and the policy $POLICY refuses debug enclaves (no allow_debug = true): the pipeline could never form. Build the image with scripts/build-eif.sh --debug-policy and run that build (--build target/eif/NAME-debug)" >&2
  exit 2
fi
if [[ $DEBUG_MODE == 1 || $policy_debug == 1 || "${DEBUG_POLICY:-0}" == 1 ]]; then
  how="the policy $POLICY accepts debug-mode enclaves"
  [[ $DEBUG_MODE == 0 ]] || how="enclaves in debug mode (PCRs zero, memory readable by this parent, consoles kept), $how"
  echo "run-nitro: DEBUG BRING-UP: $how; refused by every production policy, never for clients' data" >&2
fi
# One gateway per parent: this run's gateway holds GATEWAY_LOCK while it
# lives (taken before any enclave starts, so a refused run starts nothing).
if [[ $DRY_RUN == 0 && $NO_GATEWAY == 0 ]]; then
  exec 9>>"$GATEWAY_LOCK" || { echo "run-nitro: cannot open $GATEWAY_LOCK (GATEWAY_LOCK)" >&2; exit 1; }
  if ! flock -n 9; then
    echo "run-nitro: a gateway already runs on this parent ($(cat "$GATEWAY_LOCK" 2>/dev/null || echo "$GATEWAY_LOCK is held")): one gateway serves every pipeline of a parent. Start this pipeline with --no-gateway (its enclaves and host proxy only) and give that gateway this pipeline's section (docs/deploy-nitro.md, two pipelines)" >&2
    exit 1
  fi
  echo "run-nitro.sh pid $$, gateway $CONFIG, stages at CIDs $CID_BASE..$(( CID_BASE + N - 1 ))" >"$GATEWAY_LOCK"
fi

# A GGUF's stages are costed by `gateway plan` for this split: each stage's
# own weights as it holds them and its KV cache at the budget, from the
# file's tensors and metadata. Without a gateway binary, the estimates above.
PLAN=""
# The GGUF the manifest pins (the file the stages load).
gguf_file=$(python3 -c 'import json,sys; print(next((sys.argv[2] + "/" + f["path"] for f in json.load(open(sys.argv[1]))["files"] if f["path"].endswith(".gguf")), ""))' "$MODEL_DIR/manifest.json" "$MODEL_DIR")
if [[ "$TASK" == completion && -n "$gguf_file" && -x "$GATEWAY" ]]; then
  PLAN=$("$GATEWAY" plan --model "$gguf_file" --layers "$LAYERS" --kv-tokens "$KV_TOKENS" \
    --weights "$WEIGHTS" --json) || {
    echo "run-nitro: gateway plan failed (a gateway binary older than plan --layers? cargo build --release)" >&2
    exit 1
  }
  plan_field() { python3 -c 'import json,sys; print(json.loads(sys.argv[1])[int(sys.argv[2])][sys.argv[3]])' "$PLAN" "$1" "$2"; }
  weights_how="whole model; each stage its own, from gateway plan"
else
  weights_how="whole model, the upper bound used for each stage"
fi
echo "== sizing ($ARCH, $N stages): eif $eif_mib MiB ($eif_how), weights $weights_mib MiB ($weights_how), cpus $cpus"
routes=()
mems=()
# Embedding models are [pipeline], generation models [completions] in the config.
S=PIPELINE
[[ "$TASK" == completion ]] && S=COMPLETIONS
env_over=("GATEWAY_${S}__POLICY=$POLICY" "GATEWAY_${S}__MODEL_DIR=$MODEL_DIR")
for i in "${!RANGES[@]}"; do
  r="${RANGES[$i]}"; start=${r%%..*}; end=${r##*..}
  stage_weights_mib=$weights_mib
  if [[ -n "$PLAN" ]]; then
    stage_weights_mib=$(mib_up "$(plan_field "$i" weight_bytes)")
    kv_mib=$(mib_up "$(plan_field "$i" kv_bytes)")
    act_mib=0
  elif [[ "$TASK" == completion ]]; then
    kv_mib=$(mib_up $(( KV_TOKENS * (end - start) * KV_BYTES_PER_TOKEN_LAYER )))
    act_mib=0
  else
    kv_mib=0; act_mib=192
  fi
  sum=$(( eif_mib + stage_weights_mib + kv_mib + act_mib + 512 ))
  mem=$(( (sum + 255) / 256 * 256 ))
  floor=$(( (4 * eif_mib + 255) / 256 * 256 ))
  if (( floor > mem )); then
    mem=$floor; why="4 x eif ($eif_mib), nitro-cli's minimum, above"
  else
    why="="
  fi
  mem="${MEMORY_MIB:-$mem}"
  if (( mem < 4 * eif_mib )); then
    echo "run-nitro: MEMORY_MIB=$mem is below 4 x the EIF ($eif_mib MiB): nitro-cli would refuse it (E26)" >&2
    exit 2
  fi
  cid=$(( CID_BASE + i ))
  echo "stage $i: layers $start..$end cid $cid: memory $mem MiB $why roundup_256($eif_mib eif + $stage_weights_mib weights + $kv_mib kv + $act_mib activations + 512), cpus $cpus"
  mems+=("$mem")
  routes+=("vsock://any:$(( PROXY_BASE + i ))=vsock://$cid:$PORT")
  env_over+=("GATEWAY_${S}__STAGES__${i}__LAYERS=[$start, $end]" "GATEWAY_${S}__STAGES__${i}__ADDRESS=vsock://$cid:$PORT")
  if (( i > 0 )); then
    env_over+=("GATEWAY_${S}__STAGES__${i}__PEER_ADDRESS=vsock://3:$(( PROXY_BASE + i ))")
  elif [[ "$TASK" == completion && $N -gt 1 ]]; then
    # The exit stage sends sampled tokens back to the entry stage.
    env_over+=("GATEWAY_${S}__STAGES__0__PEER_ADDRESS=vsock://3:$PROXY_BASE")
  fi
done
total_mem=0
for m in "${mems[@]}"; do total_mem=$(( total_mem + m )); done
total_cpus=$(( N * cpus ))
need_vcpus=$(( total_cpus + 2 ))
need_mib=$(( total_mem + 4096 ))
instance="none of m6i's sizes (at most 128 vCPUs, 512 GiB)"
for size in large:2 xlarge:4 2xlarge:8 4xlarge:16 8xlarge:32 12xlarge:48 16xlarge:64 24xlarge:96 32xlarge:128; do
  v=${size##*:}
  if (( v >= need_vcpus && v * 4096 >= need_mib )); then instance="m6i.${size%%:*} ($v vCPUs, $(( v * 4 )) GiB)"; break; fi
done
start_wait=$(( N * (60 * ((eif_mib + 6143) / 6144) + 30 + (eif_mib + 99) / 100) + 10 ))
START_WAIT_SECS="${START_WAIT_SECS:-$start_wait}"
[[ "$START_WAIT_SECS" =~ ^[1-9][0-9]*$ ]] || { echo "run-nitro: START_WAIT_SECS must be a number of seconds" >&2; exit 2; }
echo "start wait: $START_WAIT_SECS s ($N stages one after another, each 60 s per started 6 GiB of EIF (nitro-cli's boot timeout) + 30 s + 1 s per 100 MiB; + 10 s)"
echo "kubernetes runner memory limit: at least $(( eif_mib + 256 ))Mi (the EIF, which nitro-cli holds while it loads it, + 256 MiB)"
echo "== parent: /etc/nitro_enclaves/allocator.yaml for this pipeline (add the other pipeline's, if any):"
echo "memory_mib: $total_mem"
echo "cpu_count: $total_cpus"
echo "instance: at least $need_vcpus vCPUs ($total_cpus for the enclaves, CPU 0 and its sibling for the parent) and $need_mib MiB: $instance"
if [[ "$TASK" == completion ]]; then
  echo "note: these stages are the config's [completions] pipeline: $CONFIG must have one, and its"
  echo "      [pipeline] (embeddings) enclaves must run too (docs/deploy-nitro.md, two pipelines)."
fi

runner_env=(EIF="$EIF" CID_BASE="$CID_BASE" STAGES="$N" ENCLAVE_CPUS="$cpus"
  ENCLAVE_MEMORY_MIB="$(IFS=,; echo "${mems[*]}")" ROUTES="${routes[*]}" DEBUG_MODE="$DEBUG_MODE"
  GATEWAY="$GATEWAY")
for v in START_LOCK LOG_DIR BACKOFF_MIN_SECS BACKOFF_MAX_SECS; do
  [[ -z "${!v+set}" ]] || runner_env+=("$v=${!v}")
done
echo "== enclaves and host proxy ($RUNNER)"
if [[ $DRY_RUN == 1 ]]; then
  env "${runner_env[@]}" DRY_RUN=1 sh "$RUNNER"
else
  state="$(mktemp -d)"
  # The runner and the enclave processes nitro-cli leaves must not hold the
  # gateway's lock (fd 9): only this script and its gateway do.
  env "${runner_env[@]}" READY_FILE="$state/ready" HEARTBEAT_FILE="$state/heartbeat" sh "$RUNNER" 9>&- &
  runner=$!
  # TERM makes the runner terminate its enclaves and the proxy.
  trap 'kill -TERM $runner 2>/dev/null; wait $runner 2>/dev/null; rm -rf "$state"' EXIT
  logs="${LOG_DIR:-/tmp/enclave-runner}"
  for _ in $(seq 1 "$START_WAIT_SECS"); do
    [[ -f "$state/ready" ]] && break
    kill -0 $runner 2>/dev/null || { echo "run-nitro: the enclave runner stopped (see its log above, and $logs/stage-*.last-error)" >&2; exit 1; }
    sleep 1
  done
  [[ -f "$state/ready" ]] || { echo "run-nitro: the enclaves were not all RUNNING after $START_WAIT_SECS s (START_WAIT_SECS; see $logs and nitro-cli describe-enclaves)" >&2; exit 1; }
fi
if [[ $NO_GATEWAY == 1 ]]; then
  echo "== no gateway (--no-gateway): this pipeline's enclaves and host proxy run; the parent's gateway serves them"
  [[ $DRY_RUN == 1 ]] || wait $runner
  exit 0
fi
echo "== gateway ($CONFIG)"
run env "${env_over[@]}" "$GATEWAY" serve --config "$CONFIG"
