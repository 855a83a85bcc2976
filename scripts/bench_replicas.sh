#!/usr/bin/env bash
# Throughput of the embeddings pipeline with 1, 2 and 3 replicas behind one
# gateway (issue 14), on this machine: gateway/examples/bench_embeddings run
# once per replica count and round, the counts interleaved so that drift on
# the shared machine hits all alike. Writes benchmark_results/replicas.{json,md,png}.
# On 2 cores more replicas cannot add throughput (every replica competes for
# the same cores); the run shows what they cost, and docs/scaling.md models
# real hosts.
#
# Usage: scripts/bench_replicas.sh [ROUNDS] [REPLICA COUNTS...]   (default: 2 rounds, 1 2 3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROUNDS="${1:-2}"
shift || true
COUNTS=("${@:-1 2 3}")
read -r -a COUNTS <<<"${COUNTS[*]}"
scripts/setup.sh >/dev/null
cargo build --release --workspace
cargo build --release -p gateway --example bench_embeddings
OUT=target/bench-replicas
rm -rf "$OUT"
mkdir -p "$OUT"
for n in "${COUNTS[@]}"; do
  # The shipped config, embeddings only, with `replicas = n`.
  python3 - "$n" >"$OUT/gateway-r$n.toml" <<'PYEOF'
import re, sys
n = sys.argv[1]
out, skip = [], False
for line in open("config/gateway.toml"):
    header = re.match(r"^\s*\[\[?([A-Za-z0-9_.]+)\]?\]", line)
    if header:
        skip = header.group(1).split(".")[0] == "completions"
    if skip:
        continue
    out.append(line)
    if line.strip() == "[pipeline]":
        out.append(f"replicas = {n}\n")
sys.stdout.write("".join(out))
PYEOF
done
VENV=target/bench-venv
if [[ ! -x "$VENV/bin/python" ]]; then python3 -m venv "$VENV"; fi
"$VENV/bin/python" -c "import matplotlib" 2>/dev/null || "$VENV/bin/pip" install -q matplotlib
for round in $(seq 1 "$ROUNDS"); do
  for n in "${COUNTS[@]}"; do
    echo "== round $round, replicas = $n"
    ./target/release/examples/bench_embeddings --config "$OUT/gateway-r$n.toml" \
      --baseline-threads 2 --baseline-secs 3 --gateway-secs 12 --rounds 1 \
      --out-dir "$OUT/r$n-round$round" --note "replicas = $n, round $round"
  done
done
"$VENV/bin/python" scripts/bench_replicas.py "$OUT" benchmark_results
