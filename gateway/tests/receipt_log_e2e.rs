//! End to end: receipt entries in the transparency log (issue 49, item 2).
//! With `[transparency] log_receipts = true` the gateway logs the digest of
//! every receipt it keeps (never its content), in batches, and serves
//! `GET /v1/receipts/{id}/inclusion`: an RFC 9942 COSE receipt that checks
//! against the log's key here (`proto::transparency`) and, where Python has
//! it, with the PyPI `scitt-cose` package, written by others; its root and
//! size are the log's signed checkpoint's.

mod common;

use common::{cli, http_get, http_post, p, temp_dir, Gateway, Options};
use proto::transparency::{verify_checkpoint, verify_inclusion_receipt, Entry};
use serde_json::json;
use std::process::Command;
use std::time::{Duration, Instant};

const ORIGIN: &str = "test.example/receipts";

/// `scripts/verify_cose_receipt.py` when python3 has `scitt_cose`.
fn scitt_cose(receipt: &std::path::Path, entry: &[u8], vkey: &str) -> Option<serde_json::Value> {
    let ok = Command::new("python3")
        .args(["-c", "import scitt_cose, cryptography"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIPPED scitt-cose: python3 without scitt_cose (scripts/requirements-test.txt)");
        return None;
    }
    let out = Command::new("python3")
        .arg(common::root().join("scripts/verify_cose_receipt.py"))
        .args([
            "--receipt",
            p(receipt),
            "--entry-hex",
            &hex::encode(entry),
            "--vkey",
            vkey,
        ])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(out.status.success(), v["ok"] == true, "{v}");
    Some(v)
}

#[tokio::test(flavor = "multi_thread")]
async fn receipts_are_logged_by_digest_and_proven_with_rfc9942_receipts() {
    let dir = temp_dir("receipt-log");
    let log_dir = dir.join("log");
    let gw = Gateway::start(Options {
        extra: format!(
            "\n[transparency]\ndir = {log_dir:?}\norigin = {ORIGIN:?}\nlog_receipts = true\nreceipt_batch_ms = 50\n"
        ),
        ..Options::default()
    });
    let (code, vkey, err) = cli(&["log", "vkey", "--dir", p(&log_dir)]);
    assert_eq!(code, 0, "{err}");
    let vkey = vkey.trim().to_string();

    // A few answers, each with its receipt id.
    let mut ids = Vec::new();
    for i in 0..5 {
        let r = http_post(
            &format!("{}/v1/embeddings", gw.url),
            &json!({"model": "all-MiniLM-L6-v2", "input": format!("logged {i}")}),
        )
        .await;
        assert_eq!(r.status(), 200);
        ids.push(r.headers()["receipt-id"].to_str().unwrap().to_string());
    }
    let (code, entries_before, _) = cli(&["log", "entries", "--dir", p(&log_dir)]);
    assert_eq!(code, 0);
    for id in &ids {
        let receipt = http_get(&format!("{}/v1/receipts/{id}", gw.url))
            .await
            .bytes()
            .await
            .unwrap()
            .to_vec();
        let entry = gateway::transparency::receipts::receipt_entry(&receipt);
        // Served once its batch is in the log (404 with Retry-After before).
        let t0 = Instant::now();
        let cose = loop {
            let r = http_get(&format!("{}/v1/receipts/{id}/inclusion", gw.url)).await;
            if r.status() == 200 {
                assert_eq!(r.headers()["content-type"], "application/cose");
                break r.bytes().await.unwrap().to_vec();
            }
            assert_eq!(r.status(), 404);
            assert!(r.headers().contains_key("retry-after"));
            let body: serde_json::Value = r.json().await.unwrap();
            assert_eq!(body["error"]["code"], "receipt_not_logged", "{body}");
            assert!(t0.elapsed() < Duration::from_secs(20), "never logged");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let proven = verify_inclusion_receipt(&cose, &vkey, &entry).expect("the receipt verifies");
        // The tree it names is the one the log signs.
        let note = http_get(&format!("{}/v1/transparency/checkpoint", gw.url))
            .await
            .bytes()
            .await
            .unwrap();
        let cp = verify_checkpoint(&note, &vkey, ORIGIN).unwrap();
        assert!(proven.size <= cp.size());
        if proven.size == cp.size() {
            assert_eq!(proven.root, *cp.hash());
        }
        // Not for another entry, nor under another key.
        let other = gateway::transparency::receipts::receipt_entry(b"another receipt");
        assert!(verify_inclusion_receipt(&cose, &vkey, &other).is_err());
        // And by a verifier nobody here wrote.
        let file = dir.join(format!("{id}.cose"));
        std::fs::write(&file, &cose).unwrap();
        if let Some(v) = scitt_cose(&file, &entry, &vkey) {
            assert_eq!(v["ok"], true, "{v}");
            assert_eq!(v["leaf_index"], proven.index, "{v}");
            assert_eq!(v["tree_size"], proven.size, "{v}");
            assert_eq!(v["root"], hex::encode(proven.root.0), "{v}");
            assert!(scitt_cose(&file, &other, &vkey).is_some_and(|v| v["ok"] == false));
        }
    }
    // The log holds digests only: one receipt entry per answer, nothing of
    // the request or the answer.
    let (code, listed, _) = cli(&["log", "entries", "--dir", p(&log_dir)]);
    assert_eq!(code, 0);
    let receipts: Vec<serde_json::Value> = listed
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| e["kind"] == "receipt")
        .collect();
    assert!(
        receipts.len() >= ids.len(),
        "{listed}\n(before: {entries_before})"
    );
    for e in &receipts {
        let keys: Vec<&str> = e.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, ["index", "kind", "receipt_sha256"], "{e}");
    }
    assert!(!listed.contains("logged 0"));
    let entries = std::fs::read(log_dir.join("entries")).unwrap();
    assert!(!entries.windows(8).any(|w| w == b"logged 0"));
    // Entries parse back as receipt entries.
    let leaf = gateway::transparency::receipts::receipt_entry(b"x");
    assert!(matches!(Entry::from_bytes(&leaf), Ok(Entry::Receipt(_))));
    // An id never issued: the receipt store's 404, not the log's.
    let r = http_get(&format!(
        "{}/v1/receipts/{}/inclusion",
        gw.url,
        "00".repeat(16)
    ))
    .await;
    assert_eq!(r.status(), 404);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "receipt_not_found", "{body}");
}
