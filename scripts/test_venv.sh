#!/usr/bin/env bash
# The virtualenv of the Python test dependencies (scripts/requirements-test.txt:
# openai, LangChain, jsonschema, numpy, cryptography), cached in
# target/test-venv; prints its path. scripts/test.sh makes it and puts it
# first on PATH; nothing else installs these (scripts/setup.sh and
# scripts/start.sh install nothing).
# Made with the `python3` on PATH (PYTHON=... to choose another); on Debian and
# Ubuntu `python3 -m venv` needs the python3-venv package.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
VENV=target/test-venv
REQ=scripts/requirements-test.txt
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV" >&2 || {
    rm -rf "$VENV"
    echo "test_venv: '$PY -m venv' failed; on Debian/Ubuntu: apt-get install python3-venv" >&2
    exit 1
  }
fi
# Installed once per version of the requirements file (a copy is kept in the venv).
if ! cmp -s "$REQ" "$VENV/requirements-test.txt"; then
  echo "test_venv: installing $REQ into $VENV ..." >&2
  "$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$REQ" >&2
  cp "$REQ" "$VENV/requirements-test.txt"
fi
echo "$VENV"
