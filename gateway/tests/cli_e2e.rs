//! End to end: the client verbs of the `gateway` binary against a real
//! gateway (real stages): `verify evidence`, `verify receipt`, `seal` →
//! HTTP → `open`, and `proxy` driven by the stock `openai` Python SDK (or
//! reqwest when python3 + openai are not importable).
//!
//! One gateway serves every section (each gateway starts two model-loading
//! stage processes); the sections run in order and name themselves on failure.

mod common;

use base64::Engine as _;
use common::*;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;

const MODEL: &str = "all-MiniLM-L6-v2";

/// Saves `/v1/attestation?nonce=` as CBOR and as JSON.
async fn save_evidence(url: &str, nonce: &[u8], dir: &Path) -> (PathBuf, PathBuf) {
    let get = |accept: &'static str| {
        client()
            .get(format!("{url}/v1/attestation?nonce={}", hex::encode(nonce)))
            .header("accept", accept)
            .send()
    };
    let cbor = get("application/cbor").await.unwrap();
    assert_eq!(cbor.status(), 200);
    let cbor_path = dir.join("evidence.cbor");
    std::fs::write(&cbor_path, cbor.bytes().await.unwrap()).unwrap();
    let js = get("application/json").await.unwrap();
    assert_eq!(js.status(), 200);
    let json_path = dir.join("evidence.json");
    std::fs::write(&json_path, js.bytes().await.unwrap()).unwrap();
    (cbor_path, json_path)
}

struct Ctx {
    url: String,
    dir: PathBuf,
    policy: PathBuf,
    bad_policy: PathBuf,
    nonce: Vec<u8>,
    evidence_cbor: PathBuf,
    evidence_json: PathBuf,
}

fn evidence_checks(c: &Ctx) {
    let nonce = hex::encode(&c.nonce);
    for ev in [&c.evidence_cbor, &c.evidence_json] {
        let (code, out, err) = cli(&[
            "verify",
            "evidence",
            "--policy",
            p(&c.policy),
            "--nonce",
            &nonce,
            p(ev),
        ]);
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
    let (code, out, _) = cli(&[
        "verify",
        "evidence",
        "--policy",
        p(&c.policy),
        p(&c.evidence_cbor),
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("WARN freshness"), "{out}");

    // Machine-readable.
    let (code, out, _) = cli(&[
        "verify",
        "evidence",
        "--json",
        "--policy",
        p(&c.policy),
        "--nonce",
        &nonce,
        p(&c.evidence_cbor),
    ]);
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
    let (code, out, _) = cli(&[
        "verify",
        "evidence",
        "--policy",
        p(&c.bad_policy),
        "--nonce",
        &nonce,
        p(&c.evidence_cbor),
    ]);
    assert_eq!(code, 1, "{out}");
    let line = out
        .lines()
        .find(|l| l.starts_with("FAIL stage 0"))
        .unwrap_or_else(|| panic!("no FAIL line for stage 0:\n{out}"));
    assert!(line.contains("measurement"), "{line}");
    assert!(line.contains("not in the policy"), "{line}");
    assert!(out.contains("RESULT: FAILED"), "{out}");
    let (code, out, _) = cli(&[
        "verify",
        "evidence",
        "--json",
        "--policy",
        p(&c.bad_policy),
        "--nonce",
        &nonce,
        p(&c.evidence_cbor),
    ]);
    assert_eq!(code, 1);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ok"], false);

    // Another nonce than the one the evidence binds: stale.
    let (code, out, _) = cli(&[
        "verify",
        "evidence",
        "--policy",
        p(&c.policy),
        "--nonce",
        "00112233",
        p(&c.evidence_cbor),
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL nonce"), "{out}");

    // Not a bundle: a usage/input error, not a verification verdict.
    let junk = c.dir.join("junk.bin");
    std::fs::write(&junk, b"\x00\x01junk").unwrap();
    let (code, _, err) = cli(&["verify", "evidence", "--policy", p(&c.policy), p(&junk)]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("error"), "{err}");
}

async fn receipt_checks(c: &Ctx) {
    let request =
        serde_json::to_vec(&json!({"model": MODEL, "input": ["a receipt for curl users"]}))
            .unwrap();
    let receipt_nonce = hex::encode(b"receipt nonce for the cli");
    let r = client()
        .post(format!("{}/v1/embeddings", c.url))
        .header("content-type", "application/json")
        .header("receipt-nonce", &receipt_nonce)
        .body(request.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let id = r.headers()["receipt-id"].to_str().unwrap().to_string();
    let header_b64 = r.headers()["receipt"].to_str().unwrap().to_string();
    let response = r.bytes().await.unwrap().to_vec();
    let stored = client()
        .get(format!("{}/v1/receipts/{id}", c.url))
        .send()
        .await
        .unwrap()
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
        let mut args = vec![
            "verify",
            "receipt",
            "--evidence",
            p(evidence),
            "--policy",
            p(&c.policy),
            "--evidence-nonce",
            &nonce,
            "--request",
            p(&req_path),
            "--response",
            p(response),
        ];
        args.extend_from_slice(receipt);
        args.extend_from_slice(extra);
        cli(&args)
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
    let (code, out, _) = verify(
        &c.evidence_cbor,
        &["--receipt", p(&receipt_path)],
        &resp_path,
        &[],
    );
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
    let (code, out, _) = verify(
        &c.evidence_cbor,
        &["--receipt", p(&receipt_path)],
        &bad_resp,
        &[],
    );
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
    let (code, out, _) = cli(&[
        "verify",
        "receipt",
        "--evidence",
        p(&c.evidence_cbor),
        "--policy",
        p(&c.bad_policy),
        "--receipt",
        p(&receipt_path),
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL evidence.stage 0"), "{out}");
    assert!(out.contains("evidence_not_verified"), "{out}");
}

/// Sends what `gateway seal` wrote, as `curl --data-binary @BODY -H @HEADERS` would.
async fn post_sealed(url: &str, body: &Path, headers: &Path) -> reqwest::Response {
    let mut rb = client()
        .post(format!("{url}/v1/embeddings"))
        .body(std::fs::read(body).unwrap());
    for line in std::fs::read_to_string(headers).unwrap().lines() {
        let (k, v) = line.split_once(':').expect("name: value");
        rb = rb.header(k.trim(), v.trim());
    }
    rb.send().await.unwrap()
}

async fn seal_open_checks(c: &Ctx) {
    use std::os::unix::fs::PermissionsExt;
    let dir = &c.dir;
    let request =
        serde_json::to_vec(&json!({"model": MODEL, "input": "sealed by gateway seal"})).unwrap();
    let req = dir.join("sealed-req.json");
    std::fs::write(&req, &request).unwrap();

    // Keys from fresh, verified evidence (--gateway with --policy).
    let (body, headers, key, resp, plain) = (
        dir.join("body.bin"),
        dir.join("headers.txt"),
        dir.join("client-key.json"),
        dir.join("resp.bin"),
        dir.join("resp.json"),
    );
    let (code, out, err) = cli(&[
        "seal",
        "--gateway",
        &c.url,
        "--policy",
        p(&c.policy),
        "--in",
        p(&req),
        "--out",
        p(&body),
        "--headers",
        p(&headers),
        "--key-out",
        p(&key),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(!err.contains("WARN keys"), "keys come from evidence: {err}");
    let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the client key file is secret");
    let header_text = std::fs::read_to_string(&headers).unwrap();
    for name in [
        "hpke-key-id:",
        "hpke-aead: 1",
        "hpke-encapsulated-key:",
        "receipt-nonce:",
    ] {
        assert!(header_text.contains(name), "{name} in {header_text}");
    }
    let receipt_nonce = header_text
        .lines()
        .find_map(|l| l.strip_prefix("receipt-nonce: "))
        .unwrap()
        .to_string();
    assert_ne!(std::fs::read(&body).unwrap(), request, "the body is sealed");

    let r = post_sealed(&c.url, &body, &headers).await;
    assert_eq!(r.status(), 200);
    let receipt_b64 = r.headers()["receipt"].to_str().unwrap().to_string();
    std::fs::write(&resp, r.bytes().await.unwrap()).unwrap();
    let (code, out, err) = cli(&[
        "open",
        "--key",
        p(&key),
        "--in",
        p(&resp),
        "--out",
        p(&plain),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&plain).unwrap()).unwrap();
    assert_eq!(v["data"][0]["embedding"].as_array().unwrap().len(), 384);
    // `--out -` (the default) writes to stdout.
    let (code, out, _) = cli(&["open", "--key", p(&key), "--in", p(&resp)]);
    assert_eq!(code, 0);
    assert_eq!(out.as_bytes(), std::fs::read(&plain).unwrap());

    // The receipt binds the plaintext request and the opened response.
    let evidence_nonce = hex::encode(&c.nonce);
    let base = [
        "verify",
        "receipt",
        "--evidence",
        p(&c.evidence_cbor),
        "--evidence-nonce",
        &evidence_nonce,
        "--policy",
        p(&c.policy),
        "--request",
        p(&req),
        "--response",
        p(&plain),
        "--receipt-b64",
        &receipt_b64,
    ];
    let (code, out, err) = cli(&[&base[..], &["--nonce", &receipt_nonce]].concat());
    assert_eq!(code, 0, "{out}\n{err}");
    // Without the client key, `sealing` is the host's word and says so.
    assert!(out.contains("WARN sealing: NOT PROVEN"), "{out}");
    assert!(!out.contains("INFO sealing: enclave"), "{out}");
    // With it (the nonce comes from the key file too), it is proven.
    let (code, out, err) = cli(&[&base[..], &["--client-key", p(&key)]].concat());
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("PASS sealing: enclave"), "{out}");
    assert!(out.contains("PASS nonce"), "{out}");
    assert!(out.contains("INFO sealing: enclave"), "{out}");
    assert!(out.contains("(proven"), "{out}");

    // Sending the same sealed body again is a replay: the host answers with
    // a plain error, which `open` reports as such.
    let again = post_sealed(&c.url, &body, &headers).await;
    assert_eq!(again.status(), 400);
    let replay = dir.join("replay.bin");
    std::fs::write(&replay, again.bytes().await.unwrap()).unwrap();
    let (code, _, err) = cli(&["open", "--key", p(&key), "--in", p(&replay)]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("not sealed"), "{err}");

    // Keys from the raw application/ohttp-keys bytes (the entry stage's key
    // id, from the evidence), ChaCha20-Poly1305, no receipt nonce.
    let keys = get_bytes(&format!("{}/.well-known/hpke-keys", c.url)).await;
    let keys_path = dir.join("keys.bin");
    std::fs::write(&keys_path, &keys).unwrap();
    let bundle: proto::bundle::EvidenceBundle =
        proto::cbor::from_slice(&std::fs::read(&c.evidence_cbor).unwrap()).unwrap();
    let entry = proto::sealing::KeyConfig::decode_list(&bundle.stages[0].claims.hpke_keys).unwrap();
    let key_id = entry[0].key_id.to_string();
    let unverified = |insecure: bool| {
        let mut args = vec![
            "seal",
            "--keys",
            p(&keys_path),
            "--key-id",
            &key_id,
            "--aead",
            "chacha20poly1305",
            "--no-receipt-nonce",
            "--in",
            p(&req),
            "--out",
            p(&body),
            "--headers",
            p(&headers),
            "--key-out",
            p(&key),
        ];
        if insecure {
            args.push("--insecure-unverified-keys");
        }
        cli(&args)
    };
    // Keys no verified evidence vouches for: refused by default...
    let _ = std::fs::remove_file(&key);
    let (code, _, err) = unverified(false);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("refusing to seal to keys that no verified evidence"),
        "{err}"
    );
    assert!(!key.exists(), "nothing written");
    // ...and used only when asked for explicitly, which the output repeats.
    let (code, out, err) = unverified(true);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        err.contains("INSECURE keys (--insecure-unverified-keys)"),
        "unverified keys are flagged: {err}"
    );
    let header_text = std::fs::read_to_string(&headers).unwrap();
    assert!(header_text.contains("hpke-aead: 3"), "{header_text}");
    assert!(!header_text.contains("receipt-nonce"), "{header_text}");
    let r = post_sealed(&c.url, &body, &headers).await;
    assert_eq!(r.status(), 200);
    std::fs::write(&resp, r.bytes().await.unwrap()).unwrap();
    let (code, out, err) = cli(&["open", "--key", p(&key), "--in", p(&resp)]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["model"], MODEL);

    // Evidence that does not verify: `seal` refuses to use its keys.
    let (code, _, err) = cli(&[
        "seal",
        "--evidence",
        p(&c.evidence_cbor),
        "--policy",
        p(&c.bad_policy),
        "--in",
        p(&req),
        "--out",
        p(&body),
        "--headers",
        p(&headers),
        "--key-out",
        p(&key),
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("refusing to seal"), "{err}");
}

/// A dishonest host: it publishes a key of its own under the entry stage's
/// key id at `/.well-known/hpke-keys`, opens every sealed POST with it, seals
/// the plaintext again to the real entry stage (with the client's receipt
/// nonce, so the receipt says `sealing: enclave`), and re-seals the stage's
/// response and receipt trailer to the client. Runs on its own thread.
fn resealing_host(upstream: String, entry_key_id: u8) -> String {
    use axum::body::{to_bytes, Body};
    use axum::http::{Method, Request};
    use axum::response::Response;
    use proto::sealing::{
        open_request, open_response_with_trailer, seal_request, seal_response_with_trailer,
        KeyConfig, SealedHeaders, ServerKey,
    };
    let own = std::sync::Arc::new(ServerKey::generate(entry_key_id));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let (upstream, own) = (upstream.clone(), own.clone());
        async move {
            let (parts, body) = req.into_parts();
            if parts.uri.path() == "/.well-known/hpke-keys" {
                return Response::new(Body::from(KeyConfig::encode_list(&[own.config()])));
            }
            assert_eq!(parts.method, Method::POST);
            let body = to_bytes(body, 64 << 20).await.unwrap();
            let get = |n: &'static str| parts.headers.get(n).and_then(|v| v.to_str().ok());
            let headers = SealedHeaders::from_header_values(get).unwrap();
            let (plain, material) = open_request(&own, &headers, &body).unwrap();
            let real = get_bytes(&format!("{upstream}/.well-known/hpke-keys")).await;
            let real = KeyConfig::decode_list(&real).unwrap();
            let real = real.iter().find(|k| k.key_id == entry_key_id).unwrap();
            let (h2, b2, key2) = seal_request(real, headers.aead, &plain).unwrap();
            let mut rb = client()
                .post(format!("{upstream}{}", parts.uri))
                .header("content-type", "application/octet-stream")
                .body(b2);
            if let Some(n) = get("receipt-nonce") {
                rb = rb.header("receipt-nonce", n);
            }
            for (k, v) in h2.to_header_values() {
                rb = rb.header(k, v);
            }
            let r = rb.send().await.unwrap();
            assert_eq!(r.status(), 200);
            let mut out = Response::builder().status(200);
            for k in ["receipt", "receipt-id", "hpke-sealed"] {
                if let Some(v) = r.headers().get(k) {
                    out = out.header(k, v);
                }
            }
            let sealed = r.bytes().await.unwrap();
            let (resp, trailer) = open_response_with_trailer(&key2, &sealed).unwrap();
            let trailer = trailer.expect("a receipt trailer");
            let resealed = seal_response_with_trailer(&material, &resp, &trailer).unwrap();
            out.body(Body::from(resealed)).unwrap()
        }
    });
    serve_on_thread(listener, app)
}

/// Issue 18, finding 1: a host that hands out a key of its own, opens the
/// request and re-seals it to the entry stage gets a genuine receipt that
/// says `sealing: enclave`; the entry stage's link names the encapsulated key
/// it opened, so `gateway open` and `gateway verify receipt --client-key`
/// catch it.
async fn resealing_host_checks(c: &Ctx) {
    let dir = &c.dir;
    let bundle: proto::bundle::EvidenceBundle =
        proto::cbor::from_slice(&std::fs::read(&c.evidence_cbor).unwrap()).unwrap();
    let entry = proto::sealing::KeyConfig::decode_list(&bundle.stages[0].claims.hpke_keys).unwrap();
    let host = resealing_host(c.url.clone(), entry[0].key_id);
    let request =
        serde_json::to_vec(&json!({"model": MODEL, "input": "my secret diagnosis"})).unwrap();
    let req = dir.join("mitm-req.json");
    std::fs::write(&req, &request).unwrap();
    let (body, headers, key, resp, plain, receipt) = (
        dir.join("mitm-body.bin"),
        dir.join("mitm-headers.txt"),
        dir.join("mitm-key.json"),
        dir.join("mitm-resp.bin"),
        dir.join("mitm-resp.json"),
        dir.join("mitm-receipt.cbor"),
    );
    // The client takes the host's keys on trust (no --policy).
    let (code, out, err) = cli(&[
        "seal",
        "--insecure-unverified-keys",
        "--gateway",
        &host,
        "--in",
        p(&req),
        "--out",
        p(&body),
        "--headers",
        p(&headers),
        "--key-out",
        p(&key),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let r = post_sealed(&host, &body, &headers).await;
    assert_eq!(r.status(), 200);
    let receipt_b64 = r.headers()["receipt"].to_str().unwrap().to_string();
    std::fs::write(&resp, r.bytes().await.unwrap()).unwrap();
    // The host's re-sealing is perfect: the response opens, the receipt is
    // genuine and says "enclave"...
    let rc = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(&receipt_b64)
        .unwrap();
    let (body_rc, _) = proto::receipt::parse_unverified(&rc).unwrap();
    assert_eq!(body_rc.sealing, proto::receipt::Sealing::Enclave);
    // ...but `gateway open` refuses, and writes nothing.
    let (code, out, err) = cli(&[
        "open",
        "--key",
        p(&key),
        "--in",
        p(&resp),
        "--out",
        p(&plain),
        "--receipt-out",
        p(&receipt),
    ]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(err.contains("the host opened the request"), "{err}");
    assert!(!plain.exists(), "nothing written");
    // `verify receipt` with the client key fails on `sealing`.
    let mut args = vec![
        "verify",
        "receipt",
        "--evidence",
        p(&c.evidence_cbor),
        "--policy",
        p(&c.policy),
        "--request",
        p(&req),
        "--receipt-b64",
        &receipt_b64,
        // No response kept here: the resealing host's answer is not opened.
        "--insecure-partial",
    ];
    let (code, out, err) = cli(&args);
    assert_eq!(code, 0, "without the client key it verifies: {out}\n{err}");
    assert!(out.contains("WARN sealing: NOT PROVEN"), "{out}");
    args.extend(["--client-key", p(&key)]);
    let (code, out, err) = cli(&args);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("FAIL sealing"), "{out}");
    assert!(out.contains("sealing_mismatch"), "{out}");
    assert!(!out.contains("INFO sealing: enclave"), "{out}");
}

const OPENAI_SCRIPT: &str = r#"
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="not-needed-by-the-proxy", max_retries=0)
raw = client.embeddings.with_raw_response.create(model=sys.argv[2], input=["hello through the proxy", "second input"])
emb = raw.parse()
models = [m.id for m in client.models.list()]
err = None
try:
    client.embeddings.create(model="no-such-model", input="x")
except Exception as e:
    err = getattr(e, "status_code", None)
print(json.dumps({
    "verified": raw.headers.get("receipt-verified"),
    "sealing": raw.headers.get("receipt-sealing"),
    "receipt": raw.headers.get("receipt"),
    "receipt_id": raw.headers.get("receipt-id"),
    "receipt_nonce": raw.headers.get("receipt-nonce"),
    "n": len(emb.data),
    "dim": len(emb.data[0].embedding),
    "models": models,
    "bad_model_status": err,
}))
"#;

async fn proxy_checks(c: &Ctx) {
    let proxy = start_proxy(&c.url, &[&c.policy], &[], &c.dir)
        .unwrap_or_else(|(code, log)| panic!("proxy did not start ({code}):\n{log}"));

    let result: serde_json::Value = if python_openai_available() {
        let out = Command::new("python3")
            .args(["-c", OPENAI_SCRIPT, &proxy.url, MODEL])
            .env("NO_PROXY", "127.0.0.1,localhost")
            .env_remove("OPENAI_BASE_URL")
            .output()
            .expect("python3");
        assert!(
            out.status.success(),
            "openai SDK through the proxy failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    } else {
        eprintln!("python3 + openai not importable: driving the proxy with reqwest");
        let r = client()
            .post(format!("{}/v1/embeddings", proxy.url))
            .json(&json!({"model": MODEL, "input": ["hello through the proxy", "second input"]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let h = |n: &str| r.headers().get(n).map(|v| v.to_str().unwrap().to_string());
        let (verified, sealing, receipt, receipt_id, receipt_nonce) = (
            h("receipt-verified"),
            h("receipt-sealing"),
            h("receipt"),
            h("receipt-id"),
            h("receipt-nonce"),
        );
        let body: serde_json::Value = r.json().await.unwrap();
        let models: serde_json::Value = get_json(&format!("{}/v1/models", proxy.url)).await;
        let bad = client()
            .post(format!("{}/v1/embeddings", proxy.url))
            .json(&json!({"model": "no-such-model", "input": "x"}))
            .send()
            .await
            .unwrap();
        json!({
            "verified": verified, "sealing": sealing, "receipt": receipt,
            "receipt_id": receipt_id, "receipt_nonce": receipt_nonce,
            "n": body["data"].as_array().unwrap().len(),
            "dim": body["data"][0]["embedding"].as_array().unwrap().len(),
            "models": models["data"].as_array().unwrap().iter().map(|m| m["id"].clone()).collect::<Vec<_>>(),
            "bad_model_status": bad.status().as_u16(),
        })
    };
    assert_eq!(result["verified"], "true", "{result}");
    assert_eq!(result["sealing"], "enclave", "{result}");
    assert_eq!(result["n"], 2, "{result}");
    assert_eq!(result["dim"], 384, "{result}");
    assert_eq!(result["models"], json!([MODEL]), "{result}");
    assert_eq!(result["bad_model_status"], 404, "{result}");
    assert_eq!(result["receipt_id"].as_str().unwrap().len(), 32);
    // The receipt the proxy passed on is a real one: it decodes, names the
    // enclave sealing and carries the nonce the proxy chose.
    let receipt = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(result["receipt"].as_str().unwrap())
        .unwrap();
    let (body, _) = proto::receipt::parse_unverified(&receipt).unwrap();
    assert_eq!(body.sealing.as_str(), "enclave");
    assert_eq!(
        body.client_nonce.map(hex::encode),
        result["receipt_nonce"].as_str().map(str::to_string)
    );

    // Errors come back in OpenAI shape.
    let r = client()
        .post(format!("{}/v1/embeddings", proxy.url))
        .header("receipt-nonce", "not hex")
        .json(&json!({"model": MODEL, "input": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_error_shape(&r.json().await.unwrap());
    // An input only the entry stage can refuse (the host sees ciphertext):
    // its error comes back sealed and the proxy opens it.
    let r = client()
        .post(format!("{}/v1/embeddings", proxy.url))
        .json(&json!({"model": MODEL, "input": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let e: serde_json::Value = r.json().await.unwrap();
    assert_error_shape(&e);
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("must not be an empty array"),
        "{e}"
    );
    let r = client()
        .get(format!("{}/v1/nothing-here", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_error_shape(&r.json().await.unwrap());
    drop(proxy);

    // A host that tampers with the sealed answer (here: the last byte, in the
    // receipt trailer): the proxy withholds it. A tampered `receipt` header
    // changes nothing: the proxy checks the receipt sealed inside.
    let relay = tampering_relay(c.url.clone(), Tamper::ReceiptHeader);
    let proxy = start_proxy(&relay, &[&c.policy], &[], &c.dir)
        .unwrap_or_else(|(code, log)| panic!("proxy did not start ({code}):\n{log}"));
    let r = client()
        .post(format!("{}/v1/embeddings", proxy.url))
        .json(&json!({"model": MODEL, "input": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "the sealed-in receipt is the one checked");
    assert_eq!(r.headers()["receipt-verified"], "true");
    drop(proxy);
    let relay = tampering_relay(c.url.clone(), Tamper::LastBodyByte);
    let proxy = start_proxy(&relay, &[&c.policy], &[], &c.dir)
        .unwrap_or_else(|(code, log)| panic!("proxy did not start ({code}):\n{log}"));
    let r = client()
        .post(format!("{}/v1/embeddings", proxy.url))
        .json(&json!({"model": MODEL, "input": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    assert_eq!(r.headers()["receipt-verified"], "false");
    let e: serde_json::Value = r.json().await.unwrap();
    assert_error_shape(&e);
    assert_eq!(e["error"]["code"], "response_unopenable", "{e}");
    drop(proxy);

    // Evidence that does not match the policy: the proxy refuses to start.
    match start_proxy(&c.url, &[&c.bad_policy], &[], &c.dir) {
        Ok(_) => panic!("a proxy must not start against evidence its policy rejects"),
        Err((code, log)) => {
            assert_eq!(code, 1, "{log}");
            assert!(log.contains("refusing to start"), "{log}");
            assert!(log.contains("stage 0"), "{log}");
        }
    }
}

#[tokio::test]
async fn cli_verbs_against_a_real_gateway() {
    let gw = Gateway::start(Options::default());
    let dir = temp_dir("cli");
    let policy_text = client_policy_text(&gw.url).await;
    let policy = dir.join("policy.toml");
    std::fs::write(&policy, &policy_text).unwrap();
    // Stage 0 pinned to another measurement.
    let first =
        policy_text.find("measurements = [\"mock:").unwrap() + "measurements = [\"mock:".len();
    let mut bad_text = policy_text.clone();
    bad_text.replace_range(first..first + 64, &"00".repeat(32));
    let bad_policy = dir.join("bad-policy.toml");
    std::fs::write(&bad_policy, &bad_text).unwrap();
    let nonce = b"cli e2e nonce".to_vec();
    let (evidence_cbor, evidence_json) = save_evidence(&gw.url, &nonce, &dir).await;
    let ctx = Ctx {
        url: gw.url.clone(),
        dir,
        policy,
        bad_policy,
        nonce,
        evidence_cbor,
        evidence_json,
    };
    let t = std::time::Instant::now();
    evidence_checks(&ctx);
    eprintln!("verify evidence: ok ({:?})", t.elapsed());
    receipt_checks(&ctx).await;
    eprintln!("verify receipt: ok ({:?})", t.elapsed());
    seal_open_checks(&ctx).await;
    eprintln!("seal/open: ok ({:?})", t.elapsed());
    resealing_host_checks(&ctx).await;
    eprintln!("resealing host caught: ok ({:?})", t.elapsed());
    proxy_checks(&ctx).await;
    eprintln!("proxy: ok ({:?})", t.elapsed());
    drop(gw);
}
