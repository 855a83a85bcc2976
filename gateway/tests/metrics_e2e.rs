//! `/metrics` end to end: counters move with requests, stage health is
//! reported, and no request content, path ids or tokens become labels.

mod common;

use common::{client, embed, get_bytes, http_get, post_sealed, sample, Gateway, Options};
use proto::sealing::{seal_request, Aead, KeyConfig};
use serde_json::json;

const MODEL: &str = "all-MiniLM-L6-v2";
const MARKER: &str = "MARKER-9c41e7-never-in-metrics";

async fn metrics(url: &str) -> String {
    let r = http_get(&format!("{url}/metrics")).await;
    assert_eq!(r.status(), 200);
    let ct = r.headers()["content-type"].to_str().unwrap().to_string();
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    r.text().await.unwrap()
}

#[tokio::test]
async fn counters_move_stages_are_up_and_no_content_leaks() {
    let gw = Gateway::start(Options::default());
    let before = metrics(&gw.url).await;
    assert_eq!(sample(&before, "gateway_pipeline_ready"), 1.0);
    assert_eq!(sample(&before, "gateway_stage_up{stage=\"0\"}"), 1.0);
    assert_eq!(sample(&before, "gateway_stage_up{stage=\"1\"}"), 1.0);
    assert!(before.contains("# TYPE gateway_http_request_duration_seconds histogram"));
    assert!(before.contains("gateway_attestation_failures_total 0"));
    assert!(before.contains("gateway_pipeline_reconnects_total 0"));

    // A plain request carrying the marker in its input, its receipt nonce
    // and an Authorization header (auth is off: ignored, never recorded).
    let r = client()
        .post(format!("{}/v1/embeddings", gw.url))
        .bearer_auth(MARKER)
        .header("receipt-nonce", hex::encode(MARKER))
        .json(&json!({"model": MODEL, "input": [MARKER, "second"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // The marker in paths: an unknown model, a receipt id, an unknown route.
    let (s, _) = embed(&gw.url, json!({"model": MARKER, "input": "x"})).await;
    assert_eq!(s, 404);
    for path in [
        format!("/v1/models/{MARKER}"),
        format!("/v1/receipts/{MARKER}"),
        format!("/{MARKER}"),
    ] {
        let r = http_get(&format!("{}{path}", gw.url)).await;
        assert_eq!(r.status(), 404, "{path}");
    }

    // Sealed to the enclave key and to the gateway key.
    let keys = get_bytes(&format!("{}/.well-known/hpke-keys", gw.url)).await;
    for key in KeyConfig::decode_list(&keys).unwrap() {
        let body = serde_json::to_vec(&json!({"model": MODEL, "input": MARKER})).unwrap();
        let (headers, sealed, _) = seal_request(&key, Aead::Aes128Gcm, &body).unwrap();
        let r = post_sealed(&gw.url, &headers, sealed).await;
        assert_eq!(r.status(), 200);
    }

    let after = metrics(&gw.url).await;
    let emb = "gateway_http_requests_total{endpoint=\"/v1/embeddings\",status=\"200\"}";
    assert_eq!(sample(&after, emb) - sample(&before, emb), 3.0, "{after}");
    let emb404 = "gateway_http_requests_total{endpoint=\"/v1/embeddings\",status=\"404\"}";
    assert_eq!(sample(&after, emb404), 1.0);
    assert_eq!(
        sample(
            &after,
            "gateway_http_requests_total{endpoint=\"/v1/models/{id}\",status=\"404\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &after,
            "gateway_http_requests_total{endpoint=\"/v1/receipts/{id}\",status=\"404\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &after,
            "gateway_http_requests_total{endpoint=\"unmatched\",status=\"404\"}"
        ),
        1.0
    );
    let count = "gateway_http_request_duration_seconds_count{endpoint=\"/v1/embeddings\"}";
    assert_eq!(sample(&after, count), 4.0);
    let inf =
        "gateway_http_request_duration_seconds_bucket{endpoint=\"/v1/embeddings\",le=\"+Inf\"}";
    assert_eq!(sample(&after, inf), 4.0);
    assert!(
        sample(
            &after,
            "gateway_http_request_duration_seconds_sum{endpoint=\"/v1/embeddings\"}"
        ) > 0.0
    );
    for sealing in ["plain", "enclave", "gateway"] {
        let name = format!("gateway_embeddings_requests_by_sealing_total{{sealing=\"{sealing}\"}}");
        let want = if sealing == "plain" { 2.0 } else { 1.0 };
        assert_eq!(sample(&after, &name), want, "{name}");
    }
    assert_eq!(sample(&after, "gateway_receipts_issued_total"), 3.0);
    // Only this scrape is in flight.
    assert_eq!(sample(&after, "gateway_http_requests_in_flight"), 1.0);
    assert_eq!(sample(&after, "gateway_stage_up{stage=\"1\"}"), 1.0);

    assert!(!after.contains(MARKER), "marker in /metrics:\n{after}");
    assert!(!after.contains(&hex::encode(MARKER)));
    // Every line is a comment or `name{labels} number`.
    for l in after.lines().filter(|l| !l.starts_with('#')) {
        let (_, v) = l.rsplit_once(' ').unwrap();
        assert!(v.parse::<f64>().is_ok(), "bad sample line {l:?}");
    }
}
