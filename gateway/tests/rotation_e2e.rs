//! HPKE key rotation end to end: the real gateway and two real stages with
//! `[keys] rotate_secs = 4, overlap_secs = 3`. The entry stage's new key is
//! published (signed with its attested receipt key, in the evidence bundle
//! and at `/.well-known/hpke-keys`) when it is made; requests sealed to the
//! old key succeed during the overlap and get `hpke_key_unknown` after it,
//! for the enclave key and the gateway-held key alike; `gateway proxy`,
//! holding the old key, refetches the keys and retries once.

mod common;

use common::{
    client_policy_text, evidence_bundle, get_json, http_get, http_post, post_sealed, start_proxy,
    temp_dir, Gateway, Options,
};
use proto::policy::Policy;
use proto::sealing::{seal_request, Aead, KeyConfig};
use serde_json::json;
use std::time::{Duration, Instant};

const MODEL: &str = "all-MiniLM-L6-v2";

/// The keys published now: (enclave-held, gateway-held), current first.
async fn published(url: &str) -> (Vec<u8>, Vec<u8>) {
    let v = get_json(&format!("{url}/.well-known/hpke-keys?format=json")).await;
    let ids = |holder: &str| {
        v["keys"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|k| k["held_by"] == holder)
            .map(|k| k["key_id"].as_u64().unwrap() as u8)
            .collect()
    };
    (ids("enclave"), ids("gateway"))
}

/// Polls the published keys until `done` holds (at most 20 s).
async fn wait_for(
    url: &str,
    what: &str,
    done: impl Fn(&(Vec<u8>, Vec<u8>)) -> bool,
) -> (Vec<u8>, Vec<u8>) {
    let start = Instant::now();
    loop {
        let keys = published(url).await;
        if done(&keys) {
            return keys;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{what}: keys stayed {keys:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Seals an embeddings request to `key`; returns the status and error code.
async fn sealed_to(url: &str, key: &KeyConfig) -> (u16, Option<String>) {
    let body = serde_json::to_vec(&json!({"model": MODEL, "input": "rotated keys"})).unwrap();
    let (headers, sealed, _) = seal_request(key, Aead::ChaCha20Poly1305, &body).unwrap();
    let r = post_sealed(url, &headers, sealed).await;
    let status = r.status().as_u16();
    let code = if status == 200 {
        None
    } else {
        let v: serde_json::Value = r.json().await.unwrap();
        v["error"]["code"].as_str().map(str::to_string)
    };
    (status, code)
}

/// Every key configuration published now, by id.
async fn configs(url: &str) -> Vec<KeyConfig> {
    let bytes = http_get(&format!("{url}/.well-known/hpke-keys"))
        .await
        .bytes()
        .await
        .unwrap();
    KeyConfig::decode_list(&bytes).unwrap()
}

fn by_id(keys: &[KeyConfig], id: u8) -> KeyConfig {
    keys.iter().find(|k| k.key_id == id).cloned().unwrap()
}

#[tokio::test]
async fn keys_rotate_overlap_then_retire_and_the_proxy_follows() {
    let dir = temp_dir("rotation");
    let log_dir = dir.join("log");
    let gw = Gateway::start(Options {
        extra: format!(
            "[keys]\nrotate_secs = 4\noverlap_secs = 3\n[transparency]\ndir = {log_dir:?}\n"
        ),
        ..Options::default()
    });
    // A log-backed client policy: every key set the client takes keys
    // from must be a logged key-set entry.
    let (code, vkey, err) = common::cli(&["log", "vkey", "--dir", common::p(&log_dir)]);
    assert_eq!(code, 0, "{err}");
    let policy_text = format!(
        "{}\n[transparency]\nlog_key = {:?}\n",
        client_policy_text(&gw.url).await,
        vkey.trim()
    );
    let policy = Policy::from_toml(&policy_text).unwrap();
    let policy_path = dir.join("client-policy.toml");
    std::fs::write(&policy_path, &policy_text).unwrap();

    // Before any rotation: one key each; the proxy attests and trusts it.
    let (enclave, gateway) = published(&gw.url).await;
    assert_eq!(
        (enclave.len(), gateway.len()),
        (1, 1),
        "{enclave:?} {gateway:?}"
    );
    let (first, first_gateway) = (enclave[0], gateway[0]);
    let first_keys = configs(&gw.url).await;
    let proxy = start_proxy(&gw.url, &[&policy_path], &[], &dir)
        .unwrap_or_else(|(code, log)| panic!("proxy did not start ({code}):\n{log}"));
    let through_proxy = || async {
        let r = http_post(
            &format!("{}/v1/embeddings", proxy.url),
            &json!({"model": MODEL, "input": "through the proxy"}),
        )
        .await;
        let verified = r
            .headers()
            .get("receipt-verified")
            .map(|v| v.to_str().unwrap().to_string());
        (r.status().as_u16(), verified)
    };
    assert_eq!(through_proxy().await, (200, Some("true".into())));
    assert_eq!(
        sealed_to(&gw.url, &by_id(&first_keys, first)).await,
        (200, None)
    );

    // A rotation: the new keys come first, the old ones are still listed
    // and still accepted.
    let (enclave, _) = wait_for(&gw.url, "rotation", |(e, g)| {
        e.len() == 2 && e[1] == first && g.len() == 2 && g[1] == first_gateway
    })
    .await;
    let second = enclave[0];
    assert_ne!(second, first);
    assert_eq!(
        sealed_to(&gw.url, &by_id(&first_keys, first)).await,
        (200, None),
        "overlap"
    );
    assert_eq!(
        sealed_to(&gw.url, &by_id(&first_keys, first_gateway)).await,
        (200, None),
        "gateway key overlap"
    );
    // The bundle carries the signed set, and a verifier takes the new key
    // from it: the entry stage's attested receipt key signed it.
    let bundle = evidence_bundle(&gw.url, b"after the first rotation").await;
    let set = bundle.stages[0]
        .key_set
        .as_ref()
        .expect("stage 0's signed key set");
    let receipt_key = bundle.stages[0].claims.receipt_key;
    let listed: Vec<u8> = proto::key_rotation::KeySet::verify(set, &receipt_key)
        .unwrap()
        .configs()
        .iter()
        .map(|k| k.key_id)
        .collect();
    assert_eq!(
        listed,
        [second, first],
        "newest first, the replaced key still listed"
    );
    let (lines, verified) = bundle.verify(&policy, b"after the first rotation");
    let verified = verified.unwrap_or_else(|| panic!("{lines:#?}"));
    assert_eq!(verified.entry_keys[0].key_id, second, "{lines:#?}");
    // The rotated set was logged before the bundle offered it.
    let (code, entries, _) = common::cli(&["log", "entries", "--dir", common::p(&log_dir)]);
    assert_eq!(code, 0);
    let logged: Vec<serde_json::Value> = entries
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| e["kind"] == "key_set")
        .collect();
    assert!(
        logged
            .iter()
            .any(|e| e["key_ids"] == json!([second, first])),
        "{entries}"
    );
    let line = lines.iter().find(|l| l.name == "logged key set").unwrap();
    assert!(
        line.detail.contains(&format!("keys [{second}, {first}]")),
        "{line}"
    );
    assert!(
        lines.iter().any(|l| l.detail.contains("signed at")),
        "{lines:#?}"
    );
    let forged = {
        let mut b = bundle.clone();
        let set = proto::key_rotation::KeySet {
            issued_at: 1,
            keys: vec![(
                proto::sealing::ServerKey::derive(7, b"host's key").config(),
                None,
            )],
        };
        let host_key = ed25519_dalek::SigningKey::from_bytes(&[9; 32]);
        b.stages[0].key_set = Some(serde_bytes::ByteBuf::from(set.sign(&host_key)));
        b
    };
    assert!(
        forged
            .verify(&policy, b"after the first rotation")
            .1
            .is_none(),
        "a key set the host signed is refused"
    );

    // After the overlap: the first keys are gone and refused.
    wait_for(&gw.url, "retirement", |(e, g)| {
        !e.contains(&first) && !g.contains(&first_gateway)
    })
    .await;
    for (key, what) in [(first, "enclave"), (first_gateway, "gateway")] {
        assert_eq!(
            sealed_to(&gw.url, &by_id(&first_keys, key)).await,
            (400, Some("hpke_key_unknown".into())),
            "retired {what} key"
        );
    }

    // The proxy still holds the first key: refused, it re-attests and
    // retries once, and the answer's receipt verifies.
    assert_eq!(through_proxy().await, (200, Some("true".into())));
    let log = std::fs::read_to_string(dir.join("proxy-client-policy.log")).unwrap();
    assert!(log.contains("re-attesting"), "{log}");
}
