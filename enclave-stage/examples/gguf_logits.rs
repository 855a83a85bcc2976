//! A GGUF model's logits as the stage computes them, for
//! `scripts/test_gguf_models.py`, which compares them with llama.cpp's on the
//! same file: the whole model in one `LlamaPart`, teacher-forced one token at
//! a time (decode steps, the quantized kernels) with every position's logits
//! written as little-endian f32 rows, then greedy decoding after a prefill
//! (the dequantized-GEMM path) with the chosen ids printed as JSON.
//!
//! ```text
//! gguf_logits MODEL.gguf WEIGHTS TOKENS_FILE LOGITS_OUT PROMPT_LEN GREEDY_LEN
//! ```
//! `TOKENS_FILE` holds comma-separated token ids. A model the stage refuses
//! prints `{"error": "…"}` and exits 3.
//!
//! ```text
//! gguf_logits --tokenize MODEL.gguf TEXTS_JSON
//! ```
//! instead tokenizes each text of the JSON list as the entry stage does (the
//! tokenizer built from the file's metadata, special tokens matched, none
//! added) and decodes the ids back as the exit stage does (special tokens
//! skipped), printing
//! `{"ids": [[…]], "texts": […]}`.

use enclave_stage::models::llama::{argmax_rows, LlamaConfig, LlamaPart, SeqSlice, WeightFormat};
use std::io::Write;
use std::path::Path;

/// `--tokenize MODEL TEXTS_JSON`: ids and decoded texts as JSON.
fn tokenize(model: &Path, texts: &Path) -> anyhow::Result<()> {
    let mut f = std::fs::File::open(model)?;
    let ct = candle_core::quantized::gguf_file::Content::read(&mut f)?;
    let doc = match enclave_stage::models::gguf_tokenizer::tokenizer_json(&ct) {
        Ok(d) => d,
        Err(e) => {
            println!("{}", serde_json::json!({ "error": e }));
            std::process::exit(3);
        }
    };
    let t =
        tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&doc)?).map_err(anyhow::Error::msg)?;
    let texts: Vec<String> = serde_json::from_slice(&std::fs::read(texts)?)?;
    let (mut ids, mut decoded) = (Vec::new(), Vec::new());
    for text in &texts {
        let enc = t.encode(text.as_str(), false).map_err(anyhow::Error::msg)?;
        decoded.push(t.decode(enc.get_ids(), true).map_err(anyhow::Error::msg)?);
        ids.push(enc.get_ids().to_vec());
    }
    println!("{}", serde_json::json!({ "ids": ids, "texts": decoded }));
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() == 4 && a[1] == "--tokenize" {
        return tokenize(Path::new(&a[2]), Path::new(&a[3]));
    }
    if a.len() != 7 {
        anyhow::bail!(
            "usage: gguf_logits MODEL WEIGHTS TOKENS_FILE LOGITS_OUT PROMPT_LEN GREEDY_LEN"
        );
    }
    let format: WeightFormat = a[2].parse().map_err(anyhow::Error::msg)?;
    let tokens: Vec<u32> = std::fs::read_to_string(&a[3])?
        .split(',')
        .map(|t| t.trim().parse())
        .collect::<Result<_, _>>()?;
    let (prompt_len, greedy_len): (usize, usize) = (a[5].parse()?, a[6].parse()?);
    let path = Path::new(&a[1]);
    let loaded = LlamaConfig::read(path)
        .and_then(|c| LlamaPart::load_as(path, 0..c.num_layers, true, true, format));
    let mut part = match loaded {
        Ok(p) => p,
        Err(e) => {
            println!("{}", serde_json::json!({ "error": e.to_string() }));
            std::process::exit(3);
        }
    };

    let mut out = std::io::BufWriter::new(std::fs::File::create(&a[4])?);
    for (i, &t) in tokens.iter().enumerate() {
        let batch = [SeqSlice::new(1, i, 1)];
        let h = part.forward(&part.embed(&[t])?, &batch)?;
        for v in part
            .logits_last(&h, &batch)?
            .flatten_all()?
            .to_vec1::<f32>()?
        {
            out.write_all(&v.to_le_bytes())?;
        }
    }
    out.flush()?;
    part.free(1);

    let mut ids = tokens[..prompt_len].to_vec();
    let mut pos = 0;
    let mut greedy = Vec::new();
    while greedy.len() < greedy_len {
        let batch = [SeqSlice::new(2, pos, ids.len() - pos)];
        let h = part.forward(&part.embed(&ids[pos..])?, &batch)?;
        pos = ids.len();
        let next = argmax_rows(&part.logits_last(&h, &batch)?)?[0];
        greedy.push(next);
        ids.push(next);
    }
    println!(
        "{}",
        serde_json::json!({ "greedy": greedy, "weight_bytes": part.weight_bytes() })
    );
    Ok(())
}
