//! The stage engine against the sentence-transformers reference vectors
//! (`gateway/tests/data/embeddings_reference.json`, made by
//! `scripts/make_reference.py`), in one process: whole model and the same
//! model split in two stages whose activations cross the wire format, for
//! each weight format an embedding stage serves.

mod support;

use enclave_stage::role::StageSpec;
use enclave_stage::serving::embedding::engine::{Engine, Padded};
use proto::frames::WeightFormat;
use std::path::PathBuf;

fn model_dir() -> PathBuf {
    support::model_dir("all-minilm-l6-v2", "manifest.json")
}

#[path = "../../gateway/tests/support/embeddings_reference.rs"]
mod embeddings_reference;
use embeddings_reference::{cosine, load_reference, Reference};

fn reference() -> Reference {
    load_reference(&support::root())
}

fn spec(index: u32, n: u32, layers: std::ops::Range<usize>) -> StageSpec {
    StageSpec {
        stage_index: index,
        num_stages: n,
        layers,
    }
}

/// The weight formats an embedding stage serves, with the smallest cosine
/// to the sentence-transformers vectors each must keep: f32 is the
/// reference path; bf16 is held to issue 12's bar for reduced precision
/// (≥ 0.999; measured ≥ 0.9999, `benchmark_results/embeddings.md`).
const FORMATS: [(WeightFormat, f64); 2] =
    [(WeightFormat::F32, 0.9999), (WeightFormat::Bf16, 0.999)];

#[test]
fn whole_model_matches_sentence_transformers() {
    let r = reference();
    assert!(r.texts.len() >= 20);
    for (format, bar) in FORMATS {
        let engine = Engine::load(&model_dir(), &spec(0, 1, 0..6), format).unwrap();
        assert_eq!(engine.weights().0, format);
        assert_eq!(
            engine.claims.weights,
            (format != WeightFormat::F32).then_some(format),
            "the claims name a format other than the model's own"
        );
        for (i, text) in r.texts.iter().enumerate() {
            assert_eq!(
                engine.tokenize(text).unwrap().len(),
                r.tokens[i] as usize,
                "token count of item {i}"
            );
        }
        // Batched, as the stage runs them (padding must not change results).
        let refs: Vec<&str> = r.texts.iter().map(|s| s.as_str()).collect();
        let out = engine.embed_texts(&refs).unwrap();
        let mut worst = 1f64;
        for (i, v) in out.iter().enumerate() {
            assert_eq!(v.len(), 384);
            let c = cosine(v, &r.vectors[i]);
            assert!(c >= bar, "{format} item {i}: cosine {c}");
            worst = worst.min(c);
        }
        if format == WeightFormat::Bf16 {
            // Rounded, but not the f32 path under another name.
            assert!(worst < 0.999_999, "bf16 equals f32: {worst}");
        }
    }
}

#[test]
fn embedding_stages_refuse_generation_formats() {
    for format in [WeightFormat::Q8_0, WeightFormat::Q4_1] {
        let err = Engine::load(&model_dir(), &spec(0, 1, 0..6), format)
            .err()
            .expect("a generation format must not load");
        assert!(format!("{err:#}").contains("f32 or bf16"), "{err:#}");
    }
}

#[test]
fn two_stages_agree_with_one_stage() {
    for (format, _) in FORMATS {
        two_stages_agree(format);
    }
}

fn two_stages_agree(format: WeightFormat) {
    let r = reference();
    let whole = Engine::load(&model_dir(), &spec(0, 1, 0..6), format).unwrap();
    let first = Engine::load(&model_dir(), &spec(0, 2, 0..3), format).unwrap();
    let second = Engine::load(&model_dir(), &spec(1, 2, 3..6), format).unwrap();
    assert!(first.tokenize("x").is_ok());
    assert!(
        second.tokenize("x").is_err(),
        "only the entry stage tokenizes"
    );
    let seqs: Vec<Vec<u32>> = r.texts.iter().map(|t| first.tokenize(t).unwrap()).collect();
    let refs: Vec<&[u32]> = seqs.iter().map(|s| s.as_slice()).collect();
    let mid = first.run_tokens(&refs).unwrap();
    // Across the wire format, as between two processes.
    let (h, m) = mid.to_frames().unwrap();
    let mid = Padded::from_frames(&h, &m, 384).unwrap();
    let split = second.pool(&second.run_hidden(mid).unwrap()).unwrap();
    let texts: Vec<&str> = r.texts.iter().map(|s| s.as_str()).collect();
    let one = whole.embed_texts(&texts).unwrap();
    for (i, v) in one.iter().enumerate() {
        let c = cosine(v, &split[i * 384..(i + 1) * 384]);
        assert!(c >= 0.99999, "{format} item {i}: cosine {c}");
    }
}

#[test]
fn tampered_weights_refuse_to_load() {
    let dir = std::env::temp_dir().join(format!("tampered-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Every file the manifest pins, as shipped, but the weights.
    std::fs::copy(model_dir().join("manifest.json"), dir.join("manifest.json")).unwrap();
    let manifest = proto::manifest::LoadedManifest::load(&model_dir()).unwrap();
    for f in &manifest.manifest.files {
        std::fs::create_dir_all(dir.join(&f.path).parent().unwrap()).unwrap();
        std::fs::copy(model_dir().join(&f.path), dir.join(&f.path)).unwrap();
    }
    let mut weights = std::fs::read(model_dir().join("model.safetensors")).unwrap();
    let n = weights.len();
    weights[n - 100] ^= 0x40;
    std::fs::write(dir.join("model.safetensors"), weights).unwrap();
    let err = Engine::load(&dir, &spec(0, 1, 0..6), WeightFormat::F32)
        .err()
        .expect("tampered weights must not load");
    let msg = format!("{err:#}");
    assert!(
        msg.contains("model.safetensors") && msg.contains("does not match"),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
