//! OpenTelemetry end to end: an in-process OTLP/HTTP collector (axum,
//! decoding `ExportTraceServiceRequest` with `opentelemetry-proto`) receives
//! the spans of the real gateway (tracing switched on by the environment
//! override `GATEWAY_TELEMETRY__OTLP_ENDPOINT`) serving an embeddings
//! request, a completions request, a streamed completion and a chat
//! completion, each through
//! two real stages. It checks the GenAI attributes, the caller's trace
//! context, one child span per stage (with its queue span) at plausible
//! times, the stage metrics, and that a marker string sent in every request
//! appears in no span, no log line (gateway and stages), no stdout and not
//! in `/metrics`.

mod common;

use axum::body::Bytes;
use common::{
    client, dev_policy, http_post, metrics_text, sample, smollm_dir, temp_dir, Gateway, Options,
};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const EMBED_MODEL: &str = "all-MiniLM-L6-v2";
const GEN_MODEL: &str = "SmolLM2-135M-Instruct";
const MARKER: &str = "MARKER-5e0c2a-never-in-telemetry";
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_SPAN: &str = "00f067aa0ba902b7";

/// What the collector received: decoded requests and their raw bodies.
#[derive(Default)]
struct Received {
    requests: Vec<ExportTraceServiceRequest>,
    raw: Vec<u8>,
}

/// Starts the collector on a free port; returns its base URL.
async fn collector(store: Arc<Mutex<Received>>) -> String {
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let store = store.clone();
            async move {
                let req = ExportTraceServiceRequest::decode(body.as_ref()).expect("OTLP protobuf");
                let mut s = store.lock().unwrap();
                s.raw.extend_from_slice(&body);
                s.requests.push(req);
                (
                    [("content-type", "application/x-protobuf")],
                    Vec::<u8>::new(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

fn spans(store: &Mutex<Received>) -> Vec<Span> {
    store
        .lock()
        .unwrap()
        .requests
        .iter()
        .flat_map(|r| &r.resource_spans)
        .flat_map(|r| &r.scope_spans)
        .flat_map(|s| s.spans.clone())
        .collect()
}

fn attr<'a>(s: &'a Span, key: &str) -> Option<&'a AnyValue> {
    s.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

fn attr_str(s: &Span, key: &str) -> String {
    match attr(s, key) {
        Some(AnyValue::StringValue(v)) => v.clone(),
        other => panic!("{}: {key} is {other:?}", s.name),
    }
}

fn attr_int(s: &Span, key: &str) -> i64 {
    match attr(s, key) {
        Some(AnyValue::IntValue(v)) => *v,
        other => panic!("{}: {key} is {other:?}", s.name),
    }
}

/// Both pipelines with two stages each; traces to `collector`.
fn options(collector: &str) -> Options {
    let dir = temp_dir("otel-policy");
    let path = dir.join("policy-completions.toml");
    std::fs::write(&path, dev_policy(&[[0, 15], [15, 30]])).unwrap();
    let mut table = format!(
        "[completions]\npolicy = {:?}\nmodel_dir = {:?}\n",
        path,
        smollm_dir()
    );
    for s in [[0, 15], [15, 30]] {
        table += &format!("[[completions.stages]]\nlayers = [{}, {}]\n", s[0], s[1]);
    }
    Options {
        extra: table,
        env: vec![(
            "GATEWAY_TELEMETRY__OTLP_ENDPOINT".into(),
            collector.to_string(),
        )],
        ..Options::default()
    }
}

/// The request span with this operation (and, for completions, streamed or not).
fn request_span<'a>(all: &'a [Span], op: &str, nth: usize) -> Option<&'a Span> {
    let mut v: Vec<&Span> = all
        .iter()
        .filter(|s| s.name.starts_with(op) && attr(s, "gen_ai.operation.name").is_some())
        .collect();
    v.sort_by_key(|s| s.start_time_unix_nano);
    v.get(nth).copied()
}

fn children<'a>(all: &'a [Span], parent: &Span) -> Vec<&'a Span> {
    let mut v: Vec<&Span> = all
        .iter()
        .filter(|s| s.parent_span_id == parent.span_id && s.trace_id == parent.trace_id)
        .collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

/// Checks the per-stage child spans of a request span (two stages).
fn check_stage_spans(all: &[Span], req: &Span) {
    let kids = children(all, req);
    let names: Vec<&str> = kids.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["stage 0", "stage 1"], "children of {}", req.name);
    let slack = 50_000_000; // 50 ms: the stages' clock is this machine's
    for (i, st) in kids.iter().enumerate() {
        assert_eq!(attr_int(st, "gateway.stage.index"), i as i64);
        assert!(attr_int(st, "gateway.stage.batches") >= 1, "{st:?}");
        assert!(attr_int(st, "gateway.stage.compute_ns") > 0, "{st:?}");
        let times = format!(
            "{}: request [{}, {}], {} [{}, {}]",
            req.name,
            req.start_time_unix_nano,
            req.end_time_unix_nano,
            st.name,
            st.start_time_unix_nano,
            st.end_time_unix_nano
        );
        assert!(
            st.start_time_unix_nano + slack >= req.start_time_unix_nano,
            "{times}"
        );
        assert!(
            st.end_time_unix_nano <= req.end_time_unix_nano + slack,
            "{times}"
        );
        assert!(st.end_time_unix_nano >= st.start_time_unix_nano);
        let q = children(all, st);
        assert_eq!(q.len(), 1, "queue span of {}", st.name);
        assert_eq!(q[0].name, format!("stage {i} queue"));
        assert!(q[0].end_time_unix_nano <= st.end_time_unix_nano);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn spans_carry_genai_attributes_and_stage_hops_and_no_content() {
    let store = Arc::new(Mutex::new(Received::default()));
    let url = collector(store.clone()).await;
    let gw = Gateway::start(options(&url));
    assert!(gw.log().contains("exporting traces over OTLP/HTTP"));
    let traceparent = format!("00-{TRACE_ID}-{PARENT_SPAN}-01");

    // Embeddings, continuing the caller's trace; the marker in the input,
    // an Authorization header and the request id.
    let r = client()
        .post(format!("{}/v1/embeddings", gw.url))
        .header("traceparent", &traceparent)
        .bearer_auth(MARKER)
        .json(&json!({"model": EMBED_MODEL, "input": [format!("{MARKER} one"), "two"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // A completion and a streamed completion with the marker in the prompt.
    let prompt = format!("Repeat {MARKER} please:");
    let r = http_post(
        &format!("{}/v1/completions", gw.url),
        &json!({"model": GEN_MODEL, "prompt": prompt, "max_tokens": 6, "n": 2,
                      "temperature": 0.0}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert!(body["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    let r = http_post(
        &format!("{}/v1/completions", gw.url),
        &json!({"model": GEN_MODEL, "prompt": prompt, "max_tokens": 6,
                      "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let stream = r.bytes().await.unwrap();
    assert!(String::from_utf8_lossy(&stream).contains("[DONE]"));
    // A chat request with the marker in a message.
    let r = http_post(
        &format!("{}/v1/chat/completions", gw.url),
        &json!({"model": GEN_MODEL, "max_tokens": 4,
                      "messages": [{"role": "user", "content": prompt}]}),
    )
    .await;
    assert_eq!(r.status(), 200);

    // The spans arrive within a few export periods.
    let mut all = Vec::new();
    for _ in 0..100 {
        all = spans(&store);
        let stage_spans = all.iter().filter(|s| s.name.starts_with("stage ")).count();
        if request_span(&all, "text_completion", 1).is_some()
            && request_span(&all, "embeddings", 0).is_some()
            && request_span(&all, "chat", 0).is_some()
            && stage_spans >= 14
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    for s in &all {
        eprintln!(
            "SPAN {} {} parent {} dur {:.1} ms attrs {}",
            s.name,
            hex::encode(&s.span_id),
            hex::encode(&s.parent_span_id),
            (s.end_time_unix_nano - s.start_time_unix_nano) as f64 / 1e6,
            s.attributes.len()
        );
    }
    let emb = request_span(&all, "embeddings", 0).expect("embeddings span");
    assert_eq!(emb.name, format!("embeddings {EMBED_MODEL}"));
    assert_eq!(
        hex::encode(&emb.trace_id),
        TRACE_ID,
        "caller's trace continued"
    );
    assert_eq!(hex::encode(&emb.parent_span_id), PARENT_SPAN);
    assert_eq!(attr_str(emb, "gen_ai.operation.name"), "embeddings");
    assert_eq!(attr_str(emb, "gen_ai.request.model"), EMBED_MODEL);
    assert_eq!(attr_str(emb, "gen_ai.response.model"), EMBED_MODEL);
    assert!(attr_int(emb, "gen_ai.usage.input_tokens") > 0);
    assert_eq!(attr_str(emb, "http.route"), "/v1/embeddings");
    assert_eq!(attr_int(emb, "http.response.status_code"), 200);
    check_stage_spans(&all, emb);

    for nth in 0..2 {
        let c = request_span(&all, "text_completion", nth).expect("completions span");
        assert_eq!(c.name, format!("text_completion {GEN_MODEL}"));
        assert_eq!(attr_str(c, "gen_ai.operation.name"), "text_completion");
        assert_eq!(attr_str(c, "gen_ai.request.model"), GEN_MODEL);
        assert_eq!(attr_str(c, "gen_ai.response.model"), GEN_MODEL);
        assert!(attr_int(c, "gen_ai.usage.input_tokens") > 0);
        assert!(attr_int(c, "gen_ai.usage.output_tokens") > 0);
        match attr(c, "gen_ai.response.finish_reasons") {
            Some(AnyValue::ArrayValue(a)) => {
                assert_eq!(a.values.len(), if nth == 0 { 2 } else { 1 }, "{c:?}");
                for v in &a.values {
                    let r = match &v.value {
                        Some(AnyValue::StringValue(s)) => s.as_str(),
                        other => panic!("finish reason {other:?}"),
                    };
                    assert!(["stop", "length"].contains(&r), "{r}");
                }
            }
            other => panic!("finish reasons: {other:?}"),
        }
        assert_eq!(attr_str(c, "http.route"), "/v1/completions");
        assert_eq!(attr_int(c, "http.response.status_code"), 200);
        check_stage_spans(&all, c);
    }

    let chat = request_span(&all, "chat", 0).expect("chat span");
    assert_eq!(chat.name, format!("chat {GEN_MODEL}"));
    assert_eq!(attr_str(chat, "gen_ai.operation.name"), "chat");
    assert_eq!(attr_str(chat, "http.route"), "/v1/chat/completions");
    assert!(attr_int(chat, "gen_ai.usage.output_tokens") > 0);
    check_stage_spans(&all, chat);

    // Stage metrics: the stages answered, batch sizes and tokens counted,
    // time to first token observed for the completions and the chat.
    let m = metrics_text(&gw.url).await;
    for p in ["embeddings", "completions"] {
        for st in 0..2 {
            let l = format!("pipeline=\"{p}\",stage=\"{st}\"");
            assert_eq!(
                sample(&m, &format!("gateway_stage_stats_up{{{l}}}")),
                1.0,
                "{m}"
            );
            assert_eq!(
                sample(&m, &format!("gateway_pipeline_stage_up{{{l}}}")),
                1.0
            );
            assert!(sample(&m, &format!("gateway_stage_batch_size_count{{{l}}}")) >= 1.0);
            assert!(sample(&m, &format!("gateway_stage_tokens_total{{{l}}}")) > 0.0);
            assert!(
                sample(
                    &m,
                    &format!("gateway_stage_batch_size_bucket{{{l},le=\"+Inf\"}}")
                ) >= 1.0
            );
        }
    }
    assert!(
        sample(
            &m,
            "gateway_genai_output_tokens_total{pipeline=\"completions\",operation=\"text_completion\"}"
        ) > 0.0
    );
    assert_eq!(
        sample(
            &m,
            "gateway_genai_requests_total{pipeline=\"embeddings\",operation=\"embeddings\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &m,
            "gateway_completions_time_to_first_token_seconds_count{pipeline=\"completions\"}"
        ),
        3.0
    );
    let reasons = sample(
        &m,
        "gateway_completions_finish_reasons_total{pipeline=\"completions\",reason=\"stop\"}",
    ) + sample(
        &m,
        "gateway_completions_finish_reasons_total{pipeline=\"completions\",reason=\"length\"}",
    );
    assert_eq!(reasons, 4.0, "{m}");

    // The marker is nowhere: spans (raw export bodies: names, attributes,
    // events), logs of the gateway and its stages, stdout, metrics.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let raw = store.lock().unwrap().raw.clone();
    assert!(!raw.is_empty());
    assert!(
        !raw.windows(MARKER.len()).any(|w| w == MARKER.as_bytes()),
        "the marker reached the collector"
    );
    let log = gw.log();
    assert!(log.contains("stage ready"), "stage logs are captured too");
    assert!(!log.contains(MARKER), "the marker is in the log");
    assert!(!gw.stdout().contains(MARKER), "the marker is on stdout");
    assert!(!metrics_text(&gw.url).await.contains(MARKER));
}
