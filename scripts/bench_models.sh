#!/usr/bin/env bash
# Your own GGUF beside llama.cpp (issue 31): a 1B-class random-weight Llama
# shape (hidden 2048, 16 layers, GQA 32/8, SmolLM2's vocabulary) written in
# F16 by scripts/make_gguf_fixtures.py and quantized to Q4_K_M by llama.cpp
# (target/bench-models/, 2.8 GB of files, made once), then decode rate and
# time to first token after a 512-token prompt through the gateway with 1, 2
# and 4 stages beside llama.cpp on the same file, and each stage's peak RSS.
#
#   scripts/bench_models.sh [ROUNDS]     (default 5; about 15 minutes on
#   2 cores after the files exist; BENCH_LLAMA_PORTABLE=1 for the portable
#   llama.cpp build, BENCH_LLAMA_AVX512=1 for its AVX-512 build, see
#   scripts/llama_venv.sh)
# Writes benchmark_results/models.{json,md,png}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROUNDS="${1:-5}"
scripts/setup.sh >/dev/null
cargo build --release --bin gateway --bin enclave-stage
# The fixture is made with the test virtualenv's gguf package and llama.cpp.
TEST_VENV="$(scripts/llama_venv.sh --test)"
DIR=target/bench-models
"$TEST_VENV/bin/python" scripts/make_gguf_fixtures.py --shape 1b \
  --source models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf --out "$DIR"
if [[ ! -f "$DIR/llama-1b.Q4_K_M.gguf" ]]; then
  "$TEST_VENV/bin/python" - "$DIR" <<'PYEOF'
import ctypes, os, sys, llama_cpp
d = sys.argv[1]
src, dst = f"{d}/llama-1b.F16.gguf", f"{d}/llama-1b.Q4_K_M.gguf"
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 2
assert llama_cpp.llama_model_quantize(src.encode(), (dst + ".part").encode(), ctypes.byref(p)) == 0
os.replace(dst + ".part", dst)
PYEOF
fi
VENV="$(scripts/llama_venv.sh)"
python3 scripts/bench_models.py --model "$DIR/llama-1b.Q4_K_M.gguf" --rounds "$ROUNDS" \
  --llama-python "$VENV/bin/python" \
  --commit "$(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty)"
