//! End to end: the real gateway binary, real stage processes, real HTTP.

mod common;

use common::{
    assert_error_shape, client, cosine, embed, evidence_bundle, get_json, max_diff, model_dir,
    post_with_header, reference, signal, temp_dir, vectors, wait_gone, Gateway, Options,
};
use serde_json::json;

const MODEL: &str = "all-MiniLM-L6-v2";

#[tokio::test]
async fn two_stages_match_reference_and_one_stage() {
    let (texts, tokens, refs) = reference();
    assert!(texts.len() >= 20);
    let two = Gateway::start(Options::default());
    let one = Gateway::start(Options {
        stages: vec![[0, 6]],
        ..Options::default()
    });
    let (s2, b2) = embed(&two.url, json!({"model": MODEL, "input": texts})).await;
    assert_eq!(s2, 200, "{b2}");
    let (s1, b1) = embed(&one.url, json!({"model": MODEL, "input": texts})).await;
    assert_eq!(s1, 200, "{b1}");
    let v2 = vectors(&b2);
    let v1 = vectors(&b1);
    assert_eq!(v2.len(), texts.len());
    for i in 0..texts.len() {
        assert_eq!(v2[i].len(), 384);
        let norm: f32 = v2[i].iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "item {i} norm {norm}");
        let c = cosine(&v2[i], &refs[i]);
        assert!(c >= 0.9999, "item {i}: cosine to reference {c}");
        let c = cosine(&v2[i], &v1[i]);
        assert!(c >= 0.99999, "item {i}: one vs two stages {c}");
    }
    assert_eq!(b2["model"], MODEL);
    assert_eq!(
        b2["usage"]["prompt_tokens"].as_u64().unwrap(),
        tokens.iter().sum::<u64>()
    );
    assert_eq!(b2["data"][3]["index"], 3);
    // The stages hold the weights in bf16 by default (the vectors above are
    // theirs), and each stage's evidence says so.
    let bundle = evidence_bundle(&two.url, b"which weights").await;
    assert_eq!(bundle.stages.len(), 2);
    for st in &bundle.stages {
        assert_eq!(st.claims.weights, Some(proto::frames::WeightFormat::Bf16));
    }

    // Each text alone, all at once: batching across requests must not mix them up.
    let futs = texts.iter().map(|t| {
        let url = two.url.clone();
        let body = json!({"model": MODEL, "input": t});
        async move { embed(&url, body).await }
    });
    let singles = futures_join(futs).await;
    for (i, (s, b)) in singles.iter().enumerate() {
        assert_eq!(*s, 200, "{b}");
        let v = &vectors(b)[0];
        assert!(
            max_diff(v, &v2[i]) < 1e-5,
            "item {i} alone differs from batched"
        );
        assert_eq!(b["usage"]["prompt_tokens"].as_u64().unwrap(), tokens[i]);
    }
}

async fn futures_join<F: std::future::Future<Output = T> + Send + 'static, T: Send + 'static>(
    futs: impl Iterator<Item = F>,
) -> Vec<T> {
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let gw = Gateway::start(Options {
        server_extra: "max_body_bytes = 4096\nmax_inputs = 8\n".into(),
        ..Options::default()
    });
    let cases = [
        (
            json!({"model": MODEL, "input": [[101, 2023]]}),
            400,
            Some("input"),
        ),
        (
            json!({"model": MODEL, "input": [101, 2023]}),
            400,
            Some("input"),
        ),
        (json!({"model": MODEL, "input": ""}), 400, Some("input")),
        (json!({"model": MODEL, "input": []}), 400, Some("input")),
        (
            json!({"model": MODEL, "input": vec!["a"; 9]}),
            400,
            Some("input"),
        ),
        (json!({"model": MODEL}), 400, Some("input")),
        (json!({"input": "a"}), 400, Some("model")),
        (
            json!({"model": MODEL, "input": "a", "dimensions": 385}),
            400,
            Some("dimensions"),
        ),
        (
            json!({"model": MODEL, "input": "a", "encoding_format": "int8"}),
            400,
            Some("encoding_format"),
        ),
        (
            json!({"model": "text-embedding-3-small", "input": "a"}),
            404,
            Some("model"),
        ),
        (
            json!({"model": MODEL, "input": "x".repeat(5000)}),
            413,
            None,
        ),
    ];
    for (body, status, param) in cases {
        let (s, b) = embed(&gw.url, body.clone()).await;
        assert_eq!(s, status, "{body} -> {b}");
        assert_error_shape(&b);
        assert_eq!(b["error"]["param"].as_str(), param, "{b}");
    }
    let (_, b) = embed(&gw.url, json!({"model": MODEL, "input": [[1, 2]]})).await;
    assert!(b["error"]["message"]
        .as_str()
        .unwrap()
        .contains("check_embedding_ctx_length"));

    let c = client();
    let url = |path: &str| format!("{}{path}", gw.url);
    for (rb, status) in [
        (c.post(url("/v1/embeddings")).body("{not json"), 400),
        (c.get(url("/v1/embeddings")), 405),
        (c.get(url("/v1/nothing")), 404),
    ] {
        let r = rb.send().await.unwrap();
        assert_eq!(r.status(), status);
        assert_error_shape(&r.json().await.unwrap());
    }

    // The service still works after all that.
    let (s, b) = embed(
        &gw.url,
        json!({"model": MODEL, "input": "still fine", "dimensions": 64}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    let v = &vectors(&b)[0];
    assert_eq!(v.len(), 64);
    assert!((v.iter().map(|x| x * x).sum::<f32>().sqrt() - 1.0).abs() < 1e-4);
    let (s, b) = embed(
        &gw.url,
        json!({"model": MODEL, "input": "b64", "encoding_format": "base64"}),
    )
    .await;
    assert_eq!(s, 200);
    assert!(b["data"][0]["embedding"].is_string());

    let models: serde_json::Value = get_json(&format!("{}/v1/models", gw.url)).await;
    assert_eq!(models["data"][0]["id"], MODEL);
    let ready = c.get(format!("{}/readyz", gw.url)).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    let ready: serde_json::Value = ready.json().await.unwrap();
    assert!(
        ready["warning"].as_str().unwrap().contains("MOCK"),
        "mock must be loud: {ready}"
    );
    assert_eq!(ready["stages"].as_array().unwrap().len(), 2);
    assert!(gw.log().contains("MOCK ATTESTATION"));
    let health = c.get(format!("{}/healthz", gw.url)).send().await.unwrap();
    assert_eq!(health.status(), 200);
}

#[test]
fn unpinned_measurement_is_refused_naming_the_stage() {
    let zero = format!("mock:{}", "0".repeat(64));
    let policy = format!(
        "allow_mock = true\n[[stages]]\nindex = 0\nlayers = [0, 3]\nmeasurements = [\"{zero}\"]\n[[stages]]\nindex = 1\nlayers = [3, 6]\nmeasurements = [\"{zero}\"]\n"
    );
    let stderr = Gateway::refused_by_policy(
        &policy,
        "the gateway must refuse stages whose measurement is not pinned",
    );
    assert!(
        stderr.contains("refusing to serve")
            && stderr.contains("stage 1")
            && stderr.contains("is not in the policy"),
        "{stderr}"
    );
}

#[test]
fn mock_evidence_is_refused_by_a_production_policy() {
    let policy = "allow_mock = false\n[[stages]]\nindex = 0\nlayers = [0, 3]\n[[stages]]\nindex = 1\nlayers = [3, 6]\n";
    let stderr = Gateway::refused_by_policy(policy, "mock evidence must be refused");
    assert!(stderr.contains("mock evidence is not accepted"), "{stderr}");
}

#[test]
fn wrong_layer_claims_are_refused() {
    // The policy expects a different split than the stages run.
    let policy = "allow_mock = true\ntrust_local_build = true\n[[stages]]\nindex = 0\nlayers = [0, 2]\n[[stages]]\nindex = 1\nlayers = [2, 6]\n";
    let stderr = Gateway::refused_by_policy(policy, "layer mismatch must be refused");
    assert!(stderr.contains("claims layers"), "{stderr}");
}

#[test]
fn tampered_weights_stop_the_stage_from_starting() {
    let dir = temp_dir("tampered");
    let src = model_dir();
    for e in std::fs::read_dir(&src).unwrap().flatten() {
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
        }
    }
    let w = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&w).unwrap();
    let n = bytes.len() / 2;
    bytes[n] ^= 1;
    std::fs::write(&w, bytes).unwrap();
    let stderr = Gateway::refused(
        Options {
            model_dir: dir.clone(),
            ..Options::default()
        },
        "tampered weights must stop the stage",
    );
    assert!(
        stderr.contains("model.safetensors") && stderr.contains("does not match the manifest"),
        "{stderr}"
    );
    assert!(stderr.contains("exited before it was ready"), "{stderr}");
}

#[test]
fn ctrl_c_stops_gateway_and_stages() {
    let mut gw = Gateway::start(Options::default());
    let stages = gw.stage_pids();
    assert_eq!(stages.len(), 2, "expected two stage processes");
    assert_eq!(gw.interrupt(), Some(0));
    wait_gone(&stages, "stage processes outlived the gateway");
}

#[test]
fn killed_gateway_takes_its_stages_down() {
    let mut gw = Gateway::start(Options::default());
    let stages = gw.stage_pids();
    signal(gw.child.id(), "KILL");
    let _ = gw.child.wait();
    wait_gone(
        &stages,
        "stages must exit when their supervisor dies (stdin closed)",
    );
}

#[tokio::test]
async fn logs_are_json_lines_with_request_ids_and_no_content() {
    let gw = Gateway::start(Options::default());
    let marker = "LOG-MARKER-5d1e0c";
    let body = json!({"model": MODEL, "input": marker});
    let url = format!("{}/v1/embeddings", gw.url);
    let r = post_with_header(&url, &body, ("x-request-id", "test-req-42")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-request-id"], "test-req-42");
    // A client id that is not plain is replaced by a fresh one.
    let r = client()
        .get(format!("{}/v1/models", gw.url))
        .header("x-request-id", "bad id with spaces")
        .send()
        .await
        .unwrap();
    let fresh = r.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(fresh.len(), 24, "{fresh}");
    let log = gw.log();
    let mut saw_request = false;
    for line in log.lines().filter(|l| l.starts_with('{')) {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        if v["fields"]["message"] == "request" && v["span"]["request_id"] == "test-req-42" {
            saw_request = true;
        }
    }
    assert!(
        saw_request,
        "no JSON request line with the request id:\n{log}"
    );
    assert!(!log.contains(marker), "request content reached the log");
}
