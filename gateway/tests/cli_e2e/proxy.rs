//! `gateway proxy` sections.

use super::{Ctx, MODEL};
use crate::common::{
    assert_error_shape, expect_api_error, get_json, http_get, http_post, post_with_header,
    python_openai_available, run_python_json, start_proxy, tampering_relay, Tamper,
};
use base64::Engine as _;
use serde_json::json;

pub(super) const OPENAI_SCRIPT: &str = r#"
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="not-needed-by-the-proxy", max_retries=0)
raw = client.embeddings.with_raw_response.create(model=sys.argv[2], input=["hello through the proxy", "second input"])
emb = raw.parse()
models = [m.id for m in client.models.list()]
err = None
try:
    client.embeddings.create(model="no-such-model", input="x")
except Exception as e:
    err = getattr(e, "status_code", None)
print(json.dumps({
    "verified": raw.headers.get("receipt-verified"),
    "sealing": raw.headers.get("receipt-sealing"),
    "receipt": raw.headers.get("receipt"),
    "receipt_id": raw.headers.get("receipt-id"),
    "receipt_nonce": raw.headers.get("receipt-nonce"),
    "n": len(emb.data),
    "dim": len(emb.data[0].embedding),
    "models": models,
    "bad_model_status": err,
}))
"#;

pub(super) async fn proxy_checks(c: &Ctx) {
    let proxy = start_proxy(&c.url, &[&c.policy], &[], &c.dir)
        .unwrap_or_else(|(code, log)| panic!("proxy did not start ({code}):\n{log}"));

    let result: serde_json::Value = if python_openai_available() {
        run_python_json(OPENAI_SCRIPT, &[&proxy.url, MODEL])
    } else {
        eprintln!("python3 + openai not importable: driving the proxy with reqwest");
        let r = http_post(
            &format!("{}/v1/embeddings", proxy.url),
            &json!({"model": MODEL, "input": ["hello through the proxy", "second input"]}),
        )
        .await;
        assert_eq!(r.status(), 200);
        let h = |n: &str| r.headers().get(n).map(|v| v.to_str().unwrap().to_string());
        let (verified, sealing, receipt, receipt_id, receipt_nonce) = (
            h("receipt-verified"),
            h("receipt-sealing"),
            h("receipt"),
            h("receipt-id"),
            h("receipt-nonce"),
        );
        let body: serde_json::Value = r.json().await.unwrap();
        let models: serde_json::Value = get_json(&format!("{}/v1/models", proxy.url)).await;
        let bad = http_post(
            &format!("{}/v1/embeddings", proxy.url),
            &json!({"model": "no-such-model", "input": "x"}),
        )
        .await;
        json!({
            "verified": verified, "sealing": sealing, "receipt": receipt,
            "receipt_id": receipt_id, "receipt_nonce": receipt_nonce,
            "n": body["data"].as_array().unwrap().len(),
            "dim": body["data"][0]["embedding"].as_array().unwrap().len(),
            "models": models["data"].as_array().unwrap().iter().map(|m| m["id"].clone()).collect::<Vec<_>>(),
            "bad_model_status": bad.status().as_u16(),
        })
    };
    assert_eq!(result["verified"], "true", "{result}");
    assert_eq!(result["sealing"], "enclave", "{result}");
    assert_eq!(result["n"], 2, "{result}");
    assert_eq!(result["dim"], 384, "{result}");
    assert_eq!(result["models"], json!([MODEL]), "{result}");
    assert_eq!(result["bad_model_status"], 404, "{result}");
    assert_eq!(result["receipt_id"].as_str().unwrap().len(), 32);
    // The receipt the proxy passed on is a real one: it decodes, names the
    // enclave sealing and carries the nonce the proxy chose.
    let receipt = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(result["receipt"].as_str().unwrap())
        .unwrap();
    let (body, _) = proto::receipt::parse_unverified(&receipt).unwrap();
    assert_eq!(body.sealing.as_str(), "enclave");
    assert_eq!(
        body.client_nonce.map(hex::encode),
        result["receipt_nonce"].as_str().map(str::to_string)
    );

    // Errors come back in OpenAI shape.
    let body = json!({"model": MODEL, "input": "x"});
    let url = format!("{}/v1/embeddings", proxy.url);
    let r = post_with_header(&url, &body, ("receipt-nonce", "not hex")).await;
    assert_eq!(r.status(), 400);
    assert_error_shape(&r.json().await.unwrap());
    // An input only the entry stage can refuse (the host sees ciphertext):
    // its error comes back sealed and the proxy opens it.
    let r = http_post(
        &format!("{}/v1/embeddings", proxy.url),
        &json!({"model": MODEL, "input": []}),
    )
    .await;
    expect_api_error(r, 400, "must not be an empty array").await;
    let r = http_get(&format!("{}/v1/nothing-here", proxy.url)).await;
    assert_eq!(r.status(), 404);
    assert_error_shape(&r.json().await.unwrap());
    drop(proxy);

    // A host that tampers with the sealed answer (here: the last byte, in the
    // receipt trailer): the proxy withholds it. A tampered `receipt` header
    // changes nothing: the proxy checks the receipt sealed inside.
    // One embedding through a proxy in front of a relay applying `tamper`.
    let through = |tamper: Tamper| async move {
        let relay = tampering_relay(c.url.clone(), tamper);
        let proxy = start_proxy(&relay, &[&c.policy], &[], &c.dir)
            .unwrap_or_else(|(code, log)| panic!("proxy did not start ({code}):\n{log}"));
        let url = format!("{}/v1/embeddings", proxy.url);
        (
            proxy,
            http_post(&url, &json!({"model": MODEL, "input": "x"})).await,
        )
    };
    let (proxy, r) = through(Tamper::ReceiptHeader).await;
    assert_eq!(r.status(), 200, "the sealed-in receipt is the one checked");
    assert_eq!(r.headers()["receipt-verified"], "true");
    drop(proxy);
    let (proxy, r) = through(Tamper::LastBodyByte).await;
    assert_eq!(r.status(), 502);
    assert_eq!(r.headers()["receipt-verified"], "false");
    let e: serde_json::Value = r.json().await.unwrap();
    assert_error_shape(&e);
    assert_eq!(e["error"]["code"], "response_unopenable", "{e}");
    drop(proxy);

    // Evidence that does not match the policy: the proxy refuses to start.
    match start_proxy(&c.url, &[&c.bad_policy], &[], &c.dir) {
        Ok(_) => panic!("a proxy must not start against evidence its policy rejects"),
        Err((code, log)) => {
            assert_eq!(code, 1, "{log}");
            assert!(log.contains("refusing to start"), "{log}");
            assert!(log.contains("stage 0"), "{log}");
        }
    }
}
