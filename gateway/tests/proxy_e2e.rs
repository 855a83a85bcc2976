//! `gateway proxy` end to end with both pipelines: the stock `openai`
//! Python SDK (or reqwest where it is not importable) sends embeddings, a
//! completion, a streamed completion, a chat completion and a streamed chat
//! completion through the proxy, which seals each
//! to the attested entry stage of the right pipeline and checks the receipt
//! the exit stage sealed into the response (for the stream: over the whole
//! event stream, `[DONE]` held back until it verifies).
//!
//! - streamed text == non-streamed text for the same seed (completions and
//!   chat);
//! - every exchange is archived, and `gateway verify receipt` passes on each
//!   archive offline; the proxy serves the receipts it verified;
//! - a stream sealed to the gateway-held key comes back re-sealed with the
//!   stages' receipt as its trailer;
//! - a host that tampers with the sealed stream: the client's stream ends
//!   with an error event, never `[DONE]`.

mod common;

use common::{
    assert_error_shape, cli, client, completions_options, http_get, http_post, p, pinned_policy,
    python_openai_available, run_python_json, start_proxy, tampering_relay, Gateway, Tamper,
};
use proto::sealing::{open_response_with_trailer, seal_request, Aead, KeyConfig};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

const EMBED_MODEL: &str = "all-MiniLM-L6-v2";
const GEN_MODEL: &str = "SmolLM2-135M-Instruct";

/// A gateway with a 1-stage embeddings and a 2-stage completions pipeline.
fn start_gateway() -> Gateway {
    Gateway::start(completions_options(&[[0, 15], [15, 30]], ""))
}

const SDK_SCRIPT: &str = r#"
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="not-needed-by-the-proxy", max_retries=0)
emb = client.embeddings.with_raw_response.create(model=sys.argv[2], input=["hello through the proxy"])
args = dict(model=sys.argv[3], prompt="Once upon a time", max_tokens=24, temperature=0.8, seed=7)
whole = client.completions.with_raw_response.create(**args)
raw = client.completions.with_raw_response.create(stream=True, **args)
text = "".join(c.choices[0].text for c in raw.parse() if c.choices)
chat_args = dict(model=sys.argv[3], messages=[{"role": "user", "content": "Name a colour."}],
                 max_tokens=16, temperature=0.8, seed=7)
chat = client.chat.completions.with_raw_response.create(**chat_args)
chat_raw = client.chat.completions.with_raw_response.create(stream=True, **chat_args)
chat_text = "".join(c.choices[0].delta.content or "" for c in chat_raw.parse() if c.choices)
print(json.dumps({
    "emb_verified": emb.headers.get("receipt-verified"),
    "dim": len(emb.parse().data[0].embedding),
    "whole_verified": whole.headers.get("receipt-verified"),
    "whole_text": whole.parse().choices[0].text,
    "stream_text": text,
    "stream_receipt_id": raw.headers.get("receipt-id"),
    "chat_verified": chat.headers.get("receipt-verified"),
    "chat_text": chat.parse().choices[0].message.content,
    "chat_stream_text": chat_text,
    "chat_stream_receipt_id": chat_raw.headers.get("receipt-id"),
}))
"#;

/// The same three calls with reqwest: the SDK script's output shape.
async fn drive_with_reqwest(url: &str) -> Value {
    let post = |path: &str, body: Value| client().post(format!("{url}{path}")).json(&body).send();
    let emb = post(
        "/v1/embeddings",
        json!({"model": EMBED_MODEL, "input": ["hello through the proxy"]}),
    )
    .await
    .unwrap();
    let emb_verified = header(&emb, "receipt-verified");
    let emb: Value = emb.json().await.unwrap();
    let args = json!({"model": GEN_MODEL, "prompt": "Once upon a time", "max_tokens": 24,
                      "temperature": 0.8, "seed": 7});
    let whole = post("/v1/completions", args.clone()).await.unwrap();
    let whole_verified = header(&whole, "receipt-verified");
    let whole: Value = whole.json().await.unwrap();
    let mut stream_args = args.clone();
    stream_args["stream"] = json!(true);
    // A stream's text and receipt id; `field` picks the text out of a chunk.
    let stream = |path: &'static str, args: Value, field: fn(&Value) -> &Value| {
        let r = post(path, args);
        async move {
            let r = r.await.unwrap();
            let id = r.headers()["receipt-id"].to_str().unwrap().to_string();
            let body = r.text().await.unwrap();
            let mut text = String::new();
            for ev in body.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
                if ev != "[DONE]" {
                    let v: Value = serde_json::from_str(ev).unwrap();
                    text += field(&v["choices"][0]).as_str().unwrap_or("");
                }
            }
            (text, id)
        }
    };
    let (text, id) = stream("/v1/completions", stream_args, |c| &c["text"]).await;
    let chat_args = json!({"model": GEN_MODEL, "max_tokens": 16, "temperature": 0.8, "seed": 7,
                           "messages": [{"role": "user", "content": "Name a colour."}]});
    let chat = post("/v1/chat/completions", chat_args.clone())
        .await
        .unwrap();
    let chat_verified = header(&chat, "receipt-verified");
    let chat: Value = chat.json().await.unwrap();
    let mut chat_stream_args = chat_args;
    chat_stream_args["stream"] = json!(true);
    let (chat_text, chat_id) = stream("/v1/chat/completions", chat_stream_args, |c| {
        &c["delta"]["content"]
    })
    .await;
    json!({
        "emb_verified": emb_verified,
        "dim": emb["data"][0]["embedding"].as_array().unwrap().len(),
        "whole_verified": whole_verified,
        "whole_text": whole["choices"][0]["text"],
        "stream_text": text,
        "stream_receipt_id": id,
        "chat_verified": chat_verified,
        "chat_text": chat["choices"][0]["message"]["content"],
        "chat_stream_text": chat_text,
        "chat_stream_receipt_id": chat_id,
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn stock_sdk_streams_through_the_proxy_and_every_receipt_verifies() {
    let gw = start_gateway();
    let pe = pinned_policy(&gw.url, EMBED_MODEL, &gw.dir.join("pinned-e.toml")).await;
    let pc = pinned_policy(&gw.url, GEN_MODEL, &gw.dir.join("pinned-c.toml")).await;
    let archive = gw.dir.join("archive");
    let proxy = start_proxy(&gw.url, &[&pe, &pc], &["--archive", p(&archive)], &gw.dir)
        .unwrap_or_else(|(code, log)| panic!("proxy did not start ({code}):\n{log}"));

    let result: Value = if python_openai_available() {
        run_python_json(SDK_SCRIPT, &[&proxy.url, EMBED_MODEL, GEN_MODEL])
    } else {
        eprintln!("python3 + openai not importable: driving the proxy with reqwest");
        drive_with_reqwest(&proxy.url).await
    };
    assert_eq!(result["emb_verified"], "true", "{result}");
    assert_eq!(result["dim"], 384);
    assert_eq!(result["whole_verified"], "true", "{result}");
    assert!(!result["whole_text"].as_str().unwrap().is_empty());
    assert_eq!(
        result["stream_text"], result["whole_text"],
        "streamed text concatenates to the non-streamed text"
    );

    assert_eq!(result["chat_verified"], "true", "{result}");
    assert!(!result["chat_text"].as_str().unwrap().is_empty());
    assert_eq!(
        result["chat_stream_text"], result["chat_text"],
        "streamed chat concatenates to the non-streamed chat"
    );

    // The proxy serves the stream's receipt, which it verified.
    let id = result["stream_receipt_id"].as_str().unwrap();
    let r = http_get(&format!("{}/v1/receipts/{id}", proxy.url)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["receipt-verified"], "true");

    // Every exchange is archived and verifies offline.
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&archive)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|d| !d.file_name().unwrap().to_str().unwrap().starts_with('.'))
        .collect();
    dirs.sort();
    assert_eq!(dirs.len(), 5, "{dirs:?}");
    let chat_id = result["chat_stream_receipt_id"].as_str().unwrap();
    for id in [id, chat_id] {
        let stream_dir = archive.join(id);
        assert!(dirs.contains(&stream_dir));
        let streamed = std::fs::read(stream_dir.join("response")).unwrap();
        assert!(streamed.ends_with(b"data: [DONE]\n\n"));
    }

    let mode = |p: &Path| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    };
    assert_eq!(mode(&archive), 0o700, "the archive holds plaintext");
    for d in &dirs {
        assert_eq!(mode(d), 0o700, "{}", d.display());
        assert_eq!(mode(&d.join("request.json")), 0o600, "{}", d.display());
        assert_eq!(mode(&d.join("response")), 0o600, "{}", d.display());
        let request: Value =
            serde_json::from_slice(&std::fs::read(d.join("request.json")).unwrap()).unwrap();
        let policy = if request["model"] == GEN_MODEL {
            &pc
        } else {
            &pe
        };
        let read = |f: &str| std::fs::read_to_string(d.join(f)).unwrap();
        let verify = |response: &Path| {
            cli(&[
                "verify",
                "receipt",
                "--evidence",
                p(&d.join("evidence.cbor")),
                "--evidence-nonce",
                &read("evidence-nonce.hex"),
                "--policy",
                p(policy),
                "--request",
                p(&d.join("request.json")),
                "--response",
                p(response),
                "--nonce",
                &read("nonce.hex"),
                "--digest-salt",
                &read("digest-salt.hex"),
                "--receipt",
                p(&d.join("receipt.cbor")),
            ])
        };
        let (code, out, err) = verify(&d.join("response"));
        assert_eq!(code, 0, "{}:\n{out}\n{err}", d.display());
        if request["messages"].is_array() {
            // A chat receipt (the sealed streamed one included) names its endpoint.
            assert!(out.contains("endpoint /v1/chat/completions"), "{out}");
        }
        // The same check on a response with one byte changed fails.
        let mut bytes = std::fs::read(d.join("response")).unwrap();
        bytes[0] ^= 1;
        let tampered = d.join("response.tampered");
        std::fs::write(&tampered, bytes).unwrap();
        let (code, out, _) = verify(&tampered);
        assert_eq!(code, 1, "{out}");
    }
    drop(proxy);

    // A stream sealed to the gateway-held key (0x80): the gateway opens the
    // stages' stream and seals it again, receipt trailer included.
    let keys = http_get(&format!(
        "{}/.well-known/hpke-keys?model={GEN_MODEL}",
        gw.url
    ))
    .await
    .bytes()
    .await
    .unwrap();
    let keys = KeyConfig::decode_list(&keys).unwrap();
    let gateway_key = keys.iter().find(|k| k.key_id == 0x80).unwrap();
    let request = serde_json::to_vec(&json!({"model": GEN_MODEL, "prompt": "Hello",
        "max_tokens": 6, "temperature": 0, "stream": true}))
    .unwrap();
    let (headers, body, client_key) = seal_request(gateway_key, Aead::Aes128Gcm, &request).unwrap();
    let mut rb = client()
        .post(format!("{}/v1/completions", gw.url))
        .body(body);
    for (k, v) in headers.to_header_values() {
        rb = rb.header(k, v);
    }
    let r = rb.send().await.unwrap();
    assert_eq!(r.status(), 200);
    let id = r.headers()["receipt-id"].to_str().unwrap().to_string();
    let (events, trailer) =
        open_response_with_trailer(&client_key, &r.bytes().await.unwrap()).unwrap();
    assert!(events.ends_with(b"data: [DONE]\n\n"));
    let stored = http_get(&format!("{}/v1/receipts/{id}", gw.url))
        .await
        .bytes()
        .await
        .unwrap();
    let trailer = proto::receipt::ReceiptTrailer::decode(&trailer.unwrap()).unwrap();
    assert_eq!(trailer.receipt, stored, "re-sealed receipt trailer");
    let (body, _) = proto::receipt::parse_unverified(&stored).unwrap();
    assert_eq!(body.sealing.as_str(), "gateway");
    // The response digest is salted: the plain SHA-256 of the events is not
    // in the receipt, the salted one is.
    let salt = trailer.digest_salt.expect("the trailer carries the salt");
    let plain = proto::digest::Sha256Digest::of(&events);
    assert_ne!(body.response_digest, plain);
    assert_eq!(
        body.response_digest,
        proto::receipt::salted_digest(&salt, &plain)
    );

    // A host that flips a byte of the sealed stream (in its receipt
    // trailer): the stream ends with an error event, never [DONE].
    let relay = tampering_relay(gw.url.clone(), Tamper::LastBodyByte);
    let proxy = start_proxy(&relay, &[&pe, &pc], &[], &gw.dir)
        .unwrap_or_else(|(code, log)| panic!("proxy did not start ({code}):\n{log}"));
    let r = http_post(
        &format!("{}/v1/completions", proxy.url),
        &json!({"model": GEN_MODEL, "prompt": "Once upon a time", "max_tokens": 8,
                      "temperature": 0, "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    let events: Vec<&str> = body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert!(!events.contains(&"[DONE]"), "{body}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "response_unopenable", "{body}");
    let r = http_post(
        &format!("{}/v1/embeddings", proxy.url),
        &json!({"model": EMBED_MODEL, "input": "x"}),
    )
    .await;
    assert_eq!(r.status(), 502);
    let e: Value = r.json().await.unwrap();
    assert_error_shape(&e);
    assert_eq!(e["error"]["code"], "response_unopenable", "{e}");
    assert_eq!(r_headers_verified(&client(), &proxy.url).await, "false");
    drop(proxy);

    // A host that relabels a genuine sealed answer as an error: the proxy
    // does not pass the answer on under the host's status (fail closed).
    let relay = tampering_relay(gw.url.clone(), Tamper::Status(400));
    let proxy = start_proxy(&relay, &[&pe, &pc], &[], &gw.dir)
        .unwrap_or_else(|(code, log)| panic!("proxy did not start ({code}):\n{log}"));
    for stream in [false, true] {
        let r = http_post(
            &format!("{}/v1/chat/completions", proxy.url),
            &json!({"model": GEN_MODEL, "max_tokens": 4, "stream": stream,
                          "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
        assert_eq!(r.status(), 502, "stream: {stream}");
        assert_eq!(r.headers()["receipt-verified"], "false");
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["code"], "upstream_status_mismatch", "{e}");
    }
    drop(proxy);

    // A genuine stage error (sealed to the proxy) passes with its status,
    // marked as carrying no verified receipt.
    let proxy = start_proxy(&gw.url, &[&pe, &pc], &[], &gw.dir)
        .unwrap_or_else(|(code, log)| panic!("proxy did not start ({code}):\n{log}"));
    let r = http_post(
        &format!("{}/v1/chat/completions", proxy.url),
        &json!({"model": GEN_MODEL, "tools": [{"type": "function"}],
                      "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(r.status(), 400);
    assert_eq!(r.headers()["receipt-verified"], "false");
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "tools[0].function", "{e}");
}

/// The `receipt-verified` header of a proxy-made error (an unknown model).
async fn r_headers_verified(c: &reqwest::Client, url: &str) -> String {
    let r = c
        .post(format!("{url}/v1/embeddings"))
        .json(&json!({"model": "no-such-model", "input": "x"}))
        .send()
        .await
        .unwrap();
    r.headers()["receipt-verified"]
        .to_str()
        .unwrap()
        .to_string()
}

/// A response header's value as text.
fn header(r: &reqwest::Response, name: &str) -> String {
    r.headers()[name].to_str().unwrap().to_string()
}
