#!/usr/bin/env bash
# The multi-container test alone (docs/containers.md): builds the images
# (static musl build, scripts/build-images.sh), runs the gateway and two stage
# containers with docker/compose.yaml, checks the reference vectors, stops and
# restarts each stage under load, and removes everything it created.
# Needs a Docker engine, docker compose (or docker-compose), musl-gcc and the
# x86_64-unknown-linux-musl Rust target; skipped (and passes) without Docker.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
CONTAINERS_E2E=1 cargo test --release --workspace --features enclave-stage/fault-injection \
  --test containers_e2e -- --nocapture
