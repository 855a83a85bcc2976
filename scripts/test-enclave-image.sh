#!/usr/bin/env bash
# Runs the Nitro enclave image here, started the way an enclave's init starts
# it, and serves requests through it (docs/deploy-nitro.md, "What is tested").
# This catches an image that would never start before hardware does.
#
#   1. scripts/build-eif.sh --image-only: the static nitro build and the
#      enclave image, exactly as for `nitro-cli build-enclave`;
#   2. the command nitro-cli would take from the image config: CMD alone
#      when the image has CMD and ENV (else ENTRYPOINT), never the two
#      joined (aws-nitro-enclaves-cli, enclave_build/src/docker.rs). It must
#      start with the program;
#   3. each stage started from that command with `docker run --entrypoint ""`
#      (so nothing but the command runs), with the image's ENV, as root in /
#      (an enclave ignores USER and WORKDIR), read-only, no capabilities, on an
#      internal network (no route out), in the memory run-nitro.sh sizes for
#      an enclave. Three substitutions stand in for the hardware, and only
#      these: `--attestation nitro` becomes `--attestation mock --mock-cid
#      CID` (no /dev/nsm, no vsock to read the CID from: the stage still
#      takes its index from the CID, through `--stage-from-cid`), the vsock
#      listen address becomes TCP, and a mock-accepting policy is mounted
#      over /config/policy.toml;
#   4. a gateway (target/release/gateway) attests both stages against a
#      policy pinning the mock measurement of the image's binary, manifest
#      and that policy, written from the build's record by `gateway policy
#      from-build --mock --stage-policy`, and serves embeddings through them;
#      build-eif.sh --log logs the image's release (`gateway log add-release
#      --mock`) in a fresh log: its entries pin that same measurement.
# Needs Docker; installs Debian's musl-tools and the musl Rust target (rustup)
# when missing; without a Docker engine it says SKIPPED and exits 0.
# Env: ENCLAVE_IMAGE_E2E=0 skips it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ "${ENCLAVE_IMAGE_E2E:-1}" == 0 ]]; then
  echo "enclave image: SKIPPED (ENCLAVE_IMAGE_E2E=0)"; exit 0
fi
if ! docker info >/dev/null 2>&1; then
  echo "enclave image: SKIPPED (no Docker engine)"; exit 0
fi
# The musl target and musl-gcc (ring's C parts), installed when missing.
scripts/ensure-musl.sh
fail() { echo "FAIL: $*" >&2; exit 1; }
[[ -x target/release/gateway ]] || fail "no target/release/gateway (cargo build --release -p gateway)"

NAME=enclave-image-test
PREFIX=confidential-inference-test
IMAGE="$PREFIX/enclave-stage-nitro:$NAME"
MODEL=models/all-minilm-l6-v2
LAYERS=0..3,3..6
CID_BASE=16
OUT="target/eif/$NAME"
RUN="$$"
NET="enclave-image-test-$RUN"
tmp="$(mktemp -d)"
gw=""
cleanup() {
  [[ -n "$gw" ]] && kill "$gw" 2>/dev/null
  docker rm -f "stage0-$RUN" "stage1-$RUN" >/dev/null 2>&1 || true
  docker network rm "$NET" >/dev/null 2>&1 || true
  docker image rm "$IMAGE" "$PREFIX/enclave-stage-nitro-base:$NAME" >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT

echo "== 1. the enclave image (scripts/build-eif.sh --image-only)"
target/release/gateway log init --dir "$tmp/log" --origin test.example/image >/dev/null
scripts/build-eif.sh --image-only --name "$NAME" --prefix "$PREFIX" --model "$MODEL" \
  --layers "$LAYERS" --cid-base "$CID_BASE" --log "$tmp/log" >"$tmp/build.log" 2>&1 \
  || { tail -30 "$tmp/build.log"; fail "build-eif.sh --image-only"; }
# --log put the image's release in that transparency log: one entry per
# stage, the mock measurement of the image's own binary, model and policy.
own="$(target/release/gateway measure --stage-binary "$OUT/stage/enclave-stage" \
  --model-dir "$OUT/stage/models/$(basename "$MODEL")" --stage-policy "$OUT/stage/config/policy.toml")"
target/release/gateway log entries --dir "$tmp/log" >"$tmp/entries.jsonl"
[[ "$(grep -c "\"$own\"" "$tmp/entries.jsonl")" == 2 ]] \
  || { cat "$tmp/entries.jsonl"; echo "want $own"; fail "build-eif.sh --log: the image's two releases"; }

echo "== 2. the command nitro-cli takes from $IMAGE"
docker image inspect "$IMAGE" >"$tmp/inspect.json"
python3 - "$tmp/inspect.json" "$tmp/cmd" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))[0]["Config"]
cmd, env, entrypoint = config.get("Cmd"), config.get("Env"), config.get("Entrypoint")
# nitro-cli: CMD (with ENV) when the image has both, else ENTRYPOINT alone.
taken = cmd if cmd and env else entrypoint
if not taken:
    sys.exit("FAIL: the image has neither CMD nor ENTRYPOINT for nitro-cli to run")
if taken[0] != "/enclave-stage":
    sys.exit(f"FAIL: nitro-cli would run {taken[0]!r} as the enclave's program: {taken}")
if entrypoint:
    sys.exit(f"FAIL: ENTRYPOINT {entrypoint} is set: docker would run it, nitro-cli would not")
if "--attestation" not in taken or taken[taken.index("--attestation") + 1] != "nitro":
    sys.exit(f"FAIL: the enclave command does not attest with nitro: {taken}")
open(sys.argv[2], "w").write("\n".join(taken) + "\n")
print("nitro-cli would run:", " ".join(taken))
print("with ENV:", " ".join(env))
PY
mapfile -t CMD <"$tmp/cmd"

echo "== 3. the stages, started from that command"
manifest_sha="$(sha256sum "$MODEL/manifest.json" | cut -d' ' -f1)"
stage_policy="$tmp/stage-policy.toml"
cat >"$stage_policy" <<EOF
# Mounted over the image's /config/policy.toml by scripts/test-enclave-image.sh:
# mock evidence (no Nitro hardware here), neighbours of this same build.
allow_mock = true
trust_local_build = true
manifest_sha256 = "$manifest_sha"
[[stages]]
index = 0
layers = [0, 3]
measurements = []
[[stages]]
index = 1
layers = [3, 6]
measurements = []
EOF
# The memory run-nitro.sh gives each enclave.
mem="$(scripts/run-nitro.sh --dry-run --build "$tmp/no-eif" --model "$MODEL" --layers "$LAYERS" \
  | sed -n 's/^stage 0: .*: memory \([0-9]*\) MiB.*/\1/p')"
[[ -n "$mem" ]] || fail "no memory size from run-nitro.sh --dry-run"
docker network create --internal "$NET" >/dev/null
for i in 0 1; do
  args=()
  for ((k = 0; k < ${#CMD[@]}; k++)); do
    a="${CMD[$k]}"
    if [[ "$a" == --attestation ]]; then
      args+=(--attestation mock --mock-cid $((CID_BASE + i))); k=$((k + 1))
    elif [[ "$a" == vsock://any:* ]]; then
      args+=("tcp://0.0.0.0:${a##*:}")
    else
      args+=("$a")
    fi
  done
  docker run -d --name "stage$i-$RUN" --network "$NET" --read-only --user 0:0 \
    --cap-drop ALL --security-opt no-new-privileges --memory "${mem}m" \
    -v "$stage_policy:/config/policy.toml:ro" --entrypoint "" "$IMAGE" "${args[@]}" >/dev/null
done
ip() { docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$1"; }
ip0="$(ip "stage0-$RUN")"; ip1="$(ip "stage1-$RUN")"
port="$(echo "${CMD[*]}" | sed -n 's/.*vsock:\/\/any:\([0-9]*\).*/\1/p')"

echo "== 4. a gateway attests them and serves through them"
# The gateway's policy from the build's record (`gateway policy from-build
# --mock`, with the mounted stage policy in place of the image's), and the
# measurement it pins against `gateway measure` on the image's own files.
target/release/gateway policy from-build "$OUT/build-record.json" --mock --stage-policy "$stage_policy" \
  --out "$tmp/policy.toml" >"$tmp/from-build.out" 2>&1 || { cat "$tmp/from-build.out"; fail "policy from-build"; }
measurement="$(target/release/gateway measure --stage-binary "$OUT/stage/enclave-stage" \
  --model-dir "$OUT/stage/models/$(basename "$MODEL")" --stage-policy "$stage_policy")"
[[ "$(grep -c "^measurements = \[\"$measurement\"\]$" "$tmp/policy.toml")" == 2 ]] \
  || { cat "$tmp/policy.toml"; fail "the policy from the build record does not pin $measurement for both stages"; }
grep -q "^manifest_sha256 = \"$manifest_sha\"$" "$tmp/policy.toml" || fail "the policy from the build record pins another manifest"
gport="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
GATEWAY_SERVER__LISTEN="127.0.0.1:$gport" GATEWAY_RECEIPTS__PATH="$tmp/receipts.sqlite3" \
  GATEWAY_PIPELINE__POLICY="$tmp/policy.toml" GATEWAY_PIPELINE__MODEL_DIR="$MODEL" \
  GATEWAY_PIPELINE__CONNECT_TIMEOUT_SECS=120 \
  GATEWAY_PIPELINE__STAGES__0__ADDRESS="tcp://$ip0:$port" \
  GATEWAY_PIPELINE__STAGES__1__ADDRESS="tcp://$ip1:$port" \
  GATEWAY_PIPELINE__STAGES__1__PEER_ADDRESS="tcp://$ip1:$port" \
  target/release/gateway serve --config config/gateway-nitro.toml >"$tmp/gateway.log" 2>&1 &
gw=$!
ready=""
for _ in $(seq 1 180); do
  if curl -sf "http://127.0.0.1:$gport/readyz" >/dev/null 2>&1; then ready=1; break; fi
  kill -0 "$gw" 2>/dev/null || break
  sleep 1
done
if [[ -z "$ready" ]]; then
  tail -20 "$tmp/gateway.log"
  for i in 0 1; do echo "-- stage $i"; docker logs "stage$i-$RUN" 2>&1 | tail -10; done
  fail "the gateway never became ready on the enclave image's stages"
fi
for i in 0 1; do
  docker logs "stage$i-$RUN" 2>&1 | grep "stage index from the vsock CID" | grep -q "\"cid\":$((CID_BASE + i)),.*\"stage\":$i\b" \
    || { docker logs "stage$i-$RUN" 2>&1 | tail -5; fail "stage $i did not take its index from CID $((CID_BASE + i))"; }
done
curl -sf "http://127.0.0.1:$gport/v1/embeddings" -H 'content-type: application/json' \
  -d '{"model":"all-MiniLM-L6-v2","input":["a sealed enclave image that boots"]}' >"$tmp/emb.json" \
  || { tail -20 "$tmp/gateway.log"; fail "embeddings request"; }
python3 - "$tmp/emb.json" <<'PY'
import json, math, sys
r = json.load(open(sys.argv[1]))
v = r["data"][0]["embedding"]
assert len(v) == 384, len(v)
norm = math.sqrt(sum(x * x for x in v))
assert abs(norm - 1) < 1e-3, norm
print(f"embedding: 384 dims, norm {norm:.4f}")
PY
echo "enclave image: OK (booted from nitro-cli's command, attested (mock) and served)"
