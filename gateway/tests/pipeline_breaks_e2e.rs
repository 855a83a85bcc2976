//! Requests caught in a pipeline break (issue 15): the stages that survive
//! a break free everything those requests held, so repeated breaks leave
//! their memory flat.

mod common;

use common::{
    assert_chat_serves, completions_options, http_get, http_post, metrics_text, sample, signal,
    Gateway,
};
use serde_json::json;
use std::time::{Duration, Instant};

const REQUESTS_0: &str = "gateway_stage_requests{pipeline=\"completions\",stage=\"0\"}";
const SEQS_0: &str = "gateway_stage_active_sequences{pipeline=\"completions\",stage=\"0\"}";
const KV_0: &str = "gateway_stage_kv_cache_tokens{pipeline=\"completions\",stage=\"0\"}";

/// The pid of completions stage `index` (a child of the gateway started
/// with the SmolLM2 model folder).
fn completions_stage(gw: &Gateway, index: u32) -> u32 {
    gw.stage_pids()
        .into_iter()
        .find(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
            let smol = args.iter().any(|a| a.ends_with(b"smollm2-135m-instruct"));
            let at = args.iter().position(|a| *a == b"--stage-index");
            smol && at.is_some_and(|i| args.get(i + 1) == Some(&index.to_string().as_bytes()))
        })
        .unwrap_or_else(|| panic!("no completions stage {index}"))
}

/// Polls `/metrics` until `done` holds (60 s at most).
async fn wait_metrics(gw: &Gateway, what: &str, done: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = metrics_text(&gw.url).await;
        if done(&m) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: requests {}, sequences {}, KV {}\n{}",
            sample(&m, REQUESTS_0),
            sample(&m, SEQS_0),
            sample(&m, KV_0),
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Kills the exit stage of a 2-stage completions pipeline in the middle of
/// a long stream, three times. Each time the stream ends (it does not
/// hang), the gateway rebuilds the pipeline, and the entry stage, which
/// survived, holds no request, sequence or KV-cache token of it.
#[tokio::test]
async fn surviving_stages_free_requests_caught_in_a_break() {
    let gw = Gateway::start(completions_options(&[[0, 15], [15, 30]], ""));
    let entry = completions_stage(&gw, 0);
    for round in 0..3 {
        let url = gw.url.clone();
        let stream = tokio::spawn(async move {
            let r = http_post(
                &format!("{url}/v1/chat/completions"),
                &json!({"model": "SmolLM2-135M-Instruct", "stream": true, "n": 2,
                    "max_tokens": 2000, "temperature": 1.0,
                    "logit_bias": {"2": -100, "0": -100},
                    "messages": [{"role": "user", "content": "Tell me a long story."}]}),
            )
            .await;
            assert_eq!(r.status(), 200);
            r.bytes().await.map(|b| b.to_vec()).unwrap_or_default()
        });
        wait_metrics(&gw, "the stream never started", |m| {
            sample(m, SEQS_0) >= 2.0
        })
        .await;
        signal(completions_stage(&gw, 1), "KILL");
        let body = tokio::time::timeout(Duration::from_secs(30), stream)
            .await
            .unwrap_or_else(|_| panic!("round {round}: the stream hung after the break"))
            .unwrap();
        assert!(
            !String::from_utf8_lossy(&body).contains("[DONE]"),
            "round {round}: a broken stream ended as if complete"
        );
        // Rebuilt, with the same entry stage, which holds nothing of it.
        let deadline = Instant::now() + Duration::from_secs(60);
        while http_get(&format!("{}/readyz", gw.url)).await.status() != 200 {
            assert!(
                Instant::now() < deadline,
                "round {round}: not rebuilt:\n{}",
                gw.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        wait_metrics(&gw, "not freed after the break", |m| {
            m.contains(SEQS_0)
                && sample(m, REQUESTS_0) == 0.0
                && sample(m, SEQS_0) == 0.0
                && sample(m, KV_0) == 0.0
        })
        .await;
        assert_eq!(
            completions_stage(&gw, 0),
            entry,
            "the entry stage restarted"
        );
    }
    // And the rebuilt pipeline serves.
    assert_chat_serves(&gw.url).await;
}
