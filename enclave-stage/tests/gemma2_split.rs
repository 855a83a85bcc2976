//! Gemma 2's sliding window follows a layer's index in the whole model, so
//! a split keeps it: a random-weight `gemma2` GGUF (written here with
//! Candle's GGUF writer: 3 layers, a window of 4 positions on layers 0 and
//! 2, layer 1 global) run whole and as two parts split after layer 0 gives
//! the same hidden states and logits, for a 12-token prefill (longer than
//! the window) and decode steps after it. A part that counted its layers
//! from 0 would window layer 1 and not layer 2, and differ. That the window
//! itself is right is `scripts/test_gguf_models.py`'s (against llama.cpp).

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use enclave_stage::models::llama::{LlamaPart, SeqSlice, WeightFormat};
use std::path::Path;

const VOCAB: usize = 50;
const HIDDEN: usize = 64;
const LAYERS: usize = 3;

/// Deterministic values in [-scale, scale).
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn write_gemma2(path: &Path) {
    use gguf_file::Value as V;
    let mut md: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String("gemma2".into())),
        ("general.name".into(), V::String("tiny gemma2".into())),
    ];
    for (k, v) in [
        ("context_length", 64u32),
        ("embedding_length", HIDDEN as u32),
        ("block_count", LAYERS as u32),
        ("feed_forward_length", 128),
        ("attention.head_count", 2),
        ("attention.head_count_kv", 1),
        ("attention.key_length", 32),
        ("attention.value_length", 32),
        ("attention.sliding_window", 4),
    ] {
        md.push((format!("gemma2.{k}"), V::U32(v)));
    }
    md.push((
        "gemma2.attention.layer_norm_rms_epsilon".into(),
        V::F32(1e-6),
    ));
    md.push(("gemma2.attn_logit_softcapping".into(), V::F32(5.0)));
    md.push(("gemma2.final_logit_softcapping".into(), V::F32(10.0)));
    let mut seed = 0;
    let mut t = |shape: &[usize], scale: f32, offset: f32| {
        seed += 1;
        let n = shape.iter().product();
        let v: Vec<f32> = values(n, seed, scale).iter().map(|x| x + offset).collect();
        let t = Tensor::from_vec(v, shape, &Device::Cpu).unwrap();
        QTensor::quantize(&t, GgmlDType::F32).unwrap()
    };
    let mut tensors = vec![
        (
            "token_embd.weight".to_string(),
            t(&[VOCAB, HIDDEN], 0.3, 0.0),
        ),
        ("output_norm.weight".to_string(), t(&[HIDDEN], 0.1, 1.0)),
    ];
    for i in 0..LAYERS {
        let p = |n: &str| format!("blk.{i}.{n}.weight");
        for norm in [
            "attn_norm",
            "post_attention_norm",
            "ffn_norm",
            "post_ffw_norm",
        ] {
            tensors.push((p(norm), t(&[HIDDEN], 0.1, 1.0)));
        }
        tensors.push((p("attn_q"), t(&[64, HIDDEN], 0.3, 0.0)));
        tensors.push((p("attn_k"), t(&[32, HIDDEN], 0.3, 0.0)));
        tensors.push((p("attn_v"), t(&[32, HIDDEN], 0.3, 0.0)));
        tensors.push((p("attn_output"), t(&[HIDDEN, 64], 0.2, 0.0)));
        tensors.push((p("ffn_gate"), t(&[128, HIDDEN], 0.3, 0.0)));
        tensors.push((p("ffn_up"), t(&[128, HIDDEN], 0.3, 0.0)));
        tensors.push((p("ffn_down"), t(&[HIDDEN, 128], 0.2, 0.0)));
    }
    let md: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut out, &md, &tensors).unwrap();
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn a_split_gemma2_windows_the_layers_the_whole_model_does() {
    let path = std::env::temp_dir().join(format!("gemma2-split-{}.gguf", std::process::id()));
    write_gemma2(&path);
    let load = |layers: std::ops::Range<usize>, embed: bool, head: bool| {
        LlamaPart::load_as(&path, layers, embed, head, WeightFormat::F32).unwrap()
    };
    let mut whole = load(0..LAYERS, true, true);
    let mut first = load(0..1, true, false);
    let mut second = load(1..LAYERS, false, true);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(whole.config().window(0), Some(4));
    assert_eq!(whole.config().window(1), None);

    let prompt: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % VOCAB as u32).collect();
    let mut steps = vec![prompt];
    steps.extend([[5u32], [17], [42]].map(|t| t.to_vec()));
    let mut pos = 0;
    for ids in steps {
        let batch = [SeqSlice::new(1, pos, ids.len())];
        let h = whole.forward(&whole.embed(&ids).unwrap(), &batch).unwrap();
        let mid = first.forward(&first.embed(&ids).unwrap(), &batch).unwrap();
        let h2 = second.forward(&mid, &batch).unwrap();
        let diff = max_diff(&h, &h2);
        assert!(diff < 1e-5, "hidden states at {pos} differ by {diff}");
        let logits = whole.logits_last(&h, &batch).unwrap();
        let logits2 = second.logits_last(&h2, &batch).unwrap();
        assert!(max_diff(&logits, &logits2) < 1e-5, "logits at {pos}");
        // The final soft cap holds the logits within ±10.
        let top = logits.abs().unwrap().max_keepdim(1).unwrap();
        assert!(top.flatten_all().unwrap().to_vec1::<f32>().unwrap()[0] <= 10.0);
        pos += ids.len();
    }
}
