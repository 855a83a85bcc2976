#!/usr/bin/env bash
# A virtualenv with llama-cpp-python built from source (about 6 minutes the
# first time), cached under target/; prints its path.
#   (no argument)  target/bench-venv: for benchmarks only, built for this
#                  CPU (GGML_NATIVE=ON); scripts/bench_peers.sh and
#                  scripts/bench_structured.sh use it
#   --test         target/test-venv-llama: the reference of
#                  scripts/test_gguf_models.py (scripts/test.sh), built
#                  portable (AVX2/FMA/F16C) so it runs on every x86-64 CI
#                  machine, with the gguf package that writes its fixtures
#                  and sentencepiece, which trains the SentencePiece one
# BENCH_LLAMA_PORTABLE=1 builds the benchmark venv portable too
# (target/bench-venv-portable), for CPUs where the native build crashes (a
# 2-core VM with AVX512-FP16 segfaulted in llama_decode with 0.3.36, 26 Nov
# 2026). BENCH_LLAMA_AVX512=1 builds it for AVX-512 (VNNI, VBMI, BF16)
# with explicit flags instead (target/bench-venv-avx512): on that VM this
# build runs where the native one crashed (27 Nov 2026), so the peer keeps
# its AVX-512 kernels. Built without pip's wheel cache: the cache would hand
# one venv the wheel built with another's flags.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PORTABLE="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
EXTRA=()
if [[ "${1:-}" == --test ]]; then
  VENV=target/test-venv-llama
  FLAGS="$PORTABLE"
  EXTRA=(gguf==0.19.0 numpy==2.4.6 sentencepiece==0.2.3)
elif [[ "${BENCH_LLAMA_PORTABLE:-0}" == 1 ]]; then
  VENV=target/bench-venv-portable
  FLAGS="$PORTABLE"
elif [[ "${BENCH_LLAMA_AVX512:-0}" == 1 ]]; then
  VENV=target/bench-venv-avx512
  FLAGS="$PORTABLE -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON"
else
  VENV=target/bench-venv
  FLAGS="-DGGML_NATIVE=ON"
fi
if [[ ! -x "$VENV/bin/python" ]]; then python3 -m venv "$VENV" >&2; fi
"$VENV/bin/python" -c "import llama_cpp" 2>/dev/null \
  || CMAKE_ARGS="$FLAGS" "$VENV/bin/pip" install -q --no-cache-dir llama-cpp-python==0.3.36 >&2
if [[ ${#EXTRA[@]} -gt 0 ]] && ! "$VENV/bin/python" -c "import gguf, numpy, sentencepiece" 2>/dev/null; then
  "$VENV/bin/pip" install -q "${EXTRA[@]}" >&2
fi
echo "$VENV"
