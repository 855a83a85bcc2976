//! Embeddings benchmark: bare in-process Candle vs the gateway pipeline.
//!
//! Run from the repository root (see `scripts/bench_embeddings.sh`):
//!
//! ```text
//! cargo build --release && cargo build --release -p gateway --example bench_embeddings
//! ./target/release/examples/bench_embeddings [--threads-per-stage 1,2]
//! ```
//!
//! * Baseline: `enclave_stage::engine::Engine` with all 6 layers in one
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

#[path = "support/stage_procs.rs"]
mod stage_procs;

use anyhow::{bail, Context, Result};
use clap::Parser;
use enclave_stage::engine::{Engine, StageSpec};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

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

// ---------------------------------------------------------------- statistics

#[derive(Clone, Debug)]
struct Summary {
    n: usize,
    p50: f64,
    p99: f64,
    mean: f64,
    min: f64,
    max: f64,
}

/// Nearest-rank percentiles of latencies in ms.
fn summarize(lat_ms: &[f64]) -> Summary {
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
fn select_round(rounds: Vec<Value>, latency_key: &str) -> Value {
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

fn summary_json(s: &Summary) -> Value {
    json!({"count": s.n, "p50_ms": s.p50, "p99_ms": s.p99, "mean_ms": s.mean,
           "min_ms": s.min, "max_ms": s.max})
}

// ------------------------------------------------------------ /proc helpers

/// `(utime + stime)` in seconds and the parent pid and name of a process.
fn proc_stat(pid: u32) -> Option<(f64, u32, String)> {
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

fn clock_ticks() -> f64 {
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

fn cpu_secs(pid: u32) -> f64 {
    proc_stat(pid).map(|s| s.0).unwrap_or(f64::NAN)
}

/// Busy CPU seconds of the whole machine (all cores) from `/proc/stat`.
fn system_busy_secs() -> f64 {
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
fn proc_mem(pid: u32) -> BTreeMap<String, u64> {
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
fn stage_children(ppid: u32, model: &str) -> Vec<(u32, Option<u32>)> {
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

fn load_avg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
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
        "load_s": load_s,
        "tokens_per_sentence": tokens,
        "levels": levels,
        "peak_rss_bytes": proc_mem(pid).get("VmHWM"),
        "reference": reference,
    });
    println!("BASELINE_RESULT {out}");
    Ok(())
}

fn run_baseline(threads: usize, secs: f64, rounds: usize, model_dir: &Path) -> Result<Value> {
    let exe = std::env::current_exe()?;
    let out = Command::new(exe)
        .arg("--baseline-worker")
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

// ------------------------------------------------------------------- gateway

struct Gateway {
    child: Child,
    pid: u32,
    url: String,
    log: PathBuf,
    config: PathBuf,
    startup_s: f64,
}

/// Writes a copy of `config` with absolute paths and the given threads.
fn temp_config(
    config: &Path,
    root: &Path,
    bin_dir: &Path,
    threads_per_stage: Option<usize>,
    token_budget: Option<usize>,
) -> Result<(PathBuf, toml::Value)> {
    let text =
        std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    let mut v: toml::Value = toml::from_str(&text)?;
    let abs = |p: &str| -> String {
        let p = Path::new(p);
        if p.is_absolute() {
            p.display().to_string()
        } else {
            root.join(p).display().to_string()
        }
    };
    {
        let server = v
            .get_mut("server")
            .and_then(|s| s.as_table_mut())
            .context("[server]")?;
        server.insert("listen".into(), "127.0.0.1:0".into());
    }
    {
        let p = v
            .get_mut("pipeline")
            .and_then(|s| s.as_table_mut())
            .context("[pipeline]")?;
        for key in ["policy", "model_dir"] {
            let cur = p
                .get(key)
                .and_then(|x| x.as_str())
                .with_context(|| format!("pipeline.{key}"))?
                .to_string();
            p.insert(key.into(), abs(&cur).into());
        }
        let stage_bin = match p.get("stage_binary").and_then(|x| x.as_str()) {
            Some(s) => abs(s),
            None => bin_dir.join("enclave-stage").display().to_string(),
        };
        p.insert("stage_binary".into(), stage_bin.into());
        if let Some(t) = threads_per_stage {
            p.insert("threads_per_stage".into(), toml::Value::Integer(t as i64));
        }
        if let Some(tb) = token_budget {
            p.insert("token_budget".into(), toml::Value::Integer(tb as i64));
        }
    }
    let path = std::env::temp_dir().join(format!(
        "bench-embeddings-{}-tps{}-tb{}.toml",
        std::process::id(),
        threads_per_stage.unwrap_or(0),
        token_budget.unwrap_or(0)
    ));
    std::fs::write(&path, toml::to_string(&v)?)?;
    Ok((path, v))
}

fn start_gateway(bin_dir: &Path, config: PathBuf, log: PathBuf) -> Result<Gateway> {
    let bin = bin_dir.join("gateway");
    if !bin.exists() {
        bail!("{} not found: run `cargo build --release`", bin.display());
    }
    let logf = std::fs::File::create(&log)?;
    let t0 = Instant::now();
    let mut child = Command::new(&bin)
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .args(["--listen", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(logf))
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let pid = child.id();
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        for l in lines.by_ref().map_while(Result::ok) {
            if let Some(u) = l.strip_prefix("GATEWAY LISTENING ") {
                let _ = tx.send(u.trim().to_string());
                break;
            }
        }
        // Keep draining so the gateway never blocks on stdout.
        for _ in lines.map_while(Result::ok) {}
    });
    let url = match rx.recv_timeout(Duration::from_secs(180)) {
        Ok(u) => u,
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            let mut tail = String::new();
            let _ = std::fs::File::open(&log).and_then(|mut f| f.read_to_string(&mut tail));
            let tail: String = tail
                .lines()
                .rev()
                .take(20)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n");
            bail!("gateway did not print GATEWAY LISTENING; log tail:\n{tail}");
        }
    };
    Ok(Gateway {
        child,
        pid,
        url,
        log,
        config,
        startup_s: t0.elapsed().as_secs_f64(),
    })
}

/// SIGINT, then wait; kill after 15 s. Returns how it ended.
fn stop_gateway(g: &mut Gateway, stage_pids: &[u32]) -> Value {
    let t0 = Instant::now();
    let _ = Command::new("kill")
        .args(["-INT", &g.pid.to_string()])
        .status();
    let mut status = None;
    while t0.elapsed() < Duration::from_secs(15) {
        if let Ok(Some(s)) = g.child.try_wait() {
            status = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let killed = status.is_none();
    if killed {
        let _ = g.child.kill();
        status = g.child.wait().ok();
    }
    let gw_s = t0.elapsed().as_secs_f64();
    // Stages must not outlive the gateway.
    while t0.elapsed() < Duration::from_secs(10)
        && stage_pids
            .iter()
            .any(|p| Path::new(&format!("/proc/{p}")).exists())
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    let leftover: Vec<u32> = stage_pids
        .iter()
        .copied()
        .filter(|p| Path::new(&format!("/proc/{p}")).exists())
        .collect();
    let _ = std::fs::remove_file(&g.config);
    json!({
        "exit_status": status.map(|s| s.to_string()),
        "killed_after_sigint_timeout": killed,
        "gateway_stop_s": gw_s,
        "stages_left_running": leftover,
    })
}

#[derive(Deserialize)]
struct EmbResponse {
    data: Vec<EmbItem>,
}

#[derive(Deserialize)]
struct EmbItem {
    embedding: Vec<f32>,
}

#[derive(Default)]
struct ClientStats {
    lat_ms: Vec<f64>,
    errors: Vec<String>,
    max_abs_diff: f32,
}

async fn one_request(
    client: &reqwest::Client,
    url: &str,
    idx: usize,
    reference: &[Vec<f32>],
    st: &mut ClientStats,
) {
    let body = json!({"model": MODEL_ID, "input": SENTENCES[idx]});
    let t = Instant::now();
    let res = async {
        let resp = client.post(url).json(&body).send().await?;
        let status = resp.status();
        let bytes = resp.bytes().await?;
        Ok::<_, reqwest::Error>((status, bytes))
    }
    .await;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    match res {
        Err(e) => st.errors.push(format!("transport: {e}")),
        Ok((status, bytes)) if status != reqwest::StatusCode::OK => st.errors.push(format!(
            "HTTP {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        )),
        Ok((_, bytes)) => match serde_json::from_slice::<EmbResponse>(&bytes) {
            Ok(r) if r.data.len() == 1 && r.data[0].embedding.len() == DIM => {
                st.lat_ms.push(ms);
                if let Some(want) = reference.get(idx) {
                    for (a, b) in r.data[0].embedding.iter().zip(want) {
                        st.max_abs_diff = st.max_abs_diff.max((a - b).abs());
                    }
                }
            }
            Ok(r) => st.errors.push(format!(
                "got {} vectors of width {:?}",
                r.data.len(),
                r.data.first().map(|d| d.embedding.len())
            )),
            Err(e) => st.errors.push(format!("bad JSON: {e}")),
        },
    }
}

/// `c` clients × `per_client` requests; returns (stats, wall seconds).
async fn gateway_level(
    client: &reqwest::Client,
    url: &str,
    c: usize,
    per_client: usize,
    reference: &std::sync::Arc<Vec<Vec<f32>>>,
) -> (ClientStats, f64) {
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for k in 0..c {
        let client = client.clone();
        let url = url.to_string();
        let reference = reference.clone();
        set.spawn(async move {
            let mut st = ClientStats::default();
            for r in 0..per_client {
                let idx = (k + r * c) % SENTENCES.len();
                one_request(&client, &url, idx, &reference, &mut st).await;
            }
            st
        });
    }
    let mut all = ClientStats::default();
    while let Some(r) = set.join_next().await {
        match r {
            Ok(st) => {
                all.lat_ms.extend(st.lat_ms);
                all.errors.extend(st.errors);
                all.max_abs_diff = all.max_abs_diff.max(st.max_abs_diff);
            }
            Err(e) => all.errors.push(format!("client task: {e}")),
        }
    }
    (all, start.elapsed().as_secs_f64())
}

struct Cpu {
    t: Instant,
    bench: f64,
    gateway: f64,
    stages: Vec<f64>,
    system: f64,
}

fn cpu_snapshot(gw: u32, stages: &[u32]) -> Cpu {
    Cpu {
        t: Instant::now(),
        bench: cpu_secs(std::process::id()),
        gateway: cpu_secs(gw),
        stages: stages.iter().map(|p| cpu_secs(*p)).collect(),
        system: system_busy_secs(),
    }
}

/// CPU cores used per process between two snapshots.
fn cpu_delta(a: &Cpu, b: &Cpu) -> Value {
    let wall = b.t.duration_since(a.t).as_secs_f64();
    let stages: Vec<f64> = a
        .stages
        .iter()
        .zip(&b.stages)
        .map(|(x, y)| (y - x) / wall)
        .collect();
    let ours = (b.bench - a.bench) + (b.gateway - a.gateway) + stages.iter().sum::<f64>() * wall;
    json!({
        "bench_client_cores": (b.bench - a.bench) / wall,
        "gateway_cores": (b.gateway - a.gateway) / wall,
        "stage_cores": stages,
        "machine_busy_cores": (b.system - a.system) / wall,
        "other_processes_cores": ((b.system - a.system) - ours) / wall,
    })
}

fn run_gateway_setup(
    args: &Args,
    root: &Path,
    bin_dir: &Path,
    threads_per_stage: Option<usize>,
    token_budget: Option<usize>,
    reference: Vec<Vec<f32>>,
) -> Result<Value> {
    let (config, cfg_value) =
        temp_config(&args.config, root, bin_dir, threads_per_stage, token_budget)?;
    // The values in effect (the gateway's defaults where the config is silent).
    let setting = |key: &str, default: i64| {
        cfg_value["pipeline"]
            .get(key)
            .and_then(|v| v.as_integer())
            .unwrap_or(default)
    };
    let tb = setting("token_budget", 4096);
    let threads_per_stage = setting("threads_per_stage", 1);
    let log = std::env::temp_dir().join(format!(
        "bench-embeddings-{}-gateway-tps{threads_per_stage}-tb{tb}.log",
        std::process::id()
    ));
    eprintln!(
        "gateway threads_per_stage={threads_per_stage} token_budget={tb}: starting (log {})",
        log.display()
    );
    let mut g = start_gateway(bin_dir, config, log)?;
    let stages = stage_children(g.pid, "all-minilm-l6-v2");
    let stage_pids: Vec<u32> = stages.iter().map(|s| s.0).collect();
    eprintln!(
        "  listening at {} after {:.1} s; stages {:?}",
        g.url, g.startup_s, stages
    );
    let result = (|| -> Result<Value> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let url = format!("{}/v1/embeddings", g.url);
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(256)
            .timeout(Duration::from_secs(120))
            .build()?;
        let reference = std::sync::Arc::new(reference);
        rt.block_on(async {
            let ready = client.get(format!("{}/readyz", g.url)).send().await?;
            if !ready.status().is_success() {
                bail!("/readyz: {}", ready.status());
            }
            // Warm up: every sentence, alone and concurrently.
            let (w1, _) = gateway_level(&client, &url, 1, SENTENCES.len(), &reference).await;
            let (w2, _) = gateway_level(&client, &url, 32, 2, &reference).await;
            if let Some(e) = w1.errors.iter().chain(&w2.errors).next() {
                bail!("warm-up request failed: {e}");
            }
            let mut levels = Vec::new();
            for c in LEVELS {
                // Pilot (also this level's warm-up) sets the fixed request count.
                let pilot_per_client = (24 / c).max(2);
                let (p, pw) = gateway_level(&client, &url, c, pilot_per_client, &reference).await;
                if let Some(e) = p.errors.first() {
                    bail!("pilot request failed at C={c}: {e}");
                }
                let rate = (c * pilot_per_client) as f64 / pw;
                let rounds = args.rounds.max(1);
                let per_client = ((args.gateway_secs / rounds as f64 * rate / c as f64).ceil()
                    as usize)
                    .clamp(3, MAX_REQUESTS_PER_LEVEL / rounds / c);
                let mut results = Vec::new();
                let (mut errors_all, mut diff_all) = (0usize, 0f32);
                for round in 0..rounds {
                    let load0 = load_avg();
                    let a = cpu_snapshot(g.pid, &stage_pids);
                    let (st, wall) =
                        gateway_level(&client, &url, c, per_client, &reference).await;
                    let b = cpu_snapshot(g.pid, &stage_pids);
                    let s = summarize(&st.lat_ms);
                    let ok = st.lat_ms.len();
                    let cpu = cpu_delta(&a, &b);
                    errors_all += st.errors.len();
                    diff_all = diff_all.max(st.max_abs_diff);
                    eprintln!(
                        "  gateway tps={threads_per_stage} tb={tb} C={c:>2} round {round}: {:8.1} sentences/s  p50 {:7.2} ms  p99 {:7.2} ms  ({} ok, {} errors, {:.1} s)  cores client {:.2} gateway {:.2} stages {} other {:.2}",
                        ok as f64 / wall,
                        s.p50,
                        s.p99,
                        ok,
                        st.errors.len(),
                        wall,
                        f(&cpu["bench_client_cores"]),
                        f(&cpu["gateway_cores"]),
                        cpu["stage_cores"],
                        f(&cpu["other_processes_cores"]),
                    );
                    let mut first_errors = st.errors.clone();
                    first_errors.truncate(5);
                    results.push(json!({
                        "concurrency": c,
                        "requests_per_client": per_client,
                        "requests": c * per_client,
                        "ok": ok,
                        "errors": st.errors.len(),
                        "first_errors": first_errors,
                        "wall_s": wall,
                        "sentences_per_s": ok as f64 / wall,
                        "request_latency": summary_json(&s),
                        "max_abs_diff_vs_in_process": st.max_abs_diff,
                        "other_processes_cores": cpu["other_processes_cores"],
                        "cpu": cpu,
                        "loadavg_before": load0,
                        "loadavg_after": load_avg(),
                    }));
                }
                let mut l = select_round(results, "request_latency");
                l["errors_all_rounds"] = json!(errors_all);
                l["max_abs_diff_all_rounds"] = json!(diff_all);
                levels.push(l);
            }
            Ok(json!(levels))
        })
    })();
    // Memory at the end of the run (VmHWM = peak since start).
    let mem: Vec<Value> = stages
        .iter()
        .map(|(pid, idx)| json!({"pid": pid, "stage_index": idx, "mem_bytes": proc_mem(*pid)}))
        .collect();
    let gw_mem = proc_mem(g.pid);
    let stop = stop_gateway(&mut g, &stage_pids);
    let log_lines = std::fs::read_to_string(&g.log)
        .map(|s| s.lines().count())
        .unwrap_or(0);
    eprintln!("  stopped: {stop}");
    let levels = result?;
    Ok(json!({
        "threads_per_stage": threads_per_stage,
        "token_budget": tb,
        "config": cfg_value.get("pipeline").cloned().map(|p| toml_to_json(&p)),
        "startup_s": g.startup_s,
        "url": g.url,
        "levels": levels,
        "stages": mem,
        "gateway_mem_bytes": gw_mem,
        "gateway_log": g.log.display().to_string(),
        "gateway_log_lines": log_lines,
        "stop": stop,
    }))
}

fn toml_to_json(v: &toml::Value) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
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

// ----------------------------------------------------------------- reporting

fn machine_info() -> Value {
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

fn level(v: &Value, c: usize) -> Option<&Value> {
    v["levels"]
        .as_array()?
        .iter()
        .find(|l| l["concurrency"].as_u64() == Some(c as u64))
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// "123.4 (0.05), …": every round's sentences/s and other-process cores;
/// the reported round in bold.
fn rounds_cell(l: &Value) -> String {
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

fn write_markdown(out: &Value) -> String {
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
            "## Baseline: bare Candle, {} thread(s)\n\n| C | sentences/s | batch p50 ms | batch p99 ms | batches | CPU cores used | rounds: sentences/s (other cores) |\n|---|---|---|---|---|---|---|\n",
            b["threads"]
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
    for &t in &args.baseline_threads {
        eprintln!("baseline: {t} thread(s)");
        let mut b = run_baseline(t, args.baseline_secs, args.rounds, &model_dir)?;
        if reference.is_empty() {
            reference = serde_json::from_value(b["reference"].take())?;
            tokens = serde_json::from_value(b["tokens_per_sentence"].clone())?;
        }
        if let Some(o) = b.as_object_mut() {
            o.remove("reference");
        }
        baselines.push(b);
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
