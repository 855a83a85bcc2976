#!/usr/bin/env bash
# The whole test suite, as CI runs it:
#   1. setup (models; the Python test deps in target/test-venv, which goes
#      first on PATH, so every `python3` below and in cargo's tests is its;
#      Debian's postgresql for the receipt store's test), idempotent; setup
#      again with the distribution's externally-managed /usr/bin/python3
#      (scripts/test-setup-stock-python.sh); docs/layout.md is
#      current (scripts/layout.py --check); no crate's modules import each
#      other in a circle (scripts/module_cycles.py); the transparency-log
#      verifier written from the C2SP texts checks itself
#      (scripts/tlog_verify.py --self-test; gateway/tests/transparency_e2e.rs
#      then runs it against the gateway's log);
#   2. release build with the test-only fault-injection switch compiled into
#      the stage (tests that start the binaries need it);
#   3. cargo test (unit, channel adversarial, model vs reference, end to end);
#   4. GGUF models of every architecture (llama, qwen2, qwen3, phi3, gemma2;
#      Phi-4's and Phi-4-mini's kinds of phi3) and tensor
#      type the stages load, random weights of real shapes, against
#      llama.cpp on the same files, and a SentencePiece vocabulary cut and
#      served as llama.cpp cuts it (scripts/test_gguf_models.py, with
#      llama-cpp-python built into target/test-venv-llama); embedding models
#      in the sentence-transformers layout (every pooling served, random
#      weights) served by `serve --embedding-model` against
#      sentence-transformers' vectors (scripts/test_embedding_models.py);
#      the `nitro` feature's unit tests and the Nitro scripts' checks
#      (scripts/test-nitro-scripts.sh, no hardware needed); where a Docker
#      engine runs, the Nitro enclave image started as an enclave's init
#      would start it, serving through a gateway (scripts/test-enclave-image.sh:
#      a static musl build; ENCLAVE_IMAGE_E2E=0 skips it); the enclave
#      binary built in two folders from copies of the commit, byte for byte
#      the same, and where Docker runs the stage image's layers twice
#      (scripts/test-reproducible-build.sh; REPRO_BUILD=0 skips it); the Kubernetes
#      overlays rendered and schema-validated (scripts/test-k8s-manifests.sh);
#   5. against a live gateway: the README's quickstart commands as written,
#      their output against the README's, and its sealed path (policy pin,
#      proxy) (scripts/check_quickstart.py); docs/curl.md's walkthrough as
#      written (scripts/check_curl_walkthrough.py); the stock `openai` Python
#      SDK and LangChain's ChatOpenAI, directly and through `gateway proxy`,
#      with structured outputs and tool calls (scripts/test_structured.py: the
#      schema suite directly, a fifth of it through the proxy);
#   6. the Python package (client/python): its wheel built with maturin from
#      PyPI, installed with `openai` into a clean virtualenv, and
#      client/python/tests/test_client.py run against the live gateway.
# CONTAINERS_E2E=1 adds the multi-container test (gateway/tests/containers_e2e.rs:
# static musl build, images, compose; needs Docker, docs/containers.md). Off by
# default: its static build is a second release build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
FEATURES=(--features enclave-stage/fault-injection)

scripts/setup.sh
# The Python test deps live in their own virtualenv (scripts/test_venv.sh);
# first on PATH, it is the `python3` of this script, of the scripts it runs and
# of the tests that start `python3` (gateway/tests/common/cli.rs).
TEST_VENV="$(scripts/test_venv.sh)"
export PATH="$PWD/$TEST_VENV/bin:$PATH"
echo "== setup with the distribution's python (externally managed; scripts/test-setup-stock-python.sh)"
scripts/test-setup-stock-python.sh
# gateway/tests/receipt_store_e2e.rs starts a real PostgreSQL server.
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  echo "== installing Debian's postgresql (the receipt store's test starts a server)"
  SUDO=""; [[ "$(id -u)" == 0 ]] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >/dev/null
fi
python3 scripts/layout.py --check
python3 scripts/module_cycles.py
echo "== the independent transparency-log verifier, against spec vectors and tampered logs (scripts/tlog_verify.py --self-test)"
python3 scripts/tlog_verify.py --self-test
cargo build --release --workspace "${FEATURES[@]}"
cargo test --release --workspace "${FEATURES[@]}"

echo "== the nitro feature (NSM provider; everything but /dev/nsm itself)"
cargo test --release -p proto --features nitro --lib
cargo test --release -p enclave-stage --features nitro --lib -- provider role
echo "== Nitro deployment scripts (docs/deploy-nitro.md; no hardware needed)"
scripts/test-nitro-scripts.sh
echo "== the Nitro enclave image, booted as an enclave's init would (scripts/test-enclave-image.sh; Docker)"
scripts/test-enclave-image.sh
echo "== the enclave binary built twice in two folders: the same bytes (scripts/test-reproducible-build.sh)"
# 3 minutes once the image test has built the static dependencies (about
# 11 without Docker, which builds them here); REPRO_FULL=1 builds both from
# scratch (16 to 21 minutes); REPRO_BUILD=0 skips it.
scripts/test-reproducible-build.sh
echo "== Kubernetes manifests (docs/deploy-kubernetes.md; rendered and validated offline)"
scripts/test-k8s-manifests.sh

echo "== GGUF models of every architecture and tensor type against llama.cpp (scripts/test_gguf_models.py)"
# llama-cpp-python is built from source into target/test-venv-llama the first
# time (about 6 minutes); random-weight fixtures are made in target/.
LLAMA_VENV="$(scripts/llama_venv.sh --test)"
"$LLAMA_VENV/bin/python" scripts/test_gguf_models.py \
  --bin target/release/examples/gguf_logits \
  --source models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \
  --dir target/gguf-fixtures/v3 --report target/gguf-fixtures/v3/report.json

echo "== embedding models in the sentence-transformers layout against sentence-transformers (scripts/test_embedding_models.py)"
# Random-weight BERT folders made with numpy; the reference vectors were made
# once with sentence-transformers (--make-reference) and are kept with the
# fixtures' digests in gateway/tests/data/embedding_models_reference.json.
python3 scripts/test_embedding_models.py

echo "== a live gateway, as scripts/start.sh starts it"
log="$(mktemp)"
./target/release/gateway serve --listen 127.0.0.1:0 >"$log.out" 2>"$log" &
gw=$!
trap 'kill -INT $gw 2>/dev/null; wait $gw 2>/dev/null || true' EXIT
url=""
for _ in $(seq 1 600); do
  url="$(sed -n 's/^GATEWAY LISTENING //p' "$log.out")"
  [[ -n "$url" ]] && break
  kill -0 $gw 2>/dev/null || { cat "$log"; echo "gateway exited" >&2; exit 1; }
  sleep 0.1
done
[[ -n "$url" ]] || { cat "$log"; echo "gateway did not start" >&2; exit 1; }
echo "== the README's quickstart, its commands as written (scripts/check_quickstart.py)"
python3 scripts/check_quickstart.py --base-url "$url"
echo "== docs/curl.md's walkthrough, its commands as written (scripts/check_curl_walkthrough.py)"
python3 scripts/check_curl_walkthrough.py --base-url "$url"
echo "== openai SDK against a live gateway"
python3 scripts/test_openai_sdk.py --base-url "$url/v1"
echo "== structured outputs and tool calls: schema suite, openai SDK, LangChain (scripts/test_structured.py)"
python3 scripts/test_structured.py --base-url "$url/v1"

echo "== openai SDK and LangChain through gateway proxy (sealed end to end, receipts verified)"
# Policies pinning the measurements this gateway's stages report (trust on
# first use, a test shortcut: a real client pins measurements it got from a
# trusted build), one per model.
./target/release/gateway policy pin --gateway "$url" --all --trust-on-first-use --out "$log.policies"
POLICIES=("$log.policies/all-MiniLM-L6-v2.toml" "$log.policies/SmolLM2-135M-Instruct.toml")
./target/release/gateway proxy --upstream "$url" --listen 127.0.0.1:0 \
  --policy "${POLICIES[0]}" --policy "${POLICIES[1]}" >"$log.proxy.out" 2>"$log.proxy" &
px=$!
trap 'kill -INT $gw $px 2>/dev/null; wait $gw $px 2>/dev/null || true' EXIT
purl=""
for _ in $(seq 1 300); do
  purl="$(sed -n 's/^PROXY LISTENING //p' "$log.proxy.out")"
  [[ -n "$purl" ]] && break
  kill -0 $px 2>/dev/null || { cat "$log.proxy"; echo "proxy exited" >&2; exit 1; }
  sleep 0.1
done
[[ -n "$purl" ]] || { cat "$log.proxy"; echo "proxy did not start" >&2; exit 1; }
python3 scripts/test_openai_sdk.py --base-url "$purl/v1" --expect-verified
python3 scripts/test_structured.py --base-url "$purl/v1" --expect-verified --quick
# The schemas and tools crossed the gateway sealed: its log never names them.
if grep -q 'get_weather\|maxLength' "$log"; then
  echo "the gateway's log names a tool or schema of a sealed request" >&2; exit 1
fi

echo "== the Python package (client/python): wheel built with maturin, clean virtualenv, openai SDK"
[[ -x target/py-build-venv/bin/maturin ]] || {
  python3 -m venv target/py-build-venv
  target/py-build-venv/bin/pip install -q --disable-pip-version-check maturin==1.16.0
}
rm -rf target/wheels/confidential_gateway-*.whl target/py-client-venv
target/py-build-venv/bin/maturin build --release -m client/python/Cargo.toml --out target/wheels
python3 -m venv target/py-client-venv
target/py-client-venv/bin/pip install -q --disable-pip-version-check \
  target/wheels/confidential_gateway-*.whl openai==3.54.0
# (The script's folder holds no package source: the installed wheel is what runs.)
target/py-client-venv/bin/python client/python/tests/test_client.py \
  --base-url "$url" --policy "${POLICIES[0]}" --policy "${POLICIES[1]}" \
  --log-key "$(./target/release/gateway log vkey --dir data/transparency)"

if [[ "${CONTAINERS_E2E:-}" == 1 ]]; then
  echo "== containers e2e: ran in cargo test (CONTAINERS_E2E=1; it says SKIPPED above if no Docker engine)"
else
  echo "== containers e2e: not run (CONTAINERS_E2E=1 scripts/test.sh, or scripts/test-containers.sh)"
fi
