#!/usr/bin/env bash
# Renders every Kubernetes overlay (docker/k8s/overlays/*) with
# `kubectl kustomize` and validates each rendered object offline against the
# Kubernetes JSON schemas (kubernetes-validate from PyPI, strict: unknown
# fields are errors), for the Kubernetes versions EKS runs. Then it checks the
# rendered nitro overlay against what AWS's nitro-cli and device plugin need
# (issue 33): seccomp that allows vsock on the runner, hugepages-1Gi and no
# 2Mi pages, one aws.ec2.nitro/nitro_enclaves per enclave and the enclave
# CPUs as aws.ec2.nitro/nitro_enclaves_cpus, one runner pod per node (required
# anti-affinity on the hostname, no surge), the fixed CIDs and routes of the
# single EIF, and readiness and liveness probes that follow the runner; and
# what a first bring-up needs (issue 48): a runner memory limit that holds
# any EIF its enclaves can run (a quarter of the largest enclave, nitro-cli's
# E26 rule, + the runner's 256 MiB), the node's start lock on a hostPath,
# the runner's LOG_DIR on a volume, its log as the termination message, no
# host-proxy route on vsock port 9000. No cluster is needed or contacted.
# Run by scripts/test.sh.
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
! grep -q "attestation.*mock" "$out/nitro.yaml" || { echo "FAIL nitro overlay mentions mock attestation" >&2; exit 1; }
# The nitro overlay against what issue 33 found (AWS's nitro-cli and device
# plugin). Each check names what it guards; all failures are listed.
"$VENV/bin/python" - "$out/nitro.yaml" <<'PY'
import math, re, sys, yaml

docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
def find(kind, name):
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"].startswith(name):
            return d
    sys.exit(f"FAIL nitro overlay has no {kind} {name}")
dep = find("Deployment", "embeddings-stages")
pod = dep["spec"]["template"]["spec"]
runners = [c for c in pod["containers"] if "run-enclaves.sh" in " ".join(c.get("command", []) + c.get("args", []))]
if len(runners) != 1:
    sys.exit("FAIL nitro overlay: embeddings-stages must have exactly one container running run-enclaves.sh")
(c,) = runners
env = {e["name"]: e.get("value") for e in c.get("env", [])}
res = c.get("resources", {})
req, lim = res.get("requests", {}), res.get("limits", {})
stages = int(env.get("STAGES", "2"))
cpus = int(env.get("ENCLAVE_CPUS", "2"))
mems = [int(m) for m in (env.get("ENCLAVE_MEMORY_MIB") or "0").split(",")]
mems = mems * stages if len(mems) == 1 else mems
fails = []
def check(ok, what):
    if not ok:
        fails.append(what)

# vsock: RuntimeDefault refuses socket(AF_VSOCK) (containerd, moby).
seccomp = (c.get("securityContext", {}).get("seccompProfile")
           or pod.get("securityContext", {}).get("seccompProfile") or {}).get("type")
check(seccomp in ("Unconfined", "Localhost"),
      f"the runner's seccomp profile is {seccomp}: it must allow socket(AF_VSOCK) (Unconfined, or a Localhost profile)")
# The Nitro allocator reserves 1 GiB pages first; nitro-cli gives an enclave whole pages.
gib = sum(math.ceil(m / 1024) for m in mems)
check(req.get("hugepages-1Gi") == f"{gib}Gi" and lim.get("hugepages-1Gi") == f"{gib}Gi",
      f"hugepages-1Gi must be {gib}Gi in requests and limits (ENCLAVE_MEMORY_MIB {mems} in whole GiB), not {req.get('hugepages-1Gi')}/{lim.get('hugepages-1Gi')}")
check(not any(re.search("(?i)hugepages-2Mi", str(x)) for x in (req, lim, pod.get("volumes", []))),
      "hugepages-2Mi requested or mounted: the allocator reserves 1 GiB pages first")
# AWS's device plugin: one aws.ec2.nitro/nitro_enclaves unit per enclave
# (MAX_ENCLAVES_PER_NODE, at most 4), one aws.ec2.nitro/nitro_enclaves_cpus
# unit per enclave CPU (ENCLAVE_CPU_ADVERTISEMENT=true).
for k, want in (("aws.ec2.nitro/nitro_enclaves", stages), ("aws.ec2.nitro/nitro_enclaves_cpus", stages * cpus)):
    check(str(req.get(k)) == str(want) and str(lim.get(k)) == str(want),
          f"{k} must be {want} in requests and limits ({stages} enclaves x {cpus} CPUs), not {req.get(k)}/{lim.get(k)}")
# One runner per node: the CIDs and the parent's vsock ports are node-wide.
labels = dep["spec"]["template"]["metadata"]["labels"]
terms = pod.get("affinity", {}).get("podAntiAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", [])
check(any(t.get("topologyKey") == "kubernetes.io/hostname"
          and all(labels.get(k) == v for k, v in t.get("labelSelector", {}).get("matchLabels", {}).items())
          and t.get("labelSelector", {}).get("matchLabels") for t in terms),
      "no required podAntiAffinity on kubernetes.io/hostname selecting the pod's own labels (one runner per node)")
roll = dep["spec"].get("strategy", {}).get("rollingUpdate", {})
check(dep["spec"].get("strategy", {}).get("type") == "Recreate" or str(roll.get("maxSurge")) == "0",
      "rolling updates must not surge (maxSurge 0): a surge pod has no node to go to")
# The single EIF from build-eif.sh (--stage-from-cid 16): fixed CIDs 16.., parent port 8001.
base = env.get("CID_BASE")
check(base == "16", f"CID_BASE must be 16, the EIF's --stage-from-cid, not {base}")
check("POD_IP" not in env, "CIDs derived from the pod's IP")
routes = (env.get("ROUTES") or "").split()
want_routes = ["tcp://0.0.0.0:9000=vsock://16:9000", "tcp://0.0.0.0:9001=vsock://17:9000", "vsock://any:8001=vsock://17:9000"]
check(all(r in routes for r in want_routes), f"ROUTES must hold {want_routes}, not {routes}")
gw = find("ConfigMap", "gateway-config")["data"]["gateway.toml"]
check(re.search(r'^peer_address = "vsock://3:8001"', gw, re.M) is not None,
      "gateway.toml: stage 1's peer_address must be vsock://3:8001 (the route to CID 17)")
# Supervision: readiness follows the enclaves, a hung runner restarts.
ready = env.get("READY_FILE", "/tmp/enclaves-ready")
rp = c.get("readinessProbe", {})
check("exec" in rp and ready in " ".join(rp["exec"].get("command", [])) and "tcpSocket" not in rp,
      f"the readiness probe must be an exec test of READY_FILE ({ready}), not {rp}")
lp = c.get("livenessProbe", {})
check("exec" in lp and env.get("HEARTBEAT_FILE", "/tmp/enclave-runner-heartbeat") in " ".join(lp["exec"].get("command", [])),
      f"the liveness probe must check the runner's heartbeat file, not {lp}")
# The runner's memory: nitro-cli holds the EIF while it loads it, and the
# runner refuses to start below EIF + RUNNER_MIB; an EIF is at most a
# quarter of its enclave's memory (E26), so this limit holds any EIF.
def mib(q):
    q = str(q or "0")
    for suf, f in (("Gi", 1024), ("Mi", 1), ("G", 1e9 / 2**20), ("M", 1e6 / 2**20)):
        if q.endswith(suf):
            return float(q[: -len(suf)]) * f
    return float(q) / 2**20
runner_mib = int(env.get("RUNNER_MIB", "256"))
need = max(mems) // 4 + runner_mib
check(mib(lim.get("memory")) >= need and mib(req.get("memory")) >= need,
      f"the runner's memory request and limit must be at least {need}Mi (largest enclave {max(mems)} MiB / 4, the "
      f"largest EIF it runs, + RUNNER_MIB {runner_mib}), not {req.get('memory')}/{lim.get('memory')}")
# Starts on a node take turns: START_LOCK on the node (hostPath), not in the container.
lock = env.get("START_LOCK")
mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
vols = {v["name"]: v for v in pod.get("volumes", [])}
lock_vol = next((vols.get(n) for p, n in mounts.items() if lock and lock.startswith(p.rstrip("/") + "/")), None)
check(lock_vol is not None and "hostPath" in lock_vol,
      f"START_LOCK ({lock}) must lie on a hostPath volume, shared by every runner of the node")
logs = env.get("LOG_DIR")
check(logs in mounts, f"LOG_DIR ({logs}) must be a mounted volume (kept across container restarts)")
check(c.get("terminationMessagePolicy") == "FallbackToLogsOnError",
      "the runner's terminationMessagePolicy must be FallbackToLogsOnError (a failed start shows in kubectl describe pod)")
check(not any(re.match(r"vsock://[^=]*:9000=", r) for r in routes),
      "a route listens on vsock port 9000 of the parent: nitro-cli's boot heartbeat port")
runner_cm = find("ConfigMap", "enclave-runner")["data"].get("run-enclaves.sh", "")
check("describe-enclaves" in runner_cm, "the runner in the ConfigMap does not supervise (no describe-enclaves)")
check("BACKOFF_MAX_SECS" in runner_cm and "flock" in runner_cm,
      "the runner in the ConfigMap has no restart back-off or start lock")
if fails:
    for f in fails:
        print(f"FAIL nitro overlay: {f}", file=sys.stderr)
    sys.exit(1)
print(f"PASS nitro overlay: seccomp {seccomp} on the runner, hugepages-1Gi {gib}Gi, {stages} enclaves and "
      f"{stages * cpus} enclave CPUs, one runner per node, CIDs 16.., exec readiness and liveness, no mock, "
      f"runner memory {lim.get('memory')} >= {need}Mi, START_LOCK on the node, LOG_DIR kept, no route on port 9000")
PY
