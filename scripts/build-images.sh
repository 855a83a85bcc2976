#!/usr/bin/env bash
# Builds the container images (see docs/containers.md):
#
#   $PREFIX/enclave-stage:$TAG  FROM scratch: the static enclave-stage binary,
#                               the model files and the policy (the input to
#                               `nitro-cli build-enclave`, and the compose stages)
#   $PREFIX/gateway:$TAG        FROM scratch: the static gateway binary, its
#                               remote-launch config (docker/gateway.toml), the
#                               policy and the model manifest
#
# Both binaries are a static musl release build (x86_64-unknown-linux-musl,
# target dir target/static, without the test-only fault-injection feature).
# The gateway image's policy pins the mock measurement of exactly the stage
# binary, model manifest and stage policy copied into the stage image,
# computed here from the files (`gateway measure`), never from what a
# container reports; it does not trust the local build. The stage image's
# own policy accepts neighbours of its own measurement.
#
# Usage: scripts/build-images.sh [--tag TAG] [--prefix PREFIX] [--log DIR]
#   TAG     image tag (default: latest)
#   PREFIX  image name prefix (default: confidential-inference)
#   DIR     a transparency log's folder (`gateway log init`): the stage image's release (its mock
#           measurement, layers and manifest) is appended to it with `gateway
#           log add-release --mock`, from target/images/$TAG/build-record.json
#           (scripts/build_record.py), so that a client can pin the images
#           with `gateway policy pin --log-key` (docs/transparency.md)
# Environment: MODEL_DIR (default models/all-minilm-l6-v2, from scripts/setup.sh).
#
# Writes target/images/$TAG/: policy.toml (the gateway's policy; the stage's
# is stage/config/policy.toml), measurement
# (mock:<hex>), images.env (IMAGE_PREFIX, IMAGE_TAG, STAGE_IMAGE,
# GATEWAY_IMAGE, MEASUREMENT), build-record.json (what the stage image was
# built from) and the two build contexts.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TAG=latest
PREFIX=confidential-inference
LOG_DIR=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tag) TAG="$2"; shift 2 ;;
    --prefix) PREFIX="$2"; shift 2 ;;
    --log) LOG_DIR="$2"; shift 2 ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$TAG" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || { echo "bad --tag: $TAG" >&2; exit 2; }
MODEL_DIR="${MODEL_DIR:-models/all-minilm-l6-v2}"
TARGET=x86_64-unknown-linux-musl
STATIC_DIR=target/static

command -v docker >/dev/null || { echo "build-images: docker is not installed" >&2; exit 1; }
[[ -f "$MODEL_DIR/manifest.json" ]] || { echo "build-images: no $MODEL_DIR/manifest.json; run scripts/setup.sh first" >&2; exit 1; }

# The musl std for the toolchain in use (rustup fetches it once).
if ! rustc --print sysroot >/dev/null 2>&1 || [[ ! -d "$(rustc --print sysroot)/lib/rustlib/$TARGET" ]]; then
  rustup target add "$TARGET" || {
    echo "build-images: the $TARGET standard library is missing and rustup could not fetch it" >&2
    exit 1
  }
fi
# ring (rustls, in the gateway) compiles C for the target: Debian's musl-tools.
command -v musl-gcc >/dev/null || {
  echo "build-images: musl-gcc not found; install it (Debian: apt-get install musl-tools)" >&2
  exit 1
}
export CC_x86_64_unknown_linux_musl="${CC_x86_64_unknown_linux_musl:-musl-gcc}"

echo "== static build ($TARGET, $STATIC_DIR)"
start=$(date +%s)
cargo build --release --locked --target "$TARGET" --target-dir "$STATIC_DIR" -p enclave-stage -p gateway
echo "static build: $(( $(date +%s) - start )) s"
BIN="$STATIC_DIR/$TARGET/release"
for b in enclave-stage gateway; do
  # A dynamically linked binary cannot run in a FROM scratch image.
  if ldd "$BIN/$b" >/dev/null 2>&1 && ! ldd "$BIN/$b" 2>&1 | grep -q 'statically linked'; then
    echo "build-images: $BIN/$b is not statically linked" >&2
    ldd "$BIN/$b" >&2
    exit 1
  fi
done

OUT="target/images/$TAG"
rm -rf "$OUT"
mkdir -p "$OUT/stage/models" "$OUT/stage/config" "$OUT/gateway/models"
model="$(basename "$MODEL_DIR")"
cp "$BIN/enclave-stage" "$OUT/stage/enclave-stage"
cp -rL "$MODEL_DIR" "$OUT/stage/models/$model"
cp "$BIN/gateway" "$OUT/gateway/gateway"
mkdir -p "$OUT/gateway/models/$model"
cp "$MODEL_DIR/manifest.json" "$OUT/gateway/models/$model/manifest.json"
cp docker/gateway.toml "$OUT/gateway/gateway.toml"
# An empty folder the image gives the gateway user for its receipt store.
mkdir -p "$OUT/gateway/data"

# The policy tables of the two stages (MiniLM's layers 0-3 and 3-6), each
# accepting the measurements listed in $1 (TOML strings, comma-separated).
stage_tables() {
  printf '[[stages]]\nindex = %d\nlayers = %s\nmeasurements = [%s]\n\n' \
    0 "[0, 3]" "$1" 1 "[3, 6]" "$1"
}

MANIFEST_SHA256="$(sha256sum "$OUT/stage/models/$model/manifest.json" | cut -d' ' -f1)"
# The stages' own policy (baked into the stage image): mock evidence, peers
# must be this same build (the stage's own measurement). It cannot pin that
# measurement itself: the measurement covers this very file.
cat >"$OUT/stage/config/policy.toml" <<EOF
# Written by scripts/build-images.sh for $PREFIX/enclave-stage:$TAG: the
# policy each stage judges its neighbours by. MOCK evidence is accepted (no
# enclave hardware in containers); a neighbour must report this stage's own
# measurement (binary, model manifest and this file).
allow_mock = true
trust_local_build = true
manifest_sha256 = "$MANIFEST_SHA256"

$(stage_tables "")
EOF
# The measurement of the binary, manifest and stage policy in the stage image.
MEASUREMENT="$("$BIN/gateway" measure --stage-binary "$OUT/stage/enclave-stage" \
  --model-dir "$OUT/stage/models/$model" --stage-policy "$OUT/stage/config/policy.toml")"
cat >"$OUT/policy.toml" <<EOF
# Written by scripts/build-images.sh for the images tagged $TAG: the
# gateway's policy. MOCK evidence: the containers run without enclave
# hardware, and their documents are signed by a public mock key. What this
# policy does pin is the measurement of the exact stage binary, model
# manifest and stage policy baked into $PREFIX/enclave-stage:$TAG, computed
# on the build host from those files.
allow_mock = true
trust_local_build = false
manifest_sha256 = "$MANIFEST_SHA256"

$(stage_tables "\"$MEASUREMENT\"")
EOF
cp "$OUT/policy.toml" "$OUT/gateway/policy.toml"
echo "$MEASUREMENT" >"$OUT/measurement"

# The stage image's build record: what it was built from, for a rebuild to
# compare and for the log's release entry.
COMMIT="$(git rev-parse HEAD 2>/dev/null || true)"
DIRTY=""
[[ -z "$COMMIT" ]] || { [[ -z "$(git status --porcelain 2>/dev/null)" ]] && DIRTY=no || DIRTY=yes; }
python3 scripts/build_record.py write --out "$OUT/build-record.json" --binary "$OUT/stage/enclave-stage" \
  --model-dir "$OUT/stage/models/$model" --stage-policy "$OUT/stage/config/policy.toml" \
  --layers 0..3,3..6 --commit "$COMMIT" --dirty "$DIRTY" \
  --source-date-epoch "${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}" \
  --command "cargo build --release --locked --target $TARGET -p enclave-stage -p gateway" \
  --target "$TARGET"
if [[ -n "$LOG_DIR" ]]; then
  version=()
  [[ -n "$COMMIT" ]] || version=(--version "source without git")
  "$BIN/gateway" log add-release --dir "$LOG_DIR" "$OUT/build-record.json" --mock ${version[@]+"${version[@]}"}
  # The entries logged are this very measurement's (computed from the files above).
  "$BIN/gateway" log entries --dir "$LOG_DIR" | grep -q "${MEASUREMENT#mock:}" || {
    echo "build-images: the log holds no release entry with measurement $MEASUREMENT" >&2
    exit 1
  }
fi

STAGE_IMAGE="$PREFIX/enclave-stage:$TAG"
GATEWAY_IMAGE="$PREFIX/gateway:$TAG"
echo "== docker build $STAGE_IMAGE"
docker build -q -f docker/enclave-stage.Dockerfile --build-arg "MODEL=$model" -t "$STAGE_IMAGE" "$OUT/stage"
echo "== docker build $GATEWAY_IMAGE"
docker build -q -f docker/gateway.Dockerfile -t "$GATEWAY_IMAGE" "$OUT/gateway"
printf '%s\n' "IMAGE_PREFIX=$PREFIX" "IMAGE_TAG=$TAG" "STAGE_IMAGE=$STAGE_IMAGE" \
  "GATEWAY_IMAGE=$GATEWAY_IMAGE" "MEASUREMENT=$MEASUREMENT" >"$OUT/images.env"
echo "built $STAGE_IMAGE and $GATEWAY_IMAGE; stage measurement $MEASUREMENT (policy: $OUT/policy.toml)"
