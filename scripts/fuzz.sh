#!/usr/bin/env bash
# Coverage-guided fuzzing (libFuzzer through cargo-fuzz, stable toolchain, no
# sanitizer) of every parser that takes bytes from outside a process: the
# targets of gateway/fuzz (docs/fuzzing.md).
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]   # default: 60 s for every target
#
# Each campaign starts from the generated seeds (gateway/fuzz/examples/fuzz_seeds.rs) and the committed
# corpus (gateway/fuzz/corpus/<target>); what it finds goes to
# target/fuzz/corpus/<target>, crashes to target/fuzz/artifacts/<target>/,
# logs to target/fuzz/logs/. Environment:
#   FUZZ_JOBS=N    targets run N at a time (default 1; this machine has 2 cores)
#   FUZZ_MERGE=1   afterwards, add the inputs that reach new coverage to the
#                  committed corpus (libFuzzer -set_cover_merge=1 over edges
#                  only: the fewest inputs that reach every edge reached)
#   FUZZ_REPORT=1  afterwards, write benchmark_results/fuzz.{json,md}
# Exits 1 if any target crashed, hung or ran out of memory.
# `cargo test -p fuzz` replays the seeds and the committed corpus without a
# fuzzer (CI does that); this script is for campaigns.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SECONDS_PER_TARGET="${1:-60}"
shift || true
FUZZ_DIR=gateway/fuzz
WORK=target/fuzz
CARGO_FUZZ_VERSION=0.13.2
FUZZ_ARGS=(--fuzz-dir "$FUZZ_DIR" --sanitizer none --features libfuzzer)

if ! cargo fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
  echo "fuzz: installing cargo-fuzz $CARGO_FUZZ_VERSION (crates.io)"
  cargo install --locked --quiet cargo-fuzz --version "$CARGO_FUZZ_VERSION"
fi
if [[ $# -gt 0 ]]; then
  TARGETS=("$@")
else
  mapfile -t TARGETS < <(basename -s .rs "$FUZZ_DIR"/fuzz_targets/*.rs)
fi

echo "fuzz: building ${#TARGETS[@]} targets (instrumented, release with debug assertions)"
cargo fuzz build "${FUZZ_ARGS[@]}"
# The targets run from these binaries, not through `cargo fuzz run`, which
# would rebuild from whatever the working tree holds by then.
BIN="target/$(rustc -vV | sed -n 's/^host: //p')/release"
rm -rf "$WORK/seeds" "$WORK/logs"
mkdir -p "$WORK/logs"
cargo run --quiet --release -p fuzz --example fuzz_seeds -- "$WORK/seeds"

run_one() {
  local t="$1"
  mkdir -p "$WORK/corpus/$t" "$WORK/artifacts/$t" "$FUZZ_DIR/corpus/$t"
  local rc=0
  "$BIN/$t" "$WORK/corpus/$t" "$FUZZ_DIR/corpus/$t" "$WORK/seeds/$t" \
    -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
    -max_len=65536 -print_final_stats=1 -artifact_prefix="$WORK/artifacts/$t/" \
    >"$WORK/logs/$t.log" 2>&1 || rc=$?
  echo "$rc" >"$WORK/logs/$t.rc"
  echo "fuzz: $t done (exit $rc): $(grep -E '^#[0-9]+' "$WORK/logs/$t.log" | tail -1)"
}

jobs_max="${FUZZ_JOBS:-1}"
for t in "${TARGETS[@]}"; do
  while [[ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]]; do wait -n || true; done
  echo "fuzz: $t for ${SECONDS_PER_TARGET}s"
  run_one "$t" &
done
wait

if [[ "${FUZZ_MERGE:-}" == 1 ]]; then
  for t in "${TARGETS[@]}"; do
    echo "fuzz: merging new coverage of $t into $FUZZ_DIR/corpus/$t"
    "$BIN/$t" "$FUZZ_DIR/corpus/$t" "$WORK/corpus/$t" "$WORK/seeds/$t" \
      -set_cover_merge=1 -use_counters=0 -use_value_profile=0 -timeout=10 -rss_limit_mb=2048 -max_len=65536 >"$WORK/logs/$t.merge.log" 2>&1
  done
fi

python3 scripts/fuzz_report.py "$WORK" "$SECONDS_PER_TARGET" "${TARGETS[@]}"
failed=0
for t in "${TARGETS[@]}"; do
  [[ "$(cat "$WORK/logs/$t.rc")" == 0 ]] || { echo "fuzz: $t FAILED: see $WORK/logs/$t.log and $WORK/artifacts/$t/" >&2; failed=1; }
done
exit "$failed"
