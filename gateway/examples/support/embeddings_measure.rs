//! bench_embeddings: latency summaries and what /proc says about CPU time and
//! memory of the gateway and its stages.

use super::stage_procs;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::process::Command;

#[derive(Clone, Debug)]
pub(super) struct Summary {
    pub(super) n: usize,
    pub(super) p50: f64,
    pub(super) p99: f64,
    pub(super) mean: f64,
    pub(super) min: f64,
    pub(super) max: f64,
}

/// Nearest-rank percentiles of latencies in ms.
pub(super) fn summarize(lat_ms: &[f64]) -> Summary {
    let mut v = lat_ms.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    let pct = |p: f64| -> f64 {
        if n == 0 {
            return f64::NAN;
        }
        let rank = ((p / 100.0) * n as f64).ceil() as usize;
        v[rank.clamp(1, n) - 1]
    };
    Summary {
        n,
        p50: pct(50.0),
        p99: pct(99.0),
        mean: v.iter().sum::<f64>() / n.max(1) as f64,
        min: v.first().copied().unwrap_or(f64::NAN),
        max: v.last().copied().unwrap_or(f64::NAN),
    }
}

/// Of several rounds of one measurement, the one least disturbed by other
/// processes (lowest `other_processes_cores`, measured independently of the
/// result), with every round's throughput and interference attached.
pub(super) fn select_round(rounds: Vec<Value>, latency_key: &str) -> Value {
    let other = |r: &Value| {
        r["other_processes_cores"]
            .as_f64()
            .filter(|x| x.is_finite())
            .unwrap_or(f64::INFINITY)
    };
    let best = (0..rounds.len())
        .min_by(|a, b| other(&rounds[*a]).total_cmp(&other(&rounds[*b])))
        .unwrap_or(0);
    let summary: Vec<Value> = rounds
        .iter()
        .map(|r| {
            json!({
                "sentences_per_s": r["sentences_per_s"],
                "p50_ms": r[latency_key]["p50_ms"],
                "p99_ms": r[latency_key]["p99_ms"],
                "other_processes_cores": r["other_processes_cores"],
            })
        })
        .collect();
    let mut out = rounds.into_iter().nth(best).unwrap_or(Value::Null);
    out["selected_round"] = json!(best);
    out["rounds"] = json!(summary);
    out
}

pub(super) fn summary_json(s: &Summary) -> Value {
    json!({"count": s.n, "p50_ms": s.p50, "p99_ms": s.p99, "mean_ms": s.mean,
           "min_ms": s.min, "max_ms": s.max})
}

// ------------------------------------------------------------ /proc helpers

/// `(utime + stime)` in seconds and the parent pid and name of a process.
pub(super) fn proc_stat(pid: u32) -> Option<(f64, u32, String)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let open = s.find('(')?;
    let close = s.rfind(')')?;
    let name = s[open + 1..close].to_string();
    let rest: Vec<&str> = s[close + 2..].split_whitespace().collect();
    // rest[0] = state (field 3); ppid = field 4; utime = 14; stime = 15.
    let ppid = rest.get(1)?.parse().ok()?;
    let ut: f64 = rest.get(11)?.parse().ok()?;
    let st: f64 = rest.get(12)?.parse().ok()?;
    Some(((ut + st) / clock_ticks(), ppid, name))
}

pub(super) fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

pub(super) fn cpu_secs(pid: u32) -> f64 {
    proc_stat(pid).map(|s| s.0).unwrap_or(f64::NAN)
}

/// Busy CPU seconds of the whole machine (all cores) from `/proc/stat`.
pub(super) fn system_busy_secs() -> f64 {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<f64> = s
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    if f.len() < 5 {
        return f64::NAN;
    }
    // user nice system idle iowait irq softirq steal ...
    let total: f64 = f.iter().take(8).sum();
    (total - f[3] - f[4]) / clock_ticks()
}

/// `Vm*`/`Rss*` fields of `/proc/PID/status`, in bytes.
pub(super) fn proc_mem(pid: u32) -> BTreeMap<String, u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let mut out = BTreeMap::new();
    for line in s.lines() {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        if !["VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem", "VmPeak"].contains(&k) {
            continue;
        }
        if let Some(kb) = v
            .split_whitespace()
            .next()
            .and_then(|x| x.parse::<u64>().ok())
        {
            out.insert(k.to_string(), kb * 1024);
        }
    }
    out
}

/// The gateway's stage processes for `model` (the gateway also runs the
/// completions pipeline's stages), with their `--stage-index`.
pub(super) fn stage_children(ppid: u32, model: &str) -> Vec<(u32, Option<u32>)> {
    let mut out: Vec<(u32, Option<u32>)> = stage_procs::stage_children(ppid, model)
        .into_iter()
        .map(|(pid, argv)| {
            let index = stage_procs::arg(&argv, "--stage-index").and_then(|v| v.parse().ok());
            (pid, index)
        })
        .collect();
    out.sort_by_key(|(pid, idx)| (idx.unwrap_or(u32::MAX), *pid));
    out
}

pub(super) fn load_avg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}
