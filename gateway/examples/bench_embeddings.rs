//! Embeddings benchmark: bare in-process Candle vs the gateway pipeline.
//!
//! Run from the repository root (see `scripts/bench_embeddings.sh`):
//!
//! ```text
//! cargo build --release && cargo build --release -p gateway --example bench_embeddings
//! ./target/release/examples/bench_embeddings [--threads-per-stage 1,2]
//! ```
//!
//! * Baseline: `enclave_stage::serving::embedding::engine::Engine` with all 6 layers in one
//!   process, `embed_texts` on batches of C sentences (what an ideal server
//!   would do with C concurrent single-sentence requests). Candle reads its
//!   thread count once, so each thread count runs in a child process (this
//!   binary re-executed with the hidden `--baseline-worker` mode).
//! * Gateway: `gateway serve` with a temporary copy of the config (absolute
//!   paths, `listen = 127.0.0.1:0`), C concurrent clients sending one
//!   sentence per `POST /v1/embeddings`.
//! * Memory: peak RSS (VmHWM) of each stage vs 2 × its weight bytes + 100 MiB.
//!
//! Writes `benchmark_results/embeddings.json` and `benchmark_results/embeddings.md`.

#[path = "support/embeddings_gateway.rs"]
mod gateway_run;
#[path = "support/embeddings_measure.rs"]
mod measure;
#[path = "support/embeddings_report.rs"]
mod report;
#[path = "support/stage_procs.rs"]
mod stage_procs;

use anyhow::{bail, Context, Result};
use clap::Parser;
use enclave_stage::role::StageSpec;
use enclave_stage::serving::embedding::engine::Engine;
use gateway_run::run_gateway_setup;
use measure::{cpu_secs, proc_mem, select_round, summarize, summary_json, system_busy_secs};
use report::{f, level, machine_info, write_markdown};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

const MODEL_ID: &str = "all-MiniLM-L6-v2";
const DIM: usize = 384;
const LEVELS: [usize; 3] = [1, 8, 64];
const MIB: f64 = 1024.0 * 1024.0;
/// Fixed overhead allowed per stage on top of 2 × its weights.
const RSS_OVERHEAD_BYTES: u64 = 100 << 20;
/// Upper bound on requests per gateway level (keeps a slow run bounded).
const MAX_REQUESTS_PER_LEVEL: usize = 20_000;

/// Typical English sentences, 8–30 tokens each with `[CLS]`/`[SEP]`; cycled.
const SENTENCES: [&str; 32] = [
    "The weather is lovely today.",
    "Please send me the quarterly report by Friday.",
    "How do I reset my password?",
    "The cat sat quietly on the warm windowsill.",
    "Our new office is located near the central train station.",
    "Can you recommend a good Italian restaurant in the area?",
    "The meeting has been moved to three o'clock tomorrow afternoon.",
    "Machine learning models need large amounts of training data.",
    "She finished the marathon in just under four hours.",
    "The package was delivered to the wrong address yesterday.",
    "I would like to cancel my subscription, effective immediately.",
    "Photosynthesis converts sunlight into chemical energy in plants.",
    "The museum is closed on Mondays and public holidays.",
    "He forgot his umbrella and got soaked on the way home.",
    "Interest rates are expected to remain stable this year.",
    "What time does the last bus leave for the airport?",
    "The software update fixes several security vulnerabilities and improves battery life.",
    "Children learn languages faster than most adults do.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Our customer support team is available around the clock.",
    "The bridge was closed for repairs after the storm last week.",
    "Please make sure all devices are switched off before takeoff.",
    "The novel tells the story of a family across three generations.",
    "Regular exercise can improve both physical and mental health.",
    "The committee will announce the winners at the end of the month.",
    "I can't find my keys anywhere.",
    "The hotel offers free breakfast and a shuttle to the beach.",
    "Scientists discovered a new species of frog in the rainforest.",
    "The invoice total does not match the amount on the purchase order.",
    "Traffic on the highway was unusually light this morning.",
    "Remember to water the plants while I am away on vacation.",
    "The concert was postponed because the lead singer caught a cold.",
];

#[derive(Parser, Debug)]
#[command(about = "Embeddings benchmark: bare Candle baseline vs the gateway pipeline")]
struct Args {
    /// Internal: run the in-process baseline and print its result as JSON.
    #[arg(long, hide = true)]
    baseline_worker: bool,
    /// Internal (baseline worker): Candle threads.
    #[arg(long, hide = true, default_value_t = 1)]
    threads: usize,
    /// Gateway `pipeline.threads_per_stage` values to measure (comma-separated;
    /// default: the config's).
    #[arg(long, value_delimiter = ',')]
    threads_per_stage: Vec<usize>,
    /// Gateway `pipeline.token_budget` values to measure (comma-separated;
    /// default: the config's). Every threads-per-stage × token-budget pair is
    /// one gateway setup.
    #[arg(long, value_delimiter = ',')]
    token_budget: Vec<usize>,
    /// Baseline thread counts (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 2])]
    baseline_threads: Vec<usize>,
    /// Seconds per baseline concurrency level (all rounds together).
    #[arg(long, default_value_t = 9.0)]
    baseline_secs: f64,
    /// Target seconds per gateway concurrency level, all rounds together
    /// (sets the fixed request count).
    #[arg(long, default_value_t = 18.0)]
    gateway_secs: f64,
    /// Rounds per level; the one least disturbed by other processes (CPU
    /// time not spent by the benchmark, gateway or stages) is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Gateway config to copy.
    #[arg(long, default_value = "config/gateway.toml")]
    config: PathBuf,
    /// Folder with `gateway` and `enclave-stage` (default: the folder above this example).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Where to write embeddings.json / embeddings.md.
    #[arg(long, default_value = "benchmark_results")]
    out_dir: PathBuf,
    /// Free-text note recorded in the results (e.g. what the binaries were built from).
    #[arg(long)]
    note: Option<String>,
    /// Also write each weight format's vectors of the 32 sentences (one
    /// sentence at a time, bare Candle) to this JSON file, for comparison
    /// with other systems (`scripts/peers_embeddings.py`).
    #[arg(long)]
    vectors_out: Option<PathBuf>,
    /// How the bare baselines hold the weights, `bf16` and/or `f32`
    /// (comma-separated; default: the embedding stages' default). The first
    /// is the one the gateway's answers are compared with and its ratios
    /// are taken against: give it the gateway config's `weights`.
    #[arg(long, value_delimiter = ',', default_values_t = vec![enclave_stage::serving::EMBEDDING_DEFAULT])]
    weights: Vec<proto::frames::WeightFormat>,
    /// Internal (baseline worker): model folder.
    #[arg(long, hide = true)]
    model_dir: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.baseline_worker {
        return baseline_worker(&args);
    }
    run(args)
}

// ------------------------------------------------------------------ baseline

fn baseline_worker(args: &Args) -> Result<()> {
    // Before Candle starts any thread (the parent sets these too).
    std::env::set_var("RAYON_NUM_THREADS", args.threads.to_string());
    std::env::set_var("CANDLE_NUM_THREADS", args.threads.to_string());
    let model_dir = args.model_dir.clone().context("--model-dir")?;
    let t0 = Instant::now();
    let engine = Engine::load(
        &model_dir,
        &StageSpec {
            stage_index: 0,
            num_stages: 1,
            layers: 0..6,
        },
        args.weights[0],
    )?;
    let load_s = t0.elapsed().as_secs_f64();
    let tokens: Vec<usize> = SENTENCES
        .iter()
        .map(|s| engine.tokenize(s).map(|t| t.len()))
        .collect::<Result<_, String>>()
        .map_err(anyhow::Error::msg)?;
    // Reference vectors (each sentence alone) to cross-check the gateway.
    let reference: Vec<Vec<f32>> = SENTENCES
        .iter()
        .map(|s| engine.embed_texts(&[s]).map(|mut v| v.remove(0)))
        .collect::<Result<_>>()?;
    let pid = std::process::id();
    let mut levels = Vec::new();
    for c in LEVELS {
        let batch = |i: usize| -> Vec<&str> {
            (0..c)
                .map(|j| SENTENCES[(i * c + j) % SENTENCES.len()])
                .collect()
        };
        for i in 0..2 {
            engine.embed_texts(&batch(i))?;
        }
        let rounds = args.rounds.max(1);
        let round_secs = args.baseline_secs / rounds as f64;
        let mut results = Vec::new();
        let mut i = 0;
        for round in 0..rounds {
            let cpu0 = cpu_secs(pid);
            let sys0 = system_busy_secs();
            let start = Instant::now();
            let mut lat = Vec::new();
            let mut n = 0;
            while start.elapsed().as_secs_f64() < round_secs || lat.len() < 5 {
                let b = batch(i);
                let t = Instant::now();
                let out = engine.embed_texts(&b)?;
                lat.push(t.elapsed().as_secs_f64() * 1e3);
                if out.len() != c || out.iter().any(|v| v.len() != DIM) {
                    bail!("baseline returned {} vectors for {c} texts", out.len());
                }
                i += 1;
                n += 1;
            }
            let wall = start.elapsed().as_secs_f64();
            let cpu = cpu_secs(pid) - cpu0;
            let other = (system_busy_secs() - sys0 - cpu) / wall;
            let s = summarize(&lat);
            eprintln!(
                "  baseline threads={} C={c:>2} round {round}: {:8.1} sentences/s  p50 {:7.2} ms  p99 {:7.2} ms  ({n} batches, cpu {:.2} cores, other processes {:.2} cores)",
                args.threads,
                (n * c) as f64 / wall,
                s.p50,
                s.p99,
                cpu / wall,
                other
            );
            results.push(json!({
                "concurrency": c,
                "batches": n,
                "sentences": n * c,
                "wall_s": wall,
                "sentences_per_s": (n * c) as f64 / wall,
                "batch_latency": summary_json(&s),
                "cpu_cores_used": cpu / wall,
                "other_processes_cores": other,
            }));
        }
        levels.push(select_round(results, "batch_latency"));
    }
    let out = json!({
        "threads": args.threads,
        "weights": args.weights[0].as_str(),
        "load_s": load_s,
        "tokens_per_sentence": tokens,
        "levels": levels,
        "peak_rss_bytes": proc_mem(pid).get("VmHWM"),
        "reference": reference,
    });
    println!("BASELINE_RESULT {out}");
    Ok(())
}

fn run_baseline(
    threads: usize,
    secs: f64,
    rounds: usize,
    model_dir: &Path,
    weights: proto::frames::WeightFormat,
) -> Result<Value> {
    let exe = std::env::current_exe()?;
    let out = Command::new(exe)
        .arg("--baseline-worker")
        .args(["--weights", weights.as_str()])
        .args(["--threads", &threads.to_string()])
        .args(["--baseline-secs", &secs.to_string()])
        .args(["--rounds", &rounds.to_string()])
        .arg("--model-dir")
        .arg(model_dir)
        .env("RAYON_NUM_THREADS", threads.to_string())
        .env("CANDLE_NUM_THREADS", threads.to_string())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .context("starting the baseline worker")?;
    if !out.status.success() {
        bail!("baseline worker (threads={threads}) failed: {}", out.status);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("BASELINE_RESULT "))
        .context("baseline worker printed no result")?;
    Ok(serde_json::from_str(line)?)
}

// ------------------------------------------------------------------- weights

/// Bytes of the tensors each stage loads: stage 0 = `embeddings.*` + its
/// layers, other stages = their layers.
fn stage_weight_bytes(weights: &Path, stage_layers: &[[u64; 2]]) -> Result<Vec<u64>> {
    let mut f =
        std::fs::File::open(weights).with_context(|| format!("opening {}", weights.display()))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)?;
    let n = u64::from_le_bytes(len);
    if n > 100 << 20 {
        bail!("safetensors header of {n} bytes");
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)?;
    let h: BTreeMap<String, Value> = serde_json::from_slice(&header)?;
    let mut out = vec![0u64; stage_layers.len()];
    for (name, info) in &h {
        if name == "__metadata__" {
            continue;
        }
        let off = info
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .with_context(|| format!("{name}: data_offsets"))?;
        let (a, b) = (
            off[0].as_u64().unwrap_or(0),
            off.get(1).and_then(|x| x.as_u64()).unwrap_or(0),
        );
        let size = b.saturating_sub(a);
        if name.starts_with("embeddings.") {
            out[0] += size;
        } else if let Some(rest) = name.strip_prefix("encoder.layer.") {
            let layer: u64 = rest.split('.').next().unwrap_or("").parse()?;
            if let Some(i) = stage_layers
                .iter()
                .position(|r| layer >= r[0] && layer < r[1])
            {
                out[i] += size;
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------- main

fn run(args: Args) -> Result<()> {
    let root = std::env::current_dir()?;
    if !root.join(&args.config).exists() {
        bail!(
            "{} not found: run from the repository root",
            args.config.display()
        );
    }
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => {
            // target/<profile>/examples/bench_embeddings → target/<profile>
            let exe = std::env::current_exe()?;
            exe.parent()
                .and_then(|p| p.parent())
                .context("locating the binaries")?
                .to_path_buf()
        }
    };
    let cfg: toml::Value = toml::from_str(&std::fs::read_to_string(&args.config)?)?;
    let model_dir = root.join(
        cfg["pipeline"]["model_dir"]
            .as_str()
            .context("pipeline.model_dir")?,
    );
    let stage_layers: Vec<[u64; 2]> = cfg["pipeline"]["stages"]
        .as_array()
        .context("pipeline.stages")?
        .iter()
        .map(|s| {
            let l = s["layers"].as_array().expect("layers");
            [
                l[0].as_integer().unwrap_or(0) as u64,
                l[1].as_integer().unwrap_or(0) as u64,
            ]
        })
        .collect();
    let machine = machine_info();
    eprintln!("machine: {machine}");

    let weights = stage_weight_bytes(&model_dir.join("model.safetensors"), &stage_layers)?;
    eprintln!("stage weight bytes: {weights:?}");

    let mut baselines = Vec::new();
    let mut reference: Vec<Vec<f32>> = Vec::new();
    let mut tokens: Vec<u64> = Vec::new();
    let mut vectors = serde_json::Map::new();
    for (&t, &w) in args
        .baseline_threads
        .iter()
        .flat_map(|t| args.weights.iter().map(move |w| (t, w)))
    {
        eprintln!("baseline: {t} thread(s), {w} weights");
        let mut b = run_baseline(t, args.baseline_secs, args.rounds, &model_dir, w)?;
        let vs = b["reference"].take();
        if reference.is_empty() {
            reference = serde_json::from_value(vs.clone())?;
            tokens = serde_json::from_value(b["tokens_per_sentence"].clone())?;
        }
        vectors.entry(w.as_str()).or_insert(vs);
        if let Some(o) = b.as_object_mut() {
            o.remove("reference");
        }
        baselines.push(b);
    }
    if let Some(path) = &args.vectors_out {
        std::fs::write(path, serde_json::to_vec(&vectors)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }

    let mut gateways = Vec::new();
    let or_config = |v: &[usize]| -> Vec<Option<usize>> {
        if v.is_empty() {
            vec![None]
        } else {
            v.iter().map(|t| Some(*t)).collect()
        }
    };
    let budgets = or_config(&args.token_budget);
    for &tps in &or_config(&args.threads_per_stage) {
        for &tb in &budgets {
            gateways.push(run_gateway_setup(
                &args,
                &root,
                &bin_dir,
                tps,
                tb,
                reference.clone(),
            )?);
        }
    }

    let mut out = json!({
        "benchmark": "embeddings",
        "model": MODEL_ID,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "bin_dir": bin_dir.display().to_string(),
        "note": args.note,
        "machine": machine,
        "sentences": {
            "count": SENTENCES.len(),
            "tokens": tokens,
            "min_tokens": tokens.iter().min(),
            "max_tokens": tokens.iter().max(),
            "mean_tokens": tokens.iter().sum::<u64>() as f64 / tokens.len().max(1) as f64,
        },
        "settings": {
            "levels": LEVELS,
            "baseline_secs_per_level": args.baseline_secs,
            "gateway_target_secs_per_level": args.gateway_secs,
            "config": args.config.display().to_string(),
        },
        "weights": {
            "file": model_dir.join("model.safetensors").display().to_string(),
            "stage_layers": stage_layers,
            "stage_weight_bytes": weights,
            "stage_rss_target_bytes": weights.iter().map(|w| 2 * w + RSS_OVERHEAD_BYTES).collect::<Vec<_>>(),
            "rss_target_rule": "2 x stage weight bytes + 100 MiB",
        },
        "baselines": baselines,
        "gateways": gateways,
    });
    out["targets"] = targets_json(&out);
    if gateways_len(&out) > 1 {
        out["threads_per_stage_comparison"] = compare_tps(&out);
    }
    std::fs::create_dir_all(&args.out_dir)?;
    let jpath = args.out_dir.join("embeddings.json");
    let mpath = args.out_dir.join("embeddings.md");
    std::fs::write(&jpath, serde_json::to_string_pretty(&out)? + "\n")?;
    std::fs::write(&mpath, write_markdown(&out))?;
    eprintln!("wrote {} and {}", jpath.display(), mpath.display());
    eprintln!("targets: {}", out["targets"]);
    Ok(())
}

fn gateways_len(out: &Value) -> usize {
    out["gateways"].as_array().map(|a| a.len()).unwrap_or(0)
}

fn base_level(out: &Value, threads: u64, c: usize) -> Option<&Value> {
    out["baselines"]
        .as_array()?
        .iter()
        .find(|b| b["threads"].as_u64() == Some(threads))
        .and_then(|b| level(b, c))
}

/// The headline ratios per gateway setup.
fn targets_json(out: &Value) -> Value {
    let mut per = Vec::new();
    for g in out["gateways"].as_array().into_iter().flatten() {
        let g64 = level(g, 64).map(|l| f(&l["sentences_per_s"]));
        let g1 = level(g, 1).map(|l| f(&l["request_latency"]["p50_ms"]));
        let ratio =
            |t| -> Option<f64> { Some(g64? / f(&base_level(out, t, 64)?["sentences_per_s"])) };
        let added = |t| -> Option<f64> {
            Some(g1? - f(&base_level(out, t, 1)?["batch_latency"]["p50_ms"]))
        };
        let rss: Vec<Value> = g["stages"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| {
                let idx = s["stage_index"].as_u64().unwrap_or(0) as usize;
                let hwm = s["mem_bytes"]["VmHWM"].as_u64().unwrap_or(0);
                let target = out["weights"]["stage_rss_target_bytes"][idx]
                    .as_u64()
                    .unwrap_or(0);
                json!({"stage_index": idx, "peak_rss_bytes": hwm, "target_bytes": target, "met": hwm <= target})
            })
            .collect();
        per.push(json!({
            "threads_per_stage": g["threads_per_stage"],
            "token_budget": g["token_budget"],
            "throughput_ratio_c64_vs_2thread_baseline": ratio(2),
            "throughput_ratio_c64_target": 0.9,
            "throughput_target_met": ratio(2).map(|r| r >= 0.9),
            "throughput_ratio_c64_vs_1thread_baseline": ratio(1),
            "added_p50_ms_c1_vs_1thread_baseline": added(1),
            "added_p50_ms_c1_vs_2thread_baseline": added(2),
            "added_p50_target_ms": 1.0,
            "added_p50_target_met_vs_1thread": added(1).map(|a| a <= 1.0),
            "stage_rss": rss,
        }));
    }
    json!(per)
}

fn compare_tps(out: &Value) -> Value {
    let gs: Vec<&Value> = out["gateways"].as_array().into_iter().flatten().collect();
    let best = |c: usize, key: &str, sub: Option<&str>, higher: bool| -> Option<(String, f64)> {
        gs.iter()
            .filter_map(|g| {
                let l = level(g, c)?;
                let v = match sub {
                    Some(s) => f(&l[key][s]),
                    None => f(&l[key]),
                };
                let label = format!(
                    "threads_per_stage={} token_budget={}",
                    g["threads_per_stage"], g["token_budget"]
                );
                Some((label, v))
            })
            .reduce(|a, b| {
                if (higher && b.1 > a.1) || (!higher && b.1 < a.1) {
                    b
                } else {
                    a
                }
            })
    };
    let c1 = best(1, "request_latency", Some("p50_ms"), false);
    let c64 = best(64, "sentences_per_s", None, true);
    let all: Vec<String> = gs
        .iter()
        .map(|g| {
            format!(
                "threads_per_stage={} token_budget={}: C=1 p50 {:.2} ms, C=64 {:.1} sentences/s (p99 {:.1} ms)",
                g["threads_per_stage"],
                g["token_budget"],
                level(g, 1).map(|l| f(&l["request_latency"]["p50_ms"])).unwrap_or(f64::NAN),
                level(g, 64).map(|l| f(&l["sentences_per_s"])).unwrap_or(f64::NAN),
                level(g, 64).map(|l| f(&l["request_latency"]["p99_ms"])).unwrap_or(f64::NAN),
            )
        })
        .collect();
    let summary = format!(
        "{}. Best at C=1 (p50 latency): {}; best at C=64 (throughput): {}.",
        all.join("; "),
        c1.as_ref().map(|x| x.0.clone()).unwrap_or_default(),
        c64.as_ref().map(|x| x.0.clone()).unwrap_or_default()
    );
    json!({
        "best_c1_p50": c1.map(|x| x.0),
        "best_c64_throughput": c64.map(|x| x.0),
        "summary": summary,
    })
}
