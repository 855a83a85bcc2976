#!/usr/bin/env bash
# Renders every Kubernetes overlay (docker/k8s/overlays/*) with
# `kubectl kustomize` and validates each rendered object offline against the
# Kubernetes JSON schemas (kubernetes-validate from PyPI, strict: unknown
# fields are errors), for the Kubernetes versions EKS runs. No cluster is
# needed or contacted. Run by scripts/test.sh.
#
# Env: K8S_VERSIONS="1.30 1.33" (default), K8S_VENV (default target/k8s-venv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VERSIONS="${K8S_VERSIONS:-1.30 1.33}"
VENV="${K8S_VENV:-target/k8s-venv}"
command -v kubectl >/dev/null || {
  echo "test-k8s-manifests: kubectl not found (it renders the kustomize overlays)" >&2
  exit 1
}
if [[ ! -x "$VENV/bin/kubernetes-validate" ]]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check kubernetes-validate==1.37.0
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
for overlay in docker/k8s/overlays/*/; do
  name="$(basename "$overlay")"
  kubectl kustomize "$overlay" >"$out/$name.yaml"
  kinds="$(grep -c '^kind:' "$out/$name.yaml")"
  for v in $VERSIONS; do
    if ! "$VENV/bin/kubernetes-validate" --strict --quiet -k "$v" "$out/$name.yaml"; then
      echo "FAIL overlay $name against Kubernetes $v" >&2
      exit 1
    fi
  done
  # What the overlay must contain (the issue's list): a missing object is a failure.
  for want in "kind: Deployment" "kind: Service" "kind: HorizontalPodAutoscaler" \
    "kind: PodDisruptionBudget" "kind: NetworkPolicy" "clusterIP: None" \
    "path: /healthz" "path: /readyz"; do
    grep -q "$want" "$out/$name.yaml" || { echo "FAIL overlay $name has no '$want'" >&2; exit 1; }
  done
  echo "PASS overlay $name: $kinds objects valid against Kubernetes $VERSIONS"
done
grep -q "aws.ec2.nitro/nitro_enclaves" "$out/nitro.yaml" || { echo "FAIL nitro overlay requests no enclave device" >&2; exit 1; }
grep -q "hugepages-2Mi" "$out/nitro.yaml" || { echo "FAIL nitro overlay requests no hugepages" >&2; exit 1; }
! grep -q "attestation.*mock" "$out/nitro.yaml" || { echo "FAIL nitro overlay mentions mock attestation" >&2; exit 1; }
echo "PASS nitro overlay: enclave device and hugepages requested, no mock"
