#!/usr/bin/env bash
# A/B benchmark of two commits on this machine, in one run: the embeddings
# benchmark (configured setup: 2 stages, 2 threads per stage, token budget
# 4096, bf16) and the completions benchmark of commit OLD and of this
# checkout, interleaved (old, new, old, new ...), so that drift on a shared
# machine hits both alike. Each side runs its own gateway and enclave-stage
# binaries under the same benchmark harness (this checkout's), with its own
# gateway config. Writes benchmark_results/ab.{json,md,png}
# (scripts/bench_ab_summary.py); the per-run outputs stay in target/ab/.
#
#   scripts/bench_ab.sh OLD_COMMIT [PASSES]      (PASSES default 2)
#
# OLD's binaries are built by scripts/build_old.sh (a worktree and a target
# directory of their own) into target/ab/old-bin.
# The script checks that the two sides' binaries differ and that each
# gateway accepts its own config. Takes about 6 minutes per pass on 2
# cores, plus the builds; the numbers only mean something on an otherwise idle
# machine. Needs scripts/setup.sh's models.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OLD="${1:?usage: scripts/bench_ab.sh OLD_COMMIT [PASSES]}"
PASSES="${2:-2}"
OLD_SHA="$(git rev-parse --verify "$OLD^{commit}")"
NEW_SHA="$(git rev-parse HEAD)"
[[ -z "$(git status --porcelain --untracked-files=no)" ]] || NEW_SHA="$NEW_SHA (with uncommitted changes)"
AB=target/ab
mkdir -p "$AB"
rm -rf "$AB/runs" && mkdir -p "$AB/runs" "$AB/old-bin/examples"

scripts/build_old.sh "$OLD_SHA"

echo "== new: $NEW_SHA"
cargo build --release --bin gateway --bin enclave-stage
cargo build --release -p gateway --example bench_embeddings --example bench_completions
# The completions harness takes its binaries from the folder above its own.
cp target/release/examples/bench_completions "$AB/old-bin/examples/"
for b in gateway enclave-stage; do
  if cmp -s "target/release/$b" "$AB/old-bin/$b"; then
    echo "bench_ab: the old and new $b are the same file: nothing to compare" >&2
    exit 1
  fi
done
target/release/gateway check-config --config config/gateway.toml >/dev/null
"$AB/old-bin/gateway" check-config --config "$AB/old-gateway.toml" >/dev/null

EMB=(--threads-per-stage 2 --token-budget 4096 --weights bf16 --rounds 3)
COMPL=(--completions-config 'threads_per_stage = 2')
for pass in $(seq 1 "$PASSES"); do
  echo "== pass $pass of $PASSES"
  target/release/examples/bench_embeddings "${EMB[@]}" --bin-dir "$AB/old-bin" \
    --config "$AB/old-gateway.toml" --out-dir "$AB/runs/emb-old-$pass" --note "A/B old $OLD_SHA" \
    >"$AB/runs/emb-old-$pass.log" 2>&1
  target/release/examples/bench_embeddings "${EMB[@]}" \
    --out-dir "$AB/runs/emb-new-$pass" --note "A/B new $NEW_SHA" >"$AB/runs/emb-new-$pass.log" 2>&1
  "$AB/old-bin/examples/bench_completions" "${COMPL[@]}" --out "$AB/runs/compl-old-$pass" \
    >"$AB/runs/compl-old-$pass.log" 2>&1
  target/release/examples/bench_completions "${COMPL[@]}" --out "$AB/runs/compl-new-$pass" \
    >"$AB/runs/compl-new-$pass.log" 2>&1
done
python3 scripts/bench_ab_summary.py --runs "$AB/runs" --old "$OLD_SHA" --new "$NEW_SHA" \
  --out benchmark_results/ab
