#!/usr/bin/env bash
# Side by side with the tools people run unprotected (issue 12), each part
# interleaved round by round, peers installed from PyPI into a
# benchmark-only virtualenv (target/bench-venv; never what CI or the tests
# use):
# - completions: llama.cpp (llama-cpp-python built from source for this CPU)
#   against the bare in-process stage code; llama.cpp gets the packaged Q4_1
#   GGUF and a Q8_0 copy it re-quantizes itself (llama_model_quantize), so
#   both sides run the same quantization;
# - embeddings: ONNX Runtime f32 / int8 (MiniLM exported with torch at
#   benchmark time) and sentence-transformers against bare Candle and the
#   gateway with the shipped config's 2 stages.
#
#   scripts/bench_peers.sh [ROUNDS] [all|completions|embeddings]
#     default 3 rounds, all: about 25 minutes, plus ~6 for the first
#     llama.cpp build and ~2 for the torch/onnxruntime download
# Writes benchmark_results/peers.{json,md} and peers.png (a part not run
# keeps its previous results).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROUNDS="${1:-3}"
PART="${2:-all}"
scripts/setup.sh >/dev/null
VENV="$(scripts/llama_venv.sh)"
"$VENV/bin/python" -c "import numpy, matplotlib, onnx, onnxruntime, sentence_transformers, torch" 2>/dev/null \
  || "$VENV/bin/pip" install -q numpy matplotlib onnx onnxruntime sentence-transformers torch
cargo build --release
cargo build --release -p enclave-stage --example bench_decode
cargo build --release -p gateway --example bench_embeddings --example bench_completions
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
"$VENV/bin/python" scripts/bench_peers.py --q8-gguf "$Q8" --rounds "$ROUNDS" --part "$PART" \
  --commit "$(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty)" --out benchmark_results
