//! Unit tests of the sealed exchange: stream events, receipt checks.

use super::sse::{ends_with_error_event, forwardable, is_error_object};
use super::{check_receipt, RequestRecord};
use crate::verify::verify_evidence;
use proto::bundle::{EvidenceBundle, LegacyEvidence};
use proto::completions::STREAM_DONE;
use proto::policy::Policy;
use proto::report::CheckStatus;

#[test]
fn whole_events_go_out_and_done_waits() {
    let ev = b"data: {\"a\":1}\n\n";
    // A partial event waits for the rest.
    assert_eq!(forwardable(&ev[..7], 0), (0, false));
    assert_eq!(forwardable(ev, 0), (ev.len(), false));
    let mut all = ev.to_vec();
    all.extend_from_slice(ev);
    all.extend_from_slice(&STREAM_DONE[..8]);
    // `[DONE]` split across pieces: nothing of it goes out...
    assert_eq!(forwardable(&all, ev.len()), (2 * ev.len(), false));
    all.extend_from_slice(&STREAM_DONE[8..]);
    // ...and once whole it is recognised and held.
    assert_eq!(forwardable(&all, 2 * ev.len()), (2 * ev.len(), true));
    // `data: [DONE]` inside an event's text is not the end.
    let inner = b"data: {\"t\":\"data: [DONE]\"}\n\n";
    assert_eq!(forwardable(inner, 0), (inner.len(), false));
}

/// A one-stage receipt for `request`/`response` whose entry link says it
/// opened `opened`, in format `version`.
fn receipt(
    key: &ed25519_dalek::SigningKey,
    stage: &proto::receipt::StageKeys,
    x: &RequestRecord<'_>,
    response: &[u8],
    opened: proto::receipt::OpenedKey,
    version: proto::receipt::ReceiptVersion,
) -> proto::receipt::ReceiptTrailer {
    use proto::digest::Sha256Digest;
    use proto::receipt::{salted_digest, sign_receipt, Link, ReceiptBody, ReceiptTrailer, Sealing};
    let salt = [4; 32];
    let digest = |b: &[u8]| {
        let plain = Sha256Digest::of(b);
        if version.salted() {
            salted_digest(&salt, &plain)
        } else {
            plain
        }
    };
    let link = Link {
        receipt_id: [1; 16],
        stage_index: 0,
        layers: stage.layers,
        evidence_digest: stage.evidence_digest,
        received_digest: digest(x.body),
        sent_digest: digest(response),
        prev_link_digest: None,
        opened: (version != proto::receipt::ReceiptVersion::V2).then_some(opened),
    };
    let receipt = sign_receipt(
        key,
        &ReceiptBody {
            version,
            receipt_id: [1; 16],
            issued_at_ms: 0,
            endpoint: x.endpoint.into(),
            model_id: "m".into(),
            manifest_digest: Sha256Digest::of(b"manifest"),
            request_digest: digest(x.body),
            response_digest: digest(response),
            client_nonce: Some(x.nonce.to_vec()),
            sequence: 0,
            mock: true,
            sealing: Sealing::Enclave,
            chain: Vec::new(),
            exit_link: link,
        },
    );
    ReceiptTrailer {
        receipt,
        digest_salt: version.salted().then_some(salt),
    }
}

/// The proxy accepts a receipt only when its entry stage says it opened
/// the proxy's own encapsulated key: a host that opened the request and
/// re-sealed it (the receipt still saying "enclave") is refused, and so
/// is a v2 receipt, which cannot say, and one that names another endpoint
/// than the request went to.
#[test]
fn receipts_must_prove_the_enclave_opened_the_proxys_key() {
    use proto::digest::Sha256Digest;
    use proto::receipt::{OpenedKey, ReceiptVersion, SealedTo, StageKeys};
    let key = ed25519_dalek::SigningKey::from_bytes(&[3; 32]);
    let stage = StageKeys {
        stage_index: 0,
        layers: [0, 30],
        evidence_digest: Sha256Digest::of(b"evidence"),
        receipt_key: key.verifying_key().to_bytes(),
    };
    let verified = proto::bundle::VerifiedBundle {
        stage_keys: vec![stage.clone()],
        entry_keys: Vec::new(),
        manifest_digest: Sha256Digest::of(b"manifest"),
        mock: true,
        measurements: Vec::new(),
    };
    let enc = [0x11; 32];
    let nonce = [9; 16];
    let x = RequestRecord {
        endpoint: "/v1/completions",
        body: b"{\"prompt\":\"hi\"}",
        nonce: &nonce,
        sealed_to: SealedTo {
            key_id: 5,
            enc: &enc,
        },
    };
    let response = b"{\"choices\":[]}";
    let check = |opened: OpenedKey, version: ReceiptVersion| {
        let rc = receipt(&key, &stage, &x, response, opened, version);
        check_receipt(&verified, true, &x, &rc, response)
    };
    let honest = check(OpenedKey::of(5, &enc), ReceiptVersion::CURRENT);
    assert!(honest.ok(), "{:#?}", honest.checks);
    // The same receipt without the salt of its digests (a trailer that
    // lost it): the request and response cannot be checked, so it fails.
    let mut unsalted = receipt(
        &key,
        &stage,
        &x,
        response,
        OpenedKey::of(5, &enc),
        ReceiptVersion::CURRENT,
    );
    unsalted.digest_salt = None;
    let report = check_receipt(&verified, true, &x, &unsalted, response);
    assert_eq!(
        report.failure().map(|e| e.code()),
        Some("digest_salt_missing")
    );
    let resealed = check(OpenedKey::of(5, &[0x22; 32]), ReceiptVersion::CURRENT);
    assert_eq!(
        resealed.failure().map(|e| e.code()),
        Some("sealing_mismatch"),
        "{:#?}",
        resealed.checks
    );
    let old = check(OpenedKey::of(5, &enc), ReceiptVersion::V2);
    assert!(!old.ok());
    assert_eq!(failed(&old), ["proxy.sealing"], "{:#?}", old.checks);
    // A receipt the stage signed for the same bytes served as another
    // endpoint (a host that relabelled the request): refused by the
    // endpoint check alone.
    let relabelled = RequestRecord {
        endpoint: "/v1/chat/completions",
        ..x
    };
    let rc = receipt(
        &key,
        &stage,
        &relabelled,
        response,
        OpenedKey::of(5, &enc),
        ReceiptVersion::CURRENT,
    );
    let report = check_receipt(&verified, true, &x, &rc, response);
    assert_eq!(failed(&report), ["proxy.endpoint"], "{:#?}", report.checks);
}

/// The names of a report's failed checks.
fn failed(report: &proto::receipt::VerifyReport) -> Vec<&str> {
    report
        .checks
        .iter()
        .filter(|c| c.error.is_some())
        .map(|c| c.name.as_str())
        .collect()
}

#[test]
fn only_an_error_event_may_end_a_stream_without_receipt() {
    assert!(is_error_object(br#"{"error":{"message":"x"}}"#));
    assert!(!is_error_object(br#"{"choices":[]}"#));
    assert!(!is_error_object(br#"{"error":"x"}"#));
    assert!(!is_error_object(b"not json"));
    let ok = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
    let mut failed = ok.to_vec();
    failed.extend(b"data: {\"error\":{\"message\":\"stage failed\"}}\n\n");
    assert!(ends_with_error_event(&failed));
    // Events that just stop are not a complete answer.
    assert!(!ends_with_error_event(ok));
    assert!(!ends_with_error_event(b""));
    // An error event earlier in the stream does not count.
    let mut later = failed.clone();
    later.extend_from_slice(ok);
    assert!(!ends_with_error_event(&later));
}

/// A one-stage mock bundle bound to `nonce` whose documents carry the
/// legacy claims binding (no purpose label) when `legacy`, else the
/// purposed one; and a policy pinning its measurement.
fn mock_bundle(nonce: &[u8], legacy: bool) -> (EvidenceBundle, Policy) {
    use proto::attestation::{
        attest_claims, legacy_claims_binding, mock_measurement, AttestationProvider,
        EvidencePurpose, MockProvider,
    };
    use proto::bundle::StageEvidence;
    use proto::digest::Sha256Digest;
    use proto::frames::StageClaims;
    use proto::sealing::{KeyConfig, ServerKey};
    let manifest = b"manifest".to_vec();
    let m = mock_measurement(
        &Sha256Digest::of(b"bin"),
        &Sha256Digest::of(&manifest),
        &Sha256Digest::of(b"policy"),
    );
    let p = MockProvider::new("stage-0", &m);
    let c = StageClaims {
        stage_index: 0,
        num_stages: 1,
        layer_start: 0,
        layer_end: 6,
        model_id: "m".into(),
        manifest_sha256: Sha256Digest::of(&manifest),
        receipt_key: [7; 32],
        hpke_keys: KeyConfig::encode_list(&[ServerKey::derive(1, b"k").config()]),
        weights: None,
    };
    let make = |purpose: EvidencePurpose, nonce: &[u8]| {
        if legacy {
            let ud = legacy_claims_binding(p.format(), &proto::cbor::to_vec(&c));
            p.attest(&c.receipt_key, &ud, nonce).unwrap()
        } else {
            attest_claims(&p, &c.receipt_key, purpose, &c, nonce).unwrap()
        }
    };
    let bundle = EvidenceBundle {
        nonce: nonce.to_vec(),
        manifest,
        transparency: None,
        stages: vec![StageEvidence {
            index: 0,
            evidence: make(EvidencePurpose::Attestation, nonce),
            boot_evidence: make(EvidencePurpose::Boot, &[]),
            claims: c.clone(),
            key_set: None,
        }],
    };
    let policy = Policy::from_toml(&format!(
        "allow_mock = true\n[[stages]]\nindex = 0\nlayers = [0, 6]\nmeasurements = [\"{}\"]\n",
        m.pinned_form()
    ))
    .unwrap();
    (bundle, policy)
}

/// Issue 34, item 5: evidence made before documents carried a purpose
/// label is accepted only by the offline verbs, which say so; the online
/// path (the SDK and the proxy, `Attested::verify`, and `gateway seal`)
/// refuses it before trusting the keys it vouches for.
#[test]
fn legacy_evidence_only_offline() {
    let nonce = b"fresh nonce";
    let (legacy, policy) = mock_bundle(nonce, true);
    // Online: refused, naming the reason.
    let refused = super::Attested::verify(legacy.clone(), &policy, nonce)
        .expect_err("the online path accepted legacy evidence");
    assert!(
        refused.iter().any(|l| l.contains("LEGACY claims binding")),
        "{refused:?}"
    );
    let online = verify_evidence(&legacy, &policy, Some(nonce), None, LegacyEvidence::Refuse);
    assert!(!online.ok());
    // Offline (`gateway verify evidence` / `verify receipt`): accepted, and
    // reported as legacy.
    let offline = verify_evidence(&legacy, &policy, Some(nonce), None, LegacyEvidence::Accept);
    assert!(offline.ok());
    assert!(offline
        .lines
        .iter()
        .any(|l| l.status == CheckStatus::Pass && l.detail.contains("LEGACY")));
    // Current evidence passes the online path.
    let (current, policy) = mock_bundle(nonce, false);
    let attested = super::Attested::verify(current, &policy, nonce).unwrap();
    assert_eq!(attested.verified.stage_keys.len(), 1);
}
