#!/usr/bin/env bash
# The benchmark-only virtualenv (target/bench-venv; never what CI or the
# tests use) with llama-cpp-python built from source for this CPU
# (GGML_NATIVE=ON; about 6 minutes the first time). Prints the venv's path.
# Used by scripts/bench_peers.sh and scripts/bench_structured.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=target/bench-venv
if [[ ! -x "$VENV/bin/python" ]]; then python3 -m venv "$VENV" >&2; fi
"$VENV/bin/python" -c "import llama_cpp" 2>/dev/null \
  || CMAKE_ARGS="-DGGML_NATIVE=ON" "$VENV/bin/pip" install -q llama-cpp-python >&2
echo "$VENV"
