#!/usr/bin/env python3
"""Runs docs/curl.md's walkthrough as written against a running gateway
(scripts/test.sh runs this, so a stale command in it fails CI).

    scripts/check_curl_walkthrough.py --base-url http://127.0.0.1:PORT

Every `sh` block after the first (which starts the gateway) runs, in order,
as one bash script from the repository root, with three substitutions: the
gateway's address (`U=…`) is --base-url, the scratch folder is a fresh
temporary one, and the proxy's port 8081 is a free one. Checked: each `echo "exit $?"`
prints the exit code the walkthrough's steps expect (evidence verifies, the
wrong nonce and the other policy fail, the receipts verify, the tampered
response fails), the archived exchange re-verifies, and the answers through
the proxy come back with `receipt-verified: true`.
"""
import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `echo "exit $?"` after: verify evidence; with another nonce; with another
# policy; verify the plain request's receipt; with a tampered response;
# verify the sealed request's receipt.
EXPECTED_EXITS = ["0", "1", "1", "0", "1", "0"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", required=True, help="the running gateway")
    args = ap.parse_args()
    for tool in ("curl", "openssl"):
        if not shutil.which(tool):
            sys.exit(f"FAIL the walkthrough needs `{tool}` (Debian: apt-get install {tool})")
    doc = open(os.path.join(ROOT, "docs/curl.md")).read()
    blocks = re.findall(r"^```sh\n(.*?)^```$", doc, re.S | re.M)
    script = "\n".join(blocks[1:])
    port = free_port()
    scratch = tempfile.mkdtemp(prefix="curl-walkthrough-")
    subs = [
        ("U=http://127.0.0.1:8080", f"U={args.base_url}"),
        ("mkdir -p /tmp/walkthrough && cd /tmp/walkthrough", f"cd {scratch}"),
        ("127.0.0.1:8081", f"127.0.0.1:{port}"),
    ]
    for old, new in subs:
        if old not in script:
            sys.exit(f"FAIL docs/curl.md no longer has {old!r} (update this check)")
        script = script.replace(old, new)
    # Whatever the walkthrough leaves running (the proxy) stops with it.
    script = "set +e\n" + script + "\nkill $(jobs -p) 2>/dev/null\nwait\n"
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "NO_PROXY": "127.0.0.1,localhost"})
    out = run.stdout + run.stderr
    failures = []

    def check(ok, what):
        print(("PASS " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    exits = re.findall(r"^exit (\d+)$", run.stdout, re.M)
    check(exits == EXPECTED_EXITS, f"the steps' exit codes are {EXPECTED_EXITS} (got {exits})")
    check(out.count("RESULT: OK (receipt verified)") >= 3,
          "the plain, the sealed and the archived receipts verify")
    check(out.count("receipt-verified: true") >= 2, "answers through the proxy are verified")
    check("The capital of France is Paris." in out, "the SDK through the proxy gets the answer")
    check("Traceback" not in out, "no Python error")
    if failures:
        print(out[-6000:])
    print(f"{'FAIL' if failures else 'OK'}: docs/curl.md walkthrough, {len(failures)} failure(s)")
    shutil.rmtree(scratch, ignore_errors=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
