//! Completions benchmark: bare in-process Candle (the same `LlamaPart` code,
//! whole model, one thread) against the gateway with a one-stage and a
//! two-stage completions pipeline, all on this machine in one run.
//!
//! Measures, with greedy decoding and end-of-sequence suppressed so every
//! request generates exactly `--max-tokens` tokens:
//! - single stream: time to first token (TTFT) and per-token latency
//!   (p50/p99 of the gaps between tokens);
//! - aggregate tokens/s with 1, 4 and 16 concurrent streams.
//!
//! Writes `<out>.json` and `<out>.md`. Run through
//! `scripts/bench_completions.sh`; numbers are meaningful on an idle machine.

#[path = "support/stage_procs.rs"]
mod stage_procs;

use anyhow::{bail, Context, Result};
use enclave_stage::models::llama::{LlamaPart, SeqSlice};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MODEL: &str = "SmolLM2-135M-Instruct";
const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "Once upon a time, in a small village",
    "The best way to learn a new language is",
    "def fibonacci(n):",
];

struct Args {
    /// Extra `[completions]` lines for both gateways (e.g. `weights = "f32"`).
    completions_config: String,
    max_tokens: usize,
    single_runs: usize,
    /// Prompt length (tokens) of the long-prompt time-to-first-token runs.
    long_prompt_tokens: usize,
    concurrency: Vec<usize>,
    out: PathBuf,
    baseline_worker: bool,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        completions_config: String::new(),
        max_tokens: 64,
        single_runs: 10,
        long_prompt_tokens: 512,
        concurrency: vec![1, 4, 16],
        out: PathBuf::from("benchmark_results/completions"),
        baseline_worker: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        match k.as_str() {
            "--max-tokens" => a.max_tokens = it.next().context("value")?.parse()?,
            "--completions-config" => a.completions_config = it.next().context("value")?,
            "--single-runs" => a.single_runs = it.next().context("value")?.parse()?,
            "--long-prompt-tokens" => a.long_prompt_tokens = it.next().context("value")?.parse()?,
            "--concurrency" => {
                a.concurrency = it
                    .next()
                    .context("value")?
                    .split(',')
                    .map(|c| c.parse())
                    .collect::<Result<_, _>>()?
            }
            "--out" => a.out = it.next().context("value")?.into(),
            "--baseline-worker" => a.baseline_worker = true,
            "--help" | "-h" => {
                println!("bench_completions [--max-tokens 64] [--single-runs 10] [--long-prompt-tokens 512] [--concurrency 1,4,16] [--out benchmark_results/completions]");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(a)
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn model_dir() -> PathBuf {
    root().join("models/smollm2-135m-instruct")
}

fn pct(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    if s.is_empty() {
        return f64::NAN;
    }
    s[((s.len() - 1) as f64 * p).round() as usize]
}

fn tokenize(prompts: &[&str]) -> Result<Vec<Vec<u32>>> {
    let tok = tokenizers::Tokenizer::from_file(model_dir().join("tokenizer.json"))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    prompts
        .iter()
        .map(|p| {
            Ok(tok
                .encode(*p, false)
                .map_err(|e| anyhow::anyhow!("{e}"))?
                .get_ids()
                .to_vec())
        })
        .collect()
}

/// A prefix of `scripts/data/quality-text.txt` that tokenizes to `n` tokens
/// (for time to first token with a long prompt).
fn long_prompt(n: usize) -> Result<String> {
    let text = std::fs::read_to_string(root().join("scripts/data/quality-text.txt"))?;
    let tok = tokenizers::Tokenizer::from_file(model_dir().join("tokenizer.json"))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let enc = tok
        .encode(text.as_str(), false)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let end = enc
        .get_offsets()
        .get(n.checked_sub(1).context("empty prompt")?)
        .context("quality text too short")?
        .1;
    Ok(text[..end].to_string())
}

/// Bare Candle, in this process (run in a child with one compute thread).
fn baseline(args: &Args) -> Result<Value> {
    let gguf = model_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut part = LlamaPart::load(&gguf, 0..30, true, true)?;
    let prompts = tokenize(&PROMPTS)?;
    let eos = 2usize;
    let mut next_id = 0u128;
    // Greedy step over a batch; EOS suppressed as in the gateway runs.
    let step = |part: &mut LlamaPart, batch: &[SeqSlice], ids: &[u32]| -> Result<Vec<u32>> {
        let h = part.embed(ids)?;
        let out = part.forward(&h, batch)?;
        let mut logits = part.logits_last(&out, batch)?.to_vec2::<f32>()?;
        for row in logits.iter_mut() {
            row[eos] = f32::NEG_INFINITY;
        }
        Ok(logits
            .iter()
            .map(|r| enclave_stage::sampling::argmax(r))
            .collect())
    };
    // Single stream.
    let mut ttft = Vec::new();
    let mut gaps = Vec::new();
    for r in 0..args.single_runs + 1 {
        let p = &prompts[r % prompts.len()];
        let id = next_id;
        next_id += 1;
        let t0 = Instant::now();
        let mut tok = step(&mut part, &[SeqSlice::new(id, 0, p.len())], p)?[0];
        let first = t0.elapsed().as_secs_f64() * 1e3;
        let mut last = Instant::now();
        let mut g = Vec::new();
        for i in 0..args.max_tokens - 1 {
            tok = step(&mut part, &[SeqSlice::new(id, p.len() + i, 1)], &[tok])?[0];
            g.push(last.elapsed().as_secs_f64() * 1e3);
            last = Instant::now();
        }
        part.free(id);
        if r > 0 {
            // The first run warms up.
            ttft.push(first);
            gaps.extend(g);
        }
    }
    // Aggregate: C sequences decoded together (one batch per step).
    let mut agg = serde_json::Map::new();
    for &c in &args.concurrency {
        let ids: Vec<u128> = (0..c as u128).map(|i| next_id + i).collect();
        next_id += c as u128;
        let ps: Vec<&Vec<u32>> = (0..c).map(|i| &prompts[i % prompts.len()]).collect();
        let t0 = Instant::now();
        let batch: Vec<SeqSlice> = ids
            .iter()
            .zip(&ps)
            .map(|(&id, p)| SeqSlice::new(id, 0, p.len()))
            .collect();
        let flat: Vec<u32> = ps.iter().flat_map(|p| p.iter().copied()).collect();
        let mut toks = step(&mut part, &batch, &flat)?;
        for i in 0..args.max_tokens - 1 {
            let batch: Vec<SeqSlice> = ids
                .iter()
                .zip(&ps)
                .map(|(&id, p)| SeqSlice::new(id, p.len() + i, 1))
                .collect();
            toks = step(&mut part, &batch, &toks)?;
        }
        let secs = t0.elapsed().as_secs_f64();
        for id in ids {
            part.free(id);
        }
        agg.insert(
            c.to_string(),
            json!({"tokens_per_s": (c * args.max_tokens) as f64 / secs}),
        );
    }
    Ok(json!({
        "ttft_ms_p50": pct(&ttft, 0.5),
        "per_token_ms_p50": pct(&gaps, 0.5),
        "per_token_ms_p99": pct(&gaps, 0.99),
        "aggregate": agg,
    }))
}

struct Gw {
    child: Child,
    url: String,
}

/// KV-cache budget per stage the benchmark's gateways run with (the shipped
/// config's).
const KV_CACHE_TOKENS: usize = 8192;

fn start_gateway(stages: &[[u32; 2]], extra: &str, dir: &Path) -> Result<Gw> {
    std::fs::create_dir_all(dir)?;
    let mut policy = String::from("allow_mock = true\ntrust_local_build = true\n");
    for (i, s) in stages.iter().enumerate() {
        policy += &format!("[[stages]]\nindex = {i}\nlayers = [{}, {}]\n", s[0], s[1]);
    }
    std::fs::write(dir.join("policy-c.toml"), &policy)?;
    std::fs::write(
        dir.join("policy-e.toml"),
        "allow_mock = true\ntrust_local_build = true\n[[stages]]\nindex = 0\nlayers = [0, 6]\n",
    )?;
    let bin = std::env::current_exe()?
        .parent()
        .and_then(|p| p.parent())
        .context("target dir")?
        .to_path_buf();
    let mut cfg = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nrequest_timeout_secs = 600\n[pipeline]\npolicy = {:?}\nmodel_dir = {:?}\nlaunch = \"local\"\nstage_binary = {:?}\n[[pipeline.stages]]\nlayers = [0, 6]\n[completions]\npolicy = {:?}\nmodel_dir = {:?}\nkv_cache_tokens = {KV_CACHE_TOKENS}\n{extra}\n",
        dir.join("policy-e.toml"),
        root().join("models/all-minilm-l6-v2"),
        bin.join("enclave-stage"),
        dir.join("policy-c.toml"),
        model_dir(),
    );
    for s in stages {
        cfg += &format!("[[completions.stages]]\nlayers = [{}, {}]\n", s[0], s[1]);
    }
    std::fs::write(dir.join("gateway.toml"), cfg)?;
    let mut child = Command::new(bin.join("gateway"))
        .args(["serve", "--config"])
        .arg(dir.join("gateway.toml"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("gateway.log"))?)
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
    let url = loop {
        match lines.next() {
            Some(Ok(l)) => {
                if let Some(u) = l.strip_prefix("GATEWAY LISTENING ") {
                    break u.to_string();
                }
            }
            _ => bail!(
                "gateway did not start; see {}",
                dir.join("gateway.log").display()
            ),
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Ok(Gw { child, url })
}

/// One streamed greedy request: (TTFT ms, gaps between tokens ms, tokens).
async fn stream_one(
    http: &reqwest::Client,
    url: &str,
    prompt: &str,
    n: usize,
) -> Result<(f64, Vec<f64>, usize)> {
    let t0 = Instant::now();
    let r = http
        .post(format!("{url}/v1/completions"))
        .json(
            &json!({"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
                      "stream": true, "logit_bias": {"2": -100}}),
        )
        .send()
        .await?;
    if r.status() != 200 {
        bail!("status {}", r.status());
    }
    let mut s = r.bytes_stream();
    let mut first = None;
    let mut last = Instant::now();
    let mut gaps = Vec::new();
    let mut tokens = 0;
    let mut buf = Vec::new();
    while let Some(chunk) = s.next().await {
        buf.extend_from_slice(&chunk?);
        while let Some(p) = buf.windows(2).position(|w| w == b"\n\n") {
            let ev: Vec<u8> = buf.drain(..p + 2).collect();
            if ev.starts_with(b"data: {") && !ev.windows(7).any(|w| w == b"\"error\"") {
                tokens += 1;
                let now = Instant::now();
                match first {
                    None => first = Some(t0.elapsed().as_secs_f64() * 1e3),
                    Some(_) => gaps.push((now - last).as_secs_f64() * 1e3),
                }
                last = now;
            }
        }
    }
    Ok((first.unwrap_or(f64::NAN), gaps, tokens))
}

/// Benchmarks several gateways (one per stage layout) side by side: every
/// single-stream run and every concurrency level goes to each gateway in
/// turn, so that drift on a shared machine hits all of them alike.
async fn bench_gateways(args: &Args, layouts: &[&[[u32; 2]]], dir: &Path) -> Result<Vec<Value>> {
    let mut gws = Vec::new();
    for (i, stages) in layouts.iter().enumerate() {
        gws.push(start_gateway(
            stages,
            &args.completions_config,
            &dir.join(format!("gw{i}")),
        )?);
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .build()?;
    let n = gws.len();
    let result = async {
        for gw in &gws {
            stream_one(&http, &gw.url, PROMPTS[0], 8).await?; // warm-up
        }
        let mut ttft = vec![Vec::new(); n];
        let mut gaps = vec![Vec::new(); n];
        for r in 0..args.single_runs {
            for (i, gw) in gws.iter().enumerate() {
                let (t, g, _) =
                    stream_one(&http, &gw.url, PROMPTS[r % PROMPTS.len()], args.max_tokens).await?;
                ttft[i].push(t);
                gaps[i].extend(g);
            }
        }
        // Time to first token with a long prompt (one token generated).
        let long = long_prompt(args.long_prompt_tokens)?;
        let mut ttft_long = vec![Vec::new(); n];
        for _ in 0..args.single_runs.div_ceil(2) {
            for (i, gw) in gws.iter().enumerate() {
                ttft_long[i].push(stream_one(&http, &gw.url, &long, 1).await?.0);
            }
        }
        let mut agg = vec![serde_json::Map::new(); n];
        for &c in &args.concurrency {
            for (i, gw) in gws.iter().enumerate() {
                let t0 = Instant::now();
                let futs = (0..c).map(|j| {
                    stream_one(&http, &gw.url, PROMPTS[j % PROMPTS.len()], args.max_tokens)
                });
                let res = futures_util::future::join_all(futs).await;
                let secs = t0.elapsed().as_secs_f64();
                let mut tokens = 0;
                for r in res {
                    tokens += r?.2;
                }
                agg[i].insert(
                    c.to_string(),
                    json!({"tokens_per_s": tokens as f64 / secs, "tokens": tokens}),
                );
            }
        }
        Ok::<_, anyhow::Error>(
            (0..n)
                .map(|i| {
                    json!({
                        "ttft_ms_p50": pct(&ttft[i], 0.5),
                        "ttft_long_prompt_ms_p50": pct(&ttft_long[i], 0.5),
                        "long_prompt_tokens": args.long_prompt_tokens,
                        "per_token_ms_p50": pct(&gaps[i], 0.5),
                        "per_token_ms_p99": pct(&gaps[i], 0.99),
                        "aggregate": agg[i],
                    })
                })
                .collect(),
        )
    }
    .await;
    let result = result.map(|mut v: Vec<Value>| {
        for (out, gw) in v.iter_mut().zip(&gws) {
            out["stages"] = stage_memory(gw.child.id());
        }
        v
    });
    for gw in &mut gws {
        let _ = Command::new("kill")
            .args(["-INT", &gw.child.id().to_string()])
            .status();
        let _ = gw.child.wait();
    }
    result
}

/// Peak RSS (VmHWM) of the gateway's completions stages, with the bound of
/// issue 12: the stage's weights as served + its KV-cache budget + 100 MiB
/// (weights and KV bytes per token from the same `LlamaPart` code, loaded
/// here for the stage's layer range).
fn stage_memory(gateway_pid: u32) -> Value {
    let mut out = Vec::new();
    for (pid, argv) in stage_procs::stage_children(gateway_pid, "smollm2-135m-instruct") {
        let arg = |flag: &str| stage_procs::arg(&argv, flag);
        let (Some(layers), Some(index)) = (arg("--layers"), arg("--stage-index")) else {
            continue;
        };
        let hwm = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map(|kb| kb * 1024);
        let (lo, hi) = layers.split_once("..").unwrap_or(("0", "0"));
        let range = lo.parse().unwrap_or(0)..hi.parse().unwrap_or(0);
        let n = arg("--num-stages")
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(1);
        let i: usize = index.parse().unwrap_or(0);
        let gguf = model_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
        let format = arg("--weights")
            .and_then(|w| w.parse().ok())
            .unwrap_or_default();
        let part = LlamaPart::load_as(&gguf, range, i == 0, i + 1 == n, format);
        let (weights, kv) = match &part {
            Ok(p) => (p.weight_bytes(), KV_CACHE_TOKENS * p.bytes_per_token()),
            Err(_) => (0, 0),
        };
        let bound = (weights + kv + (100 << 20)) as u64;
        out.push(
            json!({"stage_index": i, "layers": layers, "peak_rss_bytes": hwm,
            "weight_bytes": weights, "kv_budget_bytes": kv, "bound_bytes": bound,
            "within_bound": hwm.map(|h| h <= bound)}),
        );
    }
    out.sort_by_key(|v| v["stage_index"].as_u64());
    Value::Array(out)
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn markdown(out: &Value, args: &Args) -> String {
    let rows = [
        ("bare Candle (in-process, 1 thread)", "baseline"),
        ("gateway, 1 stage", "one_stage"),
        ("gateway, 2 stages", "two_stages"),
    ];
    let mut md = String::from("# Completions benchmark (SmolLM2-135M-Instruct)\n\n");
    md += &format!(
        "One run of `scripts/bench_completions.sh` on {} ({}). Greedy, end-of-sequence suppressed, {} tokens per request; \
         single stream = {} sequential streamed requests (TTFT and gaps between streamed tokens, as a client sees them); \
         aggregate = N concurrent streams, total tokens / wall time. The 1-stage and 2-stage gateways run side by side and \
         take turns request by request (and level by level), so that drift on a shared machine hits both alike. \
         The gateways run the code defaults (`q4_1` weights, 1 thread per stage) plus these `[completions]` lines: `{}`; the baseline is \
         the same Llama code (`enclave-stage/src/models/llama/`, f32 weights) called in-process on one thread.\n\n",
        out["machine"].as_str().unwrap_or("?"), out["when"].as_str().unwrap_or("?"), args.max_tokens, args.single_runs,
        if args.completions_config.is_empty() { "none" } else { args.completions_config.as_str() }
    );
    md += &format!(
        "| setup | TTFT p50 ms | TTFT {}-token prompt p50 ms | per-token p50 ms | per-token p99 ms |",
        args.long_prompt_tokens
    );
    for c in &args.concurrency {
        md += &format!(" tok/s @{c} |");
    }
    md += "\n|---|---|---|---|---|";
    for _ in &args.concurrency {
        md += "---|";
    }
    md += "\n";
    for (name, key) in rows {
        let v = &out[key];
        md += &format!(
            "| {name} | {:.1} | {} | {:.2} | {:.2} |",
            f(&v["ttft_ms_p50"]),
            v["ttft_long_prompt_ms_p50"]
                .as_f64()
                .map_or("–".to_string(), |t| format!("{t:.0}")),
            f(&v["per_token_ms_p50"]),
            f(&v["per_token_ms_p99"])
        );
        for c in &args.concurrency {
            md += &format!(
                " {:.1} |",
                f(&v["aggregate"][c.to_string()]["tokens_per_s"])
            );
        }
        md += "\n";
    }
    let r = &out["ratios"];
    md += &format!(
        "\n**Ratios.** 2-stage per-token p50 over 1-stage: **{:+.1} %** (target ≤ +3 %). \
         Aggregate tokens/s at 16 over single stream: 1 stage **{:.2}×**, 2 stages **{:.2}×** (target ≥ 4×); \
         bare Candle {:.2}×. 1-stage per-token p50 over bare Candle: {:+.1} %.\n",
        f(&r["two_vs_one_stage_per_token_pct"]),
        f(&r["one_stage_c16_over_c1"]),
        f(&r["two_stages_c16_over_c1"]),
        f(&r["baseline_c16_over_c1"]),
        f(&r["one_stage_vs_baseline_per_token_pct"]),
    );
    md += &format!(
        "\n**Stage memory** (peak RSS after the run, `VmHWM`; bound: the stage's weights as served + its KV-cache \
         budget of {KV_CACHE_TOKENS} tokens + 100 MiB):\n\n| gateway | stage | layers | peak RSS MiB | weights MiB | KV budget MiB | bound MiB | within |\n|---|---|---|---|---|---|---|---|\n"
    );
    let mib = |v: &Value| f(v) / (1u64 << 20) as f64;
    for (name, key) in [("1 stage", "one_stage"), ("2 stages", "two_stages")] {
        for st in out[key]["stages"].as_array().into_iter().flatten() {
            md += &format!(
                "| {name} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {} |\n",
                st["stage_index"],
                st["layers"].as_str().unwrap_or("?"),
                mib(&st["peak_rss_bytes"]),
                mib(&st["weight_bytes"]),
                mib(&st["kv_budget_bytes"]),
                mib(&st["bound_bytes"]),
                if st["within_bound"].as_bool() == Some(true) {
                    "yes"
                } else {
                    "**no**"
                }
            );
        }
    }
    md += "\nRerun: `scripts/bench_completions.sh` (about 3 minutes; numbers only mean something on an otherwise idle machine).\n";
    md
}

fn main() -> Result<()> {
    let args = parse_args()?;
    if args.baseline_worker {
        let v = baseline(&args)?;
        println!("{v}");
        return Ok(());
    }
    // The baseline runs in a child process so its thread count is set
    // before Candle starts its pool.
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(&exe);
    cmd.arg("--baseline-worker")
        .args(["--max-tokens", &args.max_tokens.to_string()])
        .args(["--single-runs", &args.single_runs.to_string()])
        .args([
            "--concurrency",
            &args
                .concurrency
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(","),
        ])
        .env("RAYON_NUM_THREADS", "1")
        .env("CANDLE_NUM_THREADS", "1");
    eprintln!("baseline (in-process Candle, 1 thread)…");
    let out = cmd.output()?;
    if !out.status.success() {
        bail!("baseline failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let baseline: Value = serde_json::from_slice(&out.stdout)?;
    let rt = tokio::runtime::Runtime::new()?;
    let tmp = std::env::temp_dir().join(format!("bench-completions-{}", std::process::id()));
    eprintln!("gateway, 1 stage and 2 stages, interleaved…");
    let mut both = rt
        .block_on(bench_gateways(
            &args,
            &[&[[0, 30]], &[[0, 15], [15, 30]]],
            &tmp,
        ))?
        .into_iter();
    let (one, two) = (
        both.next().context("1 stage")?,
        both.next().context("2 stages")?,
    );
    let c1 = |v: &Value| f(&v["aggregate"]["1"]["tokens_per_s"]);
    let c16 = |v: &Value| f(&v["aggregate"]["16"]["tokens_per_s"]);
    let ratios = json!({
        "two_vs_one_stage_per_token_pct": (f(&two["per_token_ms_p50"]) / f(&one["per_token_ms_p50"]) - 1.0) * 100.0,
        "one_stage_vs_baseline_per_token_pct": (f(&one["per_token_ms_p50"]) / f(&baseline["per_token_ms_p50"]) - 1.0) * 100.0,
        "one_stage_c16_over_c1": c16(&one) / c1(&one),
        "two_stages_c16_over_c1": c16(&two) / c1(&two),
        "baseline_c16_over_c1": c16(&baseline) / c1(&baseline),
    });
    let machine = format!(
        "{} cores, {}",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(
                |c| c.lines().find(|l| l.starts_with("model name")).map(|l| l
                    .split(':')
                    .nth(1)
                    .unwrap_or("")
                    .trim()
                    .to_string())
            )
            .unwrap_or_default()
    );
    let when = String::from_utf8(
        Command::new("date")
            .arg("-u")
            .arg("+%Y-%m-%d %H:%M UTC")
            .output()?
            .stdout,
    )?
    .trim()
    .to_string();
    let out = json!({
        "benchmark": "completions",
        "model": MODEL,
        "max_tokens": args.max_tokens,
        "single_runs": args.single_runs,
        "concurrency": args.concurrency,
        "machine": machine,
        "when": when,
        "load_average_at_end": std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim(),
        "baseline": baseline,
        "one_stage": one,
        "two_stages": two,
        "ratios": ratios,
    });
    if let Some(d) = args.out.parent() {
        std::fs::create_dir_all(d)?;
    }
    std::fs::write(
        args.out.with_extension("json"),
        serde_json::to_string_pretty(&out)?,
    )?;
    std::fs::write(args.out.with_extension("md"), markdown(&out, &args))?;
    println!("{}", markdown(&out, &args));
    Ok(())
}
