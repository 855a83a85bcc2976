#!/usr/bin/env python3
"""Your own GGUF against llama.cpp on the same file (issue 31): single-stream
decode rate and time to first token after a 512-token prompt, through the
gateway with the model split over 1, 2 and 4 stages (`gateway serve --model
FILE --stages N`), beside llama.cpp (llama-cpp-python, same file, same
threads), rounds interleaved; and each stage's peak RSS against its share of
the weights and its KV budget (`gateway plan --stages N`).

- one streamed greedy answer per round and side (end of sequence forbidden
  by `logit_bias`): time to first token from sending the request to its
  first text (gateway: HTTP, sealing for the client, the prefill through
  every stage; llama.cpp: the prompt's `eval` and the argmax, in-process),
  and the decode rate after it, (tokens − 1) over the time from the first
  text to the last.

Run by scripts/bench_models.sh, which makes the 1B-class file. Writes
benchmark_results/models.{json,md,png}.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_venv import run_plot  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
GATEWAY = os.path.join(ROOT, "target/release/gateway")

LLAMA = r"""
import json, sys, time, llama_cpp
import numpy as np
gguf, threads = sys.argv[1], int(sys.argv[2])
llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                      n_batch=512, verbose=False)
print(json.dumps({"version": llama_cpp.__version__}), flush=True)
n_vocab = llm.n_vocab()
def last():
    # The last evaluated token's logits (only those are computed, as a
    # server computes them; llm.scores would need logits_all).
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,))
for line in sys.stdin:
    req = json.loads(line)
    prompt, n = req["prompt"], req["decode"]
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    tok = int(np.argmax(last()))
    t1 = time.perf_counter()
    for _ in range(n - 1):
        llm.eval([tok])
        tok = int(np.argmax(last()))
    t2 = time.perf_counter()
    print(json.dumps({"ttft_s": t1 - t0, "decode_tok_s": (n - 1) / (t2 - t1)}), flush=True)
"""


def stream(url, body):
    """One streamed completion: (time to first text, decode tokens/s after
    it, completion tokens)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    times, tokens = [], 0
    with urllib.request.urlopen(req, timeout=900) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            v = json.loads(line[6:])
            if v.get("choices") and v["choices"][0].get("text"):
                times.append(time.perf_counter())
            if v.get("usage"):
                tokens = v["usage"]["completion_tokens"]
    rate = (tokens - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
    return times[0] - t0, rate, tokens


def start_gateway(model, stages, cache):
    p = subprocess.Popen([GATEWAY, "serve", "--listen", "127.0.0.1:0", "--model", model,
                          "--stages", str(stages), "--model-cache", cache],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT, text=True)
    for line in p.stdout:
        if line.startswith("GATEWAY LISTENING "):
            return p, line.split()[-1]
    raise RuntimeError(f"the gateway with {stages} stages did not start")


def stage_pids(gateway_pid, cache):
    """The completions stages the gateway started (their --model-dir is in the cache)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == gateway_pid and any(cache.encode() in a for a in cmd):
            i = cmd.index(b"--stage-index") if b"--stage-index" in cmd else None
            out.append((int(cmd[i + 1]) if i is not None else len(out), int(pid)))
    return [p for _, p in sorted(out)]


def peak_rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def summary(xs):
    xs = sorted(x for x in xs if x == x)
    return {"median": statistics.median(xs) if xs else float("nan"), "n": len(xs),
            "min": xs[0] if xs else float("nan"), "max": xs[-1] if xs else float("nan")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stages", default="1,2,4")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmark_results"))
    args = ap.parse_args()
    cache = os.path.join(ROOT, "target/bench-models/cache")
    stage_counts = [int(s) for s in args.stages.split(",")]
    rng = random.Random(5)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt)]
    # No end of sequence: SmolLM2's vocabulary ends sequences with 0 and 2.
    body = {"prompt": prompt, "temperature": 0, "logit_bias": {"0": -100, "2": -100}}

    gateways = {}
    try:
        for n in stage_counts:
            gateways[n] = start_gateway(args.model, n, cache)
        llama = subprocess.Popen([args.llama_python, "-c", LLAMA, args.model, str(args.threads)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        llama_version = json.loads(llama.stdout.readline())["version"]
        models = {}
        for n, (_, url) in gateways.items():
            with urllib.request.urlopen(url + "/v1/models") as r:
                ids = [m["id"] for m in json.load(r)["data"] if m["id"] != "all-MiniLM-L6-v2"]
            models[n] = ids[0]
            stream(url, {**body, "model": ids[0], "max_tokens": 2})  # warm up
        results = {f"gateway, {n} stage{'s' if n > 1 else ''}": {"ttft_s": [], "decode_tok_s": []}
                   for n in stage_counts}
        results["llama.cpp"] = {"ttft_s": [], "decode_tok_s": []}
        for r in range(args.rounds):
            for n, (_, url) in gateways.items():
                key = f"gateway, {n} stage{'s' if n > 1 else ''}"
                t1, rate, nl = stream(url, {**body, "model": models[n], "max_tokens": args.decode})
                if nl != args.decode:
                    rate = float("nan")
                results[key]["ttft_s"].append(t1)
                results[key]["decode_tok_s"].append(rate)
            llama.stdin.write(json.dumps({"prompt": prompt, "decode": args.decode}) + "\n")
            llama.stdin.flush()
            v = json.loads(llama.stdout.readline())
            results["llama.cpp"]["ttft_s"].append(v["ttft_s"])
            results["llama.cpp"]["decode_tok_s"].append(v["decode_tok_s"])
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{k} {v['decode_tok_s'][-1]:.1f} tok/s" for k, v in results.items()), flush=True)
        llama.stdin.close()
        llama.wait()
        # Peak RSS of each stage against `gateway plan --stages N`.
        memory = {}
        for n, (p, _) in gateways.items():
            plan = json.loads(subprocess.run(
                [GATEWAY, "plan", "--model", args.model, "--stages", str(n), "--kv-tokens", "8192",
                 "--json"], capture_output=True, text=True, check=True, cwd=ROOT).stdout)
            pids = stage_pids(p.pid, cache)
            memory[n] = [{"layers": s["layers"], "weight_bytes": s["weight_bytes"],
                          "kv_budget_bytes": s["kv_bytes"], "peak_rss_bytes": peak_rss(pid)}
                         for s, pid in zip(plan, pids)]
    finally:
        for p, _ in gateways.values():
            p.terminate()
            p.wait()

    stats = {k: {m: summary(v[m]) for m in ("ttft_s", "decode_tok_s")} for k, v in results.items()}
    ll = stats["llama.cpp"]
    doc = {
        "model": os.path.basename(args.model), "model_bytes": os.path.getsize(args.model),
        "commit": args.commit, "machine": os.uname().nodename, "cpus": os.cpu_count(),
        "threads": args.threads, "prompt_tokens": args.prompt, "decode_tokens": args.decode - 1,
        "rounds": args.rounds, "llama_cpp_version": llama_version,
        "llama_cpp_build": os.path.basename(os.path.dirname(os.path.dirname(args.llama_python))),
        "stats": stats, "raw": results, "memory": {str(k): v for k, v in memory.items()},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "models.json"), "w") as f:
        json.dump(doc, f, indent=1)

    mib = lambda b: f"{b / (1 << 20):.0f}"  # noqa: E731
    lines = [
        "# Your own GGUF beside llama.cpp (issue 31)",
        "",
        f"`scripts/bench_models.sh`, commit {args.commit}, {os.cpu_count()} CPUs, "
        f"{args.threads} threads each side, {args.rounds} rounds interleaved (medians; min–max).",
        f"Model: `{doc['model']}` ({doc['model_bytes'] / 1e9:.2f} GB): random weights of a "
        "1B-class Llama shape (hidden 2048, 16 layers, 32 query / 8 KV heads, FFN 8192, "
        "SmolLM2's 49,152-token vocabulary, tied head), written in F16 by "
        "`scripts/make_gguf_fixtures.py --shape 1b` and quantized to Q4_K_M by llama.cpp. "
        "Served in `q4_1` (the default: the file's Q4_K and Q6_K blocks, value for value).",
        f"llama.cpp: llama-cpp-python {llama_version} ({doc['llama_cpp_build']}), in-process, "
        "same file.",
        "",
        f"| | decode tok/s | vs llama.cpp | TTFT after {args.prompt} tokens (s) | vs llama.cpp |",
        "| --- | --- | --- | --- | --- |",
    ]
    for k, v in stats.items():
        d, t = v["decode_tok_s"], v["ttft_s"]
        lines.append(
            f"| {k} | {d['median']:.2f} ({d['min']:.2f}–{d['max']:.2f}) | "
            f"{d['median'] / ll['decode_tok_s']['median']:.2f}× | "
            f"{t['median']:.2f} ({t['min']:.2f}–{t['max']:.2f}) | "
            f"{t['median'] / ll['ttft_s']['median']:.2f}× |")
    lines += ["", "Each stage's peak RSS (VmHWM) against its weights and KV budget "
              "(`gateway plan --stages N --kv-tokens 8192`; the KV cache is allocated as "
              "requests need it, so a single stream uses a small part of the budget):", "",
              "| stages | stage | layers | weights MiB | KV budget MiB | peak RSS MiB | RSS − weights − KV budget MiB |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for n, stages in memory.items():
        for i, s in enumerate(stages):
            over = s["peak_rss_bytes"] - s["weight_bytes"] - s["kv_budget_bytes"]
            lines.append(f"| {n} | {i} | {s['layers']} | {mib(s['weight_bytes'])} | "
                         f"{mib(s['kv_budget_bytes'])} | {mib(s['peak_rss_bytes'])} | {mib(over)} |")
    with open(os.path.join(args.out, "models.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))

    run_plot(r"""
import json, sys
import matplotlib; matplotlib.use("Agg")
import matplotlib.pyplot as plt
d = json.load(open(sys.argv[1]))
names = list(d["stats"])
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
for ax, metric, label in [(axes[0], "decode_tok_s", "decode tokens/s"),
                          (axes[1], "ttft_s", "time to first token (s)")]:
    ax.bar(range(len(names)), [d["stats"][n][metric]["median"] for n in names],
           color=["tab:blue"] * (len(names) - 1) + ["tab:gray"])
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(label)
fig.suptitle(f"{d['model']}: gateway vs llama.cpp, {d['threads']} threads, {d['prompt_tokens']}-token prompt")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
""", os.path.join(args.out, "models.json"), os.path.join(args.out, "models.png"))


if __name__ == "__main__":
    main()
