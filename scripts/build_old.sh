#!/usr/bin/env bash
# Builds an older commit's gateway and enclave-stage for the A/B benchmarks
# (scripts/bench_ab.sh, scripts/bench_instructions.sh): its binaries into
# target/ab/old-bin/, its gateway config into target/ab/old-gateway.toml.
#
#   scripts/build_old.sh OLD_COMMIT
#
# OLD is checked out in a git worktree (target/ab/worktree) and built with a
# target directory of its own (target/ab/target): cargo hashes workspace
# crates by their path inside the workspace, so a shared target directory
# would mix the two checkouts' builds. The first time, the dependencies
# this checkout already built are copied in (not the workspace crates), so
# only OLD's own crates compile.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OLD_SHA="$(git rev-parse --verify "${1:?usage: scripts/build_old.sh OLD_COMMIT}^{commit}")"
AB=target/ab
WT="$AB/worktree"
mkdir -p "$AB/old-bin/examples"
if [[ ! -d "$AB/target/release/deps" && -d target/release/deps ]]; then
  mkdir -p "$AB/target/release"
  cp -a target/release/deps target/release/build target/release/.fingerprint "$AB/target/release/"
  for c in gateway enclave-stage enclave_stage proto client client-python client_python fuzz _native; do
    rm -rf "$AB/target/release/.fingerprint/$c-"* "$AB/target/release/deps/lib$c-"* \
      "$AB/target/release/deps/$c-"* "$AB/target/release/build/$c-"*
  done
fi
echo "== old: $OLD_SHA"
git worktree remove --force "$WT" 2>/dev/null || rm -rf "$WT"
git worktree add --detach "$WT" "$OLD_SHA" >/dev/null
ln -sfn "$PWD/models" "$WT/models"
(cd "$WT" && CARGO_TARGET_DIR="$PWD/../target" cargo build --release -p gateway -p enclave-stage --bin gateway --bin enclave-stage)
cp "$AB/target/release/gateway" "$AB/target/release/enclave-stage" "$AB/old-bin/"
cp "$WT/config/gateway.toml" "$AB/old-gateway.toml"
echo "$OLD_SHA" >"$AB/old-bin/COMMIT"
git worktree remove --force "$WT"
