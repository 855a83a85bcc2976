//! Fault injection end to end. Needs the stage built with the test-only
//! `fault-injection` feature (`scripts/test.sh` builds it so).

mod common;

use common::{
    assert_error_shape, cosine, embed, fault_env, get_bytes, http_get, http_post, max_diff,
    post_sealed, reference, retry_after, signal, slow_stage, vectors, Gateway, Options,
};
use serde_json::json;

const MODEL: &str = "all-MiniLM-L6-v2";

/// A text of exactly 37 tokens with [CLS]/[SEP] ("hello" is one token).
fn poison() -> String {
    vec!["hello"; 35].join(" ")
}

async fn fault_isolation_at(stage: u32, panic: bool) {
    let (texts, _, refs) = reference();
    let mut env = vec![("STAGE_FAULT_TOKENS", "37")];
    if panic {
        env.push(("STAGE_FAULT_PANIC", "1"));
    }
    let gw = Gateway::start_faulty(Options {
        env: fault_env(stage, &env),
        ..Options::default()
    });
    let (s, b) = embed(&gw.url, json!({"model": MODEL, "input": poison()})).await;
    assert_eq!(s, 500, "the poisoned request must fail: {b}");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&format!("stage {stage}")),
        "{b}"
    );

    // Clean baseline of the other requests.
    let clean: Vec<Vec<f32>> = {
        let (s, b) = embed(&gw.url, json!({"model": MODEL, "input": texts[..12]})).await;
        assert_eq!(s, 200, "{b}");
        vectors(&b)
    };
    // Now the poisoned request races with the others, many times, so that it
    // shares micro-batches with them.
    for round in 0..3 {
        let mut handles = Vec::new();
        for (i, t) in texts[..12].iter().enumerate() {
            let url = gw.url.clone();
            let t = t.clone();
            handles.push(tokio::spawn(async move {
                (i, embed(&url, json!({"model": MODEL, "input": t})).await)
            }));
            if i == 5 {
                let url = gw.url.clone();
                handles.push(tokio::spawn(async move {
                    (
                        usize::MAX,
                        embed(&url, json!({"model": MODEL, "input": ["fine", poison()]})).await,
                    )
                }));
            }
        }
        for h in handles {
            let (i, (s, b)) = h.await.unwrap();
            if i == usize::MAX {
                assert_eq!(s, 500, "round {round}: poisoned request must fail: {b}");
                assert_error_shape(&b);
                continue;
            }
            assert_eq!(s, 200, "round {round}: item {i}: {b}");
            let v = &vectors(&b)[0];
            assert!(
                max_diff(v, &clean[i]) < 1e-5,
                "round {round}: item {i} changed by another request's fault"
            );
            assert!(cosine(v, &refs[i]) >= 0.9999);
        }
    }
    // Nothing stale is left in the channels: the next batch is exactly the clean one.
    let (s, b) = embed(&gw.url, json!({"model": MODEL, "input": texts[..12]})).await;
    assert_eq!(s, 200);
    for (i, v) in vectors(&b).iter().enumerate() {
        assert!(
            max_diff(v, &clean[i]) < 1e-6,
            "item {i} differs after faults"
        );
    }
}

#[tokio::test]
async fn a_fault_in_stage_1_fails_only_its_request() {
    fault_isolation_at(1, false).await;
}

#[tokio::test]
async fn a_fault_in_stage_0_fails_only_its_request() {
    fault_isolation_at(0, false).await;
}

/// Issue 47, item 8: a panic in an embedding stage's micro-batch fails the
/// request whose row caused it, like an error; the compute thread (and so
/// every other request of the stage) lives on.
#[tokio::test]
async fn a_panic_in_a_micro_batch_fails_only_its_request() {
    fault_isolation_at(1, true).await;
}

#[tokio::test]
async fn slow_pipeline_gives_504() {
    let gw = Gateway::start_faulty(slow_stage("2500", "request_timeout_secs = 1\n"));
    let (s, b) = embed(&gw.url, json!({"model": MODEL, "input": "slow"})).await;
    assert_eq!(s, 504, "{b}");
    assert_error_shape(&b);
}

#[tokio::test]
async fn killed_stage_gives_503_then_recovers() {
    let gw = Gateway::start_faulty(slow_stage("1500", ""));
    let stages = gw.stage_pids();
    assert_eq!(stages.len(), 2);
    let url = gw.url.clone();
    let inflight =
        tokio::spawn(
            async move { embed(&url, json!({"model": MODEL, "input": "in flight"})).await },
        );
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    signal(stages[1], "KILL");
    let (s, b) = tokio::time::timeout(std::time::Duration::from_secs(10), inflight)
        .await
        .expect("an in-flight request must not hang when a stage dies")
        .unwrap();
    assert_eq!(s, 503, "{b}");
    assert_error_shape(&b);
    let (s, b) = embed(&gw.url, json!({"model": MODEL, "input": "after"})).await;
    assert_eq!(s, 503, "{b}");
    let r = http_get(&format!("{}/readyz", gw.url)).await;
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));

    // The gateway restarts the stage and rebuilds the pipeline by itself.
    let mut ready = false;
    for _ in 0..120 {
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        let r = http_get(&format!("{}/readyz", gw.url)).await;
        if r.status() == 200 {
            ready = true;
            break;
        }
    }
    assert!(ready, "pipeline did not recover:\n{}", gw.log());
    let new_stages = gw.stage_pids();
    assert_eq!(new_stages.len(), 2);
    assert!(
        !new_stages.contains(&stages[1]),
        "stage 1 must be a new process"
    );
    let (texts, _, refs) = reference();
    let (s, b) = embed(&gw.url, json!({"model": MODEL, "input": texts[0]})).await;
    assert_eq!(s, 200, "{b}");
    assert!(cosine(&vectors(&b)[0], &refs[0]) >= 0.9999);
}

/// Issue 18, finding 2: a full replay guard answers 503 + Retry-After (not
/// an unsealed 400), and requests the host sealed (plain clients) fill a
/// partition of their own, so a client's sealed request still gets in.
#[tokio::test]
async fn a_full_replay_guard_asks_to_retry_and_keeps_room_for_sealed_clients() {
    let gw = Gateway::start_faulty(Options {
        env: fault_env(0, &[("STAGE_FAULT_HOST_REPLAY_CAPACITY", "2")]),
        ..Options::default()
    });
    for _ in 0..2 {
        let (s, b) = embed(&gw.url, json!({"model": MODEL, "input": "plain"})).await;
        assert_eq!(s, 200, "{b}");
    }
    let r = http_post(
        &format!("{}/v1/embeddings", gw.url),
        &json!({"model": MODEL, "input": "one too many"}),
    )
    .await;
    assert_eq!(r.status(), 503);
    let retry = retry_after(&r);
    let window = proto::sealing::REPLAY_WINDOW.as_secs();
    assert!((1..=window).contains(&retry), "{retry} (window {window})");
    let b: serde_json::Value = r.json().await.unwrap();
    assert_error_shape(&b);
    // A client that sealed its request to the enclave key is not affected.
    let keys = proto::sealing::KeyConfig::decode_list(
        &get_bytes(&format!("{}/.well-known/hpke-keys", gw.url)).await,
    )
    .unwrap();
    let entry = keys.iter().find(|k| k.key_id != 0x80).unwrap();
    let request = serde_json::to_vec(&json!({"model": MODEL, "input": "sealed"})).unwrap();
    let (headers, body, _) =
        proto::sealing::seal_request(entry, proto::sealing::Aead::Aes128Gcm, &request).unwrap();
    let r = post_sealed(&gw.url, &headers, body).await;
    assert_eq!(r.status(), 200);
}
