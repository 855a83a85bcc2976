//! What the host can see: stages started by the test, the gateway in
//! `launch = "remote"` mode, and recording relays on every stage link. No
//! prompt, no response and no client ciphertext ever crosses a link in the
//! clear, and the only HPKE key the gateway holds (its own) cannot open a
//! body sealed to the enclave key.

mod common;

use common::{
    client, embed, expect_api_error, http_get, post_sealed, remote_stage_policies, temp_dir,
    CaptureRelay, Gateway, Options, StageProc,
};

use proto::sealing::{seal_request, Aead, KeyConfig};
use serde_json::json;

const MODEL: &str = "all-MiniLM-L6-v2";

#[tokio::test]
async fn the_host_relays_only_ciphertext() {
    let dir = temp_dir("hostview");
    let (policy, s0, s1) = remote_stages(&dir);
    let r1 = CaptureRelay::start(&s1.endpoint);
    let r0 = CaptureRelay::start(&s0.endpoint);
    let gw = Gateway::start(Options {
        policy: Some(policy.clone()),
        remote: Some(vec![r0.endpoint.clone(), r1.endpoint.clone()]),
        ..Options::default()
    });

    // A plain request: the gateway sees it, the links do not.
    let plain_marker = "PLAINTEXT-MARKER-c81f2e";
    let (s, b) = embed(
        &gw.url,
        json!({"model": MODEL, "input": [plain_marker, "second input"]}),
    )
    .await;
    assert_eq!(s, 200, "{b}");

    // A request sealed by the client to the enclave key.
    let keys = http_get(&format!("{}/.well-known/hpke-keys", gw.url)).await;
    let keys = KeyConfig::decode_list(&keys.bytes().await.unwrap()).unwrap();
    let enclave = keys.iter().find(|k| k.key_id < 0x80).unwrap();
    let sealed_marker = "SEALED-MARKER-99ab01";
    let request = serde_json::to_vec(&json!({"model": MODEL, "input": sealed_marker})).unwrap();
    let (headers, body, _) = seal_request(enclave, Aead::Aes128Gcm, &request).unwrap();
    let r = post_sealed(&gw.url, &headers, body.clone()).await;
    assert_eq!(r.status(), 200);
    let sealed_response = r.bytes().await.unwrap();

    assert!(
        r0.len() > 0 && r1.len() > 0,
        "the relays carried the traffic"
    );
    for relay in [&r0, &r1] {
        for needle in [
            plain_marker.as_bytes(),
            sealed_marker.as_bytes(),
            b"\"embedding\"",
            b"second input",
        ] {
            assert!(
                !relay.saw(needle),
                "{:?} crossed a stage link in the clear",
                String::from_utf8_lossy(needle)
            );
        }
        // Not even the client's ciphertext or the sealed answer appear verbatim:
        // every link adds its own channel encryption.
        assert!(!relay.saw(&body[body.len() - 32..]));
        assert!(!relay.saw(&sealed_response[sealed_response.len() - 32..]));
    }

    // The gateway's own key (the only HPKE private key it holds) cannot open
    // what the client sealed to the enclave.
    let mut rb = client()
        .post(format!("{}/v1/embeddings", gw.url))
        .body(body);
    let [(kid, _), (aead_h, aead_v), (enc_h, enc_v), (at_h, at_v)] = headers.to_header_values();
    rb = rb
        .header(kid, "128")
        .header(aead_h, aead_v)
        .header(enc_h, enc_v)
        .header(at_h, at_v);
    let r = rb.send().await.unwrap();
    expect_api_error(r, 400, "cannot be opened").await;

    // And what the gateway logged carries no content either.
    let log = gw.log();
    assert!(!log.contains(plain_marker) && !log.contains(sealed_marker));
}

/// Stages 0 and 1 of the embeddings model started by the test, and a
/// gateway policy that pins their measurement: the policy text and the stages.
fn remote_stages(dir: &std::path::Path) -> (String, StageProc, StageProc) {
    let (stage_policy, policy) = remote_stage_policies(dir, &[[0, 3], [3, 6]]);
    let s1 = StageProc::start(1, 2, [3, 6], &stage_policy, dir);
    let s0 = StageProc::start(0, 2, [0, 3], &stage_policy, dir);
    (policy, s0, s1)
}

/// Sends `Configure` to a stage over a host channel of its own (as any
/// local process can) and returns the stage's verdict.
async fn configure_as_intruder(
    endpoint: &str,
    next: Option<String>,
) -> Result<common::hostile::Configured, String> {
    common::hostile::Host::open(endpoint)
        .await
        .configure(next, None)
        .await
}

/// Issue 18, finding 6: a second host channel cannot reconfigure a stage
/// (and so take its output) while the gateway's channel that configured it
/// is open; the gateway keeps serving. Once that channel closes, the stage
/// may be configured again (as the gateway does when it reconnects).
#[tokio::test]
async fn another_host_channel_cannot_take_a_stage_over() {
    let dir = temp_dir("takeover");
    let (policy, s0, s1) = remote_stages(&dir);
    let gw = Gateway::start(Options {
        policy: Some(policy),
        remote: Some(vec![s0.endpoint.clone(), s1.endpoint.clone()]),
        ..Options::default()
    });
    for (ep, next) in [
        (&s1.endpoint, None),
        (&s0.endpoint, Some(s1.endpoint.clone())),
    ] {
        match configure_as_intruder(ep, next).await {
            Err(why) => assert!(why.contains("another host channel"), "{why}"),
            Ok(_) => panic!("a second host took stage {ep} over"),
        }
    }
    let (s, b) = embed(&gw.url, json!({"model": MODEL, "input": "still served"})).await;
    assert_eq!(s, 200, "{b}");
    // The gateway goes away: its channels close, and the exit stage takes
    // a configuration from a new host channel.
    drop(gw);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match configure_as_intruder(&s1.endpoint, None).await {
            Ok(_) => break,
            Err(why) => assert!(
                std::time::Instant::now() < deadline,
                "the stage stayed owned after its host left: {why}"
            ),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Issue 15: the policy file a stage judges its peers by is part of its
/// measurement. A stage started with another policy than the one the
/// gateway's policy was pinned for (here: the same file with a comment
/// added; a real attacker would allow foreign peers) reports another
/// measurement, and the gateway refuses it.
#[tokio::test]
async fn a_stage_under_another_policy_file_is_refused() {
    let dir = temp_dir("policy-measured");
    let (stage_policy, gateway_policy) = remote_stage_policies(&dir, &[[0, 6]]);
    let laxer = dir.join("laxer-policy.toml");
    std::fs::write(
        &laxer,
        std::fs::read_to_string(&stage_policy).unwrap() + "# changed\n",
    )
    .unwrap();
    let stage = StageProc::start(0, 1, [0, 6], &laxer, &dir);
    let failed = Gateway::try_start(Options {
        stages: vec![[0, 6]],
        policy: Some(gateway_policy.clone()),
        remote: Some(vec![stage.endpoint.clone()]),
        env: vec![("GATEWAY_PIPELINE__CONNECT_TIMEOUT_SECS".into(), "5".into())],
        ..Options::default()
    });
    let Err(f) = failed else {
        panic!("a stage under another policy file was accepted");
    };
    assert!(f.stderr.contains("measurement"), "{}", f.stderr);
    drop(stage);
    // The same stage binary under the policy file the measurement was
    // pinned for is accepted.
    let stage = StageProc::start(0, 1, [0, 6], &stage_policy, &dir);
    let gw = Gateway::start(Options {
        stages: vec![[0, 6]],
        policy: Some(gateway_policy),
        remote: Some(vec![stage.endpoint.clone()]),
        ..Options::default()
    });
    let (s, b) = embed(&gw.url, json!({"model": MODEL, "input": "measured"})).await;
    assert_eq!(s, 200, "{b}");
}
