#!/usr/bin/env bash
# Installs what a static musl build of the enclave needs when it is missing:
# the x86_64-unknown-linux-musl standard library (rustup) and Debian's
# musl-tools (musl-gcc, for ring's C parts), as scripts/test.sh installs
# PostgreSQL, so the tests that build the enclave image work on a fresh
# machine. Used by scripts/test-enclave-image.sh and
# scripts/test-reproducible-build.sh.
set -euo pipefail
rustup target list --installed 2>/dev/null | grep -qx x86_64-unknown-linux-musl \
  || rustup target add x86_64-unknown-linux-musl
if ! command -v musl-gcc >/dev/null; then
  echo "== installing Debian's musl-tools (the enclave binary is a static musl build)"
  SUDO=""; [[ "$(id -u)" == 0 ]] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq musl-tools >/dev/null
fi
