#!/usr/bin/env python3
"""Instructions per plain embeddings request, an old build against this
checkout's, counted by valgrind's callgrind in the gateway and in each stage.

Wall-clock A/B runs on a shared VM drift by up to ~20 % between passes;
instruction counts do not, so a per-request cost that changed by a few
percent shows here or is not there. Each side runs the configured setup
(config/gateway.toml of its own commit: two MiniLM stages) with the gateway
and both stages under `valgrind --tool=callgrind`, sends warm-up requests,
zeroes the counters (`callgrind_control -z`), sends REQUESTS sequential
one-sentence requests (the embeddings benchmark's shape), dumps the
counters (`callgrind_control -d`) and divides. Under valgrind the CPU has
no AVX-512, so the stages run their AVX2 kernels on both sides alike.

    scripts/bench_instructions.py --old-bin DIR --old-config FILE [--requests N]

`scripts/bench_instructions.sh OLD_COMMIT` builds the old side and runs
this. Writes benchmark_results/instructions.{json,md,png}.
"""

import argparse
import glob
import http.client
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

from bench_venv import run_plot

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BENCH_EMBEDDINGS = os.path.join(ROOT, "gateway/examples/bench_embeddings.rs")


def sentences():
    """The embeddings benchmark's sentences, read from its source (one list
    for both benchmarks)."""
    src = open(BENCH_EMBEDDINGS).read()
    body = re.search(r"const SENTENCES: \[&str; \d+\] = \[(.*?)\];", src, re.S).group(1)
    found = [json.loads(s) for s in re.findall(r'"(?:[^"\\]|\\.)*"', body)]
    if not found:
        sys.exit(f"bench_instructions: no SENTENCES in {BENCH_EMBEDDINGS}")
    return found


def config_for(src, workdir, port):
    """The side's own gateway config with a private receipt store and port,
    time for valgrind, and the embeddings pipeline only."""
    text = open(src).read()
    text = re.sub(r'(?m)^listen = .*$', f'listen = "127.0.0.1:{port}"', text, count=1)
    text = re.sub(r'(?m)^path = "data/receipts.sqlite3"$',
                  f'path = "{workdir}/receipts.sqlite3"', text)
    text = re.sub(r'(?m)^connect_timeout_secs = .*$', "connect_timeout_secs = 900", text)
    text = re.sub(r'(?m)^request_timeout_secs = .*$', "request_timeout_secs = 600", text)
    # Embeddings only: the completions pipeline would double the start time.
    text = re.sub(r'(?ms)^\[completions\].*?(?=^\[(?!\[completions)|\Z)', "", text)
    text = re.sub(r'(?ms)^\[\[completions\.stages\]\].*?(?=^\[(?!\[completions)|\Z)', "", text)
    path = os.path.join(workdir, "gateway.toml")
    open(path, "w").write(text)
    return path


def callgrind(workdir, bin_dir):
    """The gateway under callgrind, and the stages it starts with it
    (`--trace-children`): the gateway still hashes the real stage binary for
    `trust_local_build`."""
    return ["valgrind", "--tool=callgrind", "--dump-instr=no", "--trace-children=yes",
            f"--callgrind-out-file={workdir}/cg.%p", f"{bin_dir}/gateway"]


def post(port, text):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": "all-MiniLM-L6-v2", "input": text})
    conn.request("POST", "/v1/embeddings", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data[:200]!r}")


def totals(workdir, gateway_pid):
    """Ir of each process's dumps (`cg.PID.N`), the gateway's apart from
    the stages'."""
    out = {"gateway": 0, "stages": 0}
    for f in glob.glob(f"{workdir}/cg.*.*"):
        pid = int(f.split(".")[-2])
        m = re.search(r"(?m)^(?:summary|totals):\s+(\d+)", open(f).read())
        out["gateway" if pid == gateway_pid else "stages"] += int(m.group(1)) if m else 0
    return out


def run_side(name, bin_dir, config_src, requests, warmup):
    texts = sentences()
    workdir = tempfile.mkdtemp(prefix=f"instr-{name}-")
    port = 18600 if name == "old" else 18601
    config = config_for(config_src, workdir, port)
    log = open(os.path.join(workdir, "gateway.log"), "w")
    gw = subprocess.Popen(callgrind(workdir, bin_dir) + ["serve", "--config", config],
                          cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 1200
        while True:
            try:
                post(port, "warm up")
                break
            except (OSError, RuntimeError):
                if gw.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{name}: gateway did not come up (log: {workdir}/gateway.log)")
                time.sleep(5)
        for i in range(warmup):
            post(port, texts[i % len(texts)])
        subprocess.run(["callgrind_control", "-z"], check=True, capture_output=True)
        for i in range(requests):
            post(port, texts[i % len(texts)])
        for f in glob.glob(f"{workdir}/cg.*"):
            os.remove(f)
        subprocess.run(["callgrind_control", "-d"], check=True, capture_output=True)
        time.sleep(2)
        t = totals(workdir, gw.pid)
    finally:
        os.killpg(gw.pid, signal.SIGKILL)
        gw.wait()
    shutil.rmtree(workdir, ignore_errors=True)
    per = {k: v / requests for k, v in t.items()}
    per["total"] = per["gateway"] + per["stages"]
    print(f"{name}: " + ", ".join(f"{k} {v / 1e6:.2f} M instr/request" for k, v in per.items()),
          flush=True)
    return per


def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-bin", required=True)
    ap.add_argument("--old-config", required=True)
    ap.add_argument("--old-commit", default="")
    ap.add_argument("--new-bin", default=os.path.join(ROOT, "target/release"))
    ap.add_argument("--new-commit", default="", help="what --new-bin was built from (default: this checkout)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmark_results/instructions"))
    a = ap.parse_args()
    if not shutil.which("valgrind"):
        sys.exit("bench_instructions: needs valgrind (apt-get install valgrind)")
    old = run_side("old", os.path.abspath(a.old_bin), os.path.abspath(a.old_config),
                   a.requests, a.warmup)
    new = run_side("new", os.path.abspath(a.new_bin), os.path.join(ROOT, "config/gateway.toml"),
                   a.requests, a.warmup)
    new_commit = a.new_commit or git("rev-parse", "HEAD") + (
        " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")
    result = {
        "what": "instructions per plain one-sentence embeddings request (callgrind Ir), "
                "configured setup (2 MiniLM stages), sequential",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "requests": a.requests,
        "old": {"commit": a.old_commit, **old},
        "new": {"commit": new_commit, **new},
        "new_over_old": {k: new[k] / old[k] for k in old if old[k]},
    }
    open(a.out + ".json", "w").write(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Instructions per embeddings request: old against new",
        "",
        f"{result['what']}; {a.requests} requests after {a.warmup} warm-up; "
        f"{result['machine']}; {result['date']}.",
        f"Old: `{a.old_commit}`. New: `{new_commit}`.",
        "",
        "| process | old (M instr/request) | new (M instr/request) | new/old |",
        "| --- | --- | --- | --- |",
    ]
    for k in ("gateway", "stages", "total"):
        lines.append(f"| {k} | {old[k] / 1e6:.3f} | {new[k] / 1e6:.3f} | "
                     f"{result['new_over_old'].get(k, float('nan')):.4f} |")
    lines += [
        "",
        "Instruction counts do not drift with the VM's load; under valgrind the stages run "
        "their AVX2 kernels (valgrind exposes no AVX-512) on both sides.",
        "",
        "Rerun: `scripts/bench_instructions.sh OLD_COMMIT [REQUESTS]`.",
    ]
    open(a.out + ".md", "w").write("\n".join(lines) + "\n")
    plot(old, new, a.out + ".png")
    print("\n".join(lines))


def plot(old, new, path):
    """Old and new bars per process (matplotlib in the benchmark
    virtualenv, bench_venv.py)."""
    code = r"""
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
old, new = json.loads(sys.argv[1]), json.loads(sys.argv[2])
keys = ["gateway", "stages", "total"]
fig, ax = plt.subplots(figsize=(7, 3.2))
x = range(len(keys))
ax.bar([i - 0.2 for i in x], [old[k] / 1e6 for k in keys], 0.4, label="old")
ax.bar([i + 0.2 for i in x], [new[k] / 1e6 for k in keys], 0.4, label="new")
ax.set_xticks(list(x))
ax.set_xticklabels(keys)
ax.set_ylabel("M instructions / request")
ax.legend()
fig.tight_layout()
fig.savefig(sys.argv[3], dpi=110)
"""
    run_plot(code, json.dumps(old), json.dumps(new), path)


if __name__ == "__main__":
    main()
