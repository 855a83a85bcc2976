#!/usr/bin/env bash
# Checks the Nitro deployment scripts without Nitro hardware (scripts/test.sh
# runs it; a few seconds): build-eif.sh's PCR parsing and policy writing on
# a sample of nitro-cli build-enclave's output, the same output in a build
# record, `gateway policy from-build` and `gateway log add-release` on it
# (a transparency log's release entries with its PCRs), the policy loading in the
# gateway's config check, the refusal without nitro-cli, the enclave image's
# command as nitro-cli takes it (CMD alone), run-nitro.sh's sizing rules
# (4 x the EIF, whole cores, the parent's core, the allocator and instance,
# the start wait sized to the EIF) and commands in a dry run, and the enclave
# runner both deployments use (scripts/test-enclave-runner.sh). For a first
# bring-up (issue 48): build-eif.sh --debug-policy's policies (gateway and
# in-enclave accept debug-mode enclaves, labelled, the record says so);
# run-nitro.sh refusing --debug-mode with a production policy, a
# --proxy-port-base whose ports hold 9000, and a second gateway on one
# parent (run against the stub nitro-cli and a stub gateway), and starting
# a second pipeline with --no-gateway. Needs target/release/gateway and the
# models from scripts/setup.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
SAMPLE=scripts/testdata/nitro-cli-build-enclave.txt
PCR0=7fb5c55bc2ecbb68ed99a13d7122abfc0666b926a79d5379bc58b9445c84217f59cfdd36c08b2c79552928702efe23e4

echo "== build-eif.sh: PCRs from nitro-cli's output into a policy"
scripts/build-eif.sh --policy-from "$SAMPLE" --policy-out "$tmp/policy.toml" >/dev/null
grep -q '^allow_mock = false' "$tmp/policy.toml" || fail "policy allows mock"
[[ $(grep -c "^pcr0 = \"$PCR0\"" "$tmp/policy.toml") == 2 ]] || fail "PCR0 not pinned for both stages"
[[ $(grep -c '^pcr2 = "0f0ac32c' "$tmp/policy.toml") == 2 ]] || fail "PCR2 not pinned"
grep -q '^layers = \[3, 6\]' "$tmp/policy.toml" || fail "stage 1 layers"
grep -q "^manifest_sha256 = \"$(sha256sum models/all-minilm-l6-v2/manifest.json | cut -d' ' -f1)\"" "$tmp/policy.toml" \
  || fail "manifest not pinned"
# The gateway loads it with the Nitro config.
GATEWAY_PIPELINE__POLICY="$tmp/policy.toml" target/release/gateway check-config \
  --config config/gateway-nitro.toml >"$tmp/check.out" || { cat "$tmp/check.out"; fail "check-config"; }
grep -q "remote" "$tmp/check.out" || fail "check-config summary"
grep -q "MOCK" "$tmp/check.out" && fail "the Nitro policy must not allow mock"
echo "== the same output in a build record (scripts/build_record.py), and gateway policy from-build on it"
echo "# a stand-in in-enclave policy" >"$tmp/stage-policy.toml"
python3 scripts/build_record.py write --out "$tmp/record.json" --binary "$SAMPLE" \
  --model-dir models/all-minilm-l6-v2 --stage-policy "$tmp/stage-policy.toml" --layers 0..3,3..6 \
  --source-date-epoch 0 --command "cargo build" --target x86_64-unknown-linux-musl \
  --nitro-output "$SAMPLE" --nitro-cli-version "Nitro CLI (the sample)" || fail "build_record.py write"
target/release/gateway policy from-build "$tmp/record.json" --out "$tmp/from-build.toml" >/dev/null \
  || fail "policy from-build on a record with PCRs"
# The policy build-eif.sh writes and the one written from the record: the same.
python3 - "$tmp/policy.toml" "$tmp/from-build.toml" <<'PY' || fail "the policy from the build record differs from build-eif.sh's"
import sys, tomllib
a, b = (tomllib.load(open(p, "rb")) for p in sys.argv[1:])
for p in (a, b):
    p.setdefault("allow_debug", False)
assert a == b, (a, b)
PY
# The same record logged as a release (gateway log add-release): one entry
# per stage with the record's PCRs, the second time nothing new.
target/release/gateway log init --dir "$tmp/log" --origin test.example/releases >/dev/null || fail "log init"
target/release/gateway log add-release --dir "$tmp/log" "$tmp/record.json" 2>"$tmp/err" && fail "add-release without a commit or --version"
grep -q "pass --version" "$tmp/err" || { cat "$tmp/err"; fail "add-release refusal message"; }
target/release/gateway log add-release --dir "$tmp/log" "$tmp/record.json" --version "the sample" >"$tmp/add.out" || fail "log add-release"
grep -q "2 stage entries at \[0, 1\], 2 new; log size 2" "$tmp/add.out" || { cat "$tmp/add.out"; fail "add-release output"; }
target/release/gateway log add-release --dir "$tmp/log" "$tmp/record.json" --version "the sample" | grep -q "0 new; log size 2" || fail "add-release twice"
target/release/gateway log entries --dir "$tmp/log" >"$tmp/entries.jsonl" || fail "log entries"
[[ $(grep -c "\"measurement\":\"nitro:pcr0=$PCR0," "$tmp/entries.jsonl") == 2 ]] || { cat "$tmp/entries.jsonl"; fail "the logged releases pin PCR0"; }
# Broken output is refused, naming what is wrong.
sed 's/"PCR1": "235c/"PCR1": "zz5c/' "$SAMPLE" >"$tmp/bad.txt"
if scripts/build-eif.sh --policy-from "$tmp/bad.txt" --policy-out "$tmp/bad.toml" 2>"$tmp/err"; then
  fail "a bad PCR1 was accepted"
fi
grep -q "PCR1 is not 96 hex digits" "$tmp/err" || { cat "$tmp/err"; fail "bad PCR message"; }
echo "no json here" >"$tmp/none.txt"
scripts/build-eif.sh --policy-from "$tmp/none.txt" --policy-out "$tmp/x.toml" 2>"$tmp/err" && fail "no JSON accepted"
grep -q "no JSON object" "$tmp/err" || fail "no-JSON message"

echo "== build-eif.sh: without nitro-cli, a clear refusal; --dry-run prints the commands"
if ! command -v nitro-cli >/dev/null; then
  if scripts/build-eif.sh 2>"$tmp/err"; then fail "build-eif.sh succeeded without nitro-cli"; fi
  grep -q "nitro-cli is not installed" "$tmp/err" || fail "no nitro-cli message"
fi
scripts/build-eif.sh --dry-run --model models/smollm2-135m-instruct --layers 0..15,15..30 \
  --stage-args "--kv-cache-tokens 16384" >"$tmp/dry.out"
grep -q "cargo build .*--features nitro" "$tmp/dry.out" || fail "dry run: static build"
grep -q "MODEL=smollm2-135m-instruct" "$tmp/dry.out" || fail "dry run: MODEL build arg"
# nitro-cli runs CMD alone (never ENTRYPOINT + CMD): the CMD is the whole
# command line, program first, and ENTRYPOINT is cleared so that a container
# of the image runs exactly what the enclave will.
grep -q 'ENTRYPOINT \[\]; CMD \["/enclave-stage", "--policy", "/config/policy.toml", "--attestation", "nitro", "--listen", "vsock://any:9000", "--stage-from-cid", "16", "--layers", "0..15,15..30", "--threads", "0", "--kv-cache-tokens", "16384"\]' "$tmp/dry.out" \
  || { cat "$tmp/dry.out"; fail "dry run: enclave CMD"; }
# Signing: both options or neither; the signed build passes them on.
scripts/build-eif.sh --dry-run --signing-certificate "$SAMPLE" --private-key key.pem >"$tmp/signed.out"
grep -q -- "build-enclave .* --signing-certificate $SAMPLE --private-key key.pem" "$tmp/signed.out" || fail "signing options"
if scripts/build-eif.sh --dry-run --private-key key.pem >/dev/null 2>&1; then fail "a key without a certificate was accepted"; fi
grep -q "nitro-cli build-enclave --docker-uri confidential-inference/enclave-stage-nitro:smollm2-135m-instruct" "$tmp/dry.out" \
  || fail "dry run: nitro-cli build-enclave"

echo "== run-nitro.sh --dry-run: sizing and commands"
scripts/run-nitro.sh --dry-run --build "$tmp/none" >"$tmp/run.out"
cat "$tmp/run.out"
mini_files=$(du -sbL models/all-minilm-l6-v2 | cut -f1)
mini_weights=$(stat -L -c %s models/all-minilm-l6-v2/model.safetensors)
up() { echo $(( ($1 + 1048575) / 1048576 )); }
want=$(( ( ($(up "$mini_files") + 64) + $(up "$mini_weights") + 192 + 512 + 255) / 256 * 256 ))
[[ $(grep -c "nitro-cli run-enclave --eif-path $tmp/none/stage.eif --cpu-count 2 --memory $want --enclave-cid 1[67]" "$tmp/run.out") == 2 ]] \
  || fail "embeddings: expected two enclaves of $want MiB, 2 CPUs"
# The parent's share: the allocator reserves both enclaves, and the instance
# keeps CPU 0 and its sibling (an m6i.xlarge's 4 vCPUs cannot host them).
grep -q "^memory_mib: $(( 2 * want ))\$" "$tmp/run.out" || fail "allocator.yaml memory"
grep -q "^cpu_count: 4\$" "$tmp/run.out" || fail "allocator.yaml cpus"
grep -q "instance: at least 6 vCPUs .*: m6i.2xlarge" "$tmp/run.out" || fail "instance size"
# nitro-cli needs 4 x the EIF: a 400 MiB EIF gets 1792 MiB, not the 1280 of the sum.
mkdir -p "$tmp/big"
truncate -s 400M "$tmp/big/stage.eif"
scripts/run-nitro.sh --dry-run --build "$tmp/big" >"$tmp/big.out"
[[ $(grep -c -- "--memory 1792 --enclave-cid" "$tmp/big.out") == 2 ]] || { cat "$tmp/big.out"; fail "4 x EIF floor"; }
if MEMORY_MIB=1024 scripts/run-nitro.sh --dry-run --build "$tmp/big" >/dev/null 2>"$tmp/err"; then fail "MEMORY_MIB below 4 x EIF accepted"; fi
grep -q "below 4 x the EIF" "$tmp/err" || fail "4 x EIF message"
# Whole cores: an odd vCPU count is refused.
if CPU_COUNT=3 scripts/run-nitro.sh --dry-run --build "$tmp/none" >/dev/null 2>"$tmp/err"; then fail "CPU_COUNT=3 accepted"; fi
grep -q "whole cores" "$tmp/err" || fail "CPU_COUNT message"
grep -q -- "host-proxy --route vsock://any:8000=vsock://16:9000 --route vsock://any:8001=vsock://17:9000" "$tmp/run.out" \
  || fail "host-proxy routes"
grep -q "GATEWAY_PIPELINE__STAGES__1__PEER_ADDRESS=vsock://3:8001" "$tmp/run.out" || fail "peer address"
grep -q "serve --config config/gateway-nitro.toml" "$tmp/run.out" || fail "gateway command"
# SmolLM2 (GGUF Q4_1) with a KV budget, 15 layers per stage: each stage is
# sized with `gateway plan --layers` (its own weights as the stages hold
# them, the embedding at the entry, the tied head costing nothing more at
# the exit, and its KV cache), in the stages' default weights and in f32.
gguf=models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
s_files=$(du -sbL models/smollm2-135m-instruct | cut -f1)
for weights in q4_1 f32; do
  WEIGHTS=$weights scripts/run-nitro.sh --dry-run --build "$tmp/none" --model models/smollm2-135m-instruct \
    --layers 0..15,15..30 --kv-cache-tokens 16384 >"$tmp/run2.out"
  grep -q "each stage its own, from gateway plan" "$tmp/run2.out" || { cat "$tmp/run2.out"; fail "completions sized without gateway plan"; }
  plan=$(target/release/gateway plan --model "$gguf" --layers 0..15,15..30 --kv-tokens 16384 --weights $weights --json)
  for i in 0 1; do
    w=$(up "$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])[int(sys.argv[2])]["weight_bytes"])' "$plan" $i)")
    kv=$(up "$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])[int(sys.argv[2])]["kv_bytes"])' "$plan" $i)")
    [[ $kv == $(up $(( 16384 * 15 * 1536 ))) ]] || fail "plan's KV cache for SmolLM2 ($kv MiB)"
    want=$(( ( ($(up "$s_files") + 64) + w + kv + 512 + 255) / 256 * 256 ))
    grep -q "stage $i: .* memory $want MiB = .* + $w weights + $kv kv + 0 activations" "$tmp/run2.out" \
      || { cat "$tmp/run2.out"; fail "completions sizing, stage $i, $weights ($want MiB, weights $w, kv $kv)"; }
  done
done
if WEIGHTS=int3 scripts/run-nitro.sh --dry-run --build "$tmp/none" >/dev/null 2>&1; then fail "WEIGHTS=int3 accepted"; fi
grep -q "GATEWAY_COMPLETIONS__STAGES__0__PEER_ADDRESS=vsock://3:8000" "$tmp/run2.out" || fail "feedback route"

echo "== build-eif.sh --debug-policy: policies that accept debug-mode enclaves, loudly"
scripts/build-eif.sh --debug-policy --policy-from "$SAMPLE" --policy-out "$tmp/debug-policy.toml" >"$tmp/debug.out"
grep -q "DEBUG POLICY: accepts debug-mode enclaves" "$tmp/debug.out" || fail "debug policy: not announced"
grep -q '^# DEBUG POLICY (scripts/build-eif.sh --debug-policy), FOR A FIRST BRING-UP' "$tmp/debug-policy.toml" || fail "debug policy: no banner"
grep -q '^allow_debug = true' "$tmp/debug-policy.toml" || fail "debug policy: allow_debug"
grep -q '^allow_mock = false' "$tmp/debug-policy.toml" || fail "debug policy allows mock"
zero=$(printf '%096d' 0)
[[ $(grep -c "^pcr0 = \"$zero\"" "$tmp/debug-policy.toml") == 2 ]] || fail "debug policy: zero PCRs not pinned for both stages"
[[ $(grep -c "^pcr0 = \"$PCR0\"" "$tmp/debug-policy.toml") == 2 ]] || fail "debug policy: the EIF's own PCRs not pinned beside them"
GATEWAY_PIPELINE__POLICY="$tmp/debug-policy.toml" target/release/gateway check-config \
  --config config/gateway-nitro.toml >"$tmp/check-debug.out" || { cat "$tmp/check-debug.out"; fail "check-config with the debug policy"; }
grep -q "Nitro DEBUG-mode enclaves allowed" "$tmp/check-debug.out" || { cat "$tmp/check-debug.out"; fail "check-config does not label the debug policy"; }
grep -q "DEBUG" "$tmp/check.out" && fail "check-config labels the production policy as debug"
# The in-enclave policy of a --debug-policy image, and of a production one.
scripts/build-eif.sh --dry-run --debug-policy >"$tmp/dry-debug.out"
grep -q "^+   allow_debug = true" "$tmp/dry-debug.out" || fail "the debug image's in-enclave policy does not allow debug"
grep -q "^+   trust_same_image = true" "$tmp/dry-debug.out" || fail "the debug image's in-enclave policy: trust_same_image"
grep -q "enclave-stage-nitro:all-minilm-l6-v2-debug" "$tmp/dry-debug.out" || fail "the debug image is not named -debug"
scripts/build-eif.sh --dry-run >"$tmp/dry-prod.out"
grep -q "^+   allow_debug = false" "$tmp/dry-prod.out" || fail "the production image's in-enclave policy allows debug"
python3 scripts/build_record.py write --out "$tmp/debug-record.json" --binary "$SAMPLE" \
  --model-dir models/all-minilm-l6-v2 --stage-policy "$tmp/stage-policy.toml" --layers 0..3,3..6 \
  --source-date-epoch 0 --command "cargo build" --target x86_64-unknown-linux-musl --debug-policy
python3 -c 'import json,sys; r = json.load(open(sys.argv[1])); assert r["stage_policy"]["debug_policy"] is True, r' \
  "$tmp/debug-record.json" || fail "the record of a --debug-policy build does not say so"
python3 -c 'import json,sys; r = json.load(open(sys.argv[1])); assert "debug_policy" not in r["stage_policy"], r' \
  "$tmp/record.json" || fail "a production record says debug_policy"

echo "== run-nitro.sh: debug mode needs a debug policy; port 9000; the start wait"
if scripts/run-nitro.sh --dry-run --build "$tmp/none" --policy "$tmp/policy.toml" --debug-mode >/dev/null 2>"$tmp/err"; then
  fail "--debug-mode with a production policy accepted"
fi
grep -q "refuses debug enclaves .*build-eif.sh --debug-policy" "$tmp/err" || { cat "$tmp/err"; fail "--debug-mode refusal message"; }
scripts/run-nitro.sh --dry-run --build "$tmp/none" --policy "$tmp/debug-policy.toml" --debug-mode >"$tmp/run-debug.out" 2>"$tmp/err" \
  || { cat "$tmp/err"; fail "--debug-mode with the debug policy"; }
grep -q "DEBUG BRING-UP: enclaves in debug mode" "$tmp/err" || fail "run-nitro.sh does not announce debug mode"
[[ $(grep -c -- "--enclave-cid 1[67] --debug-mode" "$tmp/run-debug.out") == 2 ]] || fail "--debug-mode not passed to run-enclave"
for base in 8999 9000; do
  if scripts/run-nitro.sh --dry-run --build "$tmp/none" --proxy-port-base $base >/dev/null 2>"$tmp/err"; then
    fail "--proxy-port-base $base (ports $base, $((base + 1)) hold 9000) accepted"
  fi
  grep -q "nitro-cli's boot heartbeat port" "$tmp/err" || { cat "$tmp/err"; fail "port 9000 message"; }
done
scripts/run-nitro.sh --dry-run --build "$tmp/none" --proxy-port-base 7999 >"$tmp/run-7999.out" || fail "--proxy-port-base 7999"
grep -q -- "--route vsock://any:7999=vsock://16:9000 --route vsock://any:8000=vsock://17:9000" "$tmp/run-7999.out" || fail "routes from 7999"
# The wait: per stage 60 s per started 6 GiB + 30 s + 1 s per 100 MiB, + 10 s;
# and the Kubernetes runner's memory, EIF + 256 MiB.
mini_eif=$(( $(up "$mini_files") + 64 ))
grep -q "^start wait: $(( 2 * (60 + 30 + (mini_eif + 99) / 100) + 10 )) s" "$tmp/run.out" || fail "start wait for MiniLM"
grep -q "^kubernetes runner memory limit: at least $(( mini_eif + 256 ))Mi" "$tmp/run.out" || fail "the runner's memory for MiniLM"
mkdir -p "$tmp/huge"
truncate -s 7G "$tmp/huge/stage.eif"
scripts/run-nitro.sh --dry-run --build "$tmp/huge" >"$tmp/huge.out"
grep -q "^start wait: $(( 2 * (120 + 30 + 72) + 10 )) s" "$tmp/huge.out" || { grep "start wait" "$tmp/huge.out"; fail "start wait for a 7 GiB EIF"; }
grep -q "^kubernetes runner memory limit: at least $(( 7168 + 256 ))Mi" "$tmp/huge.out" || fail "the runner's memory for a 7 GiB EIF"

echo "== run-nitro.sh on a parent (stub nitro-cli and gateway): one gateway, a second pipeline with --no-gateway"
mkdir -p "$tmp/parent/bin" "$tmp/parent/stub"
cp scripts/testdata/nitro-cli-stub.sh "$tmp/parent/bin/nitro-cli"
cp scripts/testdata/gateway-stub.sh "$tmp/parent/bin/gateway"
head -c 1048576 /dev/zero >"$tmp/parent/stage.eif"
parent_env=(PATH="$tmp/parent/bin:$PATH" NITRO_STUB_DIR="$tmp/parent/stub" GATEWAY_BIN="$tmp/parent/bin/gateway"
  GATEWAY_LOCK="$tmp/parent/gateway.lock" START_LOCK="$tmp/parent/start.lock" LOG_DIR="$tmp/parent/logs" MEMORY_LIMIT_FILE=/nonexistent)
stop_parent() {
  local p
  for p in ${first:-} ${second:-}; do kill -TERM "$p" 2>/dev/null || true; done
  if [[ -f "$tmp/parent/stub/proxy.pids" ]]; then
    while read -r p; do kill "$p" 2>/dev/null || true; done <"$tmp/parent/stub/proxy.pids"
  fi
}
trap 'stop_parent; rm -rf "$tmp"' EXIT
env "${parent_env[@]}" scripts/run-nitro.sh --eif "$tmp/parent/stage.eif" --policy "$tmp/policy.toml" \
  >"$tmp/parent/first.out" 2>&1 &
first=$!
serving() { [[ -s "$tmp/parent/stub/serve-calls" ]]; }
for ((i = 0; i < 200; i++)); do serving && break; kill -0 $first 2>/dev/null || break; sleep 0.1; done
serving || { cat "$tmp/parent/first.out"; fail "the first run-nitro.sh did not start its gateway"; }
grep -q "serve --config config/gateway-nitro.toml" "$tmp/parent/stub/serve-calls" || fail "the gateway command"
# A second pipeline's run without --no-gateway: refused before any enclave starts.
# (timeout: a second gateway, if one started, would serve until killed.)
if timeout 30 env "${parent_env[@]}" scripts/run-nitro.sh --eif "$tmp/parent/stage.eif" --policy "$tmp/policy.toml" \
  --cid-base 20 --proxy-port-base 8100 >"$tmp/parent/second.out" 2>&1; then
  fail "a second run-nitro.sh started a second gateway on the parent"
fi
grep -q "a gateway already runs on this parent (run-nitro.sh pid $first" "$tmp/parent/second.out" \
  || { cat "$tmp/parent/second.out"; fail "the second gateway's refusal message"; }
grep -q -- "--enclave-cid 2[01]" "$tmp/parent/stub/calls" && fail "the refused run started enclaves"
# With --no-gateway it starts its enclaves and proxy, and no gateway.
env "${parent_env[@]}" scripts/run-nitro.sh --eif "$tmp/parent/stage.eif" --policy "$tmp/policy.toml" \
  --cid-base 20 --proxy-port-base 8100 --no-gateway >"$tmp/parent/second.out" 2>&1 &
second=$!
for ((i = 0; i < 200; i++)); do grep -q "no gateway (--no-gateway)" "$tmp/parent/second.out" && break; sleep 0.1; done
grep -q "no gateway (--no-gateway)" "$tmp/parent/second.out" || { cat "$tmp/parent/second.out"; fail "--no-gateway did not get its enclaves running"; }
[[ -e "$tmp/parent/stub/enclave-20" && -e "$tmp/parent/stub/enclave-21" ]] || fail "--no-gateway: enclaves 20, 21"
[[ $(wc -l <"$tmp/parent/stub/serve-calls") == 1 ]] || fail "--no-gateway started a gateway"
grep -q "vsock://any:8101=vsock://21:9000" "$tmp/parent/stub/proxy-calls" || fail "--no-gateway: its host proxy"
kill -TERM $second; wait $second 2>/dev/null || true; second=""
[[ ! -e "$tmp/parent/stub/enclave-20" && ! -e "$tmp/parent/stub/enclave-21" ]] || fail "--no-gateway: enclaves left after TERM"
[[ -e "$tmp/parent/stub/enclave-16" ]] || fail "stopping the second pipeline stopped the first's enclaves"
# The first run ends with its gateway; its enclaves go, and the lock is free again.
kill "$(cat "$tmp/parent/stub/serve.pid")"
wait $first 2>/dev/null || true; first=""
[[ ! -e "$tmp/parent/stub/enclave-16" ]] || fail "the first pipeline's enclaves left after its gateway ended"
flock -n "$tmp/parent/gateway.lock" true || fail "GATEWAY_LOCK still held after the gateway ended"
echo "== the enclave runner (docker/k8s/overlays/nitro/run-enclaves.sh)"
scripts/test-enclave-runner.sh
echo "nitro scripts: OK"
