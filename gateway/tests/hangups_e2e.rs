//! Clients that hang up mid-request, against the real binaries (issues 29
//! and 34): the work of a request whose client is gone stops in every
//! stage, and a request cancelled while it is being sent to the entry stage
//! disturbs no other request. In a file of their own: they load both cores,
//! which would starve the timing-sensitive tests of `slow_clients_e2e.rs`.

mod common;

use common::{embed, metrics_text, sample, Gateway, Options};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt as _;

/// Issue 34, finding 1: clients that hang up right after uploading a large
/// body (their requests' sends to the entry stage, on the channel every
/// request shares, may be cut short), while other clients keep the
/// pipeline busy: no other request fails and the pipeline never breaks
/// (a reused nonce or a half-written message would tear it down).
#[tokio::test]
async fn clients_hanging_up_after_large_uploads_fail_nothing_else() {
    let gw = Gateway::start(Options::default());
    let addr = gw.url.strip_prefix("http://").unwrap().to_string();
    // Large to send, cheap to compute (inputs are cut at 256 tokens).
    let long = "w ".repeat(300_000);
    let big = json!({"model": "all-MiniLM-L6-v2", "input": vec![long; 8]}).to_string();
    assert!(big.len() > 4 << 20);
    let mut steady = Vec::new();
    for t in 0..4 {
        let url = gw.url.clone();
        steady.push(tokio::spawn(async move {
            for i in 0..12 {
                let text = format!("steady client {t}, request {i}");
                let (s, b) = embed(&url, json!({"model": "all-MiniLM-L6-v2", "input": text})).await;
                assert_eq!(s, 200, "a steady client's request failed: {b}");
            }
        }));
    }
    for _ in 0..12 {
        let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
        conn.write_all(
            format!(
                "POST /v1/embeddings HTTP/1.1\r\nhost: {addr}\r\n\
                 content-type: application/json\r\ncontent-length: {}\r\n\r\n",
                big.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        conn.write_all(big.as_bytes()).await.unwrap();
        let _ = conn.shutdown().await;
        drop(conn);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for t in steady {
        t.await.unwrap();
    }
    let m = metrics_text(&gw.url).await;
    assert_eq!(sample(&m, "gateway_pipeline_reconnects_total"), 0.0);
    assert!(!gw.log().contains("pipeline broken"), "{}", gw.log());
    let (s, b) = embed(
        &gw.url,
        json!({"model": "all-MiniLM-L6-v2", "input": "after"}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
}

/// Issue 29, finding 3: clients that send 2,048-input embeddings requests
/// and hang up. Every stage stops computing their rows within about a
/// second (the entry stage drops the queued rows of a cancelled request
/// before computing them and tells the later stages, which skip its rows),
/// instead of computing all of them for nobody.
#[tokio::test]
async fn large_requests_that_hang_up_leave_the_stages_idle() {
    let gw = Gateway::start(Options::default());
    let addr = gw.url.strip_prefix("http://").unwrap().to_string();
    let inputs: Vec<String> = (0..2048)
        .map(|i| format!("sentence {i} of a request that nobody will wait for, long enough"))
        .collect();
    let big = json!({"model": "all-MiniLM-L6-v2", "input": inputs}).to_string();
    let batches = |m: &str, stage: u32| {
        sample(
            m,
            &format!("gateway_stage_batches_total{{pipeline=\"embeddings\",stage=\"{stage}\"}}"),
        )
    };
    let before = batches(&metrics_text(&gw.url).await, 1);
    let mut conns = Vec::new();
    for _ in 0..4 {
        let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
        conn.write_all(
            format!(
                "POST /v1/embeddings HTTP/1.1\r\nhost: {addr}\r\n\
                 content-type: application/json\r\ncontent-length: {}\r\n\r\n{big}",
                big.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        conns.push(conn);
    }
    // The last stage is at work on them; then every client hangs up.
    let deadline = Instant::now() + Duration::from_secs(60);
    while batches(&metrics_text(&gw.url).await, 1) < before + 4.0 {
        assert!(Instant::now() < deadline, "the stages never started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(conns);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let m = metrics_text(&gw.url).await;
    let (a0, a1) = (batches(&m, 0), batches(&m, 1));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let m = metrics_text(&gw.url).await;
    assert_eq!(
        (batches(&m, 0), batches(&m, 1)),
        (a0, a1),
        "the stages kept computing rows of requests whose clients hung up"
    );
    let (s, b) = embed(
        &gw.url,
        json!({"model": "all-MiniLM-L6-v2", "input": "next"}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
}
