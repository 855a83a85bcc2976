#!/usr/bin/env bash
# Builds the Nitro enclave image (EIF) of one pipeline and writes its PCRs
# into a gateway policy (docs/deploy-nitro.md):
#
#   1. a static musl build of enclave-stage with the `nitro` feature
#      (target dir target/static-nitro);
#   2. the stage image (docker/enclave-stage.Dockerfile, MODEL build arg)
#      with the in-enclave policy, and on top of it the enclave image whose
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
#   --policy-from FILE   only step 4: read nitro-cli's output from FILE and
#                        write the policy (to --policy-out, default OUT/policy.toml)
#   --policy-out FILE    where step 4 writes the policy
# Writes OUT/eif.env (EIF, POLICY, MODEL_DIR, LAYERS, CID_BASE, PORT,
# NITRO_CLI_VERSION) for scripts/run-nitro.sh. Needs docker and nitro-cli (AWS
# Nitro Enclaves CLI) unless --dry-run, --image-only or --policy-from; says so
# and exits 1 if either is missing.
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
NAME=""
PREFIX=confidential-inference
DRY_RUN=0
POLICY_FROM=""
POLICY_OUT=""
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
    --name) NAME="$2"; shift 2 ;;
    --prefix) PREFIX="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --policy-from) POLICY_FROM="$2"; shift 2 ;;
    --policy-out) POLICY_OUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,54p' "$0"; exit 0 ;;
    *) echo "build-eif: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
MODEL_DIR="${MODEL_DIR%/}"
model="$(basename "$MODEL_DIR")"
NAME="${NAME:-$model}"
[[ "$NAME" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || { echo "build-eif: bad --name: $NAME" >&2; exit 2; }
[[ "$LAYERS" =~ ^[0-9]+\.\.[0-9]+(,[0-9]+\.\.[0-9]+)*$ ]] || { echo "build-eif: bad --layers: $LAYERS" >&2; exit 2; }
[[ "$CID_BASE" =~ ^[0-9]+$ && "$CID_BASE" -ge 4 ]] || { echo "build-eif: --cid-base must be a number >= 4 (0-3 are reserved)" >&2; exit 2; }
[[ "$THREADS" =~ ^[0-9]+$ ]] || { echo "build-eif: --threads takes a number (0: one per enclave CPU)" >&2; exit 2; }
[[ -n "$SIGN_CERT" && -z "$SIGN_KEY" || -z "$SIGN_CERT" && -n "$SIGN_KEY" ]] \
  && { echo "build-eif: --signing-certificate and --private-key go together" >&2; exit 2; }
[[ -z "$SIGN_CERT" || -f "$SIGN_CERT" ]] || { echo "build-eif: no certificate at $SIGN_CERT" >&2; exit 1; }
[[ -f "$MODEL_DIR/manifest.json" ]] || { echo "build-eif: no $MODEL_DIR/manifest.json; run scripts/setup.sh first" >&2; exit 1; }
OUT="target/eif/$NAME"
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

# Step 4: nitro-cli's output (text with one JSON object) -> policy file.
write_policy() {
  local from="$1" out="$2" pcrs version=""
  [[ -f "$(dirname "$from")/nitro-cli.version" ]] && version="$(head -n1 "$(dirname "$from")/nitro-cli.version")"
  pcrs="$(python3 - "$from" <<'PY'
import json, re, sys
text = open(sys.argv[1]).read()
start = text.find("{")
if start < 0:
    sys.exit(f"{sys.argv[1]}: no JSON object in nitro-cli's output")
try:
    m = json.JSONDecoder().raw_decode(text[start:])[0]["Measurements"]
except (ValueError, KeyError, TypeError) as e:
    sys.exit(f"{sys.argv[1]}: not nitro-cli build-enclave output ({e!r})")
out = []
for k in ("PCR0", "PCR1", "PCR2", "PCR8"):
    v = m.get(k)
    if v is None:
        if k == "PCR8":
            continue
        sys.exit(f"{sys.argv[1]}: no {k} in Measurements")
    if not re.fullmatch(r"[0-9a-fA-F]{96}", v):
        sys.exit(f"{sys.argv[1]}: {k} is not 96 hex digits (SHA-384)")
    out.append(f"{k.lower()} = \"{v.lower()}\"")
print("\n".join(out))
PY
)" || exit 1
  mkdir -p "$(dirname "$out")"
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

if [[ $DRY_RUN == 0 && $IMAGE_ONLY == 0 ]]; then
  command -v nitro-cli >/dev/null || {
    echo "build-eif: nitro-cli is not installed: it runs on an AWS Nitro Enclaves parent instance" >&2
    echo "  (Amazon Linux: dnf install aws-nitro-enclaves-cli; see docs/deploy-nitro.md)." >&2
    echo "  --dry-run prints the commands; --policy-from FILE writes a policy from saved output." >&2
    exit 1
  }
fi
if [[ $DRY_RUN == 0 ]]; then
  command -v docker >/dev/null || { echo "build-eif: docker is not installed" >&2; exit 1; }
  command -v musl-gcc >/dev/null || { echo "build-eif: musl-gcc not found (Debian: apt-get install musl-tools)" >&2; exit 1; }
fi

TARGET=x86_64-unknown-linux-musl
STATIC_DIR=target/static-nitro
BIN="$STATIC_DIR/$TARGET/release/enclave-stage"
BASE_IMAGE="$PREFIX/enclave-stage-nitro-base:$NAME"
EIF_IMAGE="$PREFIX/enclave-stage-nitro:$NAME"
EIF="$OUT/stage.eif"

# The in-enclave policy: neighbours are accepted when they run this same
# image (trust_same_image) and claim the layers below.
stage_policy() {
  cat <<EOT
# Inside the enclave (written by scripts/build-eif.sh): a neighbour must be a
# Nitro enclave running this same image (its PCRs cannot be pinned in the
# image itself) and claim the layers below.
allow_mock = false
allow_debug = false
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

echo "== static build with the nitro feature ($TARGET, $STATIC_DIR)"
export CC_x86_64_unknown_linux_musl="${CC_x86_64_unknown_linux_musl:-musl-gcc}"
run cargo build --release --locked --target "$TARGET" --target-dir "$STATIC_DIR" -p enclave-stage --features nitro
echo "== build context $OUT/stage"
if [[ $DRY_RUN == 0 ]]; then
  rm -rf "$OUT/stage"; mkdir -p "$OUT/stage/models"
  cp "$BIN" "$OUT/stage/enclave-stage"
  cp -rL "$MODEL_DIR" "$OUT/stage/models/$model"
  stage_policy >"$OUT/stage/policy.toml"
  printf 'FROM %s\nENTRYPOINT []\nCMD %s\n' "$BASE_IMAGE" "$(cmd_json)" >"$OUT/enclave.Dockerfile"
else
  echo "+ (copy $BIN, $MODEL_DIR, the in-enclave policy into $OUT/stage)"
  echo "+ (write $OUT/enclave.Dockerfile: FROM $BASE_IMAGE; ENTRYPOINT []; CMD $(cmd_json))"
fi
run docker build -q -f docker/enclave-stage.Dockerfile --build-arg "MODEL=$model" -t "$BASE_IMAGE" "$OUT/stage"
run docker build -q -f "$OUT/enclave.Dockerfile" -t "$EIF_IMAGE" "$OUT"
if [[ $IMAGE_ONLY == 1 ]]; then
  echo "build-eif: enclave image $EIF_IMAGE (no EIF: --image-only)"
  exit 0
fi
echo "== nitro-cli build-enclave"
SIGN=()
[[ -n "$SIGN_CERT" ]] && SIGN=(--signing-certificate "$SIGN_CERT" --private-key "$SIGN_KEY")
if [[ $DRY_RUN == 1 ]]; then
  run nitro-cli build-enclave --docker-uri "$EIF_IMAGE" --output-file "$EIF" ${SIGN[@]+"${SIGN[@]}"}
  echo "+ (write $POLICY_OUT from its output, $OUT/build-enclave.json)"
  exit 0
fi
nitro-cli --version >"$OUT/nitro-cli.version"
nitro-cli build-enclave --docker-uri "$EIF_IMAGE" --output-file "$EIF" ${SIGN[@]+"${SIGN[@]}"} | tee "$OUT/build-enclave.json"
write_policy "$OUT/build-enclave.json" "$POLICY_OUT"
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
NITRO_CLI_VERSION="$(head -n1 "$OUT/nitro-cli.version")"
EOT
echo "build-eif: $EIF; PCRs in $POLICY_OUT; run it with scripts/run-nitro.sh --build $OUT"
