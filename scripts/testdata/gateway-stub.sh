#!/usr/bin/env bash
# A stand-in for the gateway binary, for scripts/test-enclave-runner.sh and
# scripts/test-nitro-scripts.sh: `host-proxy` and `serve` record their
# arguments and pid in $NITRO_STUB_DIR (proxy-calls, proxy.pid, proxy.pids;
# serve-calls, serve.pid) and then only sleep.
case "$1" in
  host-proxy)
    echo "$$" >>"$NITRO_STUB_DIR/proxy.pids"
    echo "$$" >"$NITRO_STUB_DIR/proxy.pid"
    echo "$*" >>"$NITRO_STUB_DIR/proxy-calls"
    ;;
  serve)
    echo "$$" >>"$NITRO_STUB_DIR/proxy.pids"
    echo "$$" >"$NITRO_STUB_DIR/serve.pid"
    echo "$*" >>"$NITRO_STUB_DIR/serve-calls"
    ;;
  *) echo "stub gateway: unexpected command $1" >&2; exit 2 ;;
esac
exec sleep 1000
