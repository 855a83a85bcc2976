#!/bin/sh
# Runs in each embeddings-stages pod on a Nitro node: starts the two stage
# enclaves, one EIF per stage (/eif/stage0.eif, /eif/stage1.eif, each with
# its stage fixed on its command line), with CIDs derived from the pod's IP
# so that several pods share a node, then relays with `gateway host-proxy`:
#   pod :9000 -> stage 0's vsock port 9000  (the gateway's channel to stage 0)
#   pod :9001 -> stage 1's vsock port 9000  (the gateway's channel to stage 1)
#   vsock :8001 on the parent -> stage 1     (stage 0's next hop, vsock://3:8001)
# NEVER RUN on Nitro hardware.
set -eu
run() { # STAGE CID
  nitro-cli run-enclave --eif-path "/eif/stage$1.eif" --cpu-count "$ENCLAVE_CPUS" \
    --memory "$ENCLAVE_MEMORY_MIB" --enclave-cid "$2" >"/tmp/enclave-$2.json"
}
# nitro-cli needs distinct CIDs per node: derive a base from the pod's IP.
base=$(( 16 + ($(echo "$POD_IP" | cut -d. -f4) * 2) ))
run 0 "$base"
run 1 $((base + 1))
trap 'nitro-cli terminate-enclave --all' EXIT TERM INT
gateway host-proxy \
  --route "tcp://0.0.0.0:9000=vsock://$base:9000" \
  --route "tcp://0.0.0.0:9001=vsock://$((base + 1)):9000" \
  --route "vsock://any:8001=vsock://$((base + 1)):9000" &
wait $!
