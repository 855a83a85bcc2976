//! Bare in-process stage code (the whole model in one `LlamaPart`; SmolLM2
//! unless `--gguf FILE`):
//! time to first token for a prompt and single-stream greedy decode speed,
//! for `scripts/bench_peers.py`, which runs it beside llama.cpp. Threads come
//! from `RAYON_NUM_THREADS` / `CANDLE_NUM_THREADS`, as in a stage.
//!
//! ```text
//! bench_decode --weights q8_0 --prompt-tokens 32,512 --decode-tokens 64 [--decode-after 32]
//! ```
//! (`--decode-after N`: the decode steps follow an N-token prompt, so they
//! attend over N + i cached positions.)
//! prints one JSON object: `{"weights", "weight_bytes", "ttft_ms": {"32": …},
//! "decode_tok_s"}`.

use anyhow::{anyhow, bail, Result};
use enclave_stage::models::llama::{LlamaPart, SeqSlice, WeightFormat};
use enclave_stage::sampling::argmax;
use serde_json::json;
use std::time::Instant;

fn main() -> Result<()> {
    let mut weights = WeightFormat::default();
    let mut prompts = vec![32usize, 512];
    let mut decode = 64usize;
    let mut decode_after = 32usize;
    let mut gguf =
        std::path::PathBuf::from("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| anyhow!("{flag} needs a value"));
        match flag.as_str() {
            "--weights" => weights = value()?.parse().map_err(anyhow::Error::msg)?,
            "--prompt-tokens" => {
                prompts = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--decode-tokens" => decode = value()?.parse()?,
            "--decode-after" => decode_after = value()?.parse()?,
            "--gguf" => gguf = value()?.into(),
            other => bail!("unknown argument {other}"),
        }
    }
    let layers = enclave_stage::models::llama::LlamaConfig::read(&gguf)?.num_layers;
    let mut part = LlamaPart::load_as(&gguf, 0..layers, true, true, weights)?;
    // A fixed pseudo-text: ids spread over the vocabulary.
    let ids = |n: usize| -> Vec<u32> { (0..n as u32).map(|i| 100 + (i * 7919) % 40000).collect() };
    let mut seq = 0u128;
    let first = |part: &mut LlamaPart, p: &[u32], seq: u128| -> Result<u32> {
        let b = [SeqSlice::new(seq, 0, p.len())];
        let h = part.embed(p)?;
        let h = part.forward(&h, &b)?;
        Ok(argmax(&part.logits_last(&h, &b)?.to_vec2::<f32>()?[0]))
    };
    // Warm-up (first-touch page faults, thread pool start).
    first(&mut part, &ids(8), seq)?;
    part.free(seq);
    let mut ttft = serde_json::Map::new();
    for &n in &prompts {
        seq += 1;
        let t = Instant::now();
        first(&mut part, &ids(n), seq)?;
        ttft.insert(n.to_string(), json!(t.elapsed().as_secs_f64() * 1e3));
        part.free(seq);
    }
    seq += 1;
    let p = ids(decode_after);
    let mut tok = first(&mut part, &p, seq)?;
    let t = Instant::now();
    for i in 0..decode {
        let b = [SeqSlice::new(seq, p.len() + i, 1)];
        let h = part.embed(&[tok])?;
        let h = part.forward(&h, &b)?;
        tok = argmax(&part.logits_last(&h, &b)?.to_vec2::<f32>()?[0]);
    }
    let tok_s = decode as f64 / t.elapsed().as_secs_f64();
    println!(
        "{}",
        json!({
            "weights": weights.as_str(),
            "weight_bytes": part.weight_bytes(),
            "ttft_ms": ttft,
            "decode_tok_s": tok_s,
        })
    );
    Ok(())
}
