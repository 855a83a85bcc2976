#!/usr/bin/env bash
# Completions side by side with llama.cpp (issue 12's peer benchmark, the
# part built so far): llama-cpp-python built from source for this CPU, in a
# benchmark-only virtualenv (target/bench-venv; never what CI or the tests
# use), against the bare in-process stage code, interleaved round by round.
# llama.cpp gets the packaged Q4_1 GGUF and a Q8_0 copy it re-quantizes
# itself (llama_model_quantize), so both sides run the same quantization.
#
#   scripts/bench_peers.sh [ROUNDS]     # default 3; about 10 minutes,
#                                       # plus ~6 for the first llama.cpp build
# Writes benchmark_results/peers.{json,md}, peers-table.md and peers.png.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROUNDS="${1:-3}"
scripts/setup.sh >/dev/null
VENV=target/bench-venv
if [[ ! -x "$VENV/bin/python" ]]; then python3 -m venv "$VENV"; fi
"$VENV/bin/python" -c "import llama_cpp" 2>/dev/null \
  || CMAKE_ARGS="-DGGML_NATIVE=ON" "$VENV/bin/pip" install -q llama-cpp-python
"$VENV/bin/python" -c "import numpy, matplotlib" 2>/dev/null \
  || "$VENV/bin/pip" install -q numpy matplotlib
cargo build --release -p enclave-stage --example bench_decode
Q8="target/bench/SmolLM2-135M-Instruct.Q8_0.gguf"
mkdir -p target/bench
if [[ ! -f "$Q8" ]]; then
  "$VENV/bin/python" - "$Q8" <<'PY'
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
p.allow_requantize = True
src = b"models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
rc = llama_cpp.llama_model_quantize(src, sys.argv[1].encode(), p)
sys.exit(rc)
PY
fi
"$VENV/bin/python" scripts/bench_peers.py --q8-gguf "$Q8" --rounds "$ROUNDS" \
  --commit "$(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty)" --out benchmark_results
