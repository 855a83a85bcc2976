#!/usr/bin/env bash
# Embeddings benchmark: bare in-process Candle vs the gateway pipeline.
# Builds the release binaries and the benchmark, then runs it from the
# repository root. Writes benchmark_results/embeddings.{json,md}.
#
#   scripts/bench_embeddings.sh                      # default setups (below)
#   scripts/bench_embeddings.sh --threads-per-stage 1 --gateway-secs 10
#
# Arguments replace the defaults and go to the benchmark (see --help).
# Honours CARGO_TARGET_DIR. Needs the model set up by scripts/setup.sh.
# Takes about 5 minutes with the defaults on a 2-core machine; the numbers
# are only meaningful on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ ! -f models/all-minilm-l6-v2/model.safetensors ]]; then
  echo "models/all-minilm-l6-v2 missing: run scripts/setup.sh first" >&2
  exit 1
fi

cargo build --release
cargo build --release -p gateway --example bench_embeddings

target_dir="${CARGO_TARGET_DIR:-target}"
if [[ $# -eq 0 ]]; then
  # The configured setup (threads_per_stage = 2, token_budget = 4096), plus
  # 1 thread per stage and smaller micro-batches as comparisons; bare Candle
  # with bf16 (the default) and f32 weights.
  set -- --threads-per-stage 1,2 --token-budget 4096,512 --weights bf16,f32
fi
exec "$target_dir/release/examples/bench_embeddings" "$@"
