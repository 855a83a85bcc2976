//! End to end: the client verbs of the `gateway` binary against a real
//! gateway (real stages): `verify evidence`, `verify receipt`, `seal` →
//! HTTP → `open`, `policy pin`, `policy from-build`, and `proxy` driven by the stock `openai` Python SDK (or
//! reqwest when python3 + openai are not importable).
//!
//! One gateway serves every section (each gateway starts two model-loading
//! stage processes); the sections run in order and name themselves on failure.

mod common;
#[path = "cli_e2e/cut_stream.rs"]
mod cut_stream;
#[path = "cli_e2e/evidence.rs"]
mod evidence;
#[path = "cli_e2e/policy_build.rs"]
mod policy_build;
#[path = "cli_e2e/policy_pin.rs"]
mod policy_pin;
#[path = "cli_e2e/proxy.rs"]
mod proxy;
#[path = "cli_e2e/sealing.rs"]
mod sealing;

use common::{cli, client, client_policy_text, p, temp_dir, Gateway, Options};
use std::path::{Path, PathBuf};

const MODEL: &str = "all-MiniLM-L6-v2";

/// Saves `/v1/attestation?nonce=` as CBOR and as JSON.
async fn save_evidence(url: &str, nonce: &[u8], dir: &Path) -> (PathBuf, PathBuf) {
    let get = |accept: &'static str| {
        client()
            .get(format!("{url}/v1/attestation?nonce={}", hex::encode(nonce)))
            .header("accept", accept)
            .send()
    };
    let cbor = get("application/cbor").await.unwrap();
    assert_eq!(cbor.status(), 200);
    let cbor_path = dir.join("evidence.cbor");
    std::fs::write(&cbor_path, cbor.bytes().await.unwrap()).unwrap();
    let js = get("application/json").await.unwrap();
    assert_eq!(js.status(), 200);
    let json_path = dir.join("evidence.json");
    std::fs::write(&json_path, js.bytes().await.unwrap()).unwrap();
    (cbor_path, json_path)
}

struct Ctx {
    url: String,
    dir: PathBuf,
    policy: PathBuf,
    bad_policy: PathBuf,
    nonce: Vec<u8>,
    evidence_cbor: PathBuf,
    evidence_json: PathBuf,
    /// The gateway's folder (its gateway.toml, and policy.toml, which its
    /// stages are started with).
    gateway_dir: PathBuf,
    /// The policy file the stages run with.
    stage_policy: PathBuf,
}

#[tokio::test]
async fn cli_verbs_against_a_real_gateway() {
    let gw = Gateway::start(Options::default());
    let dir = temp_dir("cli");
    let policy_text = client_policy_text(&gw.url).await;
    let policy = dir.join("policy.toml");
    std::fs::write(&policy, &policy_text).unwrap();
    // Stage 0 pinned to another measurement.
    let first =
        policy_text.find("measurements = [\"mock:").unwrap() + "measurements = [\"mock:".len();
    let mut bad_text = policy_text.clone();
    bad_text.replace_range(first..first + 64, &"00".repeat(32));
    let bad_policy = dir.join("bad-policy.toml");
    std::fs::write(&bad_policy, &bad_text).unwrap();
    let nonce = b"cli e2e nonce".to_vec();
    let (evidence_cbor, evidence_json) = save_evidence(&gw.url, &nonce, &dir).await;
    let ctx = Ctx {
        url: gw.url.clone(),
        dir,
        policy,
        bad_policy,
        nonce,
        evidence_cbor,
        evidence_json,
        gateway_dir: gw.dir.clone(),
        stage_policy: gw.dir.join("policy.toml"),
    };
    let t = std::time::Instant::now();
    evidence::evidence_checks(&ctx);
    eprintln!("verify evidence: ok ({:?})", t.elapsed());
    evidence::receipt_checks(&ctx).await;
    eprintln!("verify receipt: ok ({:?})", t.elapsed());
    sealing::seal_open_checks(&ctx).await;
    eprintln!("seal/open: ok ({:?})", t.elapsed());
    sealing::resealing_host_checks(&ctx).await;
    eprintln!("resealing host caught: ok ({:?})", t.elapsed());
    policy_pin::policy_pin_checks(&ctx);
    eprintln!("policy pin: ok ({:?})", t.elapsed());
    policy_build::policy_from_build_checks(&ctx);
    eprintln!("policy from-build: ok ({:?})", t.elapsed());
    proxy::proxy_checks(&ctx).await;
    eprintln!("proxy: ok ({:?})", t.elapsed());
    drop(gw);
}

/// `gateway verify receipt --evidence EVIDENCE --policy POLICY EXTRA...`.
fn verify_receipt(evidence: &Path, policy: &Path, extra: &[&str]) -> (i32, String, String) {
    let head = [
        "verify",
        "receipt",
        "--evidence",
        p(evidence),
        "--policy",
        p(policy),
    ];
    cli(&[&head[..], extra].concat())
}

/// `gateway open --key KEY --in RESPONSE EXTRA...`.
fn open_cli(key: &Path, response: &Path, extra: &[&str]) -> (i32, String, String) {
    cli(&[&["open", "--key", p(key), "--in", p(response)][..], extra].concat())
}
