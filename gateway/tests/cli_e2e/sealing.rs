//! `seal` → HTTP → `open` sections, and the host that re-seals.

use super::{open_cli, verify_receipt, Ctx, MODEL};
use crate::common::{cli, client, get_bytes, p, seal_cli, serve_on_thread};
use base64::Engine as _;
use serde_json::json;
use std::path::Path;

/// Sends what `gateway seal` wrote, as `curl --data-binary @BODY -H @HEADERS` would.
pub(super) async fn post_sealed(url: &str, body: &Path, headers: &Path) -> reqwest::Response {
    let mut rb = client()
        .post(format!("{url}/v1/embeddings"))
        .body(std::fs::read(body).unwrap());
    for line in std::fs::read_to_string(headers).unwrap().lines() {
        let (k, v) = line.split_once(':').expect("name: value");
        rb = rb.header(k.trim(), v.trim());
    }
    rb.send().await.unwrap()
}

pub(super) async fn seal_open_checks(c: &Ctx) {
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
    let (code, out, err) = seal_cli(
        &["--gateway", &c.url, "--policy", p(&c.policy)],
        [&req, &body, &headers, &key],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(!err.contains("WARN keys"), "keys come from evidence: {err}");
    let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the client key file is secret");
    let header_text = std::fs::read_to_string(&headers).unwrap();
    for name in [
        "hpke-key-id:",
        "hpke-aead: 1",
        "hpke-encapsulated-key:",
        "hpke-sealed-at:",
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
    let (code, out, err) = open_cli(&key, &resp, &["--out", p(&plain)]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&plain).unwrap()).unwrap();
    assert_eq!(v["data"][0]["embedding"].as_array().unwrap().len(), 384);
    // `--out -` (the default) writes to stdout.
    let (code, out, _) = open_cli(&key, &resp, &[]);
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
    // `open` kept the salt of the receipt's digests (only inside the sealed
    // response) in the key file; without it the bytes cannot be checked.
    let key_json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&key).unwrap()).unwrap();
    let salt = key_json["digest_salt"].as_str().unwrap().to_string();
    assert_eq!(salt.len(), 64, "{key_json}");
    let (code, out, _) = cli(&[&base[..], &["--nonce", &receipt_nonce]].concat());
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("[digest_salt_missing]"), "{out}");
    let (code, out, err) = cli(&[
        &base[..],
        &["--nonce", &receipt_nonce, "--digest-salt", &salt],
    ]
    .concat());
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
    let (code, _, err) = open_cli(&key, &replay, &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("not sealed"), "{err}");

    // Issue 29, finding 9: a request the enclave opens and then refuses
    // gets an error sealed to the client: `open` writes it out for the
    // user but exits non-zero.
    let bad = dir.join("bad-req.json");
    std::fs::write(&bad, br#"{"model": "no-such-model", "input": "x"}"#).unwrap();
    let (bad_body, bad_headers, bad_key, bad_resp) = (
        dir.join("bad-body.bin"),
        dir.join("bad-headers.txt"),
        dir.join("bad-key.json"),
        dir.join("bad-resp.bin"),
    );
    let (code, out, err) = seal_cli(
        &["--gateway", &c.url, "--policy", p(&c.policy)],
        [&bad, &bad_body, &bad_headers, &bad_key],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    let r = post_sealed(&c.url, &bad_body, &bad_headers).await;
    assert_eq!(r.status(), 404);
    std::fs::write(&bad_resp, r.bytes().await.unwrap()).unwrap();
    let (code, out, err) = open_cli(&bad_key, &bad_resp, &[]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(err.contains("the enclave answered with an error"), "{err}");
    assert!(
        out.contains("no-such-model"),
        "the sealed error is written: {out}"
    );

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
            "--keys",
            p(&keys_path),
            "--key-id",
            &key_id,
            "--aead",
            "chacha20poly1305",
            "--no-receipt-nonce",
        ];
        if insecure {
            args.push("--insecure-unverified-keys");
        }
        seal_cli(&args, [&req, &body, &headers, &key])
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
    let (code, out, err) = open_cli(&key, &resp, &[]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["model"], MODEL);

    // Evidence that does not verify: `seal` refuses to use its keys.
    let (code, _, err) = seal_cli(
        &[
            "--evidence",
            p(&c.evidence_cbor),
            "--policy",
            p(&c.bad_policy),
        ],
        [&req, &body, &headers, &key],
    );
    assert_ne!(code, 0);
    assert!(err.contains("refusing to seal"), "{err}");
}

/// A dishonest host: it publishes a key of its own under the entry stage's
/// key id at `/.well-known/hpke-keys`, opens every sealed POST with it, seals
/// the plaintext again to the real entry stage (with the client's receipt
/// nonce, so the receipt says `sealing: enclave`), and re-seals the stage's
/// response and receipt trailer to the client. Runs on its own thread.
pub(super) fn resealing_host(upstream: String, entry_key_id: u8) -> String {
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
pub(super) async fn resealing_host_checks(c: &Ctx) {
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
    let (code, out, err) = seal_cli(
        &["--insecure-unverified-keys", "--gateway", &host],
        [&req, &body, &headers, &key],
    );
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
    let (code, out, err) = open_cli(
        &key,
        &resp,
        &["--out", p(&plain), "--receipt-out", p(&receipt)],
    );
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(err.contains("the host opened the request"), "{err}");
    assert!(!plain.exists(), "nothing written");
    // `verify receipt` with the client key fails on `sealing`.
    // No response kept here: the resealing host's answer is not opened, so
    // neither is the salt of the receipt's digests, without which the
    // request bytes cannot be checked either.
    let mut args = vec!["--receipt-b64", &receipt_b64, "--insecure-partial"];
    let (code, out, err) = verify_receipt(&c.evidence_cbor, &c.policy, &args);
    assert_eq!(code, 0, "without the client key it verifies: {out}\n{err}");
    assert!(out.contains("WARN sealing: NOT PROVEN"), "{out}");
    args.extend(["--client-key", p(&key)]);
    let (code, out, err) = verify_receipt(&c.evidence_cbor, &c.policy, &args);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("FAIL sealing"), "{out}");
    assert!(out.contains("sealing_mismatch"), "{out}");
    assert!(!out.contains("INFO sealing: enclave"), "{out}");
}
