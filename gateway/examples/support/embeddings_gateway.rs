//! bench_embeddings: the gateway under test (a temporary config, start and
//! stop, its stages' CPU and memory) and the concurrent clients that load it.

use super::measure::{
    cpu_secs, load_avg, proc_mem, select_round, stage_children, summarize, summary_json,
    system_busy_secs,
};
use super::report::f;
use super::{Args, DIM, LEVELS, MAX_REQUESTS_PER_LEVEL, MODEL_ID, SENTENCES};
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub(super) struct Gateway {
    child: Child,
    pid: u32,
    url: String,
    log: PathBuf,
    config: PathBuf,
    startup_s: f64,
}

/// Writes a copy of `config` with absolute paths and the given threads.
pub(super) fn temp_config(
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

pub(super) fn start_gateway(bin_dir: &Path, config: PathBuf, log: PathBuf) -> Result<Gateway> {
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
pub(super) fn stop_gateway(g: &mut Gateway, stage_pids: &[u32]) -> Value {
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
pub(super) struct EmbResponse {
    data: Vec<EmbItem>,
}

#[derive(Deserialize)]
pub(super) struct EmbItem {
    embedding: Vec<f32>,
}

#[derive(Default)]
pub(super) struct ClientStats {
    lat_ms: Vec<f64>,
    errors: Vec<String>,
    max_abs_diff: f32,
}

pub(super) async fn one_request(
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
pub(super) async fn gateway_level(
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

pub(super) struct Cpu {
    t: Instant,
    bench: f64,
    gateway: f64,
    stages: Vec<f64>,
    system: f64,
}

pub(super) fn cpu_snapshot(gw: u32, stages: &[u32]) -> Cpu {
    Cpu {
        t: Instant::now(),
        bench: cpu_secs(std::process::id()),
        gateway: cpu_secs(gw),
        stages: stages.iter().map(|p| cpu_secs(*p)).collect(),
        system: system_busy_secs(),
    }
}

/// CPU cores used per process between two snapshots.
pub(super) fn cpu_delta(a: &Cpu, b: &Cpu) -> Value {
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

pub(super) fn run_gateway_setup(
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

pub(super) fn toml_to_json(v: &toml::Value) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}
