#!/usr/bin/env bash
# Per-request crypto (HPKE open/seal, receipt signatures, digests) against
# single-sentence inference. Writes benchmark_results/crypto.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --release -p gateway --example bench_crypto
