#!/usr/bin/env bash
# The benchmark-only virtualenv (never what CI or the tests use) with
# llama-cpp-python built from source (about 6 minutes the first time).
# Prints the venv's path. Used by scripts/bench_peers.sh and
# scripts/bench_structured.sh.
#   target/bench-venv            built for this CPU (GGML_NATIVE=ON)
#   target/bench-venv-portable   with BENCH_LLAMA_PORTABLE=1: AVX2/FMA/F16C
#                                only, for CPUs where the native build crashes
#                                (a 2-core VM with AVX512-FP16 segfaulted in
#                                llama_decode with 0.3.36, 26 Nov 2026)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ "${BENCH_LLAMA_PORTABLE:-0}" == 1 ]]; then
  VENV=target/bench-venv-portable
  FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
else
  VENV=target/bench-venv
  FLAGS="-DGGML_NATIVE=ON"
fi
if [[ ! -x "$VENV/bin/python" ]]; then python3 -m venv "$VENV" >&2; fi
"$VENV/bin/python" -c "import llama_cpp" 2>/dev/null \
  || CMAKE_ARGS="$FLAGS" "$VENV/bin/pip" install -q llama-cpp-python==0.3.36 >&2
echo "$VENV"
