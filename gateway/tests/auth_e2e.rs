//! API keys end to end: the real gateway with `[auth] enabled`, keys from
//! the config (as digests) and from `GATEWAY_API_KEYS`, per-key rate and
//! concurrency limits.

mod common;

use common::{
    assert_error_shape, client, completions_options, http_post, retry_after, Gateway, Options,
};
use serde_json::json;
use std::io::Write as _;
use std::time::{Duration, Instant};

const MODEL: &str = "all-MiniLM-L6-v2";
const TEAM: &str = "tok-team-a-7d1e0c55";
const SLOW: &str = "tok-slow-b-93ab4f10";
const NARROW: &str = "tok-narrow-c-5e22d8";
const ENV: &str = "tok-env-d-c0ffee42";
const WRONG: &str = "sk-wrong-token-marker-51b7";

fn sha(token: &str) -> String {
    proto::digest::Sha256Digest::of(token.as_bytes()).hex()
}

fn auth_table() -> String {
    format!(
        "[auth]\nenabled = true\nkeys = [\n  {{ name = \"team-a\", sha256 = \"{}\" }},\n  {{ name = \"slow-b\", sha256 = \"{}\", requests_per_minute = 2 }},\n  {{ name = \"narrow-c\", sha256 = \"{}\", max_concurrent = 1 }},\n]\n",
        sha(TEAM),
        sha(SLOW),
        sha(NARROW)
    )
}

async fn get(url: &str, token: Option<&str>) -> reqwest::Response {
    let mut rb = client().get(url);
    if let Some(t) = token {
        rb = rb.bearer_auth(t);
    }
    rb.send().await.unwrap()
}

/// Waits (10 s at most) until the narrow key's only slot is free again.
async fn slot_released(models: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = get(models, Some(NARROW)).await.status();
        if s == 200 {
            return;
        }
        assert!(Instant::now() < deadline, "slot not released: {s}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn error_body(r: reqwest::Response, status: u16, code: &str) -> serde_json::Value {
    assert_eq!(r.status().as_u16(), status);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_error_shape(&body);
    assert_eq!(body["error"]["code"], code, "{body}");
    assert!(body["error"]["param"].is_null(), "{body}");
    body
}

/// Issue 29, item 6: a receipt is read back by the API key that made the
/// request only; another key gets the 404 of an unknown id, and so never
/// the salt of the receipt's digests.
#[tokio::test]
async fn receipts_are_read_back_by_their_own_key_only() {
    let gw = Gateway::start(Options {
        extra: auth_table(),
        env: vec![("GATEWAY_API_KEYS".into(), format!("env-d:{ENV}"))],
        ..Options::default()
    });
    let r = client()
        .post(format!("{}/v1/embeddings", gw.url))
        .bearer_auth(TEAM)
        .json(&json!({"model": MODEL, "input": "whose receipt"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let id = r.headers()["receipt-id"].to_str().unwrap().to_string();
    let salt = r.headers()["receipt-digest-salt"]
        .to_str()
        .unwrap()
        .to_string();
    let url = format!("{}/v1/receipts/{id}", gw.url);
    let own = get(&url, Some(TEAM)).await;
    assert_eq!(own.status(), 200);
    assert_eq!(own.headers()["receipt-digest-salt"], salt.as_str());
    for other in [ENV, SLOW] {
        let r = get(&url, Some(other)).await;
        assert!(r.headers().get("receipt-digest-salt").is_none());
        let b = error_body(r, 404, "receipt_not_found").await;
        assert!(!b.to_string().contains(&salt), "{b}");
    }
}

#[tokio::test]
async fn keys_limits_and_open_routes() {
    let gw = Gateway::start(Options {
        extra: auth_table(),
        env: vec![("GATEWAY_API_KEYS".into(), format!("env-d:{ENV}"))],
        ..Options::default()
    });
    let models = format!("{}/v1/models", gw.url);

    // No key, a wrong key, another scheme: 401 in OpenAI's shape, token not echoed.
    let r = get(&models, None).await;
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    let b = error_body(r, 401, "invalid_api_key").await;
    assert_eq!(b["error"]["type"], "invalid_request_error");
    let b = error_body(get(&models, Some(WRONG)).await, 401, "invalid_api_key").await;
    assert!(!b.to_string().contains(WRONG), "{b}");
    let r = client()
        .get(&models)
        .header("authorization", format!("Basic {TEAM}"))
        .send()
        .await
        .unwrap();
    error_body(r, 401, "invalid_api_key").await;
    let r = http_post(
        &format!("{}/v1/embeddings", gw.url),
        &json!({"model": MODEL, "input": "no key"}),
    )
    .await;
    error_body(r, 401, "invalid_api_key").await;

    // The right key works, on every keyed route.
    let r = client()
        .post(format!("{}/v1/embeddings", gw.url))
        .bearer_auth(TEAM)
        .json(&json!({"model": MODEL, "input": "with a key"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let receipt_id = r.headers()["receipt-id"].to_str().unwrap().to_string();
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["data"][0]["embedding"].as_array().unwrap().len(), 384);
    let receipt_url = format!("{}/v1/receipts/{receipt_id}", gw.url);
    assert_eq!(get(&receipt_url, None).await.status(), 401);
    assert_eq!(get(&receipt_url, Some(TEAM)).await.status(), 200);
    let model_url = format!("{}/v1/models/{MODEL}", gw.url);
    assert_eq!(get(&model_url, Some(TEAM)).await.status(), 200);
    assert_eq!(get(&models, Some(TEAM)).await.status(), 200);

    // A key from GATEWAY_API_KEYS works too.
    assert_eq!(get(&models, Some(ENV)).await.status(), 200);

    // What clients need before trusting us, and operators' probes, stay open.
    for path in [
        "/healthz",
        "/readyz",
        "/metrics",
        "/.well-known/hpke-keys",
        "/v1/attestation?nonce=00",
    ] {
        let r = get(&format!("{}{path}", gw.url), None).await;
        assert_eq!(r.status(), 200, "{path} should not need a key");
    }

    // requests_per_minute = 2: the third request in a burst gets 429.
    assert_eq!(get(&models, Some(SLOW)).await.status(), 200);
    assert_eq!(get(&models, Some(SLOW)).await.status(), 200);
    let r = get(&models, Some(SLOW)).await;
    let retry = retry_after(&r);
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    let b = error_body(r, 429, "rate_limit_exceeded").await;
    assert!(b["error"]["message"].as_str().unwrap().contains("slow-b"));
    // Other keys are not affected.
    assert_eq!(get(&models, Some(TEAM)).await.status(), 200);

    // max_concurrent = 1: hold one request open (its body never finishes),
    // and a second one with the same key gets 429.
    let addr = gw.url.strip_prefix("http://").unwrap().to_string();
    let mut held = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        held,
        "POST /v1/embeddings HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {NARROW}\r\n\
         content-type: application/json\r\ncontent-length: 1000\r\n\r\n{{\"model\":"
    )
    .unwrap();
    held.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let r = loop {
        let r = get(&models, Some(NARROW)).await;
        if r.status() == 429 || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(r.headers()["retry-after"], "1");
    error_body(r, 429, "rate_limit_exceeded").await;
    assert_eq!(get(&models, Some(TEAM)).await.status(), 200);
    let m = get(&format!("{}/metrics", gw.url), None)
        .await
        .text()
        .await
        .unwrap();
    let in_flight: i64 = sample(&m, "gateway_http_requests_in_flight").unwrap() as i64;
    assert!(in_flight >= 2, "the held request and this one: {in_flight}");
    // Closing the held request frees the slot.
    drop(held);
    slot_released(&models).await;

    // Refusals are counted by reason; no token or digest appears in the
    // metrics or the log.
    let m = get(&format!("{}/metrics", gw.url), None)
        .await
        .text()
        .await
        .unwrap();
    for (reason, at_least) in [
        ("missing_key", 3.0),
        ("invalid_key", 1.0),
        ("rate_limited", 1.0),
        ("concurrency_limited", 1.0),
    ] {
        let v = sample(
            &m,
            &format!("gateway_auth_rejections_total{{reason=\"{reason}\"}}"),
        )
        .unwrap();
        assert!(v >= at_least, "{reason}: {v}");
    }
    let v = sample(
        &m,
        "gateway_http_requests_total{endpoint=\"/v1/models\",status=\"401\"}",
    )
    .unwrap();
    assert!(v >= 2.0);
    let log = gw.log();
    for secret in [TEAM, SLOW, NARROW, ENV, WRONG] {
        for text in [&m, &log] {
            assert!(!text.contains(secret));
            assert!(!text.contains(&sha(secret)));
        }
    }
}

/// The value of the sample named exactly `name` (with its labels).
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
async fn bad_auth_config_is_refused_naming_the_key() {
    let stderr = Gateway::refused_with(
        "[auth]\nenabled = true\nkeys = [{ name = \"x\", sha256 = \"abc\" }]\n",
        &[],
        "must refuse",
    );
    assert!(stderr.contains("auth.keys[0].sha256"), "{stderr}");

    let stderr = Gateway::refused_with("[auth]\nenabled = true\n", &[], "must refuse");
    assert!(stderr.contains("GATEWAY_API_KEYS"), "{stderr}");

    let stderr = Gateway::refused_with(
        "[auth]\nenabled = true\n",
        &[("GATEWAY_API_KEYS", WRONG)],
        "must refuse",
    );
    assert!(stderr.contains("GATEWAY_API_KEYS: entry 0"), "{stderr}");
    assert!(!stderr.contains(WRONG), "{stderr}");
}

#[test]
fn hash_key_prints_the_digest() {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_gateway"))
        .arg("hash-key")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    writeln!(child.stdin.take().unwrap(), "{TEAM}").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap().trim(), sha(TEAM));
}

/// Issue 18, finding 3: a key's `max_concurrent` counts a streamed answer
/// until the stream ends, not only until its headers went out: 200 more
/// streams under the key are all refused while one runs.
#[tokio::test]
async fn a_stream_holds_its_keys_concurrency_slot_until_it_ends() {
    let mut opts = completions_options(&[[0, 30]], "");
    opts.extra += &auth_table();
    let gw = Gateway::start(opts);
    let models = format!("{}/v1/models", gw.url);
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.url))
        .bearer_auth(NARROW)
        .json(
            &json!({"model": "SmolLM2-135M-Instruct", "max_tokens": 2000, "stream": true,
                      "temperature": 1.0, "logit_bias": {"2": -100},
                      "messages": [{"role": "user", "content": "Tell me a long story."}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut stream = r.bytes_stream();
    use futures_util::StreamExt as _;
    stream.next().await.expect("first chunk").unwrap();
    // The stream is running: the key's only slot is taken, for 200 more
    // streams sent at once as for a plain request.
    error_body(get(&models, Some(NARROW)).await, 429, "rate_limit_exceeded").await;
    let url = format!("{}/v1/chat/completions", gw.url);
    let tries = (0..200).map(|i| {
        let url = url.clone();
        async move {
            let r = client()
                .post(url)
                .bearer_auth(NARROW)
                .json(&json!({"model": "SmolLM2-135M-Instruct", "max_tokens": 8,
                              "stream": true, "seed": i,
                              "messages": [{"role": "user", "content": "Hi"}]}))
                .send()
                .await
                .unwrap();
            r.status().as_u16()
        }
    });
    let statuses = futures_util::future::join_all(tries).await;
    assert!(
        statuses.iter().all(|&s| s == 429),
        "a second stream ran under max_concurrent = 1: {:?}",
        statuses.iter().filter(|&&s| s != 429).collect::<Vec<_>>()
    );
    assert_eq!(get(&models, Some(TEAM)).await.status(), 200);
    // The client goes away: the slot is free again.
    drop(stream);
    slot_released(&models).await;
}
