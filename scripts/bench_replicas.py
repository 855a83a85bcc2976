#!/usr/bin/env python3
"""Collects scripts/bench_replicas.sh's runs into benchmark_results/replicas.{json,md,png}.

Each run is gateway/examples/bench_embeddings with one gateway config
(`replicas = N`); per replica count and concurrency the median over rounds
of sentences/s and of p50/p99 latency is reported, with the bare in-process
Candle baseline (2 threads) of the same runs for scale.

Usage: scripts/bench_replicas.py RUNS_DIR OUT_DIR
"""
import glob
import json
import os
import re
import statistics
import sys


def main(runs, out):
    by = {}
    base = {}
    machine = None
    for path in sorted(glob.glob(os.path.join(runs, "r*-round*/embeddings.json"))):
        n = int(re.search(r"/r(\d+)-round", path).group(1))
        d = json.load(open(path))
        machine = machine or d["machine"]
        g = d["gateways"][0]
        for lv in g["levels"]:
            c = lv["concurrency"]
            by.setdefault(n, {}).setdefault(c, []).append(
                (lv["sentences_per_s"], lv["request_latency"]["p50_ms"],
                 lv["request_latency"]["p99_ms"], lv["errors"]))
        for b in d["baselines"]:
            for lv in b["levels"]:
                base.setdefault(lv["concurrency"], []).append(lv["sentences_per_s"])
    if not by:
        sys.exit(f"no runs under {runs}")
    med = statistics.median
    table = {
        n: {c: {"sentences_per_s": med(x[0] for x in v), "p50_ms": med(x[1] for x in v),
                "p99_ms": med(x[2] for x in v), "errors": sum(x[3] for x in v),
                "rounds": len(v)}
            for c, v in sorted(levels.items())}
        for n, levels in sorted(by.items())
    }
    baseline = {c: med(v) for c, v in sorted(base.items())}
    result = {"benchmark": "replicas", "machine": machine, "replicas": table,
              "baseline_2_threads_sentences_per_s": baseline,
              "command": "scripts/bench_replicas.sh"}
    os.makedirs(out, exist_ok=True)
    json.dump(result, open(os.path.join(out, "replicas.json"), "w"), indent=1)
    levels = sorted(next(iter(table.values())).keys())
    lines = [
        "# Replicas of the embeddings pipeline behind one gateway",
        "",
        f"Machine: {machine['cpu_model']}, {machine['nproc']} cores; commit "
        f"`{machine['git_commit'][:7]}`{' (dirty)' if machine.get('git_tracked_changes') else ''}, "
        f"{machine['date_utc']}. Rerun: `scripts/bench_replicas.sh [ROUNDS]`.",
        "",
        "Each row: the shipped config (embeddings only, 2 stages, 2 threads per stage) with "
        "`replicas = N`, C concurrent clients of one sentence per request "
        "(gateway/examples/bench_embeddings); medians over rounds, replica counts interleaved.",
        "",
        "| replicas | " + " | ".join(f"C={c} sentences/s (p50 / p99 ms)" for c in levels) + " | errors |",
        "| --- | " + " | ".join("---" for _ in levels) + " | --- |",
    ]
    for n, lv in table.items():
        cells = [f"{lv[c]['sentences_per_s']:.0f} ({lv[c]['p50_ms']:.1f} / {lv[c]['p99_ms']:.1f})" for c in levels]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {sum(l['errors'] for l in lv.values())} |")
    lines.append("| bare Candle, 2 threads, 1 process | "
                 + " | ".join(f"{baseline.get(c, float('nan')):.0f}" for c in levels) + " | |")
    one = table.get(1)
    if one:
        lines += ["", "| ratio to 1 replica | " + " | ".join(f"C={c}" for c in levels) + " |",
                  "| --- | " + " | ".join("---" for _ in levels) + " |"]
        for n, lv in table.items():
            lines.append(f"| {n} | " + " | ".join(
                f"{lv[c]['sentences_per_s'] / one[c]['sentences_per_s']:.2f}×" for c in levels) + " |")
    lines += [
        "",
        f"On {machine['nproc']} cores every replica's stages share the same cores, so more "
        "replicas cannot add throughput here: the table shows what they cost (more "
        "processes, caches and schedulers competing) rather than what they gain. "
        "How throughput, tail latency and KV memory grow on real hosts, where each "
        "replica has cores of its own, is modelled in [`docs/scaling.md`](../docs/scaling.md).",
        "",
        "![replicas](replicas.png)",
    ]
    open(os.path.join(out, "replicas.md"), "w").write("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for c in levels:
            ax.plot(list(table), [table[n][c]["sentences_per_s"] for n in table], marker="o", label=f"C={c}")
        ax.set_xlabel("replicas")
        ax.set_ylabel("sentences/s")
        ax.set_xticks(list(table))
        ax.set_title(f"Embeddings through one gateway, {machine['nproc']} cores")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "replicas.png"), dpi=100)
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
