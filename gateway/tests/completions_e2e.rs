//! `/v1/completions` end to end: the real gateway starting real stages that
//! run SmolLM2 split by layers.
//!
//! - with `weights = "f32"`, greedy tokens equal the `transformers`
//!   reference ids (`tests/data/completions_reference.json`) for every
//!   prompt, sent concurrently (so they share decode steps), with one stage
//!   and with two; with the default (`q4_1`) one and two stages give the
//!   same tokens, and the evidence names the format;
//! - a seeded, streamed request concatenates to the non-streamed text, ends
//!   with the usage chunk and `[DONE]`, and its receipt verifies offline
//!   against the exact event-stream bytes; sealed per time slice
//!   (`stream_options.coalesce_ms`) it gives the same events;
//! - a stage fault on one sequence mid-stream ends that stream with an error
//!   event while the concurrent streams' text stays exactly the reference;
//! - admission by KV memory: a request that can never fit gets 400, one that
//!   does not fit now gets 503 + Retry-After, and a client that disconnects
//!   mid-stream frees its sequence in every stage (the next request that
//!   needs all of the budget runs in both stages);
//! - a prompt that is slow to admit does not hold back a short request;
//! - validation errors are OpenAI-shaped.

mod common;

use common::{
    assert_error_shape, client, completions_options, http_get, http_post, model_ids, p,
    pinned_policy, post_exact, post_json, root, smollm_dir, sse_events, Gateway,
};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const MODEL: &str = "SmolLM2-135M-Instruct";
/// `[completions]` line for the f32 weights (the exact-reference tests).
const F32: &str = "weights = \"f32\"";
const EOS: u32 = 2;

struct RefItem {
    prompt: String,
    ids: Vec<u32>,
}

fn reference() -> Vec<RefItem> {
    let v: Value = serde_json::from_slice(
        &std::fs::read(root().join("gateway/tests/data/completions_reference.json")).unwrap(),
    )
    .unwrap();
    v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| RefItem {
            prompt: i["prompt"].as_str().unwrap().to_string(),
            ids: i["output_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect(),
        })
        .collect()
}

/// What the API must return for a reference item with `max_tokens` 32:
/// per-token texts through the first end-of-sequence token, the text, and
/// the finish reason.
fn expected(tok: &tokenizers::Tokenizer, ids: &[u32]) -> (Vec<String>, String, &'static str) {
    let (upto, finish) = match ids.iter().position(|&t| t == EOS) {
        Some(p) => (p + 1, "stop"),
        None => (ids.len(), "length"),
    };
    let tokens = ids[..upto]
        .iter()
        .map(|&t| tok.decode(&[t], true).unwrap())
        .collect();
    let text_ids: Vec<u32> = ids[..upto].iter().copied().filter(|&t| t != EOS).collect();
    (tokens, tok.decode(&text_ids, true).unwrap(), finish)
}

fn tokenizer() -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_file(smollm_dir().join("tokenizer.json")).unwrap()
}

async fn complete(url: &str, body: Value) -> (u16, Value, reqwest::header::HeaderMap) {
    post_json(url, "/v1/completions", &body).await
}

/// Greedy completions of every reference prompt, all at once.
async fn greedy_all(url: &str, items: &[RefItem]) -> Vec<Value> {
    let futs = items.iter().map(|it| {
        complete(
            url,
            json!({"model": MODEL, "prompt": it.prompt, "max_tokens": 32,
                   "temperature": 0, "logprobs": 0}),
        )
    });
    futures_util::future::join_all(futs)
        .await
        .into_iter()
        .map(|(status, body, _)| {
            assert_eq!(status, 200, "{body}");
            body
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn greedy_tokens_equal_the_reference_with_one_and_two_stages() {
    let items = reference();
    assert!(items.len() >= 5 && items.iter().all(|i| i.ids.len() == 32));
    let tok = tokenizer();
    let mut runs = Vec::new();
    for stages in [vec![[0, 15], [15, 30]], vec![[0, 30]]] {
        // The exact comparison is a test of the f32 weights; the quantized
        // formats are held to teacher-forced agreement and perplexity
        // (enclave-stage/tests/llama_quality.rs).
        let gw = Gateway::start(completions_options(&stages, F32));
        let bodies = greedy_all(&gw.url, &items).await;
        for (it, body) in items.iter().zip(&bodies) {
            let (tokens, text, finish) = expected(&tok, &it.ids);
            let c = &body["choices"][0];
            let got: Vec<String> = c["logprobs"]["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_str().unwrap().to_string())
                .collect();
            assert_eq!(
                got,
                tokens,
                "{} stages, prompt {:?}",
                stages.len(),
                it.prompt
            );
            assert_eq!(c["text"], text.as_str());
            assert_eq!(c["finish_reason"], finish);
            assert_eq!(
                body["usage"]["completion_tokens"].as_u64().unwrap() as usize,
                tokens.len()
            );
            assert_eq!(body["object"], "text_completion");
            assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
        }
        runs.push(bodies);
    }
    // One stage and two stages: the same tokens and text, and log-probabilities
    // within float noise.
    for (a, b) in runs[0].iter().zip(&runs[1]) {
        let (a, b) = (&a["choices"][0], &b["choices"][0]);
        assert_eq!(a["text"], b["text"]);
        assert_eq!(a["logprobs"]["tokens"], b["logprobs"]["tokens"]);
        let la = a["logprobs"]["token_logprobs"].as_array().unwrap();
        let lb = b["logprobs"]["token_logprobs"].as_array().unwrap();
        for (x, y) in la.iter().zip(lb) {
            assert!((x.as_f64().unwrap() - y.as_f64().unwrap()).abs() < 1e-3);
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn quantized_weights_give_the_same_tokens_with_one_and_two_stages() {
    // The default (Q4_1) is not held to the reference token for token (its
    // quality is measured: benchmark_results/quality.md), but it is one
    // deterministic function: the split does not change a single token.
    let items = reference();
    let mut runs = Vec::new();
    for stages in [vec![[0, 15], [15, 30]], vec![[0, 30]]] {
        let gw = Gateway::start(completions_options(&stages, ""));
        runs.push(greedy_all(&gw.url, &items[..3]).await);
    }
    for (a, b) in runs[0].iter().zip(&runs[1]) {
        assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
        assert_eq!(
            a["choices"][0]["logprobs"]["tokens"],
            b["choices"][0]["logprobs"]["tokens"]
        );
    }
}

/// Parses an SSE body into its `data:` payloads.
#[tokio::test(flavor = "multi_thread")]
async fn streamed_text_equals_non_streamed_and_its_receipt_verifies() {
    let gw = Gateway::start(completions_options(&[[0, 15], [15, 30]], ""));
    let base = json!({"model": MODEL, "prompt": ["Once upon a time", "The best way to learn"],
                      "max_tokens": 20, "temperature": 0.9, "top_p": 0.95, "seed": 1234, "n": 2,
                      "stop": ["\n\n"]});
    let (status, whole, _) = complete(&gw.url, base.clone()).await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["choices"].as_array().unwrap().len(), 4);

    let mut req = base.clone();
    req["stream"] = json!(true);
    req["stream_options"] = json!({"include_usage": true});
    let request = serde_json::to_vec(&req).unwrap();
    let r = post_exact(&format!("{}/v1/completions", gw.url), request.clone(), None).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let receipt_id = r.headers()["receipt-id"].to_str().unwrap().to_string();
    let stream = r.bytes().await.unwrap().to_vec();
    let events = sse_events(&stream);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"], whole["usage"]);
    let mut texts = vec![String::new(); 4];
    let mut finish = vec![Value::Null; 4];
    for e in &events[..events.len() - 2] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(v["usage"].is_null());
        let c = &v["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        texts[i] += c["text"].as_str().unwrap();
        if !c["finish_reason"].is_null() {
            finish[i] = c["finish_reason"].clone();
        }
    }
    for (i, c) in whole["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(texts[i], c["text"].as_str().unwrap(), "choice {i}");
        assert_eq!(finish[i], c["finish_reason"], "choice {i}");
        assert!(!texts[i].contains("\n\n"), "stop sequence removed");
    }
    assert_ne!(texts[0], texts[1], "the n samples of one prompt differ");
    // Sealed per 200 ms slice (`stream_options.coalesce_ms`): the same
    // events in the same order, whatever chunks carried them.
    let mut sliced = req.clone();
    sliced["stream_options"]["coalesce_ms"] = json!(200);
    let r = http_post(&format!("{}/v1/completions", gw.url), &sliced).await;
    assert_eq!(r.status(), 200);
    let sliced = sse_events(&r.bytes().await.unwrap());
    assert_eq!(sliced.len(), events.len());
    for (a, b) in events.iter().zip(&sliced) {
        if a == "[DONE]" {
            assert_eq!(a, b);
            continue;
        }
        let (mut a, mut b): (Value, Value) = (
            serde_json::from_str(a).unwrap(),
            serde_json::from_str(b).unwrap(),
        );
        for v in [&mut a, &mut b] {
            let o = v.as_object_mut().unwrap();
            o.remove("id");
            o.remove("created");
        }
        assert_eq!(a, b);
    }

    // The receipt covers the exact event stream, through [DONE].
    let nonce = "00112233445566778899aabbccddeeff";
    let evidence = client()
        .get(format!(
            "{}/v1/attestation?nonce={nonce}&model={MODEL}",
            gw.url
        ))
        .header("accept", "application/cbor")
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    // The default weights are Q4_1, and every stage's evidence says so.
    let bundle: proto::bundle::EvidenceBundle = proto::cbor::from_slice(&evidence).unwrap();
    for st in &bundle.stages {
        assert_eq!(st.claims.weights, Some(proto::frames::WeightFormat::Q4_1));
    }
    let receipt = http_get(&format!("{}/v1/receipts/{receipt_id}", gw.url)).await;
    assert_eq!(receipt.status(), 200);
    // A plain stream: the gateway opened it, so it kept the salt of the
    // receipt's digests from the stage's trailer and hands it out.
    let salt = receipt.headers()["receipt-digest-salt"]
        .to_str()
        .unwrap()
        .to_string();
    let receipt = receipt.bytes().await.unwrap();
    let dir = &gw.dir;
    let files = [
        ("evidence.cbor", evidence.to_vec()),
        ("receipt.cose", receipt.to_vec()),
        ("request.json", request),
        ("stream.txt", stream.clone()),
    ];
    for (name, bytes) in &files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let mut tampered = stream.clone();
    let at = tampered.len() / 2;
    tampered[at] ^= 1;
    std::fs::write(dir.join("tampered.txt"), &tampered).unwrap();
    // An offline verifier pins the measurement the stages report.
    let policy = pinned_policy(&gw.url, MODEL, &dir.join("policy-offline.toml")).await;
    let verify = |response: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_gateway"))
            .args([
                "verify",
                "receipt",
                "--evidence",
                p(&dir.join("evidence.cbor")),
                "--policy",
                p(&policy),
                "--evidence-nonce",
                nonce,
                "--request",
                p(&dir.join("request.json")),
                "--response",
                p(&dir.join(response)),
                // The stream was requested without a receipt-nonce.
                "--no-nonce",
                "--digest-salt",
                &salt,
                "--receipt",
                p(&dir.join("receipt.cose")),
            ])
            .env("RUST_LOG", "warn")
            .output()
            .unwrap()
    };
    let ok = verify("stream.txt");
    assert!(
        ok.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&ok.stdout),
        String::from_utf8_lossy(&ok.stderr)
    );
    let bad = verify("tampered.txt");
    assert!(
        !bad.status.success(),
        "a flipped byte in the stream must fail"
    );
}

/// Reads a streamed completion: (texts by choice, an error event if any, saw [DONE]).
async fn read_stream(url: &str, body: Value) -> (String, Option<Value>, bool) {
    let r = http_post(&format!("{url}/v1/completions"), &body).await;
    assert_eq!(r.status(), 200);
    let bytes = r.bytes().await.unwrap();
    let mut text = String::new();
    let mut error = None;
    let mut done = false;
    for e in sse_events(&bytes) {
        if e == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(&e).unwrap();
        if v.get("error").is_some() {
            error = Some(v);
        } else {
            text += v["choices"][0]["text"].as_str().unwrap();
        }
    }
    (text, error, done)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fault_on_one_sequence_ends_only_its_stream() {
    // Stage 0 fails every step whose input holds this (rare) token id; one
    // request is pushed to generate it first, so it fails mid-stream, in a
    // step it shares with the others.
    let poison = 48_000u32;
    let items = reference();
    assert!(items.iter().all(|i| !i.ids.contains(&poison)));
    let mut opts = completions_options(&[[0, 15], [15, 30]], F32);
    opts.env = vec![
        ("STAGE_FAULT_STAGE".into(), "0".into()),
        ("STAGE_FAULT_TOKEN_ID".into(), poison.to_string()),
    ];
    let gw = Gateway::start(opts);
    let tok = tokenizer();
    let mut bias = serde_json::Map::new();
    bias.insert(poison.to_string(), json!(100));
    let poisoned = read_stream(
        &gw.url,
        json!({"model": MODEL, "prompt": "Write a poem", "max_tokens": 32, "temperature": 0,
               "stream": true, "logit_bias": bias}),
    );
    let clean = items.iter().take(3).map(|it| {
        read_stream(
            &gw.url,
            json!({"model": MODEL, "prompt": it.prompt, "max_tokens": 32, "temperature": 0,
                   "stream": true}),
        )
    });
    let (bad, good) = tokio::join!(poisoned, futures_util::future::join_all(clean));
    let (text, error, done) = bad;
    let error = error.expect("the poisoned stream ends with an error event");
    assert_error_shape(&error);
    assert!(!done, "no [DONE] after an error");
    assert_eq!(
        text,
        tok.decode(&[poison], true).unwrap(),
        "it streamed its first token"
    );
    for (it, (text, error, done)) in items.iter().zip(good) {
        let (_, want, _) = expected(&tok, &it.ids);
        assert!(error.is_none() && done, "{:?}: {error:?}", it.prompt);
        assert_eq!(text, want, "{:?}", it.prompt);
    }
    assert!(gw.log().contains("injected fault"));
}

/// Issue 47, item 8: a step that panics (injected in the test build) fails
/// the request it belongs to, and the stage's compute thread goes on: the
/// next request is answered. Before, the panic ended the compute thread and
/// every later request waited for its deadline.
#[tokio::test(flavor = "multi_thread")]
async fn a_panic_in_a_step_fails_only_its_request() {
    let poison = 48_000u32;
    let items = reference();
    let mut opts = completions_options(&[[0, 15], [15, 30]], F32);
    opts.env = common::fault_env(
        0,
        &[
            ("STAGE_FAULT_TOKEN_ID", &poison.to_string()),
            ("STAGE_FAULT_PANIC", "1"),
        ],
    );
    let gw = Gateway::start(opts);
    let tok = tokenizer();
    let mut bias = serde_json::Map::new();
    bias.insert(poison.to_string(), json!(100));
    let limit = Duration::from_secs(60);
    let poisoned = json!({"model": MODEL, "prompt": "Write a poem", "max_tokens": 8,
                          "temperature": 0, "logit_bias": bias});
    let (status, body, _) = tokio::time::timeout(limit, complete(&gw.url, poisoned))
        .await
        .expect("the poisoned request is answered (the stage did not hang)");
    assert_eq!(status, 500, "{body}");
    assert_error_shape(&body);
    for it in items.iter().take(2) {
        let clean = json!({"model": MODEL, "prompt": it.prompt, "max_tokens": 32,
                           "temperature": 0});
        let (status, body, _) = tokio::time::timeout(limit, complete(&gw.url, clean))
            .await
            .expect("a request after the panic is answered");
        assert_eq!(status, 200, "{body}");
        let (_, want, _) = expected(&tok, &it.ids);
        assert_eq!(body["choices"][0]["text"], want.as_str(), "{:?}", it.prompt);
    }
    assert!(gw.log().contains("the step panicked"), "{}", gw.log());
}

/// Issue 47, item 7: admissions run side by side. Eight prompts of a
/// quarter MiB of letters with no space each (about a second of
/// tokenizing, then refused for the context) do not hold back a short
/// request sent after them: the short one is answered first. With admission done in turn on the
/// host channel, the long prompt's refusal always came first. How long the
/// short request waits is measured by `scripts/bench_admission.py`, not
/// asserted here.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_admission_does_not_hold_back_a_short_request() {
    let gw = Gateway::start(completions_options(&[[0, 30]], ""));
    // Just under the 32 bytes per context token the stage reads at most.
    let mut x = 0x2545_f491_u32;
    let letters: String = (0..8192 * 32 - 64)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (b'a' + (x % 26) as u8) as char
        })
        .collect();
    let url = gw.url.clone();
    let slow = tokio::spawn(async move {
        let body = json!({"model": MODEL, "prompt": vec![&letters; 8],
                          "max_tokens": 1});
        let r = complete(&url, body).await;
        (r, Instant::now())
    });
    // The long prompt is on its way to the stage before the short one.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let short = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0});
    let (status, body, _) = complete(&gw.url, short).await;
    let short_done = Instant::now();
    assert_eq!(status, 200, "{body}");
    let ((status, body, _), slow_done) = slow.await.unwrap();
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");
    assert!(
        short_done < slow_done,
        "the short request waited for the long prompts' admission ({:?} after it)",
        short_done - slow_done
    );
    eprintln!(
        "the short request was answered {:?} before the long prompts' refusal",
        slow_done - short_done
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn admission_by_kv_memory_and_disconnect_frees_every_stage() {
    // 2100 KV tokens per stage; nobody may wait.
    let gw = Gateway::start(completions_options(
        &[[0, 15], [15, 30]],
        "kv_cache_tokens = 2100\nmax_waiting = 0",
    ));
    let long = |stream: bool| {
        json!({"model": MODEL, "prompt": "Tell me a very long story about", "max_tokens": 2000,
               "temperature": 0.7, "seed": 3, "stream": stream,
               "logit_bias": {EOS.to_string(): -100}})
    };

    // Never fits: 400 naming the budget.
    let mut two = long(false);
    two["n"] = json!(2);
    let (status, body, _) = complete(&gw.url, two).await;
    assert_eq!(status, 400, "{body}");
    assert_error_shape(&body);
    assert_eq!(body["error"]["code"], "kv_cache_budget_exceeded");
    assert!(body["error"]["message"].as_str().unwrap().contains("2100"));

    // A stream holds almost the whole budget.
    let r = http_post(&format!("{}/v1/completions", gw.url), &long(true)).await;
    assert_eq!(r.status(), 200);
    let mut s = r.bytes_stream();
    let mut seen = 0;
    while seen < 3 {
        let chunk = s.next().await.expect("stream open").unwrap();
        seen += sse_events(&chunk).len();
    }
    // Meanwhile another such request does not fit: 503 + Retry-After.
    let (status, body, headers) = complete(&gw.url, long(false)).await;
    assert_eq!(status, 503, "{body}");
    assert_error_shape(&body);
    assert!(headers.contains_key("retry-after"));

    // The client goes away: every stage frees the sequence, so a request
    // that needs the whole budget again is admitted and runs through both
    // stages (the exit stage would refuse it if it still held the old one).
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = http_post(&format!("{}/v1/completions", gw.url), &{
            let mut b = long(true);
            b["max_tokens"] = json!(2000);
            b
        })
        .await;
        if r.status() == 200 {
            let mut s = r.bytes_stream();
            let first = s.next().await.unwrap().unwrap();
            let ev = sse_events(&first);
            let v: Value = serde_json::from_str(&ev[0]).unwrap();
            assert!(v.get("error").is_none(), "{v}");
            assert!(v["choices"][0]["text"].is_string());
            break;
        }
        assert_eq!(r.status(), 503);
        assert!(
            Instant::now() < deadline,
            "the cancelled stream was never freed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        gw.log().contains("cancelled"),
        "the gateway cancelled the request"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_get_openai_errors() {
    let gw = Gateway::start(completions_options(&[[0, 30]], ""));
    for (body, status, param) in [
        (json!({"model": MODEL}), 400, "prompt"),
        (
            json!({"model": MODEL, "prompt": "x", "temperature": 3}),
            400,
            "temperature",
        ),
        (
            json!({"model": MODEL, "prompt": "x", "max_tokens": 9000}),
            400,
            "prompt",
        ),
        (
            json!({"model": MODEL, "prompt": "x", "logprobs": 1, "stream": true}),
            400,
            "logprobs",
        ),
        (json!({"model": "gpt-4", "prompt": "x"}), 404, "model"),
        (
            json!({"model": MODEL, "prompt": [1, 2, 99999999]}),
            400,
            "prompt",
        ),
    ] {
        let (s, b, _) = complete(&gw.url, body.clone()).await;
        assert_eq!(s, status, "{body} → {b}");
        assert_error_shape(&b);
        assert_eq!(b["error"]["param"], param, "{body} → {b}");
    }
    let (s, b, _) = complete(
        &gw.url,
        json!({"model": MODEL, "prompt": "x", "max_tokens": 9000}),
    )
    .await;
    assert_eq!(s, 400);
    assert_eq!(b["error"]["code"], "context_length_exceeded");
    // Issue 29, finding 8: text that cannot fit the context is refused by
    // its size, before it is tokenized.
    let huge = "word ".repeat(60_000);
    let (s, b, _) = complete(&gw.url, json!({"model": MODEL, "prompt": huge})).await;
    assert_eq!(s, 400, "{b}");
    assert_eq!(b["error"]["code"], "context_length_exceeded", "{b}");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("bytes of text"),
        "{b}"
    );
    // The embeddings model does not complete, and the models list has both.
    let (s, b, _) = complete(&gw.url, json!({"model": "all-MiniLM-L6-v2", "prompt": "x"})).await;
    assert_eq!(s, 404, "{b}");
    let ids = model_ids(&gw.url).await;
    assert!(ids.iter().any(|i| i == MODEL) && ids.iter().any(|i| i == "all-MiniLM-L6-v2"));
}
