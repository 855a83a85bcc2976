//! The Llama part (SmolLM2-135M-Instruct from its GGUF, dequantized to f32)
//! against the `transformers` reference completions
//! (`gateway/tests/data/completions_reference.json`, made by
//! `scripts/make_completion_reference.py`): greedy ids for every prompt, with
//! the whole model, split in two parts, and with all prompts decoded as one
//! batch; plus the setup-time tokenizer.json against the reference ids.
//!
//! Prints timings (single-stream tokens/s, batched decode at 4 and 16
//! sequences). Set `LLAMA_BENCH_STEPS=0` to skip the batched timing.

mod support;

use enclave_stage::models::llama::{argmax_rows, LlamaPart, SeqSlice};
use std::time::Instant;
use support::{gguf, root, smollm_dir};
use tokenizers::Tokenizer;

struct Item {
    prompt: String,
    prompt_ids: Vec<u32>,
    output_ids: Vec<u32>,
}

struct Reference {
    items: Vec<Item>,
    checks: Vec<(String, Vec<u32>)>,
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn reference() -> Reference {
    let path = root().join("gateway/tests/data/completions_reference.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    assert_eq!(v["add_bos"], serde_json::Value::Bool(false));
    let items: Vec<Item> = v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| Item {
            prompt: i["prompt"].as_str().unwrap().to_string(),
            prompt_ids: ids(&i["prompt_ids"]),
            output_ids: ids(&i["output_ids"]),
        })
        .collect();
    assert!(items.len() >= 5 && items.iter().all(|i| i.output_ids.len() == 32));
    let checks = v["tokenizer_checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["text"].as_str().unwrap().to_string(), ids(&c["ids"])))
        .collect();
    Reference { items, checks }
}

/// A model split into parts that each own their KV caches.
struct Pipeline {
    parts: Vec<LlamaPart>,
}

impl Pipeline {
    fn load(cuts: &[usize]) -> Self {
        let n = cuts.len() - 1;
        let parts = (0..n)
            .map(|i| LlamaPart::load(&gguf(), cuts[i]..cuts[i + 1], i == 0, i == n - 1).unwrap())
            .collect();
        Self { parts }
    }

    /// One step over a packed batch; returns the greedy next token per sequence.
    fn step(&mut self, tokens: &[u32], batch: &[SeqSlice]) -> Vec<u32> {
        let mut h = self.parts[0].embed(tokens).unwrap();
        for p in &mut self.parts {
            h = p.forward(&h, batch).unwrap();
        }
        let logits = self.parts.last().unwrap().logits_last(&h, batch).unwrap();
        argmax_rows(&logits).unwrap()
    }

    /// Greedy-decodes `n` tokens for one sequence.
    fn generate(&mut self, seq: u128, prompt: &[u32], n: usize) -> Vec<u32> {
        let mut out = self.step(prompt, &[SeqSlice::new(seq, 0, prompt.len())]);
        while out.len() < n {
            let pos = prompt.len() + out.len() - 1;
            let t = *out.last().unwrap();
            out.extend(self.step(&[t], &[SeqSlice::new(seq, pos, 1)]));
        }
        for p in &mut self.parts {
            assert!(p.free(seq));
        }
        out
    }

    /// Prefills every prompt (one packed batch), then decodes all sequences
    /// together, one batched step per token.
    fn generate_batched(&mut self, prompts: &[Vec<u32>], n: usize) -> Vec<Vec<u32>> {
        let tokens: Vec<u32> = prompts.concat();
        let batch: Vec<SeqSlice> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| SeqSlice::new(100 + i as u128, 0, p.len()))
            .collect();
        let mut outs: Vec<Vec<u32>> = self
            .step(&tokens, &batch)
            .into_iter()
            .map(|t| vec![t])
            .collect();
        for _ in 1..n {
            let batch: Vec<SeqSlice> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| SeqSlice::new(100 + i as u128, p.len() + outs[i].len() - 1, 1))
                .collect();
            let last: Vec<u32> = outs.iter().map(|o| *o.last().unwrap()).collect();
            for (o, t) in outs.iter_mut().zip(self.step(&last, &batch)) {
                o.push(t);
            }
        }
        for i in 0..prompts.len() {
            for p in &mut self.parts {
                assert!(p.free(100 + i as u128));
            }
        }
        outs
    }
}

fn check_all(label: &str, r: &Reference, got: &[Vec<u32>]) {
    let mut bad = Vec::new();
    for (item, g) in r.items.iter().zip(got) {
        if *g != item.output_ids {
            let first = g.iter().zip(&item.output_ids).position(|(a, b)| a != b);
            bad.push(format!(
                "{:?}: first difference at step {first:?}\n  got  {g:?}\n  want {:?}",
                item.prompt, item.output_ids
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{label}: {} prompt(s) differ:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn tokenizer_matches_reference_ids() {
    let r = reference();
    let tok = Tokenizer::from_file(smollm_dir().join("tokenizer.json")).unwrap();
    let enc = |s: &str| tok.encode(s, true).unwrap().get_ids().to_vec();
    for item in &r.items {
        assert_eq!(
            enc(&item.prompt),
            item.prompt_ids,
            "prompt {:?}",
            item.prompt
        );
    }
    for (text, want) in &r.checks {
        assert_eq!(&enc(text), want, "tokenizer check {text:?}");
    }
    // Round trip of a generated continuation.
    let text = tok.decode(&r.items[0].output_ids, false).unwrap();
    assert_eq!(enc(&text), r.items[0].output_ids);
}

#[test]
fn greedy_matches_reference_whole_split_and_batched() {
    let r = reference();
    let prompts: Vec<Vec<u32>> = r.items.iter().map(|i| i.prompt_ids.clone()).collect();

    // (a) whole model, one sequence at a time.
    let mut whole = Pipeline::load(&[0, 30]);
    let cfg = whole.parts[0].config().clone();
    assert_eq!(
        (
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads
        ),
        (30, 576, 9, 3)
    );
    assert!(cfg.tied_embeddings);
    let t0 = Instant::now();
    let single: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| whole.generate(i as u128, p, 32))
        .collect();
    let dt = t0.elapsed().as_secs_f64();
    let n_tok = 32 * prompts.len();
    println!(
        "whole model, single stream: {n_tok} tokens in {dt:.2}s = {:.1} tok/s (incl. prefill)",
        n_tok as f64 / dt
    );
    check_all("whole model", &r, &single);
    assert_eq!(whole.parts[0].num_sequences(), 0);
    assert_eq!(whole.parts[0].kv_bytes_allocated(), 0);

    // (c) all prompts prefilled as one packed batch, then decoded together.
    let t0 = Instant::now();
    let batched = whole.generate_batched(&prompts, 32);
    let dt = t0.elapsed().as_secs_f64();
    println!(
        "whole model, batch of {}: {n_tok} tokens in {dt:.2}s = {:.1} tok/s",
        prompts.len(),
        n_tok as f64 / dt
    );
    check_all("batched", &r, &batched);
    drop(whole);

    // (b) two parts: 0..15 with the embedding, 15..30 with the head.
    let mut split = Pipeline::load(&[0, 15, 30]);
    assert!(split.parts[0].has_embeddings() && !split.parts[0].has_head());
    assert!(!split.parts[1].has_embeddings() && split.parts[1].has_head());
    let two: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| split.generate(i as u128, p, 32))
        .collect();
    check_all("two parts", &r, &two);
    let batched2 = split.generate_batched(&prompts, 32);
    check_all("two parts, batched", &r, &batched2);
}

#[test]
fn cache_bookkeeping_and_errors() {
    let mut p = LlamaPart::load(&gguf(), 0..2, true, false).unwrap();
    assert_eq!(p.bytes_per_token(), 2 * 2 * 3 * 64 * 4);
    let h = p.embed(&[1, 2, 3]).unwrap();
    // Position must match the cache: a fresh sequence starts at 0.
    assert!(p.forward(&h, &[SeqSlice::new(7, 1, 3)]).is_err());
    // Batch must cover the rows exactly.
    assert!(p.forward(&h, &[SeqSlice::new(7, 0, 2)]).is_err());
    // A failed batch leaves no cache advanced.
    assert_eq!(p.cache(7).map_or(0, |c| c.len()), 0);
    p.forward(&h, &[SeqSlice::new(7, 0, 3)]).unwrap();
    assert_eq!(p.cache(7).unwrap().len(), 3);
    // Replaying the same positions is refused.
    assert!(p.forward(&h, &[SeqSlice::new(7, 0, 3)]).is_err());
    p.reserve(8, 100).unwrap();
    assert_eq!(p.cache(8).unwrap().capacity(), 100);
    assert_eq!(
        p.cache(8).unwrap().allocated_bytes(),
        100 * p.bytes_per_token()
    );
    assert!(p.reserve(9, p.config().max_seq_len + 1).is_err());
    assert!(p.embed(&[49152]).is_err());
    assert!(p.free(7) && p.free(8) && !p.free(7));
    assert_eq!(p.kv_bytes_allocated(), 0);
    // No head here.
    assert!(p.logits_last(&h, &[SeqSlice::new(1, 0, 3)]).is_err());
}

/// One packed batch mixing a decode step of one sequence with the prefill of
/// another gives each its reference token; a long prefill (several attention
/// chunks) in one call equals the same prefill fed in pieces.
#[test]
fn mixed_batches_and_long_prefill() {
    let r = reference();
    let mut m = Pipeline::load(&[0, 30]);
    let (a, b) = (&r.items[0], &r.items[1]);
    assert_eq!(
        m.step(&a.prompt_ids, &[SeqSlice::new(1, 0, a.prompt_ids.len())]),
        [a.output_ids[0]]
    );
    let mut tokens = vec![a.output_ids[0]];
    tokens.extend(&b.prompt_ids);
    let batch = [
        SeqSlice::new(1, a.prompt_ids.len(), 1),
        SeqSlice::new(2, 0, b.prompt_ids.len()),
    ];
    assert_eq!(m.step(&tokens, &batch), [a.output_ids[1], b.output_ids[0]]);
    m.parts[0].free(1);
    m.parts[0].free(2);

    // ~600 tokens: the reference prompts and outputs, concatenated.
    let mut long = Vec::new();
    while long.len() < 600 {
        for i in &r.items {
            long.extend(&i.prompt_ids);
            long.extend(&i.output_ids);
        }
    }
    long.truncate(600);
    let p = &mut m.parts[0];
    let whole = {
        let h = p
            .forward(&p.embed(&long).unwrap(), &[SeqSlice::new(3, 0, 600)])
            .unwrap();
        p.logits_last(&h, &[SeqSlice::new(3, 0, 600)]).unwrap()
    };
    let mut pieces = None;
    for (start, len) in [(0, 250), (250, 1), (251, 349)] {
        let s = [SeqSlice::new(4, start, len)];
        let h = p
            .forward(&p.embed(&long[start..start + len]).unwrap(), &s)
            .unwrap();
        pieces = Some(p.logits_last(&h, &s).unwrap());
    }
    let pieces = pieces.unwrap();
    let diff = (whole.clone() - &pieces).and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>());
    let diff = diff.unwrap();
    println!("long prefill, whole vs pieces: max |Δlogit| = {diff:e}");
    assert!(diff < 1e-3, "max logit difference {diff}");
    assert_eq!(argmax_rows(&whole).unwrap(), argmax_rows(&pieces).unwrap());
}

/// Decode throughput at batch 1, 4 and 16 (sequences with different past
/// lengths), whole model. Timing only; asserts nothing about speed.
#[test]
fn batched_decode_throughput() {
    let steps: usize = std::env::var("LLAMA_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(16);
    if steps == 0 {
        return;
    }
    let r = reference();
    let mut whole = Pipeline::load(&[0, 30]);
    for bs in [1usize, 4, 16] {
        let prompts: Vec<Vec<u32>> = (0..bs)
            .map(|i| r.items[i % r.items.len()].prompt_ids.clone())
            .collect();
        let tokens: Vec<u32> = prompts.concat();
        let batch: Vec<SeqSlice> = (0..bs)
            .map(|i| SeqSlice::new(i as u128, 0, prompts[i].len()))
            .collect();
        let mut last = whole.step(&tokens, &batch);
        let t0 = Instant::now();
        for s in 0..steps {
            let batch: Vec<SeqSlice> = (0..bs)
                .map(|i| SeqSlice::new(i as u128, prompts[i].len() + s, 1))
                .collect();
            last = whole.step(&last, &batch);
        }
        let dt = t0.elapsed().as_secs_f64();
        println!(
            "batched decode, batch {bs:2}: {:.1} tok/s aggregate ({:.1} ms/step)",
            (bs * steps) as f64 / dt,
            1e3 * dt / steps as f64
        );
        for i in 0..bs {
            whole.parts[0].free(i as u128);
        }
    }
}
