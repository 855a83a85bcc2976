//! HTTP helpers for the tests: a client, requests and the checks on their answers.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// `POST url` with `body` as JSON and one extra header (panics on a
/// transport error).
pub async fn post_with_header(
    url: &str,
    body: &serde_json::Value,
    (name, value): (&str, &str),
) -> reqwest::Response {
    client()
        .post(url)
        .header(name, value)
        .json(body)
        .send()
        .await
        .unwrap()
}

/// A response's `Retry-After` seconds (panics if absent or not a number).
pub fn retry_after(r: &reqwest::Response) -> u64 {
    r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// `GET /metrics` as text.
pub async fn metrics_text(url: &str) -> String {
    let r = http_get(&format!("{url}/metrics")).await;
    assert_eq!(r.status(), 200);
    r.text().await.unwrap()
}

/// The value of the sample named exactly `name` (with its labels); 0 if absent.
pub fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// A client's policy text: the measurements the gateway reports, pinned,
/// mock allowed (trust on first use: for tests against a local gateway).
pub async fn client_policy_text(url: &str) -> String {
    let ready: serde_json::Value = get_json(&format!("{url}/readyz")).await;
    let mut text = String::from("allow_mock = true\n");
    for s in ready["stages"].as_array().unwrap() {
        text += &format!(
            "[[stages]]\nindex = {}\nlayers = [{}, {}]\nmeasurements = [\"{}\"]\n",
            s["index"],
            s["layers"][0],
            s["layers"][1],
            s["measurement"].as_str().unwrap()
        );
    }
    text
}

/// POSTs a sealed body to `/v1/embeddings` with its sealing headers.
pub async fn post_sealed(
    url: &str,
    headers: &proto::sealing::SealedHeaders,
    body: Vec<u8>,
) -> reqwest::Response {
    let mut rb = client().post(format!("{url}/v1/embeddings")).body(body);
    for (k, v) in headers.to_header_values() {
        rb = rb.header(k, v);
    }
    rb.send().await.unwrap()
}

/// An HTTP client for tests.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

/// POSTs `/v1/embeddings` and returns (status, JSON body).
pub async fn embed(gw_url: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    let r = http_post(&format!("{gw_url}/v1/embeddings"), &body).await;
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}

/// Asserts an OpenAI-shaped error body.
pub fn assert_error_shape(body: &serde_json::Value) {
    let e = &body["error"];
    assert!(e["message"].is_string(), "no error.message in {body}");
    assert!(e["type"].is_string(), "no error.type in {body}");
    assert!(
        e.get("param").is_some() && e.get("code").is_some(),
        "param/code missing in {body}"
    );
}

/// `GET url`, the body (panics on a transport error).
pub async fn get_bytes(url: &str) -> axum::body::Bytes {
    http_get(url).await.bytes().await.unwrap()
}

/// Writes a policy to `path` that pins the measurements `model`'s stages
/// report in `/readyz` (mock allowed), as a client would after checking them
/// out of band; returns `path`.
pub async fn pinned_policy(url: &str, model: &str, path: &Path) -> PathBuf {
    let ready: serde_json::Value = get_json(&format!("{url}/readyz")).await;
    let pipeline = ready["pipelines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["model"] == model)
        .unwrap_or_else(|| panic!("{model} in /readyz: {ready}"));
    let mut text = String::from("allow_mock = true\n");
    for st in pipeline["stages"].as_array().unwrap() {
        text += &format!(
            "[[stages]]\nindex = {}\nlayers = {}\nmeasurements = [{}]\n",
            st["index"], st["layers"], st["measurement"]
        );
    }
    std::fs::write(path, text).unwrap();
    path.to_path_buf()
}

/// A client policy for `model`'s stages (as [`pinned_policy`]) that also
/// pins the model manifest `manifest_bytes`, written to `dir/pinned.toml`.
/// On the way it checks that a policy pinning another manifest makes
/// `gateway proxy` refuse the same stages, naming the digest they serve.
pub async fn manifest_pinned_policy(
    url: &str,
    model: &str,
    manifest_bytes: &[u8],
    dir: &Path,
) -> PathBuf {
    let policy = pinned_policy(url, model, &dir.join("pinned.toml")).await;
    let text = std::fs::read_to_string(&policy).unwrap();
    let manifest_sha = proto::digest::Sha256Digest::of(manifest_bytes).hex();
    let pin = |sha: &str| format!("manifest_sha256 = \"{sha}\"\n{text}");
    let wrong = dir.join("wrong.toml");
    std::fs::write(&wrong, pin(&"00".repeat(32))).unwrap();
    let (_, log) = super::start_proxy(url, &[&wrong], &[], dir)
        .err()
        .expect("a proxy pinning another manifest must refuse these stages");
    assert!(
        log.contains(&format!("serves model manifest {manifest_sha}")),
        "{log}"
    );
    std::fs::write(&policy, pin(&manifest_sha)).unwrap();
    policy
}

/// The ids `GET /v1/models` lists.
pub async fn model_ids(url: &str) -> Vec<String> {
    let models: serde_json::Value = get_json(&format!("{url}/v1/models")).await;
    models["data"]
        .as_array()
        .unwrap_or_else(|| panic!("a model list: {models}"))
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

/// The `data:` payloads of a Server-Sent-Events body, in order.
pub fn sse_events(body: &[u8]) -> Vec<String> {
    String::from_utf8(body.to_vec())
        .unwrap()
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("data event").to_string())
        .collect()
}

/// `GET /v1/attestation?nonce=…` as CBOR: status, `Retry-After`, body.
pub async fn attestation_cbor(url: &str, nonce: &[u8]) -> (u16, Option<String>, Vec<u8>) {
    attestation_cbor_query(url, &format!("nonce={}", hex::encode(nonce))).await
}

/// `GET /v1/attestation?QUERY` as CBOR: status, `Retry-After`, body.
pub async fn attestation_cbor_query(url: &str, query: &str) -> (u16, Option<String>, Vec<u8>) {
    let r = client()
        .get(format!("{url}/v1/attestation?{query}"))
        .header("accept", "application/cbor")
        .send()
        .await
        .unwrap();
    let retry = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    (
        r.status().as_u16(),
        retry,
        r.bytes().await.unwrap().to_vec(),
    )
}

/// The evidence bundle for `nonce` (panics unless 200).
pub async fn evidence_bundle(url: &str, nonce: &[u8]) -> proto::bundle::EvidenceBundle {
    let (status, _, body) = attestation_cbor(url, nonce).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    proto::cbor::from_slice(&body).unwrap()
}

/// Asserts that the gateway at `url` answers a short chat request with 200.
pub async fn assert_chat_serves(url: &str) {
    let (status, b, _) = post_json(
        url,
        "/v1/chat/completions",
        &serde_json::json!({"model": "SmolLM2-135M-Instruct", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}]}),
    )
    .await;
    assert_eq!(status, 200, "{b}");
}

/// POSTs `body` as JSON to `url` + `path`: status, JSON body (null if none)
/// and headers.
pub async fn post_json(
    url: &str,
    path: &str,
    body: &serde_json::Value,
) -> (u16, serde_json::Value, reqwest::header::HeaderMap) {
    let r = http_post(&format!("{url}{path}"), body).await;
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (
        status,
        r.json().await.unwrap_or(serde_json::Value::Null),
        headers,
    )
}

/// GETs `url` and parses the JSON body (panics on any failure).
pub async fn get_json(url: &str) -> serde_json::Value {
    http_get(url).await.json().await.unwrap()
}

/// `GET url` with the test client (panics on a transport error).
pub async fn http_get(url: &str) -> reqwest::Response {
    client().get(url).send().await.unwrap()
}

/// `POST url` with `body` as JSON (panics on a transport error).
pub async fn http_post(url: &str, body: &serde_json::Value) -> reqwest::Response {
    client().post(url).json(body).send().await.unwrap()
}

/// `POST url` with `body`, exact bytes, as JSON, and a `receipt-nonce`
/// header if given (panics on a transport error).
pub async fn post_exact(
    url: &str,
    body: Vec<u8>,
    receipt_nonce: Option<&str>,
) -> reqwest::Response {
    let mut rb = client()
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    if let Some(n) = receipt_nonce {
        rb = rb.header("receipt-nonce", n);
    }
    rb.send().await.unwrap()
}

/// Asserts that `r` is an OpenAI-shaped error with `status` whose message
/// mentions `needle`; returns its body.
pub async fn expect_api_error(
    r: reqwest::Response,
    status: u16,
    needle: &str,
) -> serde_json::Value {
    assert_eq!(r.status(), status);
    let e: serde_json::Value = r.json().await.unwrap();
    assert_error_shape(&e);
    let message = e["error"]["message"].as_str().unwrap();
    assert!(message.contains(needle), "{e}");
    e
}
