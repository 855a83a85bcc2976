#!/usr/bin/env bash
# Completions benchmark: bare in-process Candle vs the gateway with a 1-stage
# and a 2-stage SmolLM2 pipeline. Builds the release binaries and the
# benchmark, then runs it from the repository root. Writes
# benchmark_results/completions.{json,md}. Arguments go to the benchmark
# (--max-tokens, --single-runs, --concurrency, --out). Honours
# CARGO_TARGET_DIR. Takes about 3 minutes on a 2-core machine; the numbers are
# only meaningful on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -f models/smollm2-135m-instruct/tokenizer.json ]]; then
  echo "models/smollm2-135m-instruct missing: run scripts/setup.sh first" >&2
  exit 1
fi
cargo build --release --bin gateway --bin enclave-stage
cargo build --release -p gateway --example bench_completions
# The gateways get config/gateway.toml's completions threads unless the
# arguments say otherwise (--completions-config 'threads_per_stage = 1').
if [[ " $* " != *" --completions-config "* ]]; then
  set -- --completions-config 'threads_per_stage = 2' "$@"
fi
exec "${CARGO_TARGET_DIR:-target}/release/examples/bench_completions" "$@"
