//! Receipt format, signing and verification tests.

use super::canonical::{canonical_bytes, decode_canonical, encode, uint};
use super::error::ReceiptError;
use super::format::{Link, OpenedKey, ReceiptBody, ReceiptVersion, Sealing};
use super::report::{CheckStatus, VerifyReport};
use super::salt::{salted_digest, DigestSalt};
use super::sign::{link_digest, parse_unverified, sign, sign_link, sign_link_as, sign_receipt};
use super::verify::{verify_receipt, SealedTo, StageKeys, VerifyInputs};
use super::{ReceiptId, RECEIPT_CONTENT_TYPE};
use crate::digest::Sha256Digest;
use ciborium::value::Value;
use ed25519_dalek::SigningKey;

struct Fixture {
    keys: Vec<SigningKey>,
    stages: Vec<StageKeys>,
    request: Vec<u8>,
    response: Vec<u8>,
    nonce: Vec<u8>,
    /// The client's encapsulated key (sealed to key id 7).
    enc: Vec<u8>,
    /// The salt of the digests (v4).
    salt: DigestSalt,
}

impl Fixture {
    /// The digest a receipt of `version` carries for `bytes`.
    fn digest_as(&self, version: ReceiptVersion, bytes: &[u8]) -> Sha256Digest {
        let plain = Sha256Digest::of(bytes);
        if version.salted() {
            salted_digest(&self.salt, &plain)
        } else {
            plain
        }
    }

    /// The digest a current receipt carries for `bytes`.
    fn digest(&self, bytes: &[u8]) -> Sha256Digest {
        self.digest_as(ReceiptVersion::CURRENT, bytes)
    }
}

fn signing_key(label: &str) -> SigningKey {
    SigningKey::from_bytes(&Sha256Digest::of(label.as_bytes()).0)
}

fn fixture() -> Fixture {
    let keys: Vec<_> = (0..3).map(|i| signing_key(&format!("stage {i}"))).collect();
    let stages = keys
        .iter()
        .enumerate()
        .map(|(i, k)| StageKeys {
            stage_index: i as u32,
            layers: [2 * i as u32, 2 * i as u32 + 2],
            evidence_digest: Sha256Digest::of(format!("evidence {i}").as_bytes()),
            receipt_key: k.verifying_key().to_bytes(),
        })
        .collect();
    Fixture {
        keys,
        stages,
        request: br#"{"input":"hi"}"#.to_vec(),
        response: br#"{"data":[]}"#.to_vec(),
        nonce: b"nonce-1".to_vec(),
        enc: Sha256Digest::of(b"client enc").0.to_vec(),
        salt: Sha256Digest::of(b"salt").0,
    }
}

fn links(f: &Fixture, id: ReceiptId) -> Vec<Link> {
    links_as(f, id, ReceiptVersion::CURRENT)
}

/// The links of a receipt of `version` (its digests salted or not).
fn links_as(f: &Fixture, id: ReceiptId, version: ReceiptVersion) -> Vec<Link> {
    let d = |b: &[u8]| f.digest_as(version, b);
    let n = f.stages.len();
    (0..n)
        .map(|i| Link {
            receipt_id: id,
            stage_index: i as u32,
            layers: f.stages[i].layers,
            evidence_digest: f.stages[i].evidence_digest,
            received_digest: if i == 0 {
                d(&f.request)
            } else {
                d(format!("act {}", i - 1).as_bytes())
            },
            sent_digest: if i + 1 == n {
                d(&f.response)
            } else {
                d(format!("act {i}").as_bytes())
            },
            prev_link_digest: None,
            opened: (i == 0).then(|| OpenedKey::of(7, &f.enc)),
        })
        .collect()
}

/// Signs the links before the exit stage's in order, filling
/// prev_link_digest; returns them and the exit stage's (unsigned) link.
fn chain(f: &Fixture, links: &[Link]) -> (Vec<Vec<u8>>, Link) {
    chain_as(f, links, ReceiptVersion::CURRENT)
}

/// [`chain`] with the links signed in the link format of `version`.
fn chain_as(f: &Fixture, links: &[Link], version: ReceiptVersion) -> (Vec<Vec<u8>>, Link) {
    let mut out: Vec<Vec<u8>> = Vec::new();
    let (exit, upstream) = links.split_last().unwrap();
    for (i, l) in upstream.iter().enumerate() {
        let mut l = l.clone();
        l.prev_link_digest = out.last().map(|p| link_digest(p));
        out.push(sign_link_as(&f.keys[i], &l, version));
    }
    let mut exit = exit.clone();
    exit.prev_link_digest = out.last().map(|p| link_digest(p));
    (out, exit)
}

fn body(f: &Fixture, c: (Vec<Vec<u8>>, Link)) -> ReceiptBody {
    body_as(f, c, ReceiptVersion::CURRENT)
}

/// A receipt body of `version` (its digests salted or not).
fn body_as(
    f: &Fixture,
    (chain, exit_link): (Vec<Vec<u8>>, Link),
    version: ReceiptVersion,
) -> ReceiptBody {
    ReceiptBody {
        version,
        receipt_id: [7; 16],
        issued_at_ms: 1_700_000_000_000,
        endpoint: "/v1/embeddings".into(),
        model_id: "all-MiniLM-L6-v2".into(),
        manifest_digest: Sha256Digest::of(b"manifest"),
        request_digest: f.digest_as(version, &f.request),
        response_digest: f.digest_as(version, &f.response),
        client_nonce: Some(f.nonce.clone()),
        sequence: 1,
        mock: true,
        sealing: Sealing::Enclave,
        chain,
        exit_link,
    }
}

fn valid(f: &Fixture) -> Vec<u8> {
    let c = chain(f, &links(f, [7; 16]));
    sign_receipt(&f.keys[2], &body(f, c))
}

fn inputs<'a>(f: &'a Fixture, receipt: &'a [u8]) -> VerifyInputs<'a> {
    VerifyInputs {
        receipt,
        stages: &f.stages,
        request: Some(&f.request),
        response: Some(&f.response),
        digest_salt: Some(&f.salt),
        expected_nonce: Some(&f.nonce),
        expected_manifest: Some(Sha256Digest::of(b"manifest")),
        allow_mock: true,
        sealed_to: Some(SealedTo {
            key_id: 7,
            enc: &f.enc,
        }),
    }
}

/// The valid receipt and its report, which must pass.
fn valid_report(f: &Fixture) -> (Vec<u8>, VerifyReport) {
    let rc = valid(f);
    let report = verify_receipt(&inputs(f, &rc));
    assert!(report.ok(), "{:#?}", report.checks);
    (rc, report)
}

fn reason(f: &Fixture, receipt: &[u8]) -> Option<ReceiptError> {
    verify_receipt(&inputs(f, receipt)).failure().cloned()
}

#[test]
fn valid_receipt_verifies() {
    let f = fixture();
    let (rc, report) = valid_report(&f);
    assert!(report.checks.iter().all(|c| c.status == CheckStatus::Pass));
    assert_eq!(report.receipt.as_ref().unwrap().sequence, 1);
    let json = report.to_json();
    assert_eq!(json["ok"], true);
    assert_eq!(json["receipt"]["sealing"], "enclave");
    // With nothing optional: passes with skips.
    let mut bare = VerifyInputs::new(&rc, &f.stages);
    bare.allow_mock = true;
    let report = verify_receipt(&bare);
    assert!(report.ok());
    assert!(report
        .checks
        .iter()
        .any(|c| c.status == CheckStatus::Skipped));
    let (b, kid) = parse_unverified(&rc).unwrap();
    assert_eq!(b.receipt_id, [7; 16]);
    assert_eq!(kid, f.stages[2].receipt_key);
}

#[test]
fn payload_is_deterministic_cbor_with_sorted_integer_keys() {
    let f = fixture();
    let b = body(&f, chain(&f, &links(&f, [7; 16])));
    let bytes = b.to_cbor();
    // Map of 13 entries, keys 1..13 in order, each a one-byte uint.
    assert_eq!(bytes[0], 0xad);
    let Value::Map(entries) = decode_canonical(&bytes).unwrap() else {
        panic!()
    };
    let keys: Vec<u64> = entries
        .iter()
        .map(|(k, _)| u64::try_from(k.as_integer().unwrap()).unwrap())
        .collect();
    assert_eq!(keys, (1..=13).collect::<Vec<_>>());
    assert_eq!(&bytes[1..3], &[0x01, 0x50]); // key 1, bstr(16)
    assert_eq!(
        ReceiptBody::from_cbor(&bytes, ReceiptVersion::CURRENT).unwrap(),
        b
    );

    // Canonical ordering is by encoded bytes: 10 (0x0a) < 23 (0x17) < 24 (0x1818) < -1 (0x20).
    let v = Value::Map(vec![
        (Value::Integer((-1).into()), Value::Null),
        (uint(24), Value::Null),
        (uint(10), Value::Null),
        (uint(23), Value::Null),
    ]);
    assert_eq!(
        canonical_bytes(&v).unwrap(),
        vec![0xa4, 0x0a, 0xf6, 0x17, 0xf6, 0x18, 0x18, 0xf6, 0x20, 0xf6]
    );
    // Nested maps are sorted too; duplicates are refused.
    let nested = Value::Array(vec![Value::Map(vec![
        (uint(2), Value::Null),
        (uint(1), Value::Null),
    ])]);
    assert_eq!(
        canonical_bytes(&nested).unwrap(),
        vec![0x81, 0xa2, 0x01, 0xf6, 0x02, 0xf6]
    );
    let dup = Value::Map(vec![(uint(1), Value::Null), (uint(1), Value::Null)]);
    assert_eq!(canonical_bytes(&dup), Err(ReceiptError::NotCanonical));

    // Non-canonical encodings of the same value are refused.
    assert_eq!(
        decode_canonical(&[0xa2, 0x02, 0xf6, 0x01, 0xf6]),
        Err(ReceiptError::NotCanonical)
    ); // unsorted keys
    assert_eq!(
        decode_canonical(&[0xa1, 0x18, 0x01, 0xf6]),
        Err(ReceiptError::NotCanonical)
    ); // key 1 in two bytes
    assert_eq!(
        decode_canonical(&[0xbf, 0x01, 0xf6, 0xff]),
        Err(ReceiptError::NotCanonical)
    ); // indefinite-length map
    assert_eq!(
        decode_canonical(&[0x5f, 0x41, 0x00, 0xff]),
        Err(ReceiptError::NotCanonical)
    ); // indefinite-length bstr
    assert!(matches!(
        decode_canonical(&[0xa1, 0x01, 0xf6, 0x00]),
        Err(ReceiptError::Malformed(_))
    ));
    let link = links(&f, [7; 16]).remove(0);
    assert_eq!(Link::from_cbor(&link.to_cbor()).unwrap(), link);
    // Link v2: 8 keys, the entry stage's key 8 = [key id, sha256(enc)].
    assert_eq!(link.to_cbor()[0], 0xa8);
    let v1 = link.to_cbor_as(ReceiptVersion::V2);
    assert_eq!(v1[0], 0xa7);
    let back = Link::from_cbor_as(&v1, ReceiptVersion::V2).unwrap();
    assert_eq!(back.opened, None);
    // A link of one format does not parse as the other.
    assert!(Link::from_cbor(&v1).is_err());
    assert!(Link::from_cbor_as(&link.to_cbor(), ReceiptVersion::V2).is_err());
}

#[test]
fn every_flipped_byte_is_rejected() {
    let f = fixture();
    let rc = valid(&f);
    for i in 0..rc.len() {
        let mut bad = rc.clone();
        bad[i] ^= 0x01;
        assert!(reason(&f, &bad).is_some(), "flip at byte {i} accepted");
    }
    // A flip inside the payload is a bad signature.
    let mut bad = rc.clone();
    let n = bad.len();
    bad[n / 2] ^= 0x01;
    assert_eq!(reason(&f, &bad), Some(ReceiptError::BadSignature));
}

#[test]
fn signer_checks() {
    let f = fixture();
    let b = body(&f, chain(&f, &links(&f, [7; 16])));
    let foreign = signing_key("foreign");
    assert_eq!(
        reason(&f, &sign_receipt(&foreign, &b)),
        Some(ReceiptError::UnknownSigner)
    );
    assert_eq!(
        reason(&f, &sign_receipt(&f.keys[0], &b)),
        Some(ReceiptError::SignerNotExitStage { stage: 0 })
    );
    // A link is not a receipt, even though the exit stage signed it.
    let link2 = sign_link(&f.keys[2], &chain(&f, &links(&f, [7; 16])).1);
    assert!(matches!(
        reason(&f, &link2),
        Some(ReceiptError::BadHeader(_))
    ));
}

#[test]
fn chain_attacks() {
    let f = fixture();
    let ls = links(&f, [7; 16]);
    let (good, exit) = chain(&f, &ls);
    let with_chain = |c: Vec<Vec<u8>>| sign_receipt(&f.keys[2], &body(&f, (c, exit.clone())));
    let chain_fails = |c: Vec<Vec<u8>>, want: ReceiptError| {
        assert_eq!(reason(&f, &with_chain(c)), Some(want));
    };

    // Swapped for an unattested stage: link 1 signed by a foreign key.
    let mut c = good.clone();
    let mut l1 = ls[1].clone();
    l1.prev_link_digest = Some(link_digest(&good[0]));
    c[1] = sign_link(&signing_key("foreign"), &l1);
    chain_fails(c, ReceiptError::LinkUnknownSigner { position: 1 });
    // Reordered.
    let c = vec![good[1].clone(), good[0].clone()];
    chain_fails(
        c,
        ReceiptError::LinkWrongStage {
            position: 0,
            signer_stage: 1,
        },
    );
    // Dropped.
    let c = vec![good[0].clone()];
    chain_fails(
        c,
        ReceiptError::ChainLength {
            expected: 3,
            got: 2,
        },
    );
    // Duplicated (extra link).
    let c = vec![good[0].clone(), good[1].clone(), good[1].clone()];
    chain_fails(
        c,
        ReceiptError::ChainLength {
            expected: 3,
            got: 4,
        },
    );
    // Duplicated in place of another.
    let c = vec![good[0].clone(), good[0].clone()];
    chain_fails(
        c,
        ReceiptError::LinkWrongStage {
            position: 1,
            signer_stage: 0,
        },
    );
    // The exit stage's link signed on its own and put into the chain
    // as well: one link too many.
    let c = vec![
        good[0].clone(),
        good[1].clone(),
        sign_link(&f.keys[2], &exit),
    ];
    chain_fails(
        c,
        ReceiptError::ChainLength {
            expected: 3,
            got: 4,
        },
    );
    // A one-stage chain for a three-stage pipeline: the exit stage's
    // link lands at position 0.
    assert_eq!(
        reason(&f, &with_chain(Vec::new())),
        Some(ReceiptError::ChainLength {
            expected: 3,
            got: 1
        })
    );
    // A link's signature broken.
    let mut c = good.clone();
    let n = c[1].len();
    c[1][n - 70] ^= 1;
    chain_fails(c, ReceiptError::LinkBadSignature { position: 1 });
    // Garbage as a link.
    let mut c = good.clone();
    c[1] = vec![0x01];
    assert!(matches!(
        reason(&f, &with_chain(c)),
        Some(ReceiptError::LinkMalformed { position: 1, .. })
    ));
}

#[test]
fn link_content_checks() {
    let f = fixture();
    let base = links(&f, [7; 16]);
    let case = |edit: &dyn Fn(&mut Vec<Link>)| {
        let mut ls = base.clone();
        edit(&mut ls);
        let c = chain(&f, &ls);
        reason(&f, &sign_receipt(&f.keys[2], &body(&f, c)))
    };
    assert_eq!(
        case(&|ls| ls[1].stage_index = 2),
        Some(ReceiptError::LinkStageIndex {
            position: 1,
            got: 2
        })
    );
    assert_eq!(
        case(&|ls| ls[2].receipt_id = [8; 16]),
        Some(ReceiptError::LinkReceiptId { position: 2 })
    );
    assert_eq!(
        case(&|ls| ls[1].layers = [2, 5]),
        Some(ReceiptError::LinkLayers { position: 1 })
    );
    assert_eq!(
        case(&|ls| ls[0].evidence_digest = Sha256Digest::of(b"other")),
        Some(ReceiptError::LinkEvidence { position: 0 })
    );
    assert_eq!(
        case(&|ls| ls[2].received_digest = Sha256Digest::of(b"other")),
        Some(ReceiptError::LinkDataFlow { position: 2 })
    );
    assert_eq!(
        case(&|ls| ls[0].received_digest = Sha256Digest::of(b"other")),
        Some(ReceiptError::ChainRequestDigest)
    );
    assert_eq!(
        case(&|ls| ls[2].sent_digest = Sha256Digest::of(b"other")),
        Some(ReceiptError::ChainResponseDigest)
    );
    // The exit stage's link points at link 0 instead of link 1.
    let (c, mut exit) = chain(&f, &base);
    exit.prev_link_digest = Some(link_digest(&c[0]));
    assert_eq!(
        reason(&f, &sign_receipt(&f.keys[2], &body(&f, (c, exit)))),
        Some(ReceiptError::LinkPrevDigest { position: 2 })
    );
    // A signed link pointing at the wrong link.
    let (mut c, exit) = chain(&f, &base);
    let mut l1 = base[1].clone();
    l1.prev_link_digest = Some(link_digest(&c[1]));
    c[1] = sign_link(&f.keys[1], &l1);
    assert_eq!(
        reason(&f, &sign_receipt(&f.keys[2], &body(&f, (c, exit)))),
        Some(ReceiptError::LinkPrevDigest { position: 1 })
    );
    // Stage 0 with a non-null previous digest.
    let (mut c, exit) = chain(&f, &base);
    let mut l0 = base[0].clone();
    l0.prev_link_digest = Some(Sha256Digest::of(b"x"));
    c[0] = sign_link(&f.keys[0], &l0);
    assert_eq!(
        reason(&f, &sign_receipt(&f.keys[2], &body(&f, (c, exit)))),
        Some(ReceiptError::LinkPrevDigest { position: 0 })
    );
    // A one-stage pipeline: the exit stage's link is the whole chain.
    let one = &f.stages[..1];
    let mut only = base[0].clone();
    only.sent_digest = f.digest(&f.response);
    let mut b = body(&f, (Vec::new(), only));
    let rc = sign_receipt(&f.keys[0], &b);
    let mut i = inputs(&f, &rc);
    i.stages = one;
    assert!(verify_receipt(&i).ok());
    b.exit_link.stage_index = 1;
    let rc = sign_receipt(&f.keys[0], &b);
    let mut i = inputs(&f, &rc);
    i.stages = one;
    assert_eq!(
        verify_receipt(&i).failure(),
        Some(&ReceiptError::LinkStageIndex {
            position: 0,
            got: 1
        })
    );
}

#[test]
fn inputs_checks() {
    let f = fixture();
    let rc = valid(&f);
    // Each input changed alone makes the receipt fail with its reason.
    let fails_with = |change: fn(&mut VerifyInputs<'_>), want: ReceiptError| {
        let mut i = inputs(&f, &rc);
        change(&mut i);
        assert_eq!(verify_receipt(&i).failure(), Some(&want));
    };
    fails_with(
        |i| i.request = Some(b"another request"),
        ReceiptError::RequestMismatch,
    );
    fails_with(
        |i| i.response = Some(b"another response"),
        ReceiptError::ResponseMismatch,
    );
    fails_with(
        |i| i.expected_nonce = Some(b"nonce-2"),
        ReceiptError::NonceMismatch,
    );
    fails_with(|i| i.allow_mock = false, ReceiptError::MockNotAllowed);
    fails_with(
        |i| i.expected_manifest = Some(Sha256Digest::of(b"other")),
        ReceiptError::ManifestMismatch,
    );
    let mut b = body(&f, chain(&f, &links(&f, [7; 16])));
    b.client_nonce = None;
    let rc2 = sign_receipt(&f.keys[2], &b);
    assert_eq!(reason(&f, &rc2), Some(ReceiptError::NonceMissing));
    // Stage keys inconsistent.
    let mut bad = f.stages.clone();
    bad[1].layers = [3, 4];
    let i = VerifyInputs::new(&rc, &bad);
    assert!(matches!(
        verify_receipt(&i).failure(),
        Some(ReceiptError::BadStageKeys(_))
    ));
    let mut bad = f.stages.clone();
    bad.swap(0, 1);
    assert!(matches!(
        verify_receipt(&VerifyInputs::new(&rc, &bad)).failure(),
        Some(ReceiptError::BadStageKeys(_))
    ));
}

/// Signs a receipt over `links` with `edit` applied to the body.
fn receipt_with(f: &Fixture, ls: &[Link], edit: impl Fn(&mut ReceiptBody)) -> Vec<u8> {
    let mut b = body(f, chain(f, ls));
    edit(&mut b);
    sign_receipt(&f.keys[2], &b)
}

fn check_status(report: &VerifyReport, name: &str) -> Option<CheckStatus> {
    report
        .checks
        .iter()
        .find(|c| c.name == name)
        .map(|c| c.status)
}

#[test]
fn sealing_is_proven_only_against_the_clients_own_key() {
    let f = fixture();
    // The entry stage opened the client's key: enclave, proven.
    let (rc, report) = valid_report(&f);
    assert_eq!(report.proven_sealing(), Some(Sealing::Enclave));
    assert_eq!(report.to_json()["receipt"]["sealing_proven"], true);

    // A host that opened the client's request (sealed to a key of its
    // own) and re-sealed it to the entry stage: the entry stage opened
    // another encapsulated key, yet the receipt says "enclave".
    let other_enc = Sha256Digest::of(b"host's enc").0.to_vec();
    let mut ls = links(&f, [7; 16]);
    ls[0].opened = Some(OpenedKey::of(7, &other_enc));
    let resealed = receipt_with(&f, &ls, |_| {});
    let report = verify_receipt(&inputs(&f, &resealed));
    assert!(
        matches!(report.failure(), Some(ReceiptError::SealingMismatch(_))),
        "{:#?}",
        report.checks
    );
    assert_eq!(report.proven_sealing(), None);
    // The same key id with the client's enc but another key id also fails.
    let mut ls = links(&f, [7; 16]);
    ls[0].opened = Some(OpenedKey::of(8, &f.enc));
    let report = verify_receipt(&inputs(&f, &receipt_with(&f, &ls, |_| {})));
    assert_eq!(report.failure().map(|e| e.code()), Some("sealing_mismatch"));

    // Sealed to the gateway's key: the entry stage opened the gateway's
    // re-sealing, and the receipt says so.
    let mut ls = links(&f, [7; 16]);
    ls[0].opened = Some(OpenedKey::of(3, &other_enc));
    let gw = receipt_with(&f, &ls, |b| b.sealing = Sealing::Gateway);
    let report = verify_receipt(&inputs(&f, &gw));
    assert!(report.ok(), "{:#?}", report.checks);
    assert_eq!(report.proven_sealing(), Some(Sealing::Gateway));
    // "gateway" (or "plain") although the enclave opened the client's key.
    for s in [Sealing::Gateway, Sealing::Plain] {
        let lie = receipt_with(&f, &links(&f, [7; 16]), |b| b.sealing = s);
        assert_eq!(reason(&f, &lie).map(|e| e.code()), Some("sealing_mismatch"));
    }

    // Without the client's key the claim is the host's word: skipped.
    let mut bare = inputs(&f, &rc);
    bare.sealed_to = None;
    let report = verify_receipt(&bare);
    assert!(report.ok());
    assert_eq!(check_status(&report, "sealing"), Some(CheckStatus::Skipped));
    assert_eq!(report.proven_sealing(), None);
    let mut bare = inputs(&f, &resealed);
    bare.sealed_to = None;
    assert!(verify_receipt(&bare).ok());
}

#[test]
fn opened_key_belongs_to_the_entry_link_only() {
    let f = fixture();
    let mut ls = links(&f, [7; 16]);
    ls[0].opened = None;
    assert_eq!(
        reason(&f, &receipt_with(&f, &ls, |_| {})),
        Some(ReceiptError::LinkOpened { position: 0 })
    );
    for i in 1..3 {
        let mut ls = links(&f, [7; 16]);
        ls[i].opened = Some(OpenedKey::of(7, &f.enc));
        assert_eq!(
            reason(&f, &receipt_with(&f, &ls, |_| {})),
            Some(ReceiptError::LinkOpened { position: i })
        );
    }
}

#[test]
fn v2_receipts_verify_as_what_they_are() {
    let f = fixture();
    // A v2 receipt: v1 links (no key 8), the v2 content types.
    let mut ls = links_as(&f, [7; 16], ReceiptVersion::V2);
    ls[0].opened = None;
    let b = body_as(
        &f,
        chain_as(&f, &ls, ReceiptVersion::V2),
        ReceiptVersion::V2,
    );
    let rc = sign_receipt(&f.keys[2], &b);
    let report = verify_receipt(&inputs(&f, &rc));
    assert!(report.ok(), "{:#?}", report.checks);
    assert_eq!(check_status(&report, "sealing"), Some(CheckStatus::Skipped));
    assert_eq!(report.proven_sealing(), None);
    assert_eq!(report.receipt.as_ref().unwrap().version, ReceiptVersion::V2);
    // A v3 link inside a v2 receipt (or the reverse) is refused.
    let mut mixed = b.clone();
    mixed.chain[0] = sign_link_as(
        &f.keys[0],
        &links_as(&f, [7; 16], ReceiptVersion::V3)[0],
        ReceiptVersion::V3,
    );
    assert_eq!(
        reason(&f, &sign_receipt(&f.keys[2], &mixed)).map(|e| e.code()),
        Some("link_malformed")
    );
    let mixed = body(&f, chain_v3_with_v1_link(&f));
    assert_eq!(
        reason(&f, &sign_receipt(&f.keys[2], &mixed)).map(|e| e.code()),
        Some("link_malformed")
    );
    // Unverified parsing reads both.
    assert_eq!(parse_unverified(&rc).unwrap().0.version, ReceiptVersion::V2);
    assert_eq!(
        parse_unverified(&valid(&f)).unwrap().0.version,
        ReceiptVersion::V4
    );
}

#[test]
fn v4_digests_are_salted_and_need_the_salt() {
    let f = fixture();
    let rc = valid(&f);
    let (b, _) = parse_unverified(&rc).unwrap();
    // Whoever holds the receipt cannot confirm a guess of the request or
    // the response with a plain SHA-256.
    assert_ne!(b.request_digest, Sha256Digest::of(&f.request));
    assert_ne!(b.response_digest, Sha256Digest::of(&f.response));
    for l in links(&f, [7; 16]) {
        assert_ne!(l.received_digest, Sha256Digest::of(&f.request));
    }
    // Without the salt, request and response bytes cannot be checked: a
    // failure, not a silent skip.
    let mut i = inputs(&f, &rc);
    i.digest_salt = None;
    assert_eq!(
        verify_receipt(&i).failure().cloned(),
        Some(ReceiptError::DigestSaltMissing)
    );
    // Without bytes to check, no salt is needed.
    i.request = None;
    i.response = None;
    assert!(verify_receipt(&i).ok());
    // Another salt: the bytes do not match.
    let other = [9u8; 32];
    let mut i = inputs(&f, &rc);
    i.digest_salt = Some(&other);
    assert_eq!(
        verify_receipt(&i).failure().cloned(),
        Some(ReceiptError::RequestMismatch)
    );
}

#[test]
fn v3_receipts_with_plain_digests_still_verify() {
    let f = fixture();
    let v3 = ReceiptVersion::V3;
    let b = body_as(&f, chain_as(&f, &links_as(&f, [7; 16], v3), v3), v3);
    let rc = sign_receipt(&f.keys[2], &b);
    let mut i = inputs(&f, &rc);
    i.digest_salt = None;
    let report = verify_receipt(&i);
    assert!(report.ok(), "{:#?}", report.checks);
    assert_eq!(report.receipt.as_ref().unwrap().version, v3);
    assert_eq!(check_status(&report, "request"), Some(CheckStatus::Pass));
    // A v4 link inside a v3 receipt is refused.
    let mut mixed = b.clone();
    mixed.chain[0] = sign_link(&f.keys[0], &links(&f, [7; 16])[0]);
    assert_eq!(
        reason(&f, &sign_receipt(&f.keys[2], &mixed)).map(|e| e.code()),
        Some("link_malformed")
    );
}

/// A v3 chain whose first link is signed in the v1 link format.
fn chain_v3_with_v1_link(f: &Fixture) -> (Vec<Vec<u8>>, Link) {
    let (mut c, exit) = chain(f, &links(f, [7; 16]));
    c[0] = sign_link_as(&f.keys[0], &links(f, [7; 16])[0], ReceiptVersion::V2);
    (c, exit)
}

#[test]
fn entry_link_unverified_reads_the_opened_key() {
    let f = fixture();
    let (b, _) = parse_unverified(&valid(&f)).unwrap();
    assert_eq!(
        b.entry_link_unverified().unwrap().opened,
        Some(OpenedKey::of(7, &f.enc))
    );
    // One stage: the exit link is the entry link.
    let mut one = body(&f, (Vec::new(), links(&f, [7; 16]).remove(0)));
    one.chain.clear();
    assert_eq!(
        one.entry_link_unverified().unwrap().opened,
        Some(OpenedKey::of(7, &f.enc))
    );
}

#[test]
fn non_canonical_payload_is_refused() {
    let f = fixture();
    let b = body(&f, chain(&f, &links(&f, [7; 16])));
    // Same map with keys in reverse order, properly signed.
    let Value::Map(mut entries) = b.to_value() else {
        panic!()
    };
    entries.reverse();
    let payload = encode(&Value::Map(entries));
    let rc = sign(&f.keys[2], RECEIPT_CONTENT_TYPE, payload);
    assert_eq!(reason(&f, &rc), Some(ReceiptError::NotCanonical));
    // Unknown extra key.
    let Value::Map(mut entries) = b.to_value() else {
        panic!()
    };
    entries.push((uint(14), Value::Null));
    let rc = sign(
        &f.keys[2],
        RECEIPT_CONTENT_TYPE,
        encode(&Value::Map(entries)),
    );
    assert!(matches!(reason(&f, &rc), Some(ReceiptError::Malformed(_))));
}

#[test]
fn stage_keys_json_uses_hex() {
    let f = fixture();
    let json = serde_json::to_string(&f.stages[0]).unwrap();
    assert!(json.contains(&f.stages[0].evidence_digest.hex()));
    assert!(json.contains(&hex::encode(f.stages[0].receipt_key)));
    let back: StageKeys = serde_json::from_str(&json).unwrap();
    assert_eq!(back, f.stages[0]);
    let cbor = crate::cbor::to_vec(&f.stages[0]);
    let back: StageKeys = crate::cbor::from_slice(&cbor).unwrap();
    assert_eq!(back, f.stages[0]);
}
