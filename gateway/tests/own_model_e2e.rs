//! `gateway serve --model FILE.gguf` end to end: a user's GGUF, here a
//! random-weight Qwen3-shaped model in Q4_K (its feed-forward down in Q6_K, as in a Q4_K_M file) written by this test (SmolLM2's
//! tokenizer and chat template copied into it), served with no
//! `[completions]` table of its own across two stages.
//!
//! - `/v1/models` lists it under its `general.name`;
//! - the manifest the gateway wrote pins the file's SHA-256 (computed here
//!   independently), and a client policy that pins that manifest accepts
//!   the stages: chat and a streamed chat through `gateway proxy` come back
//!   with verified receipts, the stream concatenating to the whole answer,
//!   and a client that pins another manifest refuses the stages;
//! - a file of an architecture the stages do not serve stops the start
//!   with an error naming it, and so do a tensor of another shape than the
//!   metadata implies and a file that is not a GGUF.

mod common;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::{
    client, manifest_pinned_policy, model_ids, smollm_dir, start_proxy, Gateway, Options,
};
use serde_json::{json, Value};
use std::path::Path;

const NAME: &str = "tiny qwen3 test";
const ID: &str = "tiny-qwen3-test";

/// Deterministic values in [-scale, scale).
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Writes a random-weight GGUF of architecture `arch` (Qwen3's tensors).
fn write_gguf(path: &Path, arch: &str) {
    write_gguf_shaped(path, arch, 0)
}

/// [`write_gguf`] with `extra_q_rows` more rows in layer 1's `attn_q` than
/// the metadata implies.
fn write_gguf_shaped(path: &Path, arch: &str, extra_q_rows: usize) {
    let mut f = std::fs::File::open(smollm_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    let src = gguf_file::Content::read(&mut f).unwrap();
    let vocab = src.tensor_infos["token_embd.weight"].shape.dims()[0];
    let (hidden, ffn, layers, heads, kv, hd) = (256usize, 512usize, 2u32, 4usize, 2usize, 128usize);
    let mut md: Vec<(String, gguf_file::Value)> = src
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    use gguf_file::Value as V;
    md.push(("general.architecture".into(), V::String(arch.into())));
    md.push(("general.name".into(), V::String(NAME.into())));
    for (k, v) in [
        ("context_length", 2048u32),
        ("embedding_length", hidden as u32),
        ("block_count", layers),
        ("feed_forward_length", ffn as u32),
        ("attention.head_count", heads as u32),
        ("attention.head_count_kv", kv as u32),
        ("attention.key_length", hd as u32),
        ("attention.value_length", hd as u32),
    ] {
        md.push((format!("{arch}.{k}"), V::U32(v)));
    }
    md.push((format!("{arch}.rope.freq_base"), V::F32(1e6)));
    md.push((
        format!("{arch}.attention.layer_norm_rms_epsilon"),
        V::F32(1e-6),
    ));

    let mut seed = 0;
    let mut q = |rows: usize, cols: usize, scale: f32, dtype: GgmlDType| {
        seed += 1;
        let shape: &[usize] = if rows == 1 { &[cols] } else { &[rows, cols] };
        let t = Tensor::from_vec(values(rows * cols, seed, scale), shape, &Device::Cpu).unwrap();
        QTensor::quantize(&t, dtype).unwrap()
    };
    let norm = |q: &mut dyn FnMut(usize, usize, f32, GgmlDType) -> QTensor, n: usize| {
        let t = q(1, n, 0.1, GgmlDType::F32)
            .dequantize(&Device::Cpu)
            .unwrap();
        QTensor::quantize(&(t + 1.0).unwrap(), GgmlDType::F32).unwrap()
    };
    let mut tensors: Vec<(String, QTensor)> = vec![
        (
            "token_embd.weight".into(),
            q(vocab, hidden, 0.3, GgmlDType::Q4K),
        ),
        ("output_norm.weight".into(), norm(&mut q, hidden)),
    ];
    let s = 1.7 / (hidden as f32).sqrt();
    for i in 0..layers {
        let p = |n: &str| format!("blk.{i}.{n}.weight");
        tensors.push((p("attn_norm"), norm(&mut q, hidden)));
        let q_rows = heads * hd + if i == 1 { extra_q_rows } else { 0 };
        tensors.push((p("attn_q"), q(q_rows, hidden, s, GgmlDType::Q4K)));
        tensors.push((p("attn_k"), q(kv * hd, hidden, s, GgmlDType::Q4K)));
        tensors.push((p("attn_v"), q(kv * hd, hidden, s, GgmlDType::Q4K)));
        tensors.push((
            p("attn_output"),
            q(hidden, heads * hd, s / 2.0, GgmlDType::Q4K),
        ));
        tensors.push((p("attn_q_norm"), norm(&mut q, hd)));
        tensors.push((p("attn_k_norm"), norm(&mut q, hd)));
        tensors.push((p("ffn_norm"), norm(&mut q, hidden)));
        tensors.push((p("ffn_gate"), q(ffn, hidden, s, GgmlDType::Q4K)));
        tensors.push((p("ffn_up"), q(ffn, hidden, s, GgmlDType::Q4K)));
        // As in a Q4_K_M file: 6-bit blocks among the 4-bit ones.
        tensors.push((p("ffn_down"), q(hidden, ffn, s / 2.0, GgmlDType::Q6K)));
    }
    let md_refs: Vec<(&str, &gguf_file::Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut out, &md_refs, &t_refs).unwrap();
}

fn options(model: &Path, cache: &Path) -> Options {
    Options {
        stages: vec![[0, 6]],
        ..common::own_model_options(("--model", model), ("--stages", 2), cache)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_users_gguf_is_served_split_pinned_and_receipted() {
    let dir = common::temp_dir("own-model");
    let model = dir.join("tiny-qwen3.Q4_K.gguf");
    write_gguf(&model, "qwen3");
    let cache = dir.join("models");
    let gw = Gateway::start(options(&model, &cache));

    let ids = model_ids(&gw.url).await;
    assert!(ids.iter().any(|i| i == ID), "{ids:?}");

    // The manifest the gateway wrote pins this exact file.
    let (manifest_bytes, manifest) = common::written_manifest(&cache);
    let file_sha = proto::digest::Sha256Digest::of(&std::fs::read(&model).unwrap()).hex();
    assert_eq!(manifest["files"][0]["sha256"], file_sha.as_str());
    assert_eq!(manifest["architecture"], "qwen3");
    assert_eq!(manifest["model_id"], ID);

    // A client that pins that manifest (one pinning another refuses the
    // stages): sealed chat through the proxy.
    let policy = manifest_pinned_policy(&gw.url, ID, &manifest_bytes, &gw.dir).await;
    let proxy = start_proxy(&gw.url, &[&policy], &[], &gw.dir)
        .unwrap_or_else(|(code, log)| panic!("proxy did not start ({code}):\n{log}"));
    let args = json!({"model": ID, "max_tokens": 12, "temperature": 0.9, "seed": 3,
                      "messages": [{"role": "user", "content": "Name a colour."}]});
    let url = format!("{}/v1/chat/completions", proxy.url);
    let r = client().post(&url).json(&args).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["receipt-verified"], "true");
    let whole: Value = r.json().await.unwrap();
    assert_eq!(whole["model"], ID);
    let whole_text = whole["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(whole["usage"]["completion_tokens"], 12, "{whole}");

    let mut stream_args = args.clone();
    stream_args["stream"] = json!(true);
    let r = client().post(&url).json(&stream_args).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    assert!(
        body.ends_with("data: [DONE]\n\n"),
        "a verified stream ends in [DONE]"
    );
    let mut streamed = String::new();
    for ev in body.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
        if ev != "[DONE]" {
            let v: Value = serde_json::from_str(ev).unwrap();
            streamed += v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        }
    }
    assert_eq!(streamed, whole_text);
}

#[test]
fn unsupported_files_stop_the_start_naming_why() {
    let dir = common::temp_dir("own-model-bad");
    let cache = dir.join("models");
    let gemma = dir.join("tiny-gemma2.gguf");
    write_gguf(&gemma, "gemma2");
    let err = Gateway::refused(options(&gemma, &cache), "a gemma2 file must be refused");
    assert!(err.contains("gemma2"), "{err}");

    // A tensor of another shape than the metadata implies: refused at load,
    // not in the middle of a request.
    let misshapen = dir.join("tiny-misshapen.gguf");
    write_gguf_shaped(&misshapen, "qwen3", 32);
    let err = Gateway::refused(options(&misshapen, &cache), "a misshapen tensor");
    assert!(
        err.contains("blk.1.attn_q.weight has shape [544, 256]"),
        "{err}"
    );

    let junk = dir.join("junk.gguf");
    std::fs::write(&junk, b"not a gguf at all").unwrap();
    let err = Gateway::refused(options(&junk, &cache), "a file that is not a GGUF");
    assert!(err.contains("not a GGUF file"), "{err}");
}

/// `gateway plan`'s byte counts are the stages' own: each stage of a split,
/// loaded as a stage loads it, holds exactly the weight bytes the plan
/// counted, in every generation weight format.
#[test]
fn the_plan_counts_what_a_loaded_stage_holds() {
    use enclave_stage::models::llama::{LlamaPart, WeightFormat};
    let dir = common::temp_dir("own-model-plan");
    let model = dir.join("tiny-qwen3.Q4_K.gguf");
    write_gguf(&model, "qwen3");
    let mut f = std::fs::File::open(&model).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    for format in [WeightFormat::Q4_1, WeightFormat::Q8_0, WeightFormat::F32] {
        let costs = gateway::plan::ModelCosts::of(&ct, format).unwrap();
        for (layers, first, last) in [(0..1, true, false), (1..2, false, true), (0..2, true, true)]
        {
            let part = LlamaPart::load_as(&model, layers.clone(), first, last, format).unwrap();
            assert_eq!(
                costs.stage_weights(layers.clone(), first, last),
                part.weight_bytes() as u64,
                "{format} layers {layers:?}"
            );
        }
    }
}
