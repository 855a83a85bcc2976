#!/usr/bin/env bash
# Builds the enclave binary twice, in two different folders, and checks that
# both builds give the same bytes (docs/deploy-nitro.md, "Reproducible
# builds"):
#
#   1. two copies of the committed tree (`git archive HEAD`: what a clean
#      clone holds, without .git, so SOURCE_DATE_EPOCH is given: the commit's
#      time) in two different temporary folders;
#   2. `scripts/build-eif.sh --binary-only` in each (the static musl build
#      with the nitro feature, exactly as the enclave image gets it);
#   3. the two binaries' sha256 and the two build records must be equal (the
#      record holds no path of the build machine), and neither binary may
#      name the copy it was built in, this checkout, cargo's home, the
#      toolchain's folder or the target dir;
#   4. where a Docker engine runs, the stage image twice from the second
#      copy (`--image-only --no-cache`, contexts assembled in two folders at
#      two times): the two build records, image layers included, must be
#      equal;
#   5. where target/release/gateway exists, `gateway policy from-build --mock`
#      writes a policy from the record that `gateway check-config` loads.
#
# Default (in scripts/test.sh): both copies build with one cargo target dir
# (target/static-nitro, the image build's), so the registry dependencies are
# built once (or already were, by scripts/test-enclave-image.sh) and only the
# workspace crates (proto, enclave-stage) rebuild in each copy (their files
# are touched: cargo would otherwise take the other copy's artifacts as
# fresh, since it fingerprints workspace files by relative path and mtime),
# which is what shows that the checkout's folder does not reach the binary.
# Measured on 2 cores (Zen 4): the whole check 3 minutes with the
# dependencies built (each copy's build 79 and 80 s, each image 10 s); a
# first build of the dependencies adds 7.5 minutes (456 s; 640 s with
# another build beside it), as without Docker, where
# scripts/test-enclave-image.sh did not build them.
# REPRO_FULL=1: each copy builds from scratch in its own target dir inside
# the copy (two full release builds, about 2 × 8 to 11 minutes on those
# cores), which also shows that the target dir's path does not reach the
# binary.
# Needs the musl target and musl-gcc (installed when missing:
# scripts/ensure-musl.sh). Env: REPRO_BUILD=0 skips it; KEEP=1 keeps the
# copies (their folders are printed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ "${REPRO_BUILD:-1}" == 0 ]]; then
  echo "reproducible build: SKIPPED (REPRO_BUILD=0)"; exit 0
fi
scripts/ensure-musl.sh
fail() { echo "FAIL: $*" >&2; exit 1; }
ROOT="$(pwd)"
MODEL="$ROOT/models/all-minilm-l6-v2"
[[ -f "$MODEL/manifest.json" ]] || fail "no $MODEL/manifest.json (scripts/setup.sh)"
SOURCE_DATE_EPOCH="$(git log -1 --format=%ct)"
COMMIT="$(git rev-parse HEAD)"
export SOURCE_DATE_EPOCH
tmp="$(mktemp -d)"
# The shared target dir ends holding the workspace crates compiled from a
# copy, and cargo fingerprints their sources by relative path and mtime: a
# later build of this checkout, whose files are older, would take them as
# its own. Their fingerprints are removed, so the next build compiles them.
forget_copies() {
  rm -rf "$ROOT"/target/static-nitro/x86_64-unknown-linux-musl/release/.fingerprint/{enclave-stage,proto}-*
}
cleanup() {
  [[ "${REPRO_FULL:-0}" == 1 ]] || forget_copies
  [[ "${KEEP:-0}" == 1 ]] && echo "kept $tmp" || rm -rf "$tmp"
}
trap cleanup EXIT
# Two folders whose paths differ in length too (a path embedded in the
# binary would move everything after it).
dirs=("$tmp/a" "$tmp/second-checkout")
[[ -n "$(git status --porcelain --untracked-files=no)" ]] \
  && echo "note: the checkout has uncommitted changes; this builds the commit $COMMIT"
for d in "${dirs[@]}"; do
  mkdir -p "$d"
  git archive HEAD | tar -x -C "$d"
done

sums=()
for i in 0 1; do
  d="${dirs[$i]}"
  if [[ "${REPRO_FULL:-0}" == 1 ]]; then target="$d/target/static-nitro"; else target="$ROOT/target/static-nitro"; fi
  echo "== build $((i + 1)) of 2 in $d (target dir $target)"
  # Newer than any artifact in the shared target dir, so that the workspace
  # crates are compiled from this copy.
  find "$d" -type f -exec touch {} +
  start=$(date +%s)
  "$d/scripts/build-eif.sh" --binary-only --out "$d/out" --model "$MODEL" --target-dir "$target" \
    >"$tmp/build$i.log" 2>&1 || { tail -30 "$tmp/build$i.log"; fail "build in $d"; }
  echo "build $((i + 1)): $(( $(date +%s) - start )) s"
  grep -q "Compiling enclave-stage v.* ($d/enclave-stage)" "$tmp/build$i.log" \
    || { tail -5 "$tmp/build$i.log"; fail "the build in $d did not compile enclave-stage from $d"; }
  sums+=("$(sha256sum "$d/out/enclave-stage" | cut -d' ' -f1)")
  echo "enclave-stage sha256 ${sums[$i]}"
  # No path of this machine in the binary.
  for path in "$d" "$ROOT" "$target" "${CARGO_HOME:-$HOME/.cargo}" "$(rustc --print sysroot)"; do
    if grep -a -q -F "$path" "$d/out/enclave-stage"; then
      grep -a -o -F "$path[^[:space:]]*" "$d/out/enclave-stage" | sort -u | head -5 >&2 || true
      fail "the binary built in $d names $path"
    fi
  done
done
[[ "${sums[0]}" == "${sums[1]}" ]] || fail "the two builds differ: ${sums[0]} vs ${sums[1]}"
cmp -s "${dirs[0]}/out/build-record.json" "${dirs[1]}/out/build-record.json" \
  || { diff "${dirs[0]}/out/build-record.json" "${dirs[1]}/out/build-record.json" >&2 || true; fail "the two build records differ"; }
python3 - "${dirs[0]}/out/build-record.json" "${sums[0]}" "$SOURCE_DATE_EPOCH" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["binary"]["sha256"] == sys.argv[2], r["binary"]
assert r["source"]["source_date_epoch"] == int(sys.argv[3]), r["source"]
assert r["build"]["target"] == "x86_64-unknown-linux-musl" and r["build"]["features"] == ["nitro"]
assert any(l.startswith("release: ") for l in r["build"]["rustc"]), r["build"]["rustc"]
assert r["model"]["manifest_sha256"] and "manifest.json" in r["model"]["files"]
assert r["pipeline"]["layers"] == [[0, 3], [3, 6]]
PY

if docker info >/dev/null 2>&1; then
  echo "== the stage image twice (--image-only --no-cache) from ${dirs[1]}"
  d="${dirs[1]}"
  name="repro-test-$$"
  for i in 1 2; do
    start=$(date +%s)
    "$d/scripts/build-eif.sh" --image-only --no-cache --out "$d/img$i" --name "$name" --prefix repro-test \
      --model "$MODEL" --target-dir "$target" >"$tmp/image$i.log" 2>&1 \
      || { tail -30 "$tmp/image$i.log"; fail "image build $i"; }
    echo "image $i: $(( $(date +%s) - start )) s, layers $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["image"]["layers"])' "$d/img$i/build-record.json")"
    sleep 1
  done
  docker image rm "repro-test/enclave-stage-nitro:$name" "repro-test/enclave-stage-nitro-base:$name" >/dev/null 2>&1 || true
  cmp -s "$d/img1/build-record.json" "$d/img2/build-record.json" \
    || { diff "$d/img1/build-record.json" "$d/img2/build-record.json" >&2 || true; fail "the two image builds differ"; }
  python3 -c 'import json,sys; assert json.load(open(sys.argv[1]))["binary"]["sha256"] == sys.argv[2], "the image has another binary"' \
    "$d/img1/build-record.json" "${sums[0]}"
else
  echo "(no Docker engine: the image layers are not compared)"
fi

if [[ -x target/release/gateway ]]; then
  echo "== gateway policy from-build on the record"
  target/release/gateway policy from-build "${dirs[0]}/out/build-record.json" --mock --out "$tmp/policy.toml" \
    || fail "policy from-build"
  GATEWAY_PIPELINE__POLICY="$tmp/policy.toml" GATEWAY_PIPELINE__MODEL_DIR="$MODEL" \
    target/release/gateway check-config --config config/gateway-nitro.toml >"$tmp/check.out" 2>&1 \
    || { cat "$tmp/check.out"; fail "check-config with the policy written from the record"; }
fi
echo "reproducible build: OK (two folders, one binary: sha256 ${sums[0]})"
