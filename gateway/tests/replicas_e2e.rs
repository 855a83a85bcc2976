//! End to end: one gateway in front of three replicas of the two-stage
//! embeddings pipeline (`replicas = 3`, local processes). Every replica is
//! attested on its own and publishes its own entry key; a request sealed to
//! a replica's key goes to that replica and its receipt names that
//! replica's stages. Under steady load one replica's exit stage is killed:
//! no request hangs, the requests that arrive once the failure is known all
//! succeed on the other replicas, and the replica rejoins (restarted by the
//! launcher, re-attested) and takes requests again, without a gateway
//! restart. And replicas of remote stages found through `dns://` stage
//! addresses: the first chain found is used, its entry stage is told its
//! key ids, an empty slot says why, and a stage that comes back at its
//! address is re-attested and used again (the pairing of several addresses
//! per name, and re-resolution, are unit-tested in
//! `gateway/src/pipeline/discovery.rs`: here one name has one address).

mod common;

use common::{
    assert_error_shape, attestation_cbor_query, client, client_policy_text, embed, evidence_bundle,
    get_json, http_get, metrics_text, post_sealed, remote_stage_policies, sample, signal, temp_dir,
    Gateway, Options, StageProc,
};
use proto::bundle::EvidenceBundle;
use proto::policy::Policy;
use proto::receipt::{verify_receipt, ReceiptTrailer, VerifyInputs};
use proto::sealing::{open_response_with_trailer, seal_request, Aead};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MODEL: &str = "all-MiniLM-L6-v2";
const REPLICAS: usize = 3;

async fn readyz(url: &str) -> Value {
    http_get(&format!("{url}/readyz"))
        .await
        .json()
        .await
        .unwrap()
}

/// Which replicas `/readyz` says are ready.
async fn ready_replicas(url: &str) -> Vec<bool> {
    let v = readyz(url).await;
    v["pipelines"][0]["replicas"]
        .as_array()
        .map(|a| a.iter().map(|r| r["ready"] == true).collect())
        .unwrap_or_default()
}

/// The pid of replica `replica`'s stage `stage`, from the gateway's log.
fn stage_pid(gw: &Gateway, replica: u64, stage: u64) -> u32 {
    gw.log()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["fields"]["message"] == "local stage started")
        .filter(|v| v["fields"]["replica"] == replica && v["fields"]["stage"] == stage)
        .filter_map(|v| v["fields"]["pid"].as_u64())
        .next_back()
        .unwrap_or_else(|| panic!("no start line for replica {replica} stage {stage}")) as u32
}

async fn bundle_of(url: &str, replica: usize, nonce: &[u8]) -> EvidenceBundle {
    let (status, _, body) = attestation_cbor_query(
        url,
        &format!("nonce={}&replica={replica}", hex::encode(nonce)),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    proto::cbor::from_slice(&body).unwrap()
}

/// A sealed request to replica `replica`'s attested key: it is answered,
/// and its receipt verifies against that replica's evidence only.
async fn sealed_to_replica(url: &str, policy: &Policy, replica: usize) {
    let nonce = format!("replica {replica}").into_bytes();
    let verified = bundle_of(url, replica, &nonce)
        .await
        .verify(policy, &nonce)
        .1
        .expect("the replica's evidence verifies");
    let other = bundle_of(url, (replica + 1) % REPLICAS, &nonce)
        .await
        .verify(policy, &nonce)
        .1
        .expect("another replica's evidence verifies");
    assert_ne!(
        verified.entry_keys, other.entry_keys,
        "each replica its own key"
    );
    let request = serde_json::to_vec(&json!({"model": MODEL, "input": "to one replica"})).unwrap();
    let (headers, body, client_key) =
        seal_request(&verified.entry_keys[0], Aead::Aes128Gcm, &request).unwrap();
    let r = post_sealed(url, &headers, body).await;
    assert_eq!(r.status(), 200);
    let (plain, trailer) =
        open_response_with_trailer(&client_key, &r.bytes().await.unwrap()).unwrap();
    let trailer = ReceiptTrailer::decode(&trailer.unwrap()).unwrap();
    let check = |keys| {
        let mut inputs = VerifyInputs::new(&trailer.receipt, keys);
        inputs.request = Some(&request);
        inputs.response = Some(&plain);
        inputs.digest_salt = trailer.digest_salt.as_ref();
        inputs.allow_mock = true;
        verify_receipt(&inputs)
    };
    let report = check(&verified.stage_keys);
    assert!(report.ok(), "{:#?}", report.checks);
    assert!(
        !check(&other.stage_keys).ok(),
        "the receipt names replica {replica}'s stages, not another's"
    );
}

/// Requests per replica so far (the exit stages' answered requests).
async fn answered_by(url: &str, replica: usize) -> f64 {
    sample(
        &metrics_text(url).await,
        &format!(
            "gateway_genai_requests_total{{pipeline=\"embeddings\",replica=\"{replica}\",operation=\"embeddings\"}}"
        ),
    )
}

#[tokio::test]
async fn three_replicas_route_fail_over_and_rejoin() {
    let gw = Gateway::start(Options {
        pipeline_extra: format!("replicas = {REPLICAS}\n"),
        ..Options::default()
    });
    assert_eq!(ready_replicas(&gw.url).await, vec![true; REPLICAS]);
    let policy = Policy::from_toml(&client_policy_text(&gw.url).await).unwrap();

    // Every replica's entry key is published, each naming its replica.
    let (keys, mut replicas) = enclave_keys(&gw.url, "replica").await;
    replicas.sort();
    assert_eq!(replicas, [0, 1, 2]);
    // Each replica's key from the share of ids the gateway gave it
    // (1-42, 43-84, 85-126 for three).
    for k in keys["keys"].as_array().unwrap() {
        if k["held_by"] == "enclave" {
            let (id, r) = (
                k["key_id"].as_u64().unwrap(),
                k["replica"].as_u64().unwrap(),
            );
            assert!((1 + 42 * r..=42 + 42 * r).contains(&id), "{k}");
        }
    }
    for r in 0..REPLICAS {
        sealed_to_replica(&gw.url, &policy, r).await;
    }
    // Plain requests spread over the replicas.
    for i in 0..12 {
        let (status, _) = embed(
            &gw.url,
            json!({"model": MODEL, "input": format!("spread {i}")}),
        )
        .await;
        assert_eq!(status, 200);
    }
    for r in 0..REPLICAS {
        assert!(
            answered_by(&gw.url, r).await >= 1.0,
            "replica {r} took requests"
        );
    }

    // Steady load: four clients, each request with a deadline it must meet.
    let stop = Arc::new(AtomicBool::new(false));
    let log: Arc<Mutex<Vec<(Instant, u16)>>> = Arc::default();
    let mut clients = Vec::new();
    for c in 0..4 {
        let (url, stop, log) = (gw.url.clone(), stop.clone(), log.clone());
        clients.push(tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let r = tokio::time::timeout(
                    Duration::from_secs(30),
                    client()
                        .post(format!("{url}/v1/embeddings"))
                        .json(&json!({"model": MODEL, "input": format!("client {c} request {n}")}))
                        .send(),
                )
                .await
                .expect("no request hangs");
                let status = match r {
                    Ok(r) => {
                        let status = r.status().as_u16();
                        let body: Value = r.json().await.unwrap();
                        if status != 200 {
                            assert_eq!(status, 503, "a clean 503, nothing else: {body}");
                            assert_error_shape(&body);
                        }
                        status
                    }
                    Err(e) => panic!("transport error: {e}"),
                };
                log.lock().unwrap().push((Instant::now(), status));
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let victim = stage_pid(&gw, 1, 1);
    signal(victim, "KILL");
    // The failure is known once /readyz says so.
    let t = Instant::now();
    loop {
        if ready_replicas(&gw.url).await == [true, false, true] {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the dead replica is noticed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let known = Instant::now();
    let body = readyz(&gw.url).await;
    assert!(
        body["pipelines"][0]["replicas"][1]["reason"]
            .as_str()
            .is_some(),
        "{body}"
    );
    let up = metrics_text(&gw.url).await;
    assert_eq!(
        sample(
            &up,
            "gateway_pipeline_stage_up{pipeline=\"embeddings\",replica=\"1\",stage=\"1\"}"
        ),
        0.0
    );
    assert_eq!(
        sample(
            &up,
            "gateway_pipeline_stage_up{pipeline=\"embeddings\",replica=\"0\",stage=\"1\"}"
        ),
        1.0
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The replica rejoins: its stage restarted, re-attested, used again.
    let t = Instant::now();
    loop {
        if ready_replicas(&gw.url).await == vec![true; REPLICAS] {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "replica 1 rejoins");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_ne!(stage_pid(&gw, 1, 1), victim, "a new stage process");
    let before = answered_by(&gw.url, 1).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    assert!(
        answered_by(&gw.url, 1).await > before,
        "replica 1 takes requests again"
    );
    let after_known: Vec<u16> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|(at, _)| *at > known)
        .map(|(_, s)| *s)
        .collect();
    assert!(
        after_known.len() > 10,
        "load went on: {}",
        after_known.len()
    );
    assert!(
        after_known.iter().all(|s| *s == 200),
        "every request after the failure was known succeeded: {after_known:?}"
    );
    sealed_to_replica(&gw.url, &policy, 1).await;
}

#[tokio::test]
async fn replicas_found_through_dns_are_told_their_key_ids_and_reconnect() {
    let dir = temp_dir("replicas-dns");
    let (stage_policy, policy) = remote_stage_policies(&dir, &[[0, 3], [3, 6]]);
    let s1 = StageProc::start(1, 2, [3, 6], &stage_policy, &dir);
    // Its first key from ids the gateway will not give replica 0.
    let s0 = StageProc::start_with(
        0,
        2,
        [0, 3],
        &stage_policy,
        &dir,
        "tcp://127.0.0.1:0",
        &["--hpke-key-ids", "100-127"],
    );
    let dns = |ep: &str| ep.replace("tcp://", "dns://");
    let s1_endpoint = s1.endpoint.clone();
    let gw = Gateway::start(Options {
        policy: Some(policy),
        remote: Some(vec![dns(&s0.endpoint), dns(&s1.endpoint)]),
        pipeline_extra: "replicas = 2\ndiscovery_secs = 1\n".into(),
        ..Options::default()
    });
    assert_eq!(ready_replicas(&gw.url).await, [true, false]);
    let body = readyz(&gw.url).await;
    let why = body["pipelines"][0]["replicas"][1]["reason"]
        .as_str()
        .unwrap();
    assert!(why.contains("DNS"), "{why}");
    let (status, _) = embed(&gw.url, json!({"model": MODEL, "input": "found"})).await;
    assert_eq!(status, 200);
    // Replica 0 of 2 uses key ids 1-63: the stage replaced its first key.
    let (keys, enclave) = enclave_keys(&gw.url, "key_id").await;
    assert_eq!(enclave.len(), 1, "{keys}");
    assert!((1..=63).contains(&enclave[0]), "{enclave:?}");
    // The replacement key is the one the evidence vouches for.
    let nonce = b"dns replica";
    let verified = evidence_bundle(&gw.url, nonce)
        .await
        .verify(
            &Policy::from_toml(&client_policy_text(&gw.url).await).unwrap(),
            nonce,
        )
        .1
        .expect("bundle verifies");
    assert_eq!(u64::from(verified.entry_keys[0].key_id), enclave[0]);
    sealed_to_replica_alone(&gw.url, &verified).await;

    // Stage 1 dies: no replica is left, and the gateway says so.
    drop(s1);
    let t = Instant::now();
    while http_get(&format!("{}/readyz", gw.url)).await.status() != 503 {
        assert!(t.elapsed() < Duration::from_secs(10), "the loss is noticed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, body) = embed(&gw.url, json!({"model": MODEL, "input": "nobody"})).await;
    assert_eq!(status, 503, "{body}");
    // It comes back at its address: re-attested and used again.
    let _s1 = StageProc::start_with(1, 2, [3, 6], &stage_policy, &dir, &s1_endpoint, &[]);
    let t = Instant::now();
    while ready_replicas(&gw.url).await != [true, false] {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the replica comes back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, _) = embed(&gw.url, json!({"model": MODEL, "input": "back"})).await;
    assert_eq!(status, 200);
    drop(s0);
}

/// A request sealed to the verified entry key is answered.
async fn sealed_to_replica_alone(url: &str, verified: &proto::bundle::VerifiedBundle) {
    let request = serde_json::to_vec(&json!({"model": MODEL, "input": "sealed"})).unwrap();
    let (headers, body, client_key) =
        seal_request(&verified.entry_keys[0], Aead::Aes128Gcm, &request).unwrap();
    let r = post_sealed(url, &headers, body).await;
    assert_eq!(r.status(), 200);
    assert!(open_response_with_trailer(&client_key, &r.bytes().await.unwrap()).is_ok());
}

/// The published key list (JSON) and `field` of each enclave-held key.
async fn enclave_keys(url: &str, field: &str) -> (Value, Vec<u64>) {
    let keys = get_json(&format!("{url}/.well-known/hpke-keys?format=json")).await;
    let values = keys["keys"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|k| k["held_by"] == "enclave")
        .map(|k| k[field].as_u64().unwrap())
        .collect();
    (keys, values)
}
