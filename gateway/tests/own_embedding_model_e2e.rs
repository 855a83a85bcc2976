//! `gateway serve --embedding-model DIR` end to end: a sentence-transformers
//! folder of the user's, here the shipped all-MiniLM-L6-v2 files copied into
//! a folder of another name (so that nothing of the configured model is
//! used), served as the embeddings pipeline across three stages.
//!
//! - `/v1/models` lists it under the folder's name;
//! - the manifest the gateway wrote pins every file the stages read, with
//!   digests computed here independently, and no other file;
//! - through `gateway proxy`, for a client policy that pins that manifest,
//!   the vectors come back with verified receipts and agree with
//!   sentence-transformers' reference vectors for the model;
//! - a client that pins another manifest refuses the stages;
//! - a folder whose pooling the stages do not serve stops the start, named
//!   (`scripts/test_embedding_models.py` covers every pooling and refusal
//!   on random-weight models against sentence-transformers).

mod common;

use common::{
    client, cosine, manifest_pinned_policy, model_dir, model_ids, start_proxy, Gateway, Options,
};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

const ID: &str = "my-minilm";

/// The shipped model's files (those its pinned manifest lists) copied into
/// `dir/my-minilm`.
fn users_folder(dir: &Path) -> PathBuf {
    let folder = dir.join(ID);
    let shipped: Value =
        serde_json::from_slice(&std::fs::read(model_dir().join("manifest.json")).unwrap()).unwrap();
    for f in shipped["files"].as_array().unwrap() {
        let rel = f["path"].as_str().unwrap();
        let to = folder.join(rel);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(model_dir().join(rel), &to).unwrap();
    }
    folder
}

fn options(folder: &Path, cache: &Path) -> Options {
    common::own_model_options(
        ("--embedding-model", folder),
        ("--embedding-stages", 3),
        cache,
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_users_embedding_folder_is_served_pinned_and_receipted() {
    let dir = common::temp_dir("own-embedding");
    let folder = users_folder(&dir);
    let cache = dir.join("models");
    let gw = Gateway::start(options(&folder, &cache));

    let ids = model_ids(&gw.url).await;
    assert!(ids.iter().any(|i| i == ID), "{ids:?}");
    assert!(
        !ids.iter().any(|i| i == "all-MiniLM-L6-v2"),
        "the configured embedding model is replaced: {ids:?}"
    );

    // The manifest pins exactly the files the stages read.
    let (manifest_bytes, manifest) = common::written_manifest(&cache);
    assert_eq!(manifest["model_id"], ID);
    assert_eq!(manifest["task"], "embedding");
    assert_eq!(manifest["max_seq_len"], 256, "sentence_bert_config.json's");
    let mut pinned: Vec<(String, String)> = manifest["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["path"].as_str().unwrap().to_string(),
                f["sha256"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    pinned.sort();
    let mut expected: Vec<(String, String)> = [
        "1_Pooling/config.json",
        "config.json",
        "config_sentence_transformers.json",
        "model.safetensors",
        "modules.json",
        "sentence_bert_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    .iter()
    .map(|rel| {
        let bytes = std::fs::read(folder.join(rel)).unwrap();
        (
            rel.to_string(),
            proto::digest::Sha256Digest::of(&bytes).hex(),
        )
    })
    .collect();
    expected.sort();
    assert_eq!(pinned, expected);

    // A client that pins that manifest (one pinning another refuses the
    // stages): sealed embeddings through the proxy.
    let policy = manifest_pinned_policy(&gw.url, ID, &manifest_bytes, &gw.dir).await;
    let proxy = start_proxy(&gw.url, &[&policy], &[], &gw.dir)
        .unwrap_or_else(|(code, log)| panic!("proxy did not start ({code}):\n{log}"));
    let reference: Value = serde_json::from_slice(
        &std::fs::read(common::root().join("gateway/tests/data/embeddings_reference.json"))
            .unwrap(),
    )
    .unwrap();
    let items: Vec<&Value> = reference["items"]
        .as_array()
        .unwrap()
        .iter()
        .take(4)
        .collect();
    let inputs: Vec<&str> = items.iter().map(|i| i["text"].as_str().unwrap()).collect();
    let r = client()
        .post(format!("{}/v1/embeddings", proxy.url))
        .json(&json!({"model": ID, "input": inputs}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["receipt-verified"], "true");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["model"], ID);
    for (i, item) in items.iter().enumerate() {
        let got: Vec<f32> = serde_json::from_value(body["data"][i]["embedding"].clone()).unwrap();
        let want: Vec<f32> = serde_json::from_value(item["embedding"].clone()).unwrap();
        let c = cosine(&got, &want);
        // The config's weights are bf16 (f32 agrees to 1e-6).
        assert!(c >= 0.999, "input {i}: cosine {c}");
        // The folder's modules.json lists Normalize (cosine alone would not
        // see it dropped).
        let norm = got.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-3, "input {i}: length {norm}");
    }
}

#[test]
fn a_pooling_the_stages_do_not_serve_stops_the_start() {
    let dir = common::temp_dir("own-embedding-bad");
    let folder = users_folder(&dir);
    std::fs::write(
        folder.join("1_Pooling/config.json"),
        r#"{"embedding_dimension": 384, "pooling_mode": "weightedmean"}"#,
    )
    .unwrap();
    let err = Gateway::refused(
        options(&folder, &dir.join("models")),
        "a weighted-mean pooling must be refused",
    );
    assert!(
        err.contains("pooling mode \"weightedmean\" is not served"),
        "{err}"
    );
}
