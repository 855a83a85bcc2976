#!/usr/bin/env bash
# Structured outputs' cost (issue 32): decode under a JSON schema and under
# tools against unconstrained decoding through the gateway, the mask time
# per token, and llama.cpp's grammar sampler on the same GGUF (llama-cpp-python
# built from source into the benchmark-only virtualenv target/bench-venv, as
# scripts/bench_peers.sh does; about 6 minutes the first time).
#
#   scripts/bench_structured.sh [ROUNDS]     (default 5, about 5 minutes;
#   BENCH_LLAMA_PORTABLE=1 for the portable llama.cpp build, see
#   scripts/llama_venv.sh)
# Writes benchmark_results/structured.{json,md,png}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROUNDS="${1:-5}"
scripts/setup.sh >/dev/null
VENV="$(scripts/llama_venv.sh)"
cargo build --release
cargo build --release -p enclave-stage --example bench_grammar
python3 scripts/bench_structured.py --rounds "$ROUNDS" --llama-python "$VENV/bin/python" \
  --commit "$(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty)" --out benchmark_results
