#!/usr/bin/env python3
"""Summarises scripts/bench_ab.sh's runs (target/ab/runs) into OUT.json,
OUT.md and OUT.png: for each side (old, new), each pass's gateway numbers of
the embeddings benchmark (sentences/s and p50 latency at each concurrency)
and of the completions benchmark (per-token p50, TTFT p50 and tokens/s at
16 streams, 1 and 2 stages), their medians over the passes, and new/old."""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone

from bench_venv import run_plot


def embeddings(path):
    e = json.load(open(os.path.join(path, "embeddings.json")))
    out = {}
    for level in e["gateways"][0]["levels"]:
        c = level["concurrency"]
        out[f"embeddings C={c} sentences/s"] = level["sentences_per_s"]
        out[f"embeddings C={c} p50 ms"] = level["request_latency"]["p50_ms"]
    return out


def completions(path):
    c = json.load(open(path + ".json"))
    out = {}
    for key, name in (("one_stage", "1 stage"), ("two_stages", "2 stages")):
        s = c[key]
        out[f"completions {name} per-token p50 ms"] = s["per_token_ms_p50"]
        out[f"completions {name} TTFT p50 ms"] = s["ttft_ms_p50"]
        out[f"completions {name} tokens/s @16"] = s["aggregate"]["16"]["tokens_per_s"]
    return out


def lower_is_better(metric):
    return metric.endswith(" ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", required=True)
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    passes = sorted(
        int(n.split("-")[-1]) for n in os.listdir(a.runs) if n.startswith("emb-new-") and "." not in n
    )
    sides = {}
    for side in ("old", "new"):
        sides[side] = [
            {**embeddings(os.path.join(a.runs, f"emb-{side}-{p}")),
             **completions(os.path.join(a.runs, f"compl-{side}-{p}"))}
            for p in passes
        ]
    metrics = list(sides["new"][0].keys())
    rows = []
    for m in metrics:
        old = [r[m] for r in sides["old"]]
        new = [r[m] for r in sides["new"]]
        mo, mn = statistics.median(old), statistics.median(new)
        rows.append({"metric": m, "old": old, "new": new, "old_median": mo, "new_median": mn,
                     "new_over_old": mn / mo if mo else None,
                     "lower_is_better": lower_is_better(m)})
    cpu = platform.processor() or platform.machine()
    try:
        model = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")][0]
    except (OSError, IndexError):
        model = cpu
    result = {
        "benchmark": "A/B of two commits, interleaved (scripts/bench_ab.sh)",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} cores, {model}",
        "old": a.old,
        "new": a.new,
        "passes": len(passes),
        "rows": rows,
    }
    json.dump(result, open(a.out + ".json", "w"), indent=2)
    lines = [
        "# A/B: the embeddings and completions benchmarks of two commits",
        "",
        f"Machine: {result['machine']}; {result['when']}. Old: `{a.old}`. New: `{a.new}`.",
        f"{len(passes)} passes, each old then new, embeddings then completions "
        "(embeddings: 2 stages, 2 threads per stage, token budget 4096, bf16, best of 3 rounds; "
        "completions: 64 tokens, greedy, `threads_per_stage = 2`). Each side runs its own "
        "gateway and stage binaries under the same harness.",
        "",
        "| metric | old (each pass) | new (each pass) | old median | new median | new / old |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        fmt = lambda v: f"{v:.2f}" if v < 100 else f"{v:.1f}"
        better = "lower is better" if r["lower_is_better"] else "higher is better"
        lines.append(
            f"| {r['metric']} ({better}) | {', '.join(fmt(v) for v in r['old'])} | "
            f"{', '.join(fmt(v) for v in r['new'])} | {fmt(r['old_median'])} | "
            f"{fmt(r['new_median'])} | {r['new_over_old']:.3f} |"
        )
    spread = max(
        (max(r["old"]) - min(r["old"])) / r["old_median"] for r in rows if r["old_median"]
    )
    lines += [
        "",
        f"Noise: the largest spread of one side's own passes is {spread * 100:.0f} % of its "
        "median (old side); a new/old ratio inside that spread is no measurable change.",
        "",
        "Rerun: `scripts/bench_ab.sh OLD_COMMIT [PASSES]` (about 6 minutes a pass on 2 cores).",
    ]
    open(a.out + ".md", "w").write("\n".join(lines) + "\n")
    plot(rows, a.out + ".png")
    print("\n".join(lines))


def plot(rows, path):
    """new/old per metric, with the old side's own spread (matplotlib in
    the benchmark virtualenv, bench_venv.py)."""
    code = r"""
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
rows = json.loads(sys.argv[1])
fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
names = [r["metric"] for r in rows]
ratio = [r["new_over_old"] for r in rows]
lo = [min(r["old"]) / r["old_median"] for r in rows]
hi = [max(r["old"]) / r["old_median"] for r in rows]
y = range(len(rows))
ax.hlines(y, lo, hi, color="0.75", linewidth=6, label="old passes / old median")
ax.plot(ratio, y, "o", color="C0", label="new median / old median")
ax.axvline(1.0, color="0.3", linewidth=0.8)
ax.set_yticks(list(y))
ax.set_yticklabels(names, fontsize=8)
ax.invert_yaxis()
ax.set_xlabel("ratio to the old median")
ax.legend(fontsize=8, loc="lower right")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
"""
    run_plot(code, json.dumps(rows), path)


if __name__ == "__main__":
    main()
