#!/usr/bin/env python3
"""How long a short request waits behind prompts that are slow to admit
(issue 47, item 7), for one or more builds side by side, interleaved.

Each side is a folder with `gateway` and `enclave-stage` and a gateway
config (the shipped one: 2-stage SmolLM2 for completions). Per round and
side, a gateway is started and measured twice:

  idle    SHORTS short completions ("Hi", max_tokens 1, temperature 0),
          one after another;
  loaded  the same while SLOW_CLIENTS clients send, back to back, prompts
          of a quarter MiB of letters without a space (about half a second
          of tokenizing each, then refused for the context: the stage does
          all of the admission work and no model work).

Reported per side: the short request's p50 / p95 latency idle and loaded
(medians over rounds), how many slow prompts were admitted meanwhile, and
the slow prompt's own latency. Writes OUT/admission.{json,md,png}.

Usage: scripts/bench_admission.py [--side LABEL=BIN_DIR:CONFIG]... [--rounds N]
       [--shorts N] [--slow-clients N] [--out DIR]
Default sides: new=target/release:config/gateway.toml, and
old=target/ab/old-bin:target/ab/old-gateway.toml when scripts/build_old.sh
built one. Needs scripts/setup.sh's models; about 1 minute per round and
side on 2 cores.
"""

import argparse
import json
import os
import platform
import random
import signal
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_venv import run_plot  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def post(url, body, timeout=120):
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        e.read()
        status = e.code
    return status, (time.perf_counter() - t0) * 1000


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(bin_dir, config, tmp):
    port = free_port()
    text = open(config).read().replace('"data/receipts.sqlite3"', json.dumps(os.path.join(tmp, "r.sqlite3")))
    cfg = os.path.join(tmp, "gateway.toml")
    open(cfg, "w").write(text)
    log = open(os.path.join(tmp, "gateway.log"), "w")
    p = subprocess.Popen([os.path.join(bin_dir, "gateway"), "serve", "--config", cfg,
                          "--listen", f"127.0.0.1:{port}"], cwd=ROOT, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if p.poll() is not None:
            sys.exit(f"the gateway of {bin_dir} exited; see {log.name}")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=5) as r:
                if r.status == 200:
                    return p, url
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    p.kill()
    sys.exit(f"the gateway of {bin_dir} was not ready in 300 s")


def stop(p):
    p.send_signal(signal.SIGINT)
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def shorts(url, n):
    out = []
    for _ in range(n):
        status, ms = post(url + "/v1/completions",
                          {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0})
        if status != 200:
            sys.exit(f"a short request got {status}")
        out.append(ms)
    return out


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def measure(url, n_shorts, n_slow, letters):
    shorts(url, 3)  # warm-up
    idle = shorts(url, n_shorts)
    stop_flag = threading.Event()
    slow = []

    def slow_client():
        while not stop_flag.is_set():
            status, ms = post(url + "/v1/completions",
                              {"model": MODEL, "prompt": letters, "max_tokens": 1})
            if status != 400:
                print(f"bench_admission: a slow prompt got {status}", file=sys.stderr)
            slow.append(ms)

    threads = [threading.Thread(target=slow_client) for _ in range(n_slow)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the slow prompts are being admitted
    loaded = shorts(url, n_shorts)
    stop_flag.set()
    for t in threads:
        t.join()
    return {
        "idle_p50_ms": statistics.median(idle), "idle_p95_ms": pct(idle, 0.95),
        "loaded_p50_ms": statistics.median(loaded), "loaded_p95_ms": pct(loaded, 0.95),
        "slow_prompts": len(slow), "slow_p50_ms": statistics.median(slow) if slow else None,
    }


def machine():
    cpu, flags = "unknown", []
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name") and cpu == "unknown":
            cpu = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = sorted(f for f in line.split(":", 1)[1].split()
                           if f.startswith(("avx512", "avx2", "amx")))
            break
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=ROOT, capture_output=True, text=True).stdout.strip())
    return {"cpu": cpu, "flags": flags, "nproc": os.cpu_count(), "commit": commit,
            "dirty": dirty, "kernel": platform.release(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", action="append", default=[])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shorts", type=int, default=20)
    ap.add_argument("--slow-clients", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmark_results"))
    a = ap.parse_args()
    sides = {}
    for s in a.side or []:
        label, rest = s.split("=", 1)
        bin_dir, config = rest.split(":", 1)
        sides[label] = (bin_dir, config)
    if not sides:
        old = os.path.join(ROOT, "target/ab/old-bin")
        if os.path.exists(os.path.join(old, "gateway")):
            sides["old"] = (old, os.path.join(ROOT, "target/ab/old-gateway.toml"))
        sides["new"] = (os.path.join(ROOT, "target/release"), os.path.join(ROOT, "config/gateway.toml"))
    rnd = random.Random(1)
    letters = "".join(rnd.choice(string.ascii_lowercase) for _ in range(8192 * 32 - 64))
    runs = {label: [] for label in sides}
    for r in range(a.rounds):
        for label, (bin_dir, config) in sides.items():
            with tempfile.TemporaryDirectory() as tmp:
                p, url = start(os.path.abspath(bin_dir), os.path.abspath(config), tmp)
                try:
                    m = measure(url, a.shorts, a.slow_clients, letters)
                finally:
                    stop(p)
            print(f"round {r + 1} {label}: {m}", flush=True)
            runs[label].append(m)
    med = statistics.median
    summary = {}
    for label, ms in runs.items():
        summary[label] = {k: med(m[k] for m in ms if m[k] is not None)
                          for k in ms[0] if any(m[k] is not None for m in ms)}
        commit_file = os.path.join(sides[label][0], "COMMIT")
        if os.path.exists(commit_file):
            summary[label]["commit"] = open(commit_file).read().strip()[:7]
    info = machine()
    result = {"benchmark": "admission", "machine": info, "rounds": a.rounds,
              "shorts": a.shorts, "slow_clients": a.slow_clients, "runs": runs,
              "summary": summary, "command": "scripts/bench_admission.py " + " ".join(sys.argv[1:])}
    os.makedirs(a.out, exist_ok=True)
    json.dump(result, open(os.path.join(a.out, "admission.json"), "w"), indent=1)
    lines = [
        "# A short request behind prompts that are slow to admit",
        "",
        f"Machine: {info['cpu']}, {info['nproc']} cores ({', '.join(info['flags']) or 'no AVX-512/AVX2 flags'}); "
        f"commit `{info['commit']}`{' with uncommitted changes' if info['dirty'] else ''}, {info['date_utc']} UTC. "
        f"Rerun: `scripts/bench_admission.py` (old side: `scripts/build_old.sh COMMIT` first).",
        "",
        f"The shipped config (2-stage SmolLM2, q4_1). Short request: `\"Hi\"`, `max_tokens` 1, "
        f"temperature 0, {a.shorts} in a row, after 3 warm-up requests. Loaded: {a.slow_clients} "
        "client(s) sending, back to back, a 262,080-byte prompt of letters without a space "
        "(tokenized, then refused for the 8,192-token context: admission work only). "
        f"Medians over {a.rounds} rounds, sides interleaved.",
        "",
        "| side | idle p50 / p95 ms | loaded p50 / p95 ms | loaded p50 / idle p50 | slow prompts admitted | slow prompt p50 ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, s in summary.items():
        name = f"{label} (`{s['commit']}`)" if "commit" in s else label
        lines.append(
            f"| {name} | {s['idle_p50_ms']:.0f} / {s['idle_p95_ms']:.0f} | "
            f"{s['loaded_p50_ms']:.0f} / {s['loaded_p95_ms']:.0f} | "
            f"{s['loaded_p50_ms'] / s['idle_p50_ms']:.2f}× | {s['slow_prompts']:.0f} | "
            f"{s.get('slow_p50_ms', float('nan')):.0f} |")
    open(os.path.join(a.out, "admission.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    code = r"""
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
s = json.loads(sys.argv[1])
labels = list(s)
fig, ax = plt.subplots(figsize=(7, 3.2))
x = range(len(labels))
ax.bar([i - 0.2 for i in x], [s[l]["idle_p50_ms"] for l in labels], 0.4, label="idle p50")
ax.bar([i + 0.2 for i in x], [s[l]["loaded_p50_ms"] for l in labels], 0.4, label="behind slow prompts, p50")
ax.set_xticks(list(x))
ax.set_xticklabels(labels)
ax.set_ylabel("short request latency, ms")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
"""
    run_plot(code, json.dumps(summary), os.path.join(a.out, "admission.png"))


if __name__ == "__main__":
    main()
