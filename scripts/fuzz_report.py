#!/usr/bin/env python3
"""Summarises a fuzzing campaign of scripts/fuzz.sh from libFuzzer's logs:
per target the executions, speed, coverage (edges and features) at the start
and at the end, corpus size, peak memory and any crash, hang or out-of-memory
input found. Prints the table; with FUZZ_REPORT=1 also writes
benchmark_results/fuzz.{json,md}.

    scripts/fuzz_report.py WORK_DIR SECONDS TARGET...
"""

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATUS = re.compile(r"^#(\d+)\s+(\w+)\s+cov: (\d+) ft: (\d+) corp: (\d+)/(\S+)")


def parse(work, target):
    log = (work / "logs" / f"{target}.log").read_text(errors="replace")
    rc_file = work / "logs" / f"{target}.rc"
    stats = {k: float(v) for k, v in re.findall(r"^stat::(\w+):\s+([\d.]+)", log, re.M)}
    status = [m.groups() for m in map(STATUS.match, log.splitlines()) if m]
    inited = next((s for s in status if s[1] == "INITED"), status[0] if status else None)
    last = status[-1] if status else None
    artifacts = sorted(p.name for p in (work / "artifacts" / target).glob("*") if p.is_file())
    return {
        "target": target,
        "exit_code": int(rc_file.read_text().strip()) if rc_file.exists() else None,
        "executions": int(stats.get("number_of_executed_units", 0)),
        "execs_per_sec": int(stats.get("average_exec_per_sec", 0)),
        "new_units": int(stats.get("new_units_added", 0)),
        "peak_rss_mb": int(stats.get("peak_rss_mb", 0)),
        "slowest_unit_s": stats.get("slowest_unit_time_sec", 0),
        "edges_start": int(inited[2]) if inited else None,
        "edges_end": int(last[2]) if last else None,
        "features_start": int(inited[3]) if inited else None,
        "features_end": int(last[3]) if last else None,
        "corpus_end": int(last[4]) if last else None,
        "artifacts": artifacts,
    }


def machine():
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def main():
    work, seconds, targets = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    rows = [parse(work, t) for t in targets]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    header = ("| target | executions | exec/s | edges (start → end) | features (start → end) "
              "| corpus | peak RSS MiB | findings |\n|---|---:|---:|---:|---:|---:|---:|---|")
    lines = [header]
    for r in rows:
        found = ", ".join(r["artifacts"]) or "none"
        lines.append(f"| `{r['target']}` | {r['executions']:,} | {r['execs_per_sec']:,} | "
                     f"{r['edges_start']} → {r['edges_end']} | {r['features_start']} → {r['features_end']} | "
                     f"{r['corpus_end']} | {r['peak_rss_mb']} | {found} |")
    table = "\n".join(lines)
    print(table)
    if os.environ.get("FUZZ_REPORT") != "1":
        return
    out = ROOT / "benchmark_results"
    meta = {
        "commit": commit,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": machine(),
        "seconds_per_target": seconds,
        "jobs": int(os.environ.get("FUZZ_JOBS", "1")),
        "engine": "libFuzzer via cargo-fuzz 0.13.2, stable rustc, --sanitizer none, debug assertions on",
    }
    (out / "fuzz.json").write_text(json.dumps({**meta, "targets": rows}, indent=2) + "\n")
    total = sum(r["executions"] for r in rows)
    md = f"""# Fuzzing campaign

Written by `FUZZ_REPORT=1 FUZZ_JOBS={meta['jobs']} scripts/fuzz.sh {seconds}` (`scripts/fuzz_report.py`) on
{meta['machine']}, commit `{commit}`, {meta['date']}.
Engine: {meta['engine']}. Targets, seeds and how to run longer campaigns: `docs/fuzzing.md`.

{seconds} s per target ({seconds / 60:.0f} min), {total:,} executions in all. "Edges" are libFuzzer's
`cov` (instrumented control-flow edges reached), "features" its `ft` (edges with hit counts
and comparison values); start = after loading the seeds and the committed corpus, end =
after the campaign. Findings are the crash, hang (`timeout-`) or out-of-memory (`oom-`)
inputs the campaign saved; "none" means none.

{table}
"""
    (out / "fuzz.md").write_text(md)
    print(f"wrote {out / 'fuzz.json'} and {out / 'fuzz.md'}")


if __name__ == "__main__":
    main()
