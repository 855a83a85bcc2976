//! Issue 47, finding 4: a sealed stream cut short. When the host cancels a
//! request (or a stage fails it) mid-stream, the exit stage seals an error
//! event as the stream's final chunk, with no receipt trailer. A stage fault
//! on a token the request is pushed to generate first cuts a real sealed
//! stream that way (the same path as a `Cancel`); `gateway open`, `gateway
//! proxy` and the Python package must each fail on it, never hand it out as
//! a whole answer.

use crate::common::{
    cli, client, completions_options, fault_env, gateway_bin, p, pinned_policy,
    python_openai_available, root, seal_cli, sse_events, start_proxy, temp_dir, Gateway,
};
use serde_json::{json, Value};
use std::path::Path;

const LM: &str = "SmolLM2-135M-Instruct";
/// A rare token id; stage 0 fails every step whose input holds it.
const POISON: u32 = 48_000;

/// A streamed completion that generates [`POISON`] first, so that its
/// stream is cut after one token.
fn cut_request() -> Value {
    json!({"model": LM, "prompt": "Write a poem", "max_tokens": 16, "temperature": 0,
           "stream": true, "logit_bias": {POISON.to_string(): 100}})
}

/// The Python package, from its source and the extension the workspace
/// build made (`target/release/lib_native.so`), streaming [`cut_request`].
const PYTHON_SCRIPT: &str = r#"
import json, sys
import openai
import confidential_gateway as cg
url, lm, poison = sys.argv[1], sys.argv[2], sys.argv[3]
c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                  http_client=cg.http_client(sys.argv[4:]))
s = c.completions.create(model=lm, prompt="Write a poem", max_tokens=16, temperature=0,
                         stream=True, logit_bias={poison: 100})
text, out = [], {"raised": None}
try:
    for chunk in s:
        text.extend(ch.text for ch in chunk.choices)
except (openai.APIError, cg.ConfidentialError) as e:
    out = {"raised": type(e).__name__, "message": str(e)}
out["text"] = "".join(text)
out["receipt"] = cg.receipt_of(s) is not None
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread")]
async fn a_cut_sealed_stream_fails_in_open_proxy_and_python() {
    let mut opts = completions_options(&[[0, 15], [15, 30]], "");
    opts.env = fault_env(0, &[("STAGE_FAULT_TOKEN_ID", &POISON.to_string())]);
    let gw = Gateway::start_faulty(opts);
    let dir = temp_dir("cut-stream");
    let policy = pinned_policy(&gw.url, LM, &dir.join("policy-lm.toml")).await;

    // `gateway seal` → HTTP → `gateway open`.
    let (req, body, headers, key, resp, out) = (
        dir.join("req.json"),
        dir.join("body.bin"),
        dir.join("headers.txt"),
        dir.join("key.json"),
        dir.join("resp.bin"),
        dir.join("out.txt"),
    );
    std::fs::write(&req, serde_json::to_vec(&cut_request()).unwrap()).unwrap();
    let (code, o, e) = seal_cli(
        &["--gateway", &gw.url, "--policy", p(&policy), "--model", LM],
        [&req, &body, &headers, &key],
    );
    assert_eq!(code, 0, "{o}\n{e}");
    let mut rb = client()
        .post(format!("{}/v1/completions", gw.url))
        .body(std::fs::read(&body).unwrap());
    for line in std::fs::read_to_string(&headers).unwrap().lines() {
        let (k, v) = line.split_once(':').expect("name: value");
        rb = rb.header(k.trim(), v.trim());
    }
    let r = rb.send().await.unwrap();
    assert_eq!(r.status(), 200);
    std::fs::write(&resp, r.bytes().await.unwrap()).unwrap();
    let (code, o, e) = cli(&["open", "--key", p(&key), "--in", p(&resp), "--out", p(&out)]);
    assert_eq!(
        code, 1,
        "a cut stream must not open as a whole answer:\n{o}\n{e}"
    );
    assert!(e.contains("the sealed response was cut"), "{e}");
    assert!(
        e.contains("generation_failed"),
        "the error event is named: {e}"
    );
    assert!(!out.exists(), "nothing written");

    // `gateway proxy`: the stream ends with the stage's error event, no [DONE].
    let proxy = start_proxy(&gw.url, &[&policy], &[], &dir)
        .unwrap_or_else(|(code, log)| panic!("proxy did not start ({code}):\n{log}"));
    let r = client()
        .post(format!("{}/v1/completions", proxy.url))
        .json(&cut_request())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let events = sse_events(&r.bytes().await.unwrap());
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    let last: Value = serde_json::from_str(events.last().expect("events")).unwrap();
    assert_eq!(last["error"]["code"], "generation_failed", "{events:?}");

    // The Python package: the openai SDK raises on the error event, and no
    // receipt is handed out.
    let native = Path::new(gateway_bin()).with_file_name("lib_native.so");
    if !python_openai_available() || !native.exists() {
        eprintln!("SKIPPED the Python package's part: needs python3 with openai and {native:?} (cargo build --workspace)");
    } else {
        let pkg = dir.join("py").join("confidential_gateway");
        std::fs::create_dir_all(&pkg).unwrap();
        let src = root().join("client/python/python/confidential_gateway");
        for f in std::fs::read_dir(src).unwrap() {
            let f = f.unwrap().path();
            if f.extension().is_some_and(|x| x == "py") {
                std::fs::copy(&f, pkg.join(f.file_name().unwrap())).unwrap();
            }
        }
        std::fs::copy(&native, pkg.join("_native.abi3.so")).unwrap();
        let run = std::process::Command::new("python3")
            .args([
                "-c",
                PYTHON_SCRIPT,
                &gw.url,
                LM,
                &POISON.to_string(),
                p(&policy),
            ])
            .env("PYTHONPATH", dir.join("py"))
            .env("NO_PROXY", "127.0.0.1,localhost")
            .env_remove("OPENAI_BASE_URL")
            .output()
            .unwrap();
        let (so, se) = (
            String::from_utf8_lossy(&run.stdout),
            String::from_utf8_lossy(&run.stderr),
        );
        assert!(run.status.success(), "{so}\n{se}");
        let v: Value = serde_json::from_str(&so).unwrap();
        assert_eq!(v["raised"], "APIError", "{v}");
        assert!(v["message"].as_str().unwrap().contains("incomplete"), "{v}");
        assert_eq!(v["receipt"], false, "{v}");
    }
    drop(proxy);
    assert!(gw.log().contains("injected fault"));
}
