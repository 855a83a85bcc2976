//! bench_embeddings: the machine description and the markdown report.

use super::measure::load_avg;
use super::{MIB, RSS_OVERHEAD_BYTES, SENTENCES};
use serde_json::{json, Value};
use std::process::Command;

pub(super) fn machine_info() -> Value {
    let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .and_then(|r| r.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let cmd = |c: &str, a: &[&str]| -> String {
        Command::new(c)
            .args(a)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    let modified: Vec<String> = cmd("git", &["status", "--porcelain", "--untracked-files=no"])
        .lines()
        .map(|l| l.trim().to_string())
        .collect();
    let dirty = !modified.is_empty();
    json!({
        "nproc": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu_model": cpu_model,
        "date_utc": cmd("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
        "git_commit": cmd("git", &["rev-parse", "HEAD"]),
        "git_tracked_changes": dirty,
        "git_modified_files": modified,
        "kernel": cmd("uname", &["-r"]),
        "loadavg_at_start": load_avg(),
    })
}

pub(super) fn level(v: &Value, c: usize) -> Option<&Value> {
    v["levels"]
        .as_array()?
        .iter()
        .find(|l| l["concurrency"].as_u64() == Some(c as u64))
}

pub(super) fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// "123.4 (0.05), …": every round's sentences/s and other-process cores;
/// the reported round in bold.
pub(super) fn rounds_cell(l: &Value) -> String {
    let sel = l["selected_round"].as_u64();
    l["rounds"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, r)| {
            let t = format!(
                "{:.1} ({:.2})",
                f(&r["sentences_per_s"]),
                f(&r["other_processes_cores"])
            );
            if Some(i as u64) == sel {
                format!("**{t}**")
            } else {
                t
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

pub(super) fn write_markdown(out: &Value) -> String {
    let mut md = String::new();
    let m = &out["machine"];
    md.push_str("# Embeddings benchmark (all-MiniLM-L6-v2)\n\n");
    md.push_str(&format!(
        "Machine: {} × {} ({} cores visible), kernel {}; {}; commit {}{}.\n\
         Load average at start: {}.\n\n",
        m["nproc"],
        m["cpu_model"].as_str().unwrap_or(""),
        m["nproc"],
        m["kernel"].as_str().unwrap_or(""),
        m["date_utc"].as_str().unwrap_or(""),
        m["git_commit"].as_str().unwrap_or(""),
        if m["git_tracked_changes"].as_bool() == Some(true) {
            " (with uncommitted changes)"
        } else {
            ""
        },
        m["loadavg_at_start"].as_str().unwrap_or(""),
    ));
    md.push_str(&format!(
        "Sentences: {} fixed English sentences, {}–{} tokens (mean {:.1}) with [CLS]/[SEP], cycled. \
         Baseline: `Engine::embed_texts` on one batch of C sentences in one process (all 6 layers); \
         its latency is the batch's latency. Gateway: C concurrent clients, one sentence per \
         `POST /v1/embeddings`; latency per request, measured by the client (the client runs on \
         the same {} cores).\n\n",
        SENTENCES.len(),
        out["sentences"]["min_tokens"],
        out["sentences"]["max_tokens"],
        f(&out["sentences"]["mean_tokens"]),
        m["nproc"],
    ));
    if let Some(n) = out["note"].as_str() {
        md.push_str(&format!("Note: {n}\n\n"));
    }
    for b in out["baselines"].as_array().into_iter().flatten() {
        md.push_str(&format!(
            "## Baseline: bare Candle, {} thread(s), {} weights\n\n| C | sentences/s | batch p50 ms | batch p99 ms | batches | CPU cores used | rounds: sentences/s (other cores) |\n|---|---|---|---|---|---|---|\n",
            b["threads"],
            b["weights"].as_str().unwrap_or("f32"),
        ));
        for l in b["levels"].as_array().into_iter().flatten() {
            md.push_str(&format!(
                "| {} | {:.1} | {:.2} | {:.2} | {} | {:.2} | {} |\n",
                l["concurrency"],
                f(&l["sentences_per_s"]),
                f(&l["batch_latency"]["p50_ms"]),
                f(&l["batch_latency"]["p99_ms"]),
                l["batches"],
                f(&l["cpu_cores_used"]),
                rounds_cell(l),
            ));
        }
        md.push('\n');
    }
    let base = |t: u64| {
        out["baselines"]
            .as_array()
            .and_then(|a| a.iter().find(|b| b["threads"].as_u64() == Some(t)))
    };
    for g in out["gateways"].as_array().into_iter().flatten() {
        let tps = g["threads_per_stage"].as_u64().unwrap_or(0);
        md.push_str(&format!(
            "## Gateway: 2 stages, threads_per_stage = {tps}, token_budget = {}\n\nStartup to LISTENING: {:.1} s.\n\n\
             | C | sentences/s | p50 ms | p99 ms | requests | errors (all rounds) | CPU cores: client / gateway / stage0 / stage1 / other | rounds: sentences/s (other cores) |\n|---|---|---|---|---|---|---|---|\n",
            g["token_budget"],
            f(&g["startup_s"])
        ));
        for l in g["levels"].as_array().into_iter().flatten() {
            let cpu = &l["cpu"];
            let st: Vec<String> = cpu["stage_cores"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|x| format!("{:.2}", f(x)))
                .collect();
            md.push_str(&format!(
                "| {} | {:.1} | {:.2} | {:.2} | {} | {} | {:.2} / {:.2} / {} / {:.2} | {} |\n",
                l["concurrency"],
                f(&l["sentences_per_s"]),
                f(&l["request_latency"]["p50_ms"]),
                f(&l["request_latency"]["p99_ms"]),
                l["requests"],
                l["errors_all_rounds"],
                f(&cpu["bench_client_cores"]),
                f(&cpu["gateway_cores"]),
                st.join(" / "),
                f(&cpu["other_processes_cores"]),
                rounds_cell(l),
            ));
        }
        let max_diff = g["levels"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|l| f(&l["max_abs_diff_all_rounds"]))
            .fold(0.0, f64::max);
        md.push_str(&format!(
            "\nEvery response checked: HTTP 200 with one 384-d vector; largest |difference| from \
             the in-process embedding of the same sentence: {max_diff:.2e}.\n\n"
        ));
        md.push_str(
            "### Against the targets\n\n| Metric | Value | Target | Met? |\n|---|---|---|---|\n",
        );
        let g64 = level(g, 64).map(|l| f(&l["sentences_per_s"]));
        let g1 = level(g, 1).map(|l| f(&l["request_latency"]["p50_ms"]));
        for t in [2u64, 1] {
            if let (Some(b), Some(gv)) = (base(t).and_then(|b| level(b, 64)), g64) {
                let r = gv / f(&b["sentences_per_s"]);
                let (target, met) = if t == 2 {
                    ("≥ 0.90", if r >= 0.9 { "yes" } else { "**no**" })
                } else {
                    ("(context)", "")
                };
                md.push_str(&format!(
                    "| Throughput at C=64 / {t}-thread baseline | {:.1} / {:.1} = **{r:.2}** | {target} | {met} |\n",
                    gv,
                    f(&b["sentences_per_s"])
                ));
            }
        }
        for t in [1u64, 2] {
            if let (Some(b), Some(gv)) = (base(t).and_then(|b| level(b, 1)), g1) {
                let bp = f(&b["batch_latency"]["p50_ms"]);
                let added = gv - bp;
                md.push_str(&format!(
                    "| Added p50 latency at C=1 vs {t}-thread baseline | {gv:.2} − {bp:.2} = **{added:+.2} ms** | ≤ 1 ms | {} |\n",
                    if added <= 1.0 { "yes" } else { "**no**" }
                ));
            }
        }
        for s in g["stages"].as_array().into_iter().flatten() {
            let idx = s["stage_index"].as_u64().unwrap_or(0) as usize;
            let hwm = s["mem_bytes"]["VmHWM"].as_u64().unwrap_or(0);
            let w = out["weights"]["stage_weight_bytes"][idx]
                .as_u64()
                .unwrap_or(0);
            let target = 2 * w + RSS_OVERHEAD_BYTES;
            md.push_str(&format!(
                "| Stage {idx} peak RSS (VmHWM) | {:.1} MiB (weights {:.1} MiB) | ≤ 2×weights + 100 MiB = {:.1} MiB | {} |\n",
                hwm as f64 / MIB,
                w as f64 / MIB,
                target as f64 / MIB,
                if hwm <= target { "yes" } else { "**no**" }
            ));
        }
        md.push('\n');
    }
    if let Some(cmp) = out.get("threads_per_stage_comparison") {
        md.push_str(&format!(
            "## Gateway setups compared\n\n{}\n\n",
            cmp["summary"].as_str().unwrap_or("")
        ));
    }
    md.push_str(
        "## Notes\n\n\
         * Baseline at concurrency C = one `embed_texts` call on C sentences; throughput = sentences / wall time.\n\
         * Gateway: each level runs a short pilot (also its warm-up) that fixes the number of requests per client for ~the target duration; the pilot is not reported.\n\
         * Each level is measured in several rounds; the reported round is the one with the least CPU used by other processes (an observation independent of the result), all rounds are listed. On a shared machine the numbers are still noisy: compare setups with care.\n\
         * CPU columns: cores used during the level (from /proc/PID/stat); \"other\" = machine busy time not in the bench client, gateway or stages (e.g. another engineer's compile on this shared machine), which disturbs the numbers.\n\
         * Peak RSS is VmHWM at the end of the run (includes loading); weights are the safetensors bytes of the tensors a stage loads (stage 0: `embeddings.*` + its layers).\n\n",
    );
    md.push_str(&format!(
        "How to rerun: `scripts/bench_embeddings.sh` from the repository root (arguments are passed on, e.g. `--threads-per-stage 1,2`). This run: `{}`.\n",
        out["command"].as_str().unwrap_or("")
    ));
    md
}
