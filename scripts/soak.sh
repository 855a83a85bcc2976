#!/usr/bin/env bash
# Soak the gateway under hostile load (issue 15): the shipped config driven
# by CONNECTIONS concurrent hostile and well-formed clients for MINUTES, two
# stages killed on the way; writes benchmark_results/soak.{json,md}.
#   scripts/soak.sh [MINUTES=10] [CONNECTIONS=1000]
# Needs scripts/setup.sh to have run (models). Exit 1 if any well-formed
# request hung, was lost or got an unclean answer.
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES="${1:-10}"
CONNECTIONS="${2:-1000}"
cargo build --release -p gateway -p enclave-stage
# One descriptor per client connection, on both ends.
ulimit -n "$(ulimit -Hn)" || true
exec python3 scripts/soak.py --minutes "$MINUTES" --connections "$CONNECTIONS"
