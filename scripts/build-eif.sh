#!/usr/bin/env bash
# Builds the Nitro enclave image (EIF) of one pipeline and writes its PCRs
# into a gateway policy (docs/deploy-nitro.md):
#
#   1. a static musl build of enclave-stage with the `nitro` feature
#      (target dir target/static-nitro), reproducible: `--locked`,
#      SOURCE_DATE_EPOCH (the last commit's time unless set), RUSTFLAGS
#      remapping cargo home, the toolchain and the target dir, and musl-gcc's
#      -ffile-prefix-map the same (docs/deploy-nitro.md, "Reproducible
#      builds"); scripts/test-reproducible-build.sh checks it;
#   2. the stage image (docker/enclave-stage.Dockerfile, MODEL build arg)
#      with the in-enclave policy, its context's files at SOURCE_DATE_EPOCH
#      with fixed modes (docker COPY keeps mtimes; owner is root), and on top
#      of it the enclave image whose
#      CMD is the whole command line: nitro-cli takes CMD alone when an image
#      has one (with its ENV) and never joins it to ENTRYPOINT, so the
#      enclave image clears ENTRYPOINT and its CMD starts with the program
#      (USER and WORKDIR are not carried into an enclave either: the stage
#      runs as root in /). It runs the stage on vsock with `--attestation
#      nitro` and `--threads` (default 0: every CPU the enclave gets); every
#      stage of the pipeline runs this one image, its index taken from its
#      vsock CID (`--stage-from-cid CID_BASE`), so the in-enclave policy
#      accepts neighbours by `trust_same_image` (it cannot pin its own PCRs);
#   3. `nitro-cli build-enclave` (signed when --signing-certificate and
#      --private-key are given: PCR8), its JSON output kept in
#      OUT/build-enclave.json and `nitro-cli --version` in OUT/nitro-cli.version
#      (PCR0/1 depend on the nitro-cli release: its kernel and init);
#   4. OUT/policy.toml: the gateway's policy (allow_mock = false, the model
#      manifest pinned, PCR0/1/2 of the EIF for every stage, PCR8 too when
#      nitro-cli reports one).
# Every build writes OUT/build-record.json (scripts/build_record.py): the
# binary's sha256, the inputs' digests, the toolchain, and the image layers
# and PCRs where they were made; `gateway policy from-build` reads it.
#
# Usage: scripts/build-eif.sh [options]
#   --model DIR          model folder (default models/all-minilm-l6-v2;
#                        models/smollm2-135m-instruct for completions)
#   --layers LIST        one START..END per stage (default 0..3,3..6;
#                        completions: 0..15,15..30)
#   --cid-base N         CID of stage 0; stage i runs with CID N+i (default 16)
#   --port N             vsock port the stages listen on (default 9000)
#   --threads N          the stage's --threads in the CMD (default 0: one per
#                        enclave CPU)
#   --stage-args "..."   extra stage flags baked into the CMD (e.g.
#                        "--kv-cache-tokens 16384" for completions)
#   --signing-certificate FILE --private-key KEY
#                        sign the EIF (nitro-cli build-enclave's options of
#                        the same names; KEY a PEM file or a KMS key ARN):
#                        the policy then pins PCR8, the signer's certificate
#   --name NAME          output folder target/eif/NAME and image tag (default:
#                        the model folder's name)
#   --prefix PREFIX      image name prefix (default confidential-inference)
#   --dry-run            print the commands instead of running them
#   --image-only         steps 1-2 only: the enclave image, no nitro-cli (for
#                        scripts/test-enclave-image.sh, which runs it here)
#   --binary-only        step 1 only: OUT/enclave-stage (the binary exactly as
#                        the image gets it), OUT/stage-policy.toml (the
#                        in-enclave policy) and OUT/build-record.json; no docker
#   --out DIR            output folder (default target/eif/NAME)
#   --target-dir DIR     cargo's target dir for step 1 (default
#                        target/static-nitro)
#   --no-cache           docker build --no-cache (every layer made afresh:
#                        what a reproducibility check compares)
#   --policy-from FILE   only step 4: read nitro-cli's output from FILE and
#                        write the policy (to --policy-out, default OUT/policy.toml)
#   --policy-out FILE    where step 4 writes the policy
#   --log DIR            log the build's release in the transparency log in
#                        DIR (`gateway log add-release`, docs/transparency.md):
#                        the EIF's PCRs, or for --binary-only / --image-only
#                        builds the binary's mock measurement under the
#                        image's own in-enclave policy. A --debug-policy
#                        image is not a release and is not logged. Runs
#                        $GATEWAY (default target/release/gateway).
#   --debug-policy       a FIRST BRING-UP image (docs/deploy-nitro.md): the
#                        in-enclave policy and the gateway's accept Nitro
#                        debug-mode enclaves (allow_debug = true; PCRs zero,
#                        the parent can read their memory), so that the
#                        stages started with run-nitro.sh --debug-mode (the
#                        only mode with a console) form a pipeline. The
#                        gateway's policy pins the all-zero PCRs beside the
#                        EIF's own. An enclave not in debug mode ignores
#                        allow_debug (it never trusts a debug neighbour).
#                        Default --name: the model's name + "-debug"; the
#                        record says debug_policy. Every production policy
#                        refuses debug enclaves (allow_debug = false) and
#                        this image's PCRs (its in-enclave policy differs).
# Writes OUT/eif.env (EIF, POLICY, MODEL_DIR, LAYERS, CID_BASE, PORT,
# NITRO_CLI_VERSION) for scripts/run-nitro.sh. Needs docker and nitro-cli (AWS
# Nitro Enclaves CLI) unless --dry-run, --image-only (docker only),
# --binary-only (neither) or --policy-from; says so and exits 1 if one is
# missing. The musl target and musl-gcc: scripts/ensure-musl.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

MODEL_DIR=models/all-minilm-l6-v2
LAYERS=0..3,3..6
CID_BASE=16
PORT=9000
STAGE_ARGS=""
THREADS=0
SIGN_CERT=""
SIGN_KEY=""
IMAGE_ONLY=0
BINARY_ONLY=0
NO_CACHE=()
OUT=""
STATIC_DIR=target/static-nitro
NAME=""
PREFIX=confidential-inference
DRY_RUN=0
POLICY_FROM=""
POLICY_OUT=""
DEBUG_POLICY=0
LOG_DIR=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL_DIR="$2"; shift 2 ;;
    --layers) LAYERS="$2"; shift 2 ;;
    --cid-base) CID_BASE="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --stage-args) STAGE_ARGS="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --signing-certificate) SIGN_CERT="$2"; shift 2 ;;
    --private-key) SIGN_KEY="$2"; shift 2 ;;
    --image-only) IMAGE_ONLY=1; shift ;;
    --binary-only) BINARY_ONLY=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --target-dir) STATIC_DIR="$2"; shift 2 ;;
    --no-cache) NO_CACHE=(--no-cache); shift ;;
    --name) NAME="$2"; shift 2 ;;
    --prefix) PREFIX="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --policy-from) POLICY_FROM="$2"; shift 2 ;;
    --policy-out) POLICY_OUT="$2"; shift 2 ;;
    --debug-policy) DEBUG_POLICY=1; shift ;;
    --log) LOG_DIR="$2"; shift 2 ;;
    -h|--help) sed -n '2,91p' "$0"; exit 0 ;;
    *) echo "build-eif: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
MODEL_DIR="${MODEL_DIR%/}"
model="$(basename "$MODEL_DIR")"
if [[ $DEBUG_POLICY == 1 ]]; then NAME="${NAME:-$model-debug}"; else NAME="${NAME:-$model}"; fi
[[ "$NAME" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || { echo "build-eif: bad --name: $NAME" >&2; exit 2; }
[[ "$LAYERS" =~ ^[0-9]+\.\.[0-9]+(,[0-9]+\.\.[0-9]+)*$ ]] || { echo "build-eif: bad --layers: $LAYERS" >&2; exit 2; }
[[ "$CID_BASE" =~ ^[0-9]+$ && "$CID_BASE" -ge 4 ]] || { echo "build-eif: --cid-base must be a number >= 4 (0-3 are reserved)" >&2; exit 2; }
[[ "$THREADS" =~ ^[0-9]+$ ]] || { echo "build-eif: --threads takes a number (0: one per enclave CPU)" >&2; exit 2; }
[[ -n "$SIGN_CERT" && -z "$SIGN_KEY" || -z "$SIGN_CERT" && -n "$SIGN_KEY" ]] \
  && { echo "build-eif: --signing-certificate and --private-key go together" >&2; exit 2; }
[[ -z "$SIGN_CERT" || -f "$SIGN_CERT" ]] || { echo "build-eif: no certificate at $SIGN_CERT" >&2; exit 1; }
[[ -f "$MODEL_DIR/manifest.json" ]] || { echo "build-eif: no $MODEL_DIR/manifest.json; run scripts/setup.sh first" >&2; exit 1; }
OUT="${OUT:-target/eif/$NAME}"
OUT="${OUT%/}"
[[ $IMAGE_ONLY == 1 && $BINARY_ONLY == 1 ]] && { echo "build-eif: --image-only or --binary-only, not both" >&2; exit 2; }
POLICY_OUT="${POLICY_OUT:-$OUT/policy.toml}"
MANIFEST_SHA256="$(sha256sum "$MODEL_DIR/manifest.json" | cut -d' ' -f1)"

# The [[stages]] entries (index and layers) for LAYERS.
stage_entries() {
  local i=0 r
  IFS=',' read -ra ranges <<<"$LAYERS"
  for r in "${ranges[@]}"; do
    printf '\n[[stages]]\nindex = %d\nlayers = [%s, %s]\nmeasurements = []\n' "$i" "${r%%..*}" "${r##*..}"
    [[ -n "${1:-}" ]] && printf '%s\n' "$1"
    i=$((i + 1))
  done
}

# The banner at the top of every --debug-policy policy.
DEBUG_BANNER='# DEBUG POLICY (scripts/build-eif.sh --debug-policy), FOR A FIRST BRING-UP
# ONLY: it accepts Nitro enclaves in debug mode, whose PCRs read zero and
# whose memory the parent instance can read. Never serve clients with it;
# every production policy (allow_debug = false) refuses these enclaves.'

# Step 4: nitro-cli's output (text with one JSON object) -> policy file.
write_policy() {
  local from="$1" out="$2" pcrs version="" zero
  [[ -f "$(dirname "$from")/nitro-cli.version" ]] && version="$(head -n1 "$(dirname "$from")/nitro-cli.version")"
  pcrs="$(python3 scripts/build_record.py pcrs "$from")" || exit 1
  mkdir -p "$(dirname "$out")"
  if [[ $DEBUG_POLICY == 1 ]]; then
    zero="$(printf '%096d' 0)"
    {
      printf '%s\n' "$DEBUG_BANNER"
      cat <<EOT
# Written from nitro-cli build-enclave's output ($from${version:+, $version}).
# Every stage may run the EIF in debug mode (all PCRs zero) or not (its PCRs).
allow_mock = false
allow_debug = true
manifest_sha256 = "$MANIFEST_SHA256"
EOT
      stage_entries "$(printf '\n[[stages.nitro]]\npcr0 = "%s"\npcr1 = "%s"\npcr2 = "%s"\n\n[[stages.nitro]]\n%s\n' "$zero" "$zero" "$zero" "$pcrs")"
    } >"$out"
    echo "build-eif: wrote $out (DEBUG POLICY: accepts debug-mode enclaves)"
    return
  fi
  {
    cat <<EOT
# Written by scripts/build-eif.sh from nitro-cli build-enclave's output
# ($from${version:+, $version}). Every stage runs the same EIF, so every
# stage pins the same PCRs. Nitro evidence only; debug-mode enclaves (PCRs
# zero) are refused.
allow_mock = false
allow_debug = false
manifest_sha256 = "$MANIFEST_SHA256"
EOT
    stage_entries "$(printf '\n[[stages.nitro]]\n%s\n' "$pcrs")"
  } >"$out"
  echo "build-eif: wrote $out"
}

if [[ -n "$POLICY_FROM" ]]; then
  write_policy "$POLICY_FROM" "$POLICY_OUT"
  exit 0
fi

run() {
  if [[ $DRY_RUN == 1 ]]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

if [[ $DRY_RUN == 0 && $IMAGE_ONLY == 0 && $BINARY_ONLY == 0 ]]; then
  command -v nitro-cli >/dev/null || {
    echo "build-eif: nitro-cli is not installed: it runs on an AWS Nitro Enclaves parent instance" >&2
    echo "  (Amazon Linux: dnf install aws-nitro-enclaves-cli; see docs/deploy-nitro.md)." >&2
    echo "  --dry-run prints the commands; --policy-from FILE writes a policy from saved output." >&2
    exit 1
  }
fi
if [[ $DRY_RUN == 0 ]]; then
  [[ $BINARY_ONLY == 1 ]] || command -v docker >/dev/null || { echo "build-eif: docker is not installed" >&2; exit 1; }
  command -v musl-gcc >/dev/null || { echo "build-eif: musl-gcc not found (Debian: apt-get install musl-tools)" >&2; exit 1; }
fi

TARGET=x86_64-unknown-linux-musl
STATIC_DIR="${STATIC_DIR%/}"
BIN="$STATIC_DIR/$TARGET/release/enclave-stage"
BASE_IMAGE="$PREFIX/enclave-stage-nitro-base:$NAME"
EIF_IMAGE="$PREFIX/enclave-stage-nitro:$NAME"
EIF="$OUT/stage.eif"

# The in-enclave policy: neighbours are accepted when they run this same
# image (trust_same_image) and claim the layers below.
stage_policy() {
  [[ $DEBUG_POLICY == 0 ]] || printf '%s\n# A debug-mode stage accepts debug-mode neighbours (their PCRs, like its\n# own, read zero); a stage not in debug mode ignores allow_debug.\n' "$DEBUG_BANNER"
  cat <<EOT
# Inside the enclave (written by scripts/build-eif.sh): a neighbour must be a
# Nitro enclave running this same image (its PCRs cannot be pinned in the
# image itself) and claim the layers below.
allow_mock = false
allow_debug = $([[ $DEBUG_POLICY == 1 ]] && echo true || echo false)
trust_same_image = true
manifest_sha256 = "$MANIFEST_SHA256"
EOT
  stage_entries
}

# The enclave's whole command line (nitro-cli runs CMD alone).
cmd_json() {
  local a out='"/enclave-stage", "--policy", "/config/policy.toml", "--attestation", "nitro", "--listen", "vsock://any:'"$PORT"'", "--stage-from-cid", "'"$CID_BASE"'", "--layers", "'"$LAYERS"'", "--threads", "'"$THREADS"'"'
  for a in $STAGE_ARGS; do out+=", \"$a\""; done
  echo "[$out]"
}

# The source: its commit, whether tracked files differ from it, and
# SOURCE_DATE_EPOCH (the commit's time unless the environment sets it; a
# copy without .git, as scripts/test-reproducible-build.sh makes, sets it).
COMMIT=""
DIRTY=""
if [[ "$(git rev-parse --show-toplevel 2>/dev/null)" == "$(pwd -P)" ]]; then
  COMMIT="$(git rev-parse HEAD)"
  DIRTY=no
  [[ -z "$(git status --porcelain --untracked-files=no)" ]] || DIRTY=yes
  SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct)}"
fi
if [[ -z "${SOURCE_DATE_EPOCH:-}" ]]; then
  if [[ $DRY_RUN == 1 ]]; then SOURCE_DATE_EPOCH=0; else
    echo "build-eif: not a git checkout: set SOURCE_DATE_EPOCH (the source commit's time, in seconds)" >&2
    exit 1
  fi
fi
[[ "$SOURCE_DATE_EPOCH" =~ ^[0-9]+$ ]] || { echo "build-eif: SOURCE_DATE_EPOCH is not a number of seconds" >&2; exit 2; }
export SOURCE_DATE_EPOCH
[[ $DIRTY != yes ]] || echo "build-eif: WARNING: tracked files differ from commit $COMMIT (the record says dirty)" >&2

# Paths of this machine out of the binary: cargo's registry sources (panic
# locations of dependencies), the toolchain's and the target dir's (code
# included from build scripts' OUT_DIR) are remapped to fixed names.
# Workspace crates are compiled from relative paths, so the checkout's folder
# does not reach the binary (scripts/test-reproducible-build.sh checks both).
# RUSTFLAGS from the environment would change the binary: replaced.
CARGO_HOME_DIR="${CARGO_HOME:-$HOME/.cargo}"
if [[ $DRY_RUN == 0 ]]; then
  mkdir -p "$STATIC_DIR"
  TARGET_DIR_ABS="$(cd "$STATIC_DIR" && pwd)"
  SYSROOT="$(rustc --print sysroot)"
else
  TARGET_DIR_ABS="$STATIC_DIR"
  SYSROOT='$(rustc --print sysroot)'
fi
[[ -z "${RUSTFLAGS:-}${CARGO_ENCODED_RUSTFLAGS:-}" ]] || echo "build-eif: RUSTFLAGS from the environment replaced (a reproducible build sets its own)" >&2
unset CARGO_ENCODED_RUSTFLAGS
export RUSTFLAGS="--remap-path-prefix=$CARGO_HOME_DIR=/cargo --remap-path-prefix=$SYSROOT=/rustup-toolchain --remap-path-prefix=$TARGET_DIR_ABS=/target"
export CFLAGS_x86_64_unknown_linux_musl="-ffile-prefix-map=$CARGO_HOME_DIR=/cargo -ffile-prefix-map=$TARGET_DIR_ABS=/target"
export CC_x86_64_unknown_linux_musl="${CC_x86_64_unknown_linux_musl:-musl-gcc}"
# The same, as the record says them (no machine paths).
RUSTFLAGS_RECORD='--remap-path-prefix=$CARGO_HOME=/cargo --remap-path-prefix=$(rustc --print sysroot)=/rustup-toolchain --remap-path-prefix=$CARGO_TARGET_DIR=/target'
CFLAGS_RECORD='-ffile-prefix-map=$CARGO_HOME=/cargo -ffile-prefix-map=$CARGO_TARGET_DIR=/target'
CARGO_ARGS=(build --release --locked --target "$TARGET" -p enclave-stage --features nitro)
DEBUG_FLAG=()
[[ $DEBUG_POLICY == 0 ]] || DEBUG_FLAG=(--debug-policy)

# OUT/build-record.json for the binary $1 and the in-enclave policy $2, with
# scripts/build_record.py's further options (image, nitro-cli output).
write_record() {
  local bin="$1" pol="$2"
  shift 2
  python3 scripts/build_record.py write --out "$OUT/build-record.json" --binary "$bin" \
    --model-dir "$MODEL_DIR" --stage-policy "$pol" --layers "$LAYERS" --cmd "$(cmd_json)" \
    --commit "$COMMIT" --dirty "$DIRTY" --source-date-epoch "$SOURCE_DATE_EPOCH" \
    --command "cargo ${CARGO_ARGS[*]}" --target "$TARGET" --features nitro \
    --rustflags "$RUSTFLAGS_RECORD" --cflags "$CFLAGS_RECORD" --cc "$CC_x86_64_unknown_linux_musl" \
    ${DEBUG_FLAG[@]+"${DEBUG_FLAG[@]}"} "$@"
}

# With --log: the release in OUT/build-record.json appended to the log
# (add-release's further options: --mock for builds without PCRs).
log_release() {
  [[ -n "$LOG_DIR" ]] || return 0
  if [[ $DEBUG_POLICY == 1 ]]; then
    echo "build-eif: --log: a --debug-policy image is not a release: not logged" >&2
    return 0
  fi
  local gw="${GATEWAY:-target/release/gateway}" version=()
  [[ -x "$gw" ]] || { echo "build-eif: --log needs the gateway binary ($gw; cargo build --release, or set GATEWAY)" >&2; exit 1; }
  # Not a git checkout: the record names no commit, so say what it was built from.
  [[ -n "$COMMIT" ]] || version=(--version "source without git, SOURCE_DATE_EPOCH $SOURCE_DATE_EPOCH")
  if [[ $DRY_RUN == 1 ]]; then
    echo "+ $gw log add-release --dir $LOG_DIR $OUT/build-record.json $* ${version[*]}"
    return 0
  fi
  "$gw" log add-release --dir "$LOG_DIR" "$OUT/build-record.json" "$@" ${version[@]+"${version[@]}"}
}

# docker COPY keeps a file's mtime and mode (the owner is root:root): both
# fixed here, so that the same inputs give the same layer (one `COPY . /`:
# the folders it creates come from here too, not from the time of the build).
normalize_context() {
  find "$1" -type d -exec chmod 0755 {} +
  find "$1" -type f -exec chmod 0644 {} +
  chmod 0755 "$1/enclave-stage"
  find "$1" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
}

echo "== static build with the nitro feature ($TARGET, $STATIC_DIR, SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH)"
[[ $DRY_RUN == 0 ]] || echo "+ RUSTFLAGS=$RUSTFLAGS"
run cargo "${CARGO_ARGS[@]}" --target-dir "$STATIC_DIR"
if [[ $BINARY_ONLY == 1 ]]; then
  if [[ $DRY_RUN == 1 ]]; then
    echo "+ (copy $BIN to $OUT/enclave-stage; write $OUT/stage-policy.toml and $OUT/build-record.json)"
    log_release --mock
    exit 0
  fi
  mkdir -p "$OUT"
  cp "$BIN" "$OUT/enclave-stage"
  stage_policy >"$OUT/stage-policy.toml"
  write_record "$OUT/enclave-stage" "$OUT/stage-policy.toml"
  log_release --mock
  echo "build-eif: $OUT/enclave-stage sha256 $(sha256sum "$OUT/enclave-stage" | cut -d' ' -f1); record $OUT/build-record.json"
  exit 0
fi
echo "== build context $OUT/stage"
if [[ $DRY_RUN == 0 ]]; then
  rm -rf "$OUT/stage"; mkdir -p "$OUT/stage/models" "$OUT/stage/config"
  cp "$BIN" "$OUT/stage/enclave-stage"
  cp -rL "$MODEL_DIR" "$OUT/stage/models/$model"
  stage_policy >"$OUT/stage/config/policy.toml"
  normalize_context "$OUT/stage"
  printf 'FROM %s\nENTRYPOINT []\nCMD %s\n' "$BASE_IMAGE" "$(cmd_json)" >"$OUT/enclave.Dockerfile"
else
  echo "+ (copy $BIN, $MODEL_DIR, the in-enclave policy into $OUT/stage)"
  echo "+ (the in-enclave policy, /config/policy.toml:"
  stage_policy | sed 's/^/+   /'
  echo "+ )"
  echo "+ (write $OUT/enclave.Dockerfile: FROM $BASE_IMAGE; ENTRYPOINT []; CMD $(cmd_json))"
fi
run docker build -q ${NO_CACHE[@]+"${NO_CACHE[@]}"} -f docker/enclave-stage.Dockerfile --build-arg "MODEL=$model" -t "$BASE_IMAGE" "$OUT/stage"
run docker build -q ${NO_CACHE[@]+"${NO_CACHE[@]}"} -f "$OUT/enclave.Dockerfile" -t "$EIF_IMAGE" "$OUT"
if [[ $IMAGE_ONLY == 1 ]]; then
  [[ $DRY_RUN == 1 ]] || write_record "$OUT/stage/enclave-stage" "$OUT/stage/config/policy.toml" --image "$EIF_IMAGE"
  log_release --mock
  echo "build-eif: enclave image $EIF_IMAGE (no EIF: --image-only); record $OUT/build-record.json"
  exit 0
fi
echo "== nitro-cli build-enclave"
SIGN=()
[[ -n "$SIGN_CERT" ]] && SIGN=(--signing-certificate "$SIGN_CERT" --private-key "$SIGN_KEY")
if [[ $DRY_RUN == 1 ]]; then
  run nitro-cli build-enclave --docker-uri "$EIF_IMAGE" --output-file "$EIF" ${SIGN[@]+"${SIGN[@]}"}
  echo "+ (write $POLICY_OUT from its output, $OUT/build-enclave.json, and $OUT/build-record.json)"
  exit 0
fi
nitro-cli --version >"$OUT/nitro-cli.version"
nitro-cli build-enclave --docker-uri "$EIF_IMAGE" --output-file "$EIF" ${SIGN[@]+"${SIGN[@]}"} | tee "$OUT/build-enclave.json"
write_policy "$OUT/build-enclave.json" "$POLICY_OUT"
write_record "$OUT/stage/enclave-stage" "$OUT/stage/config/policy.toml" --image "$EIF_IMAGE" \
  --nitro-output "$OUT/build-enclave.json" --nitro-cli-version "$(head -n1 "$OUT/nitro-cli.version")"
log_release
if [[ -n "$SIGN_CERT" ]] && ! grep -q '^pcr8 = ' "$POLICY_OUT"; then
  echo "build-eif: the EIF was signed but nitro-cli reported no PCR8" >&2
  exit 1
fi
cat >"$OUT/eif.env" <<EOT
EIF=$EIF
POLICY=$POLICY_OUT
MODEL_DIR=$MODEL_DIR
LAYERS=$LAYERS
CID_BASE=$CID_BASE
PORT=$PORT
DEBUG_POLICY=$DEBUG_POLICY
NITRO_CLI_VERSION="$(head -n1 "$OUT/nitro-cli.version")"
EOT
if [[ $DEBUG_POLICY == 1 ]]; then
  echo "build-eif: $EIF is a DEBUG-POLICY image (first bring-up only); run it with scripts/run-nitro.sh --build $OUT --debug-mode"
else
  echo "build-eif: $EIF; PCRs in $POLICY_OUT; run it with scripts/run-nitro.sh --build $OUT"
fi
