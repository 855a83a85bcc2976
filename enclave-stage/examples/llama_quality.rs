//! What quantization costs: teacher-forced top-1 agreement with the f32
//! weights and perplexity, for every weight format, over a fixed English
//! text (`scripts/bench_quality.sh` runs it and writes
//! `benchmark_results/quality.{json,md}`).
//!
//! ```text
//! cargo run --release -p enclave-stage --example llama_quality -- \
//!     --text scripts/data/quality-text.txt --json out.json --markdown out.md
//! ```

use anyhow::{anyhow, bail, Context, Result};
use enclave_stage::models::llama::{LlamaPart, TeacherForced, WeightFormat};
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

struct Args {
    model_dir: PathBuf,
    text: PathBuf,
    min_tokens: usize,
    json: Option<PathBuf>,
    markdown: Option<PathBuf>,
}

fn args() -> Result<Args> {
    let mut a = Args {
        model_dir: PathBuf::from("models/smollm2-135m-instruct"),
        text: PathBuf::from("scripts/data/quality-text.txt"),
        min_tokens: 2000,
        json: None,
        markdown: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| anyhow!("{flag} needs a value"));
        match flag.as_str() {
            "--model-dir" => a.model_dir = value()?.into(),
            "--text" => a.text = value()?.into(),
            "--min-tokens" => a.min_tokens = value()?.parse()?,
            "--json" => a.json = Some(value()?.into()),
            "--markdown" => a.markdown = Some(value()?.into()),
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(a)
}

fn main() -> Result<()> {
    let a = args()?;
    let text = std::fs::read_to_string(&a.text).with_context(|| a.text.display().to_string())?;
    let tok = tokenizers::Tokenizer::from_file(a.model_dir.join("tokenizer.json"))
        .map_err(|e| anyhow!("tokenizer: {e}"))?;
    let ids = tok
        .encode(text.as_str(), false)
        .map_err(|e| anyhow!("{e}"))?
        .get_ids()
        .to_vec();
    if ids.len() < a.min_tokens {
        bail!(
            "the text has {} tokens, fewer than {}",
            ids.len(),
            a.min_tokens
        );
    }
    let gguf = a.model_dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut results: Vec<(WeightFormat, TeacherForced, f64, usize)> = Vec::new();
    for format in WeightFormat::GENERATION {
        let mut part = LlamaPart::load_as(&gguf, 0..30, true, true, format)?;
        let t = Instant::now();
        let r = part.teacher_forced(&ids, 1)?;
        let secs = t.elapsed().as_secs_f64();
        eprintln!(
            "{format}: perplexity {:.4} over {} positions ({secs:.0} s)",
            r.perplexity(),
            r.nll.len()
        );
        results.push((format, r, secs, part.weight_bytes()));
    }
    let f32 = results[0].1.clone();
    let rows: Vec<_> = results
        .iter()
        .map(|(format, r, secs, bytes)| {
            json!({
                "weights": format.as_str(),
                "weight_bytes": bytes,
                "positions": r.nll.len(),
                "perplexity": r.perplexity(),
                "perplexity_vs_f32": r.perplexity() / f32.perplexity() - 1.0,
                "top1_agreement_vs_f32": r.agreement(&f32),
                "seconds": secs,
            })
        })
        .collect();
    let doc = json!({
        "text": a.text.display().to_string(),
        "text_tokens": ids.len(),
        "method": "teacher-forced, one token per step (the decode path: int8-rounded activations for the quantized formats); agreement = share of positions whose top-1 token equals the f32 weights' top-1",
        "results": rows,
    });
    let mut md = String::from(
        "| weights | weight MiB (whole model) | perplexity | vs f32 | top-1 agreement with f32 |\n\
         | --- | --- | --- | --- | --- |\n",
    );
    for r in &rows {
        md += &format!(
            "| {} | {:.0} | {:.4} | {:+.2} % | {:.2} % |\n",
            r["weights"].as_str().unwrap_or(""),
            r["weight_bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
            r["perplexity"].as_f64().unwrap_or(0.0),
            100.0 * r["perplexity_vs_f32"].as_f64().unwrap_or(0.0),
            100.0 * r["top1_agreement_vs_f32"].as_f64().unwrap_or(0.0),
        );
    }
    print!("{md}");
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&doc)? + "\n")?;
    }
    if let Some(p) = &a.markdown {
        std::fs::write(p, md)?;
    }
    Ok(())
}
