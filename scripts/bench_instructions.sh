#!/usr/bin/env bash
# Instructions per plain embeddings request of an older commit and of this
# checkout, counted by callgrind (scripts/bench_instructions.py), immune to
# the VM's drift. Writes benchmark_results/instructions.{json,md,png}.
#
#   scripts/bench_instructions.sh OLD_COMMIT [REQUESTS]   (default 200)
#
# Needs valgrind (installed here from Debian's packages when missing) and
# scripts/setup.sh's models. About 10 minutes on 2 cores, most of it the
# stages loading their weights under valgrind.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OLD_SHA="$(git rev-parse --verify "${1:?usage: scripts/bench_instructions.sh OLD_COMMIT [REQUESTS]}^{commit}")"
command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind; }
scripts/build_old.sh "$OLD_SHA"
cargo build --release --bin gateway --bin enclave-stage
python3 scripts/bench_instructions.py --old-bin target/ab/old-bin --old-config target/ab/old-gateway.toml \
  --old-commit "$OLD_SHA" --requests "${2:-200}"
