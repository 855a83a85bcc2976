#!/usr/bin/env python3
"""Runs the README's quickstart as written against a running gateway and
compares what it prints with the output the README shows (scripts/test.sh
runs this, so a stale command or answer fails CI).

    scripts/check_quickstart.py --base-url http://127.0.0.1:PORT

Checked:
- the quickstart's start command is `scripts/start.sh`, which exists and ends
  by running `gateway serve` (what scripts/test.sh started the gateway with);
- the line it says to wait for is what the gateway prints, at the address
  config/gateway.toml listens on (the address the commands use);
- each command of its curl block, run with bash with that address replaced
  by --base-url, prints its line of the expected output: `…` stands for any
  text, and a number written `0.576…` for a number within 0.01 of it;
- each Python block of the README runs (address replaced), and each
  `print(...)  # TEXT` line prints TEXT;
- the sealed path of "Use it" as written (`gateway log vkey`, `gateway
  policy pin --log-key`, which must write log-backed policies without trust
  on first use, then `gateway proxy` on them; in a scratch folder whose
  `data` is the repository's, the proxy on a free port): the quickstart's
  chat request through the proxy gets the same answer, with
  `receipt-verified: true`.
"""
import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def blocks(text):
    """The fenced code blocks of `text`: (language, body)."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)]


def section(readme, title):
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    if not m:
        sys.exit(f"README has no '## {title}' section")
    return m.group(1)


def matches(expected, actual):
    """Whether `actual` is `expected` with each `…` some text and each
    number written `D.DDD…` a number within 0.01 of it."""
    parts = re.split(r"(-?\d+\.\d+…|…)", expected)
    pattern, numbers = "", []
    for p in parts:
        if p == "…":
            pattern += ".*?"
        elif p.endswith("…") and re.fullmatch(r"-?\d+\.\d+…", p):
            pattern += r"(-?\d+(?:\.\d+)?(?:[eE]-?\d+)?)"
            numbers.append(float(p[:-1]))
        else:
            pattern += re.escape(p)
    m = re.fullmatch(pattern, actual, re.S)
    return bool(m) and all(abs(float(got) - want) <= 0.01 for got, want in zip(m.groups(), numbers))


def check_sealed_path(readme, readme_url, base_url, quick_commands, check):
    """Runs "Use it"'s `policy pin` and `proxy` block, then the quickstart's
    chat request through that proxy."""
    sealed = [b for lang, b in blocks(section(readme, "Use it")) if lang == "sh" and "policy pin" in b]
    check(len(sealed) == 1, "\"Use it\" has one block with `gateway policy pin`")
    chat = [c for c in quick_commands if "/v1/chat/completions" in c]
    if len(sealed) != 1 or len(chat) != 1:
        return
    body = json.loads(shlex.split(chat[0])[-1])
    gateway = os.path.join(ROOT, "target/release/gateway")
    scratch = tempfile.mkdtemp(prefix="quickstart-sealed-")
    # The block reads the log's folder as `data/transparency`, relative to
    # the repository root, where this check's gateway keeps it.
    os.symlink(os.path.join(ROOT, "data"), os.path.join(scratch, "data"))
    proxy = None
    try:
        for cmd in sealed[0].replace("\\\n", " ").splitlines():
            if not cmd.strip():
                continue
            argv = shlex.split(cmd.replace(readme_url, base_url))
            check(argv[0] == "./target/release/gateway", f"sealed path runs the built gateway: {argv[:3]}")
            argv[0] = gateway
            if argv[1] == "proxy":
                argv[argv.index("--listen") + 1] = "127.0.0.1:0"
                proxy = subprocess.Popen(argv, cwd=scratch, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
                line = proxy.stdout.readline()
                check(line.startswith("PROXY LISTENING "), f"gateway proxy starts on the pinned policies ({line.strip()})")
                if not line.startswith("PROXY LISTENING "):
                    return
                proxy_url = line.split()[-1]
            else:
                # As a shell runs it (the block uses `$(cat log.vkey)`), with
                # the built gateway for `./target/release/gateway`.
                line = cmd.replace(readme_url, base_url).replace("./target/release/gateway", shlex.quote(gateway))
                run = subprocess.run(["bash", "-c", line], cwd=scratch, capture_output=True, text=True, timeout=120)
                what = f"`gateway {' '.join(argv[1:3])}`"
                if argv[1:3] == ["policy", "pin"]:
                    logged = all("[transparency]" in open(os.path.join(scratch, "policies", f)).read()
                                 for f in os.listdir(os.path.join(scratch, "policies"))) \
                        if run.returncode == 0 else False
                    check(run.returncode == 0 and "TRUST ON FIRST USE" not in run.stderr and logged,
                          f"{what} succeeds from the transparency log and writes log-backed policies")
                else:
                    check(run.returncode == 0, f"{what} succeeds")
                if run.returncode != 0:
                    print(f"     stderr: {run.stderr.strip()[-800:]}")
        if proxy is None:
            check(False, "the sealed block starts `gateway proxy`")
            return
        req = urllib.request.Request(proxy_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no HTTP proxy
        with direct.open(req, timeout=120) as r:
            verified = r.headers.get("receipt-verified")
            answer = json.load(r)["choices"][0]["message"]["content"]
        check(verified == "true" and answer == "The capital of France is Paris.",
              f"the quickstart's chat request through the proxy: receipt-verified {verified}, {answer!r}")
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait()
        shutil.rmtree(scratch, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", required=True, help="the running gateway, e.g. http://127.0.0.1:8080")
    args = ap.parse_args()
    readme = open(os.path.join(ROOT, "README.md")).read()
    quick = section(readme, "Quickstart")
    failures = []

    def check(ok, what):
        print(("PASS " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    listen = tomllib.load(open(os.path.join(ROOT, "config/gateway.toml"), "rb"))["server"]["listen"]
    readme_url = f"http://{listen}"
    qb = blocks(quick)
    shell = [b for lang, b in qb if lang == "sh"]
    expected = [b for lang, b in qb if lang == "text"]
    check(len(shell) == 2 and len(expected) == 1, "quickstart has a start block, a command block and an output block")
    if failures:
        sys.exit(1)
    start = shell[0].strip()
    check(start == "scripts/start.sh", f"the start command is scripts/start.sh (README: {start!r})")
    start_sh = open(os.path.join(ROOT, "scripts/start.sh")).read().strip().splitlines()
    check(start_sh[-1] == 'exec ./target/release/gateway serve "$@"',
          "scripts/start.sh ends by running `gateway serve` (as this check's gateway was started)")
    check(f"`GATEWAY LISTENING {readme_url}`" in quick,
          f"the quickstart waits for `GATEWAY LISTENING {readme_url}` (config/gateway.toml's listen)")

    commands = [c for c in shell[1].replace("\\\n", " ").splitlines() if c.strip()]
    lines = [l for l in expected[0].splitlines() if l.strip()]
    check(len(commands) == len(lines), f"{len(commands)} commands, {len(lines)} expected lines")
    for cmd, want in zip(commands, lines):
        if readme_url not in cmd:
            check(False, f"command does not use {readme_url}: {cmd[:60]}")
            continue
        run = subprocess.run(["bash", "-c", cmd.replace(readme_url, args.base_url)],
                             capture_output=True, text=True, timeout=120)
        got = run.stdout.strip()
        ok = run.returncode == 0 and matches(want, got)
        check(ok, f"{cmd.split()[2] if len(cmd.split()) > 2 else cmd}")
        if not ok:
            print(f"     expected: {want}\n     got:      {got}\n     stderr:   {run.stderr.strip()[:500]}")

    for lang, body in blocks(readme):
        if lang != "python":
            continue
        wants = re.findall(r"^print\(.*\)\s+# (.*)$", body, re.M)
        run = subprocess.run([sys.executable, "-c", body.replace(readme_url, args.base_url)],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "NO_PROXY": "127.0.0.1,localhost"})
        got = run.stdout.strip().splitlines()
        ok = run.returncode == 0 and got == wants
        check(ok, f"README python block ({body.splitlines()[0][:50]}…) prints {wants}")
        if not ok:
            print(f"     got: {got}\n     stderr: {run.stderr.strip()[-800:]}")

    check_sealed_path(readme, readme_url, args.base_url, commands, check)

    print(f"{'FAIL' if failures else 'OK'}: README quickstart, {len(failures)} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
