//! End to end: sealed requests (client HPKE to the enclave key), receipts
//! from the real stages verified offline against a verified evidence bundle.

mod common;

use base64::Engine as _;
use common::{
    assert_error_shape, attestation_cbor, client, client_policy_text, evidence_bundle,
    expect_api_error, http_get, post_exact, post_sealed, Gateway, Options,
};
use proto::bundle::EvidenceBundle;
use proto::policy::Policy;
use proto::receipt::{parse_unverified, verify_receipt, ReceiptTrailer, StageKeys, VerifyInputs};
use proto::sealing::{open_response_with_trailer, seal_request, Aead, KeyConfig};
use serde_json::json;

const MODEL: &str = "all-MiniLM-L6-v2";

/// A client's policy: the measurements the gateway reports, pinned, mock allowed.
async fn client_policy(url: &str) -> Policy {
    Policy::from_toml(&client_policy_text(url).await).unwrap()
}

async fn bundle(url: &str, nonce: &[u8]) -> EvidenceBundle {
    evidence_bundle(url, nonce).await
}

#[tokio::test]
async fn plain_request_gets_a_receipt_that_verifies() {
    let gw = Gateway::start(Options::default());
    let policy = client_policy(&gw.url).await;
    let nonce = b"client-chosen-nonce-1";
    let b = bundle(&gw.url, nonce).await;
    let (lines, verified) = b.verify(&policy, nonce);
    let verified = verified.unwrap_or_else(|| panic!("bundle must verify: {lines:#?}"));
    assert!(verified.mock);
    // The same bundle with another nonce is stale.
    assert!(b.verify(&policy, b"other").1.is_none());

    let request =
        serde_json::to_vec(&json!({"model": MODEL, "input": ["receipts bind bytes", "second"]}))
            .unwrap();
    let receipt_nonce = b"per-request nonce";
    let url = format!("{}/v1/embeddings", gw.url);
    let r = post_exact(&url, request.clone(), Some(&hex::encode(receipt_nonce))).await;
    assert_eq!(r.status(), 200);
    let id = r.headers()["receipt-id"].to_str().unwrap().to_string();
    let header_receipt = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(r.headers()["receipt"].to_str().unwrap())
        .unwrap();
    // A plain request: the gateway saw it, so it hands out the salt of the
    // receipt's digests too (with the response and with the stored receipt).
    let salt_hex = r.headers()["receipt-digest-salt"]
        .to_str()
        .unwrap()
        .to_string();
    let salt: proto::receipt::DigestSalt = hex::decode(&salt_hex).unwrap().try_into().unwrap();
    let response = r.bytes().await.unwrap().to_vec();
    let body: serde_json::Value = serde_json::from_slice(&response).unwrap();
    assert_eq!(body["data"].as_array().unwrap().len(), 2);

    let stored = http_get(&format!("{}/v1/receipts/{id}", gw.url)).await;
    assert_eq!(stored.status(), 200);
    assert_eq!(stored.headers()["receipt-digest-salt"], salt_hex.as_str());
    let stored = stored.bytes().await.unwrap().to_vec();
    assert_eq!(stored, header_receipt);

    let verify = |req: &[u8], resp: &[u8], nonce: Option<&[u8]>| {
        let mut inputs = VerifyInputs::new(&stored, &verified.stage_keys);
        inputs.request = Some(req);
        inputs.response = Some(resp);
        inputs.digest_salt = Some(&salt);
        inputs.expected_nonce = nonce;
        inputs.expected_manifest = Some(verified.manifest_digest);
        inputs.allow_mock = true;
        verify_receipt(&inputs)
    };
    let report = verify(&request, &response, Some(receipt_nonce));
    assert!(report.ok(), "{:#?}", report.checks);
    let receipt = report.receipt.as_ref().unwrap();
    assert_eq!(receipt.links(), 2, "one link per stage");
    assert_eq!(receipt.chain.len(), 1, "stage 0's signed link");
    assert_eq!(receipt.exit_link.stage_index, 1);
    assert!(receipt.mock);
    assert_eq!(receipt.sealing.as_str(), "plain");

    let mut other = response.clone();
    other[10] ^= 1;
    assert_eq!(
        verify(&request, &other, Some(receipt_nonce))
            .verdict()
            .unwrap_err()
            .code(),
        "response_mismatch"
    );
    assert_eq!(
        verify(b"{}", &response, Some(receipt_nonce))
            .verdict()
            .unwrap_err()
            .code(),
        "request_mismatch"
    );
    assert_eq!(
        verify(&request, &response, Some(b"wrong"))
            .verdict()
            .unwrap_err()
            .code(),
        "nonce_mismatch"
    );

    let missing = http_get(&format!("{}/v1/receipts/{}", gw.url, "00".repeat(16))).await;
    assert_eq!(missing.status(), 404);
}

#[tokio::test]
async fn sealed_request_round_trip_replay_and_unknown_key() {
    let gw = Gateway::start(Options::default());
    let keys = http_get(&format!("{}/.well-known/hpke-keys", gw.url)).await;
    assert_eq!(keys.headers()["content-type"], "application/ohttp-keys");
    let all_keys = KeyConfig::decode_list(&keys.bytes().await.unwrap()).unwrap();
    assert_eq!(
        all_keys.len(),
        2,
        "the enclave key and the gateway-held key"
    );
    let (keys, gateway_keys): (Vec<_>, Vec<_>) =
        all_keys.into_iter().partition(|k| k.key_id != 0x80);
    let nonce = b"n";
    let b = bundle(&gw.url, nonce).await;
    let verified = b
        .verify(&client_policy(&gw.url).await, nonce)
        .1
        .expect("bundle verifies");
    assert_eq!(
        verified.entry_keys, keys,
        "published keys are the attested ones"
    );

    for aead in [Aead::Aes128Gcm, Aead::ChaCha20Poly1305] {
        let request =
            serde_json::to_vec(&json!({"model": MODEL, "input": "sealed end to end"})).unwrap();
        let (headers, body, client_key) = seal_request(&keys[0], aead, &request).unwrap();
        let send = |body: Vec<u8>| {
            let mut rb = client()
                .post(format!("{}/v1/embeddings", gw.url))
                .body(body);
            for (k, v) in headers.to_header_values() {
                rb = rb.header(k, v);
            }
            rb.send()
        };
        let r = send(body.clone()).await.unwrap();
        assert_eq!(r.status(), 200);
        let receipt = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(r.headers()["receipt"].to_str().unwrap())
            .unwrap();
        // Sealed to the enclave: the host never learns the salt.
        assert!(r.headers().get("receipt-digest-salt").is_none());
        let sealed = r.bytes().await.unwrap().to_vec();
        assert!(
            serde_json::from_slice::<serde_json::Value>(&sealed).is_err(),
            "the host relays ciphertext"
        );
        let (plain, trailer) = open_response_with_trailer(&client_key, &sealed).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&plain).unwrap();
        assert_eq!(v["data"][0]["embedding"].as_array().unwrap().len(), 384);
        // The exit stage sealed the same receipt into the response, with
        // the salt of its digests.
        let trailer = ReceiptTrailer::decode(&trailer.unwrap()).unwrap();
        assert_eq!(trailer.receipt, receipt, "receipt trailer");
        assert_receipt_sealing(&trailer, &verified.stage_keys, &request, &plain, "enclave");
        // The stored receipt comes without it too.
        let id = hex::encode(parse_unverified(&receipt).unwrap().0.receipt_id);
        let stored = http_get(&format!("{}/v1/receipts/{id}", gw.url)).await;
        assert!(stored.headers().get("receipt-digest-salt").is_none());
        assert_eq!(stored.bytes().await.unwrap(), receipt);

        // The same sealed request again is a replay.
        let again = send(body).await.unwrap();
        expect_api_error(again, 400, "replay").await;
    }

    // Sealed to the gateway-held key: the gateway opens and re-seals; the
    // receipt says so.
    let request =
        serde_json::to_vec(&json!({"model": MODEL, "input": "via the gateway key"})).unwrap();
    let (headers, body, client_key) =
        seal_request(&gateway_keys[0], Aead::ChaCha20Poly1305, &request).unwrap();
    let r = post_sealed(&gw.url, &headers, body).await;
    assert_eq!(r.status(), 200);
    let receipt = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(r.headers()["receipt"].to_str().unwrap())
        .unwrap();
    let (plain, trailer) =
        open_response_with_trailer(&client_key, &r.bytes().await.unwrap()).unwrap();
    let trailer = ReceiptTrailer::decode(&trailer.unwrap()).unwrap();
    assert_eq!(trailer.receipt, receipt, "re-sealed receipt trailer");
    assert_receipt_sealing(&trailer, &verified.stage_keys, &request, &plain, "gateway");

    // A key id that is not published: a distinct error telling the client to refetch.
    let mut stale = keys[0].clone();
    stale.key_id = (1..=0x7f).find(|id| *id != keys[0].key_id).unwrap();
    let (headers, body, _) = seal_request(&stale, Aead::Aes128Gcm, b"{}").unwrap();
    let r = post_sealed(&gw.url, &headers, body).await;
    let e = expect_api_error(r, 400, "/.well-known/hpke-keys").await;
    assert_eq!(e["error"]["code"], "hpke_key_unknown");

    // Issue 29, item 4: a sealed request older than MAX_REQUEST_AGE_SECS is
    // refused outright, whichever key it is sealed to (so no replay
    // outlives the replay guard's window), and a host that moves its
    // sealing time to look fresh gets a body that does not open.
    let request = serde_json::to_vec(&json!({"model": MODEL, "input": "old"})).unwrap();
    let old = proto::sealing::unix_now() - proto::sealing::MAX_REQUEST_AGE_SECS - 5;
    for key in [&keys[0], &gateway_keys[0]] {
        let (headers, mut sealer, _) = proto::sealing::seal_request_stream_at(
            key,
            Aead::Aes128Gcm,
            old,
            &mut rand::rngs::OsRng,
        )
        .unwrap();
        let body = sealer.seal(&request, true).unwrap();
        let r = post_sealed(&gw.url, &headers, body.clone()).await;
        let e = expect_api_error(r, 400, "sealed at").await;
        assert_eq!(e["error"]["param"], "hpke-sealed-at", "{e}");
        assert_eq!(e["error"]["code"], "sealed_request_stale", "{e}");
        let moved = proto::sealing::SealedHeaders {
            sealed_at: proto::sealing::unix_now(),
            ..headers
        };
        let r = post_sealed(&gw.url, &moved, body).await;
        expect_api_error(r, 400, "cannot be opened").await;
    }

    // A tampered sealed body does not open in the enclave.
    let (headers, mut body, _) =
        seal_request(&keys[0], Aead::Aes128Gcm, b"{\"model\":\"x\"}").unwrap();
    let n = body.len();
    body[n - 1] ^= 1;
    let r = post_sealed(&gw.url, &headers, body).await;
    expect_api_error(r, 400, "cannot be opened").await;

    // An invalid request inside a sealed body gets a sealed error.
    let (headers, body, client_key) = seal_request(
        &keys[0],
        Aead::Aes128Gcm,
        b"{\"model\":\"nope\",\"input\":\"x\"}",
    )
    .unwrap();
    let r = post_sealed(&gw.url, &headers, body).await;
    assert_eq!(r.status(), 404);
    let (plain, trailer) =
        open_response_with_trailer(&client_key, &r.bytes().await.unwrap()).unwrap();
    assert_eq!(trailer, None, "an error has no receipt");
    let e: serde_json::Value = serde_json::from_slice(&plain).unwrap();
    assert_eq!(e["error"]["code"], "model_not_found");
}

/// Issue 15: `/v1/attestation` is bounded. Evidence made for a nonce is
/// served again for that nonce (the same documents, not counted); calls
/// that need fresh evidence are limited per client address (429 +
/// `Retry-After`); a new nonce still gets documents made for it.
#[tokio::test]
async fn attestation_is_cached_per_nonce_and_rate_limited_per_client() {
    let gw = Gateway::start(Options {
        server_extra: "attestation_per_minute = 3\nattestation_cache_secs = 60\n".into(),
        ..Options::default()
    });
    let (s, _, first) = attestation_cbor(&gw.url, b"n-1").await;
    assert_eq!(s, 200);
    let (s, _, again) = attestation_cbor(&gw.url, b"n-1").await;
    assert_eq!(s, 200);
    assert_eq!(first, again, "the same nonce is answered from the cache");
    for n in [&b"n-2"[..], b"n-3"] {
        let (s, _, body) = attestation_cbor(&gw.url, n).await;
        assert_eq!(s, 200);
        let b: EvidenceBundle = proto::cbor::from_slice(&body).unwrap();
        assert_eq!(b.nonce, n, "fresh evidence for the client's own nonce");
        assert_ne!(b.stages[0].evidence, {
            let f: EvidenceBundle = proto::cbor::from_slice(&first).unwrap();
            f.stages[0].evidence.clone()
        });
    }
    // Three fresh calls used the minute's budget.
    let (s, retry, body) = attestation_cbor(&gw.url, b"n-4").await;
    assert_eq!(s, 429, "{}", String::from_utf8_lossy(&body));
    let retry: u64 = retry.expect("retry-after").parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    let e: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_error_shape(&e);
    assert_eq!(e["error"]["code"], "rate_limit_exceeded");
    // A cached nonce is still served.
    let (s, _, cached) = attestation_cbor(&gw.url, b"n-1").await;
    assert_eq!(s, 200);
    assert_eq!(cached, first);
}

/// Issue 47, finding 3: one address flooding `/v1/attestation` with fresh
/// nonces, first within its own rate and then far past it, cannot starve
/// another address (the calls it was refused used to spend the global
/// budget, and it could take all of a second's budget itself).
#[tokio::test(flavor = "multi_thread")]
async fn a_flooding_address_cannot_starve_another_of_fresh_attestation() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    let gw = Gateway::start(Options {
        server_extra: "attestation_per_minute = 60\nattestation_cache_secs = 0\n".into(),
        ..Options::default()
    });
    // Two loopback source addresses: the gateway counts clients by address.
    let from = |ip: &str| {
        reqwest::Client::builder()
            .local_address(ip.parse::<std::net::IpAddr>().unwrap())
            .timeout(std::time::Duration::from_secs(30))
            .build()
            .unwrap()
    };
    let (flooder, victim) = (from("127.0.0.1"), from("127.0.0.2"));
    let fresh = |c: reqwest::Client, url: String, nonce: String| async move {
        c.get(format!("{url}/v1/attestation?nonce={}", hex::encode(nonce)))
            .header("accept", "application/cbor")
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, refused) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let (c, url, stop) = (flooder.clone(), gw.url.clone(), stop.clone());
            let (ok, refused) = (ok.clone(), refused.clone());
            tokio::spawn(async move {
                for i in 0.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    match fresh(c.clone(), url.clone(), format!("flood {t} {i}")).await {
                        200 => ok.fetch_add(1, Ordering::Relaxed),
                        429 => refused.fetch_add(1, Ordering::Relaxed),
                        s => panic!("flood: status {s}"),
                    };
                }
            })
        })
        .collect();
    // The flood runs through its own minute's budget meanwhile.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let mut answers = Vec::new();
    for i in 0..12 {
        answers.push(fresh(victim.clone(), gw.url.clone(), format!("victim {i}")).await);
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let (ok, refused) = (ok.load(Ordering::Relaxed), refused.load(Ordering::Relaxed));
    assert!(ok <= 60, "the flooder got {ok} fresh answers");
    assert!(refused > 200, "the flood was refused only {refused} times");
    assert!(
        answers.iter().all(|&s| s == 200),
        "the other address got {answers:?} while one address was answered {ok} and refused {refused} times"
    );
}

/// Verifies a receipt over `request` and `response` (mock evidence allowed)
/// and asserts who opened the request.
fn assert_receipt_sealing(
    trailer: &ReceiptTrailer,
    stage_keys: &[StageKeys],
    request: &[u8],
    response: &[u8],
    sealing: &str,
) {
    let mut inputs = VerifyInputs::new(&trailer.receipt, stage_keys);
    inputs.request = Some(request);
    inputs.response = Some(response);
    inputs.digest_salt = trailer.digest_salt.as_ref();
    inputs.allow_mock = true;
    let report = verify_receipt(&inputs);
    assert!(report.ok(), "{:#?}", report.checks);
    assert_eq!(report.receipt.unwrap().sealing.as_str(), sealing);
}
