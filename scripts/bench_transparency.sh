#!/usr/bin/env bash
# What logging every receipt costs (issue 49): embeddings throughput at
# C = 1, 8, 64 through the real gateway (2 stages, the configured setup) with
# [transparency] on and `log_receipts` off and on, interleaved (off, on,
# then on, off ...) so that drift on a shared machine hits both alike; the same
# binaries, each run with a fresh log. Also the size of an RFC 9942 COSE
# receipt for trees of 10^3 ... 10^7 entries (`gateway log receipt-size`:
# a real receipt signed over a proof of that tree's length). Writes
# benchmark_results/transparency.{json,md,png} (scripts/bench_transparency_summary.py).
#
#   scripts/bench_transparency.sh [PASSES]       (default 2)
#
# About 3 minutes per pass on 2 cores; the numbers mean something only on
# an otherwise idle machine. Needs scripts/setup.sh's models.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PASSES="${1:-2}"
OUT=target/bench-transparency
rm -rf "$OUT" && mkdir -p "$OUT/runs"
cargo build --release --bin gateway --bin enclave-stage
cargo build --release -p gateway --example bench_embeddings
EMB=(--threads-per-stage 2 --token-budget 4096 --weights bf16 --rounds 3 --baseline-threads 2 --baseline-secs 3)
for pass in $(seq 1 "$PASSES"); do
  # Odd passes run off first, even passes on first: drift within a pass
  # hits both sides alike.
  order=(off on)
  (( pass % 2 == 1 )) || order=(on off)
  for mode in "${order[@]}"; do
    run="$mode-$pass"
    python3 - config/gateway.toml "$OUT/$run.toml" "$mode" "$PWD/$OUT/log-$run" <<'PY'
import re, sys
src, dst, mode, log_dir = sys.argv[1:]
text = open(src).read()
table = (f'[transparency]\ndir = "{log_dir}"\norigin = "bench.example/log"\n'
         f'log_local_build = true\nlog_receipts = {"true" if mode == "on" else "false"}\n\n')
text, n = re.subn(r"\[transparency\]\n(?:[^\[\n][^\n]*\n|\n)*", table, text, count=1)
if n != 1:
    sys.exit("config/gateway.toml has no [transparency] table")
open(dst, "w").write(text)
PY
    echo "== pass $pass of $PASSES: log_receipts $mode"
    target/release/examples/bench_embeddings "${EMB[@]}" --config "$OUT/$run.toml" \
      --out-dir "$OUT/runs/$run" --note "log_receipts $mode" >"$OUT/runs/$run.log" 2>&1 \
      || { tail -30 "$OUT/runs/$run.log"; exit 1; }
    if [[ $mode == on ]]; then
      target/release/gateway log entries --dir "$OUT/log-$run" | grep -c '"kind":"receipt"' >"$OUT/runs/$run.receipts" || true
    fi
  done
done
for n in 1000 10000 100000 1000000 10000000; do
  target/release/gateway log receipt-size --entries "$n"
done >"$OUT/receipt-sizes.jsonl"
python3 scripts/bench_transparency_summary.py --runs "$OUT/runs" --sizes "$OUT/receipt-sizes.jsonl" \
  --commit "$(git rev-parse HEAD)" --out benchmark_results
