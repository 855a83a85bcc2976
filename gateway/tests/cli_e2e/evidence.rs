//! `verify evidence` and `verify receipt` sections.

use super::{verify_receipt, Ctx, MODEL};
use crate::common::{cli, http_get, p, post_exact};
use serde_json::json;
use std::path::Path;

pub(super) fn evidence_checks(c: &Ctx) {
    let nonce = hex::encode(&c.nonce);
    for ev in [&c.evidence_cbor, &c.evidence_json] {
        let (code, out, err) = verify_evidence(&c.policy, &["--nonce", &nonce], ev);
        assert_eq!(
            code,
            0,
            "evidence {} must verify:\n{out}\n{err}",
            ev.display()
        );
        assert!(out.contains("PASS nonce"), "{out}");
        assert!(out.contains("PASS stage 0: evidence"), "{out}");
        assert!(out.contains("PASS stage 1: evidence"), "{out}");
        assert!(
            out.contains("WARN mock"),
            "mock must never be silent:\n{out}"
        );
        assert!(out.contains("RESULT: OK"), "{out}");
        assert!(!out.contains("WARN freshness"), "{out}");
    }

    // Without --nonce: verifies, but says freshness was not checked.
    let (code, out, _) = verify_evidence(&c.policy, &[], &c.evidence_cbor);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("WARN freshness"), "{out}");

    // Machine-readable.
    let (code, out, _) =
        verify_evidence(&c.policy, &["--json", "--nonce", &nonce], &c.evidence_cbor);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("--json prints JSON");
    assert_eq!(v["ok"], true);
    assert_eq!(v["nonce_checked"], true);
    assert_eq!(v["mock"], true);
    assert_eq!(v["stages"].as_array().unwrap().len(), 2);
    let checks = v["checks"].as_array().unwrap();
    assert!(checks.iter().all(|c| c["status"] != "fail"), "{v}");
    assert!(
        checks
            .iter()
            .any(|c| c["name"] == "mock" && c["status"] == "warn"),
        "{v}"
    );

    // A policy that pins another measurement for stage 0: fails, naming the stage.
    let (code, out, _) = verify_evidence(&c.bad_policy, &["--nonce", &nonce], &c.evidence_cbor);
    assert_eq!(code, 1, "{out}");
    let line = out
        .lines()
        .find(|l| l.starts_with("FAIL stage 0"))
        .unwrap_or_else(|| panic!("no FAIL line for stage 0:\n{out}"));
    assert!(line.contains("measurement"), "{line}");
    assert!(line.contains("not in the policy"), "{line}");
    assert!(out.contains("RESULT: FAILED"), "{out}");
    let (code, out, _) = verify_evidence(
        &c.bad_policy,
        &["--json", "--nonce", &nonce],
        &c.evidence_cbor,
    );
    assert_eq!(code, 1);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ok"], false);

    // Another nonce than the one the evidence binds: stale.
    let (code, out, _) = verify_evidence(&c.policy, &["--nonce", "00112233"], &c.evidence_cbor);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL nonce"), "{out}");

    // Not a bundle: a usage/input error, not a verification verdict.
    let junk = c.dir.join("junk.bin");
    std::fs::write(&junk, b"\x00\x01junk").unwrap();
    let (code, _, err) = cli(&["verify", "evidence", "--policy", p(&c.policy), p(&junk)]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("error"), "{err}");
}

pub(super) async fn receipt_checks(c: &Ctx) {
    let request =
        serde_json::to_vec(&json!({"model": MODEL, "input": ["a receipt for curl users"]}))
            .unwrap();
    let receipt_nonce = hex::encode(b"receipt nonce for the cli");
    let url = format!("{}/v1/embeddings", c.url);
    let r = post_exact(&url, request.clone(), Some(&receipt_nonce)).await;
    assert_eq!(r.status(), 200);
    let id = r.headers()["receipt-id"].to_str().unwrap().to_string();
    let header_b64 = r.headers()["receipt"].to_str().unwrap().to_string();
    // A plain request: the gateway hands out the salt of the receipt's digests.
    let salt = r.headers()["receipt-digest-salt"]
        .to_str()
        .unwrap()
        .to_string();
    let response = r.bytes().await.unwrap().to_vec();
    let stored = http_get(&format!("{}/v1/receipts/{id}", c.url))
        .await
        .bytes()
        .await
        .unwrap();

    let dir = &c.dir;
    let (req_path, resp_path, receipt_path, receipt_txt) = (
        dir.join("plain-req.json"),
        dir.join("plain-resp.json"),
        dir.join("receipt.cose"),
        dir.join("receipt.txt"),
    );
    std::fs::write(&req_path, &request).unwrap();
    std::fs::write(&resp_path, &response).unwrap();
    std::fs::write(&receipt_path, &stored).unwrap();
    std::fs::write(&receipt_txt, format!("{header_b64}\n")).unwrap();
    let nonce = hex::encode(&c.nonce);

    let verify = |evidence: &Path, receipt: &[&str], response: &Path, extra: &[&str]| {
        let inputs = ["--evidence-nonce", &nonce, "--request", p(&req_path)];
        let response = ["--response", p(response), "--digest-salt", &salt];
        verify_receipt(
            evidence,
            &c.policy,
            &[&inputs[..], &response, receipt, extra].concat(),
        )
    };
    // The stored receipt against the CBOR evidence, nothing else given.
    let with_receipt = |response: &Path| {
        verify(
            &c.evidence_cbor,
            &["--receipt", p(&receipt_path)],
            response,
            &[],
        )
    };

    // Raw COSE file, base64url text file, and the header value inline.
    for receipt in [
        vec!["--receipt", p(&receipt_path)],
        vec!["--receipt", p(&receipt_txt)],
        vec!["--receipt-b64", header_b64.as_str()],
    ] {
        let (code, out, err) = verify(
            &c.evidence_cbor,
            &receipt,
            &resp_path,
            &["--nonce", &receipt_nonce],
        );
        assert_eq!(code, 0, "receipt {receipt:?} must verify:\n{out}\n{err}");
        assert!(out.contains("PASS receipt.signature"), "{out}");
        assert!(out.contains("PASS response"), "{out}");
        assert!(out.contains("PASS nonce: matches"), "{out}");
        assert!(out.contains("INFO sealing: plain"), "{out}");
        assert!(out.contains("WARN mock: yes"), "{out}");
        assert!(out.contains("RESULT: OK"), "{out}");
    }
    // The JSON evidence works too, and --json is machine-readable.
    let (code, out, _) = verify(
        &c.evidence_json,
        &["--receipt", p(&receipt_path), "--json"],
        &resp_path,
        &["--nonce", &receipt_nonce],
    );
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ok"], true);
    // Safe defaults: an input not given fails the verification, unless
    // --insecure-partial, which every such line then repeats; what the
    // receipt must say (endpoint, sealing) is checked when asked.
    let (code, out, _) = with_receipt(&resp_path);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAIL nonce: not given") && out.contains("[input_missing]"),
        "{out}"
    );
    let (code, out, _) = verify(
        &c.evidence_cbor,
        &["--receipt", p(&receipt_path)],
        &resp_path,
        &["--insecure-partial"],
    );
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("WARN nonce: INSECURE (--insecure-partial)"),
        "{out}"
    );
    for (extra, ok, line) in [
        (vec!["--endpoint", "/v1/embeddings"], true, "PASS endpoint"),
        (
            vec!["--endpoint", "/v1/completions"],
            false,
            "[endpoint_mismatch]",
        ),
        (
            vec!["--expect-sealing", "plain"],
            true,
            "PASS sealing.expected",
        ),
        (
            vec!["--expect-sealing", "enclave"],
            false,
            "FAIL sealing.expected: the receipt says plain",
        ),
        (
            vec!["--no-nonce"],
            false,
            "FAIL nonce: the receipt carries a client nonce",
        ),
    ] {
        let mut args = extra.clone();
        if !extra.contains(&"--no-nonce") {
            args.extend(["--nonce", receipt_nonce.as_str()]);
        }
        let (code, out, _) = verify(
            &c.evidence_cbor,
            &["--receipt", p(&receipt_path)],
            &resp_path,
            &args,
        );
        assert_eq!(code, if ok { 0 } else { 1 }, "{extra:?}:\n{out}");
        assert!(out.contains(line), "{extra:?}:\n{out}");
    }
    assert_eq!(v["sealing"], "plain");
    assert_eq!(v["mock"], true);
    assert_eq!(v["receipt"]["receipt"]["receipt_id"], id);

    // A tampered response file.
    let mut tampered = response.clone();
    tampered[10] ^= 1;
    let bad_resp = dir.join("tampered-resp.json");
    std::fs::write(&bad_resp, &tampered).unwrap();
    let (code, out, _) = with_receipt(&bad_resp);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("FAIL response") && l.contains("[response_mismatch]")),
        "{out}"
    );
    assert!(out.contains("first: response_mismatch"), "{out}");
    let (code, out, _) = verify(
        &c.evidence_cbor,
        &["--receipt", p(&receipt_path), "--json"],
        &bad_resp,
        &[],
    );
    assert_eq!(code, 1);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["reason"], "response_mismatch");

    // Another nonce than the receipt carries.
    let (code, out, _) = verify(
        &c.evidence_cbor,
        &["--receipt", p(&receipt_path)],
        &resp_path,
        &["--nonce", "abcd"],
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("nonce_mismatch"), "{out}");

    // Evidence that does not verify against the policy: the receipt is not checked.
    let (code, out, _) = verify_receipt(
        &c.evidence_cbor,
        &c.bad_policy,
        &["--receipt", p(&receipt_path)],
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL evidence.stage 0"), "{out}");
    assert!(out.contains("evidence_not_verified"), "{out}");
}

/// `gateway verify evidence --policy POLICY EXTRA... EVIDENCE`.
fn verify_evidence(policy: &Path, extra: &[&str], evidence: &Path) -> (i32, String, String) {
    let head = ["verify", "evidence", "--policy", p(policy)];
    cli(&[&head[..], extra, &[p(evidence)]].concat())
}
