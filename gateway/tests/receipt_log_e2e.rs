//! End to end: receipt entries in the transparency log (issue 49, item 2).
//! With `[transparency] log_receipts = true` the gateway logs the digest of
//! every receipt it keeps (never its content), in batches, and serves
//! `GET /v1/receipts/{id}/inclusion`: an RFC 9942 COSE receipt that checks
//! against the log's key here (`proto::transparency`) and, where Python has
//! it, with the PyPI `scitt-cose` package, written by others; its root and
//! size are the log's signed checkpoint's. A policy pinned with
//! `--receipts-logged` makes `gateway proxy` hand out only answers whose
//! receipt is proven logged (archived with its inclusion receipt), and
//! `gateway verify receipt` require `--inclusion`: another receipt's, a
//! tampered one, or none at all fails, and a gateway that does not log
//! receipts has its answers withheld.

mod common;

use common::{cli, http_get, http_post, p, policy_pin, start_proxy, temp_dir, Gateway, Options};
use proto::transparency::{verify_checkpoint, verify_inclusion_receipt, Entry};
use serde_json::json;
use std::process::Command;
use std::time::{Duration, Instant};

const ORIGIN: &str = "test.example/receipts";
const MODEL: &str = "all-MiniLM-L6-v2";

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
        let entry = proto::transparency::ReceiptEntry::leaf_of(&receipt);
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
        let other = proto::transparency::ReceiptEntry::leaf_of(b"another receipt");
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
    let leaf = proto::transparency::ReceiptEntry::leaf_of(b"x");
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

/// The `[transparency]` table of a gateway on `log_dir`.
fn logged(log_dir: &std::path::Path, log_receipts: bool) -> Options {
    Options {
        extra: format!(
            "\n[transparency]\ndir = {log_dir:?}\norigin = {ORIGIN:?}\nlog_local_build = true\nlog_receipts = {log_receipts}\nreceipt_batch_ms = 50\n"
        ),
        ..Options::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_policy_requiring_logged_receipts_accepts_only_proven_ones() {
    let dir = temp_dir("receipt-log-policy");
    let log_dir = dir.join("log");
    let gw = Gateway::start(logged(&log_dir, true));
    let (code, vkey, err) = cli(&["log", "vkey", "--dir", p(&log_dir)]);
    assert_eq!(code, 0, "{err}");
    let vkey = vkey.trim().to_string();
    let policy = dir.join("logged.toml");
    let (code, _, err) = policy_pin(
        &gw.url,
        MODEL,
        &policy,
        &["--log-key", &vkey, "--receipts-logged"],
    );
    assert_eq!(code, 0, "{err}");
    let text = std::fs::read_to_string(&policy).unwrap();
    assert!(text.contains("receipts_logged = true"), "{text}");

    // The proxy hands out an answer once its receipt is proven logged, and
    // archives the inclusion receipt with the exchange.
    let archive = dir.join("archive");
    let state = dir.join("log-state.json");
    let proxy = start_proxy(
        &gw.url,
        &[&policy],
        &["--archive", p(&archive), "--log-state", p(&state)],
        &dir,
    )
    .unwrap_or_else(|(code, log)| panic!("proxy ({code}):\n{log}"));
    let mut ids = Vec::new();
    for input in ["first logged answer", "second logged answer"] {
        let r = http_post(
            &format!("{}/v1/embeddings", proxy.url),
            &json!({"model": MODEL, "input": input}),
        )
        .await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["receipt-verified"], "true");
        ids.push(r.headers()["receipt-id"].to_str().unwrap().to_string());
    }
    drop(proxy);

    // Offline: `gateway verify receipt --inclusion` from the archive.
    let d = archive.join(&ids[0]);
    let read = |f: &str| std::fs::read_to_string(d.join(f)).unwrap();
    let file = |f: &str| d.join(f).to_str().unwrap().to_string();
    let head: Vec<String> = [
        "verify",
        "receipt",
        "--evidence",
        &file("evidence.cbor"),
        "--evidence-nonce",
        &read("evidence-nonce.hex"),
        "--policy",
        p(&policy),
        "--request",
        &file("request.json"),
        "--response",
        &file("response"),
        "--nonce",
        &read("nonce.hex"),
        "--digest-salt",
        &read("digest-salt.hex"),
        "--receipt",
        &file("receipt.cbor"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let verify = |extra: &[&str]| {
        let head: Vec<&str> = head.iter().map(String::as_str).collect();
        cli(&[&head[..], extra].concat())
    };
    let inclusion = d.join("inclusion.cose");
    let (code, out, err) = verify(&["--inclusion", p(&inclusion)]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("PASS log inclusion"), "{out}");
    // Its tree against the checkpoint the proxy kept (tiles from the log).
    let log_url = format!("{}/v1/transparency", gw.url);
    let (code, out, err) = verify(&[
        "--inclusion",
        p(&inclusion),
        "--log-state",
        p(&state),
        "--log",
        &log_url,
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("PASS log consistency"), "{out}");
    // The policy requires it: without --inclusion the check fails.
    let (code, out, _) = verify(&[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("FAIL log inclusion") && l.contains("[input_missing]")),
        "{out}"
    );
    // Another receipt's inclusion receipt proves nothing about this one.
    let other = archive.join(&ids[1]).join("inclusion.cose");
    let (code, out, _) = verify(&["--inclusion", p(&other)]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("[receipt_not_logged]"), "{out}");
    // Nor does a tampered one (its last byte: the signature).
    let mut bytes = std::fs::read(&inclusion).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    let tampered = dir.join("tampered.cose");
    std::fs::write(&tampered, bytes).unwrap();
    let (code, out, _) = verify(&["--inclusion", p(&tampered)]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL log inclusion"), "{out}");

    // A gateway on the same log that does not log receipts: the policy's
    // answers are withheld.
    let quiet = Gateway::start(logged(&log_dir, false));
    let proxy = start_proxy(&quiet.url, &[&policy], &[], &dir)
        .unwrap_or_else(|(code, log)| panic!("proxy ({code}):\n{log}"));
    let r = http_post(
        &format!("{}/v1/embeddings", proxy.url),
        &json!({"model": MODEL, "input": "an answer nobody logs"}),
    )
    .await;
    assert_eq!(r.status(), 502);
    assert_eq!(r.headers()["receipt-verified"], "false");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "receipt_not_logged", "{body}");
}
