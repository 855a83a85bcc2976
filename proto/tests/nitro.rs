//! The Nitro attestation verifier against real documents recorded on AWS
//! hardware (`tests/fixtures/nitro/`, provenance in its README) and against
//! synthetic documents from a self-made CA (rcgen + ring):
//!
//! - each real document verifies inside its certificate window and is
//!   rejected one second before and after it, with distinct reasons;
//! - any flipped byte in the signature, the payload or the leaf
//!   certificate is rejected (many positions, systematically);
//! - PCR policy (a different PCR0, PCR8, debug mode) and the binding of
//!   nonce / public key / user data are checked with distinct reasons;
//! - a chain to another root is rejected even when the bundle carries that
//!   root, and also when that root copies the AWS root's name;
//! - the stage channel accepts Nitro evidence whose PCRs match the policy
//!   and whose digest binds the claims, and refuses it otherwise.

mod channel_support;

use coset::{iana, CborSerializable, CoseSign1Builder, HeaderBuilder, TaggedCborSerializable};
use proto::attestation::{
    attest_claims, claims_binding, AnyVerifier, AttestError, AttestationProvider, BindingError,
    Evidence, EvidenceFormat, EvidencePurpose, ExpectedBinding, Measurement, VerifiedDocument,
};
use proto::channel::{ChannelLimits, LocalIdentity, PeerInfo};
use proto::digest::Sha256Digest;
use proto::frames::StageClaims;
use proto::io::channel;
use proto::io::transport::BoxStream;
use proto::nitro::{decode_document, parse_cose, NitroVerifier, MAX_CLOCK_SKEW_SECS};
use proto::policy::{Policy, PolicyError};
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, ECDSA_P384_SHA384_FIXED_SIGNING};
use std::path::PathBuf;
use std::sync::Arc;

struct Fixture {
    file: &'static str,
    from: u64,
    to: u64,
    public_key: &'static [u8],
    user_data: &'static [u8],
    nonce_len: usize,
    debug: bool,
}

/// The table of `tests/fixtures/nitro/README.md`.
const FIXTURES: &[Fixture] = &[
    Fixture {
        file: "blindai-debug.cbor",
        from: 1679495304,
        to: 1679506107,
        public_key: b"my super secret key",
        user_data: b"hello, world!",
        nonce_len: 0,
        debug: true,
    },
    Fixture {
        file: "aws-samples-debug.cbor",
        from: 1680004557,
        to: 1680015360,
        public_key: b"",
        user_data: b"",
        nonce_len: 0,
        debug: true,
    },
    Fixture {
        file: "evervault-debug.cbor",
        from: 1665582591,
        to: 1665593394,
        public_key: b"my super secret key",
        user_data: b"hello, world!",
        nonce_len: 0,
        debug: true,
    },
    Fixture {
        file: "evervault-production-pcr8.cbor",
        from: 1665651479,
        to: 1665662282,
        public_key: b"",
        user_data: b"",
        nonce_len: 256,
        debug: false,
    },
    Fixture {
        file: "evervault-debug-userdata.b64",
        from: 1695047829,
        to: 1695058632,
        public_key: b"",
        user_data: b"",
        nonce_len: 256,
        debug: true,
    },
];

const PRODUCTION_PCR0: &str = "f4d48b81a460c9916d1e685119074bf24660afd3e34fae9fca0a0d28d9d5599936332687e6f66fc890ac8cf150142d8b";

fn fixture_bytes(f: &Fixture) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/nitro")
        .join(f.file);
    decode_document(&std::fs::read(&path).unwrap()).unwrap()
}

fn mid(f: &Fixture) -> u64 {
    f.from + (f.to - f.from) / 2
}

fn verify_at(doc: &[u8], t: u64) -> Result<VerifiedDocument, AttestError> {
    NitroVerifier::aws().at(t).verify(doc).map(|v| v.document)
}

fn pcrs_of(doc: &VerifiedDocument) -> &proto::nitro::Pcrs {
    match &doc.measurement {
        Measurement::Nitro(p) => p,
        other => panic!("not a Nitro measurement: {other:?}"),
    }
}

/// The channel tests' claims, for a two-stage pipeline.
fn claims(index: u32) -> StageClaims {
    StageClaims {
        num_stages: 2,
        ..channel_support::claims(index)
    }
}

/// A policy for stage 0 (layers 0..4) pinning `pcrs` (PCR index, hex).
fn policy(pcrs: &[(u8, String)], allow_debug: bool) -> Policy {
    let mut text = format!(
        "allow_mock = false\nallow_debug = {allow_debug}\n[[stages]]\nindex = 0\nlayers = [0, 4]\n[[stages.nitro]]\n"
    );
    for (i, v) in pcrs {
        text += &format!("pcr{i} = \"{v}\"\n");
    }
    Policy::from_toml(&text).unwrap()
}

fn pins_of(doc: &VerifiedDocument, indexes: &[u8]) -> Vec<(u8, String)> {
    let p = pcrs_of(doc);
    indexes
        .iter()
        .map(|&i| (i, hex::encode(p.get(i).unwrap())))
        .collect()
}

#[test]
fn every_fixture_verifies_inside_its_window_only() {
    for f in FIXTURES {
        let doc = fixture_bytes(f);
        for t in [f.from, mid(f), f.to] {
            let v = verify_at(&doc, t).unwrap_or_else(|e| panic!("{} at {t}: {e}", f.file));
            assert_eq!(v.format, EvidenceFormat::Nitro);
            assert!(!v.module_id.is_empty());
            // The document was made inside its leaf's window.
            let made = v.timestamp_ms / 1000;
            assert!((f.from..=f.to).contains(&made), "{}: time {made}", f.file);
            assert_eq!(v.public_key, f.public_key, "{}", f.file);
            if f.file != "evervault-debug-userdata.b64" {
                assert_eq!(v.user_data, f.user_data, "{}", f.file);
            } else {
                // A DER SubjectPublicKeyInfo (P-256): SEQUENCE ...
                assert_eq!(v.user_data.first(), Some(&0x30), "{}", f.file);
            }
            assert_eq!(v.nonce.len(), f.nonce_len, "{}", f.file);
            assert_eq!(pcrs_of(&v).is_debug(), f.debug, "{}", f.file);
        }
        // A verifier whose clock is behind the enclave's: a leaf that starts
        // up to MAX_CLOCK_SKEW_SECS in its future is accepted, one further
        // out is refused, naming the verifier's own time.
        for behind in [1, MAX_CLOCK_SKEW_SECS] {
            let v = verify_at(&doc, f.from - behind);
            assert!(v.is_ok(), "{} {behind} s early: {v:?}", f.file);
        }
        match verify_at(&doc, f.from - MAX_CLOCK_SKEW_SECS - 1) {
            Err(AttestError::CertificateNotYetValid { now, not_before }) => {
                assert_eq!(now, f.from - MAX_CLOCK_SKEW_SECS - 1);
                assert_eq!(not_before, f.from, "{}", f.file);
            }
            other => panic!("{} before its window: {other:?}", f.file),
        }
        match verify_at(&doc, f.to + 1) {
            Err(AttestError::CertificateExpired { now, not_after }) => {
                assert_eq!(now, f.to + 1);
                assert_eq!(not_after, f.to, "{}", f.file);
            }
            other => panic!("{} after its window: {other:?}", f.file),
        }
        // Days later, as a verifier with the system clock sees it today.
        assert!(matches!(
            verify_at(&doc, f.to + 86_400 * 365),
            Err(AttestError::CertificateExpired { .. })
        ));
        // The document's own time is inside the window.
        let by_doc_time = NitroVerifier::aws()
            .with_time(proto::nitro::VerifyTime::DocumentTime)
            .verify(&doc);
        assert!(by_doc_time.is_ok(), "{}: {by_doc_time:?}", f.file);
    }
}

#[test]
fn fixtures_are_untagged_with_raw_es384_signatures() {
    for f in FIXTURES {
        let doc = fixture_bytes(f);
        assert_eq!(doc[0], 0x84, "{}", f.file);
        let (sign1, tagged) = parse_cose(&doc).unwrap();
        assert!(!tagged);
        assert_eq!(sign1.signature.len(), 96);
        let v = NitroVerifier::aws().at(mid(f)).verify(&doc).unwrap();
        // leaf + intermediates + the pinned root
        assert!(v.chain_len >= 3, "{}: chain of {}", f.file, v.chain_len);
        assert!(v.leaf_validity.0 <= f.from && v.leaf_validity.1 >= f.to);
        assert_eq!(v.payload.cabundle[0], NitroVerifier::aws().root_der());
    }
}

/// Where `needle` sits in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len())
        .position(|w| w == needle)
        .expect("part not found in the document")
}

#[test]
fn flipped_bytes_in_signature_payload_and_certificate_are_rejected() {
    let mut tried = 0;
    for f in FIXTURES {
        let doc = fixture_bytes(f);
        let t = mid(f);
        assert!(verify_at(&doc, t).is_ok());
        let (sign1, _) = parse_cose(&doc).unwrap();
        let payload = sign1.payload.clone().unwrap();
        let v = NitroVerifier::aws().at(t).verify(&doc).unwrap();
        let sig_at = find(&doc, &sign1.signature);
        let payload_at = find(&doc, &payload);
        let cert_at = find(&doc, &v.payload.certificate);
        let cert_len = v.payload.certificate.len();
        let mut positions: Vec<(&str, usize)> = Vec::new();
        // Every signature byte (r and s).
        positions.extend((sig_at..sig_at + 96).map(|i| ("signature", i)));
        // Every 5th payload byte, from its first: headers, PCRs, cabundle,
        // optional fields.
        positions.extend(
            (payload_at..payload_at + payload.len())
                .step_by(5)
                .map(|i| ("payload", i)),
        );
        // Every 3rd byte of the leaf certificate (its TBS, key and signature).
        positions.extend(
            (cert_at..cert_at + cert_len)
                .step_by(3)
                .map(|i| ("certificate", i)),
        );
        // The COSE envelope: array header, protected header, unprotected map.
        positions.extend((0..payload_at.min(16)).map(|i| ("envelope", i)));
        for (n, (part, i)) in positions.into_iter().enumerate() {
            // Low and high bits, alternately.
            let mask = if n % 2 == 0 { 0x01u8 } else { 0x80 };
            let mut bad = doc.clone();
            bad[i] ^= mask;
            let r = verify_at(&bad, t);
            assert!(
                r.is_err(),
                "{}: flipping {mask:#04x} at byte {i} ({part}) was accepted",
                f.file
            );
            tried += 1;
        }
    }
    assert!(tried > 2000, "only {tried} flips tried");
}

#[test]
fn flipped_signature_bytes_fail_as_bad_signature() {
    let f = &FIXTURES[0];
    let doc = fixture_bytes(f);
    let (sign1, _) = parse_cose(&doc).unwrap();
    let at = find(&doc, &sign1.signature);
    for i in at..at + 96 {
        let mut bad = doc.clone();
        bad[i] ^= 0x01;
        assert_eq!(
            verify_at(&bad, mid(f)),
            Err(AttestError::BadSignature),
            "byte {i}"
        );
    }
}

#[test]
fn flipped_certificate_bytes_never_reach_the_signature_check_unnoticed() {
    // The chain is checked before the COSE signature: a changed leaf fails
    // as a certificate problem (parse, issuer signature, name), not later.
    let f = &FIXTURES[3];
    let doc = fixture_bytes(f);
    let v = NitroVerifier::aws().at(mid(f)).verify(&doc).unwrap();
    let at = find(&doc, &v.payload.certificate);
    for i in (at..at + v.payload.certificate.len()).step_by(5) {
        let mut bad = doc.clone();
        bad[i] ^= 0x04;
        match verify_at(&bad, mid(f)) {
            Err(
                AttestError::BadCertificate(_)
                | AttestError::UntrustedChain(_)
                | AttestError::Malformed(_)
                | AttestError::CertificateExpired { .. }
                | AttestError::CertificateNotYetValid { .. },
            ) => {}
            other => panic!("certificate byte {i}: {other:?}"),
        }
    }
}

#[test]
fn pcr_policy_and_debug_mode() {
    let c = claims(0);
    for f in FIXTURES {
        let doc = verify_at(&fixture_bytes(f), mid(f)).unwrap();
        let exact = policy(&pins_of(&doc, &[0, 1, 2]), true);
        assert_eq!(exact.check(&doc, &c, None), Ok(()), "{}", f.file);
        let mut other = pins_of(&doc, &[0, 1, 2]);
        other[0].1 = "ab".repeat(48);
        match policy(&other, true).check(&doc, &c, None) {
            Err(PolicyError::Measurement {
                stage: 0, found, ..
            }) => assert!(found.starts_with("nitro:pcr0="), "{found}"),
            r => panic!("{}: a different PCR0 gave {r:?}", f.file),
        }
        // PCR1 and PCR2 count too.
        for i in [1, 2] {
            let mut other = pins_of(&doc, &[0, 1, 2]);
            other[i].1 = "cd".repeat(48);
            assert!(matches!(
                policy(&other, true).check(&doc, &c, None),
                Err(PolicyError::Measurement { .. })
            ));
        }
        let strict = policy(&pins_of(&doc, &[0, 1, 2]), false);
        if f.debug {
            assert_eq!(
                strict.check(&doc, &c, None),
                Err(PolicyError::DebugEnclave { stage: 0 }),
                "{}",
                f.file
            );
        } else {
            assert_eq!(strict.check(&doc, &c, None), Ok(()));
        }
    }
}

#[test]
fn production_document_pcr0_and_pcr8() {
    let f = &FIXTURES[3];
    let doc = verify_at(&fixture_bytes(f), mid(f)).unwrap();
    let pcrs = pcrs_of(&doc);
    assert_eq!(hex::encode(pcrs.get(0).unwrap()), PRODUCTION_PCR0);
    assert!(pcrs.pinned_form().contains(",pcr8="));
    let with8 = policy(&pins_of(&doc, &[0, 1, 2, 8]), false);
    assert_eq!(with8.check(&doc, &claims(0), None), Ok(()));
    let mut wrong8 = pins_of(&doc, &[0, 1, 2, 8]);
    wrong8[3].1 = "00".repeat(48);
    assert!(matches!(
        policy(&wrong8, false).check(&doc, &claims(0), None),
        Err(PolicyError::Measurement { .. })
    ));
    // Claims other than the policy's layers are refused after the PCRs pass.
    let mut c = claims(0);
    c.layer_end = 3;
    assert!(matches!(
        with8.check(&doc, &c, None),
        Err(PolicyError::Layers { .. })
    ));
    // Mock-only pins do not admit a Nitro document.
    let mock_only = Policy::from_toml(&format!(
        "allow_mock = true\n[[stages]]\nindex = 0\nlayers = [0, 4]\nmeasurements = [\"{}\"]\n",
        pcrs.pinned_form()
    ))
    .unwrap();
    assert!(matches!(
        mock_only.check(&doc, &claims(0), None),
        Err(PolicyError::Measurement { .. })
    ));
}

#[test]
fn policy_rejects_malformed_pcr_pins() {
    for bad in ["abcd", &"zz".repeat(48), &"00".repeat(32)] {
        let text = format!(
            "allow_mock = false\n[[stages]]\nindex = 0\nlayers = [0, 4]\n[[stages.nitro]]\npcr0 = \"{bad}\"\npcr1 = \"{z}\"\npcr2 = \"{z}\"\n",
            z = "00".repeat(48)
        );
        let e = Policy::from_toml(&text).unwrap_err();
        assert!(e.contains("pcr0 must be 96 hex digits"), "{e}");
    }
    let missing = "allow_mock = false\n[[stages]]\nindex = 0\nlayers = [0, 4]\n[[stages.nitro]]\npcr0 = \"00\"\n";
    assert!(Policy::from_toml(missing).is_err());
}

#[test]
fn binding_of_nonce_public_key_and_user_data() {
    for f in FIXTURES {
        let doc = verify_at(&fixture_bytes(f), mid(f)).unwrap();
        let exact = ExpectedBinding {
            nonce: Some(&doc.nonce),
            public_key: Some(&doc.public_key),
            user_data: Some(&doc.user_data),
        };
        assert_eq!(doc.check_binding(&exact), Ok(()));
        let other_nonce = vec![0x5a; 32];
        assert_eq!(
            doc.check_binding(&ExpectedBinding {
                nonce: Some(&other_nonce),
                ..exact
            }),
            Err(BindingError::Nonce),
            "{}",
            f.file
        );
        assert_eq!(
            doc.check_binding(&ExpectedBinding {
                public_key: Some(b"another key"),
                ..exact
            }),
            Err(BindingError::PublicKey)
        );
        assert_eq!(
            doc.check_binding(&ExpectedBinding {
                user_data: Some(b"other"),
                ..exact
            }),
            Err(BindingError::UserData)
        );
    }
}

#[test]
fn mock_evidence_is_not_a_nitro_document_and_policy_without_mock_rejects_it() {
    let m = proto::attestation::mock_measurement(
        &Sha256Digest::of(b"b"),
        &Sha256Digest::of(b"m"),
        &Sha256Digest::of(b"p"),
    );
    let ev = proto::attestation::MockProvider::new("s", &m)
        .attest(b"pk", b"ud", b"n")
        .unwrap();
    assert!(NitroVerifier::aws().verify(&ev.document).is_err());
    let relabelled = Evidence {
        format: EvidenceFormat::Nitro,
        document: ev.document.clone(),
    };
    assert!(proto::attestation::verify_any(&relabelled).is_err());
    let doc = proto::attestation::verify_any(&ev).unwrap();
    let zeros = "00".repeat(48);
    let strict = policy(&[(0, zeros.clone()), (1, zeros.clone()), (2, zeros)], true);
    assert_eq!(
        strict.check(&doc, &claims(0), None),
        Err(PolicyError::MockNotAllowed { stage: 0 })
    );
}

// ---- synthetic documents from a self-made CA ----

/// A root CA and a leaf whose key signs documents.
struct TestCa {
    root_der: Vec<u8>,
    leaf_der: Vec<u8>,
    leaf_key: EcdsaKeyPair,
    rng: SystemRandom,
}

fn test_ca(root_name: &[(rcgen::DnType, &str)]) -> TestCa {
    test_ca_signed_with(root_name, &rcgen::PKCS_ECDSA_P384_SHA384)
}

/// As [`test_ca`], with a root key (which signs the leaf certificate) of
/// `root_alg`; the leaf key, which signs documents, is P-384 either way.
fn test_ca_signed_with(
    root_name: &[(rcgen::DnType, &str)],
    root_alg: &'static rcgen::SignatureAlgorithm,
) -> TestCa {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let root_key = KeyPair::generate_for(root_alg).unwrap();
    let mut rp = CertificateParams::new(Vec::<String>::new()).unwrap();
    rp.distinguished_name = rcgen::DistinguishedName::new();
    for (t, v) in root_name {
        rp.distinguished_name.push(t.clone(), *v);
    }
    rp.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    rp.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    rp.not_before = rcgen::date_time_ymd(2020, 1, 1);
    rp.not_after = rcgen::date_time_ymd(2045, 1, 1);
    let root = rp.self_signed(&root_key).unwrap();

    let rng = SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P384_SHA384_FIXED_SIGNING, &rng).unwrap();
    let leaf_key =
        EcdsaKeyPair::from_pkcs8(&ECDSA_P384_SHA384_FIXED_SIGNING, pkcs8.as_ref(), &rng).unwrap();
    let leaf_rc = KeyPair::from_pkcs8_der_and_sign_algo(
        &rustls_pki_types::PrivatePkcs8KeyDer::from(pkcs8.as_ref()),
        &rcgen::PKCS_ECDSA_P384_SHA384,
    )
    .unwrap();
    let mut lp = CertificateParams::new(Vec::<String>::new()).unwrap();
    lp.distinguished_name = rcgen::DistinguishedName::new();
    lp.distinguished_name
        .push(DnType::CommonName, "i-0000000000000000-enc0000000000000000");
    lp.not_before = rcgen::date_time_ymd(2021, 1, 1);
    lp.not_after = rcgen::date_time_ymd(2040, 1, 1);
    lp.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let leaf = lp.signed_by(&leaf_rc, &root, &root_key).unwrap();
    TestCa {
        root_der: root.der().to_vec(),
        leaf_der: leaf.der().to_vec(),
        leaf_key,
        rng,
    }
}

/// 2030-01-01, inside the synthetic certificates' windows.
const SYNTH_NOW: u64 = 1_893_456_000;

fn synthetic_pcrs() -> Vec<(u8, Vec<u8>)> {
    [0u8, 1, 2, 3, 4, 8]
        .iter()
        .map(|&i| (i, vec![0x10 + i; 48]))
        .collect()
}

impl TestCa {
    fn payload(&self, pk: &[u8], ud: &[u8], nonce: &[u8], cabundle: &[&[u8]]) -> Vec<u8> {
        use ciborium::Value;
        let b = |x: &[u8]| Value::Bytes(x.to_vec());
        let opt = |x: &[u8]| if x.is_empty() { Value::Null } else { b(x) };
        let map = Value::Map(vec![
            (
                Value::Text("module_id".into()),
                Value::Text("i-test-enc0".into()),
            ),
            (Value::Text("digest".into()), Value::Text("SHA384".into())),
            (
                Value::Text("timestamp".into()),
                Value::Integer((SYNTH_NOW * 1000).into()),
            ),
            (
                Value::Text("pcrs".into()),
                Value::Map(
                    synthetic_pcrs()
                        .into_iter()
                        .map(|(i, v)| (Value::Integer(i.into()), Value::Bytes(v)))
                        .collect(),
                ),
            ),
            (Value::Text("certificate".into()), b(&self.leaf_der)),
            (
                Value::Text("cabundle".into()),
                Value::Array(cabundle.iter().map(|c| b(c)).collect()),
            ),
            (Value::Text("public_key".into()), opt(pk)),
            (Value::Text("user_data".into()), opt(ud)),
            (Value::Text("nonce".into()), opt(nonce)),
        ]);
        let mut out = Vec::new();
        ciborium::into_writer(&map, &mut out).unwrap();
        out
    }

    fn sign(&self, payload: Vec<u8>, alg: iana::Algorithm, tagged: bool) -> Vec<u8> {
        let sign1 = CoseSign1Builder::new()
            .protected(HeaderBuilder::new().algorithm(alg).build())
            .payload(payload)
            .create_signature(b"", |tbs| {
                self.leaf_key
                    .sign(&self.rng, tbs)
                    .unwrap()
                    .as_ref()
                    .to_vec()
            })
            .build();
        if tagged {
            sign1.to_tagged_vec().unwrap()
        } else {
            sign1.to_vec().unwrap()
        }
    }

    fn document(&self, pk: &[u8], ud: &[u8], nonce: &[u8]) -> Vec<u8> {
        let p = self.payload(pk, ud, nonce, &[&self.root_der]);
        self.sign(p, iana::Algorithm::ES384, false)
    }

    fn verifier(&self) -> NitroVerifier {
        NitroVerifier::with_root_der(self.root_der.clone()).at(SYNTH_NOW)
    }
}

fn own_ca() -> TestCa {
    test_ca(&[(rcgen::DnType::CommonName, "self-made test root")])
}

#[test]
fn synthetic_documents_verify_against_their_own_root_tagged_or_not() {
    let ca = own_ca();
    let doc = ca.document(b"pk", b"ud", b"nonce");
    let v = ca.verifier().verify(&doc).unwrap();
    assert!(!v.tagged);
    assert_eq!(v.document.nonce, b"nonce");
    let tagged = ca.sign(
        ca.payload(b"pk", b"ud", b"nonce", &[&ca.root_der]),
        iana::Algorithm::ES384,
        true,
    );
    assert_eq!(tagged[0], 0xd2);
    assert!(ca.verifier().verify(&tagged).unwrap().tagged);
    // Another algorithm in the protected header.
    let es256 = ca.sign(
        ca.payload(b"pk", b"ud", b"nonce", &[&ca.root_der]),
        iana::Algorithm::ES256,
        false,
    );
    assert!(matches!(
        ca.verifier().verify(&es256),
        Err(AttestError::UnsupportedAlgorithm(_))
    ));
    // Outside the leaf's window.
    assert!(matches!(
        ca.verifier().at(2_300_000_000).verify(&doc),
        Err(AttestError::CertificateExpired { .. })
    ));
}

#[test]
fn a_chain_to_another_root_is_rejected_even_with_that_root_in_the_bundle() {
    let ca = own_ca();
    let doc = ca.document(b"pk", b"ud", b"nonce");
    match NitroVerifier::aws().at(SYNTH_NOW).verify(&doc) {
        Err(AttestError::UntrustedChain(_)) => {}
        other => panic!("self-made root accepted or wrong reason: {other:?}"),
    }
    // The bundle also carries the real AWS root: still no path.
    let aws_root = NitroVerifier::aws().root_der().to_vec();
    let both = ca.sign(
        ca.payload(b"pk", b"ud", b"nonce", &[&aws_root, &ca.root_der]),
        iana::Algorithm::ES384,
        false,
    );
    assert!(matches!(
        NitroVerifier::aws().at(SYNTH_NOW).verify(&both),
        Err(AttestError::UntrustedChain(_))
    ));
    // A root that copies the AWS root's name: its signature on the leaf
    // does not verify with the pinned key.
    let lookalike = test_ca(&[
        (rcgen::DnType::CountryName, "US"),
        (rcgen::DnType::OrganizationName, "Amazon"),
        (rcgen::DnType::OrganizationalUnitName, "AWS"),
        (rcgen::DnType::CommonName, "aws.nitro-enclaves"),
    ]);
    let doc = lookalike.document(b"pk", b"ud", b"nonce");
    assert!(lookalike.verifier().verify(&doc).is_ok());
    match NitroVerifier::aws().at(SYNTH_NOW).verify(&doc) {
        Err(AttestError::UntrustedChain(_) | AttestError::BadCertificate(_)) => {}
        other => panic!("look-alike root accepted: {other:?}"),
    }
}

/// Issue 34, item 4: the chain accepts only what AWS's uses (ECDSA P-384
/// with SHA-384). A leaf certificate signed with P-256/SHA-256 by a root
/// the verifier trusts is refused as such; the same chain signed with
/// P-384 verifies.
#[test]
fn a_chain_signed_with_p256_sha256_is_refused() {
    let name = [(rcgen::DnType::CommonName, "self-made test root")];
    let p384 = test_ca_signed_with(&name, &rcgen::PKCS_ECDSA_P384_SHA384);
    let doc = p384.document(b"pk", b"ud", b"nonce");
    assert!(p384.verifier().verify(&doc).is_ok());
    let p256 = test_ca_signed_with(&name, &rcgen::PKCS_ECDSA_P256_SHA256);
    let doc = p256.document(b"pk", b"ud", b"nonce");
    match p256.verifier().verify(&doc) {
        Err(AttestError::BadCertificate(why)) => {
            assert!(why.contains("P-384"), "{why}")
        }
        other => panic!("a P-256/SHA-256 chain was not refused as such: {other:?}"),
    }
}

/// The order of P-384, big-endian.
const P384_N: [u8; 48] = [
    0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xc7, 0x63, 0x4d, 0x81, 0xf4, 0x37, 0x2d, 0xdf,
    0x58, 0x1a, 0x0d, 0xb2, 0x48, 0xb0, 0xa7, 0x7a, 0xec, 0xec, 0x19, 0x6a, 0xcc, 0xc5, 0x29, 0x73,
];

/// `n - s` for a 48-byte big-endian `s < n`.
fn negate_s(s: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; 48];
    let mut borrow = 0i16;
    for i in (0..48).rev() {
        let mut d = P384_N[i] as i16 - s[i] as i16 - borrow;
        borrow = (d < 0) as i16;
        if d < 0 {
            d += 256;
        }
        out[i] = d as u8;
    }
    assert_eq!(borrow, 0);
    out
}

/// Issue 34, item 4: a recorded document has no other byte form that
/// verifies, except the two the signature scheme itself allows. Refused:
/// a longer CBOR length form, an indefinite-length payload, an entry in
/// the (unsigned) unprotected header, bytes after the array. Still
/// accepted, and listed under "What is not defended" in
/// docs/threat-model.md: the other ECDSA signature `(r, n − s)`, which AWS
/// does not normalise (two of the five recorded documents have the high
/// `s`), and the COSE tag 18 in front.
#[test]
fn a_real_document_has_no_other_encoding_but_s_and_the_tag() {
    for f in FIXTURES {
        let doc = fixture_bytes(f);
        let t = mid(f);
        let (sign1, _) = parse_cose(&doc).unwrap();
        let payload = sign1.payload.clone().unwrap();
        let payload_at = find(&doc, &payload);
        // The payload's byte-string head is 0x59 (two-byte length).
        assert_eq!(doc[payload_at - 3], 0x59, "{}", f.file);
        let head = payload_at - 3;
        let refused = |bad: Vec<u8>, what: &str| match verify_at(&bad, t) {
            Err(AttestError::Malformed(_)) => {}
            other => panic!("{}: {what} was not refused: {other:?}", f.file),
        };
        // The payload's length in four bytes instead of two.
        let mut longer = doc[..head].to_vec();
        longer.extend_from_slice(&[0x5a, 0, 0]);
        longer.extend_from_slice(&doc[head + 1..]);
        refused(longer, "a four-byte payload length");
        // The payload as an indefinite-length byte string of one chunk.
        let mut indefinite = doc[..head].to_vec();
        indefinite.push(0x5f);
        indefinite.extend_from_slice(&doc[head..payload_at + payload.len()]);
        indefinite.push(0xff);
        indefinite.extend_from_slice(&doc[payload_at + payload.len()..]);
        refused(indefinite, "an indefinite-length payload");
        // An unprotected header entry (kid = h'00') instead of `{}`.
        let unprotected = 1 + 1 + sign1.protected.original_data.as_ref().unwrap().len();
        assert_eq!(doc[unprotected], 0xa0);
        let mut with_kid = doc[..unprotected].to_vec();
        with_kid.extend_from_slice(&[0xa1, 0x04, 0x41, 0x00]);
        with_kid.extend_from_slice(&doc[unprotected + 1..]);
        refused(with_kid, "an unprotected header entry");
        // Bytes after the array.
        let mut followed = doc.clone();
        followed.push(0x00);
        assert!(verify_at(&followed, t).is_err(), "{}", f.file);

        // What is still accepted: (r, n - s) and the tag.
        let mut flipped = doc.clone();
        let s_at = doc.len() - 48;
        let other_s = negate_s(&doc[s_at..]);
        flipped[s_at..].copy_from_slice(&other_s);
        assert!(verify_at(&flipped, t).is_ok(), "{}", f.file);
        let mut tagged = vec![0xd2];
        tagged.extend_from_slice(&doc);
        assert!(verify_at(&tagged, t).is_ok(), "{}", f.file);
        let digest = |d: &[u8]| {
            Evidence {
                format: EvidenceFormat::Nitro,
                document: d.to_vec(),
            }
            .digest()
        };
        assert_ne!(digest(&doc), digest(&flipped));
        assert_ne!(digest(&doc), digest(&tagged));
    }
}

#[test]
fn a_leaf_key_that_did_not_sign_is_refused_after_the_chain_passes() {
    // Same chain, signature by another key: only the COSE check can fail.
    let ca = own_ca();
    let other = own_ca();
    let payload = ca.payload(b"pk", b"ud", b"n", &[&ca.root_der]);
    let forged = CoseSign1Builder::new()
        .protected(
            HeaderBuilder::new()
                .algorithm(iana::Algorithm::ES384)
                .build(),
        )
        .payload(payload)
        .create_signature(b"", |tbs| {
            other
                .leaf_key
                .sign(&other.rng, tbs)
                .unwrap()
                .as_ref()
                .to_vec()
        })
        .build()
        .to_vec()
        .unwrap();
    assert_eq!(
        ca.verifier().verify(&forged),
        Err(AttestError::BadSignature)
    );
}

/// A Nitro-format provider signing synthetic documents (no NSM here).
struct SynthProvider(Arc<TestCa>);

impl AttestationProvider for SynthProvider {
    fn format(&self) -> EvidenceFormat {
        EvidenceFormat::Nitro
    }
    fn attest(&self, pk: &[u8], ud: &[u8], nonce: &[u8]) -> Result<Evidence, AttestError> {
        Ok(Evidence {
            format: EvidenceFormat::Nitro,
            document: self.0.document(pk, ud, nonce),
        })
    }
}

fn synth_policy(pcr0: &str) -> Policy {
    let pins: Vec<(u8, String)> = synthetic_pcrs()
        .into_iter()
        .filter(|(i, _)| *i <= 2)
        .map(|(i, v)| {
            (
                i,
                if i == 0 {
                    pcr0.to_string()
                } else {
                    hex::encode(v)
                },
            )
        })
        .collect();
    let mut text = "allow_mock = false\n[[stages]]\nindex = 0\nlayers = [0, 4]\n[[stages.nitro]]\n"
        .to_string();
    for (i, v) in pins {
        text += &format!("pcr{i} = \"{v}\"\n");
    }
    Policy::from_toml(&text).unwrap()
}

async fn pair() -> (BoxStream, BoxStream) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (a, b) = tokio::join!(tokio::net::TcpStream::connect(addr), l.accept());
    (Box::new(a.unwrap()), Box::new(b.unwrap().0))
}

async fn handshake_with(
    provider: Arc<dyn AttestationProvider>,
    verifier: AnyVerifier,
    policy: Policy,
) -> Result<PeerInfo, String> {
    let (a, b) = pair().await;
    let stage = LocalIdentity::stage(provider, claims(0));
    let host = LocalIdentity::host().with_verifier(Arc::new(verifier));
    let accept_all = |_: &PeerInfo| Ok(());
    let check = move |p: &PeerInfo| {
        policy
            .check(
                p.document.as_ref().unwrap(),
                p.claims.as_ref().unwrap(),
                None,
            )
            .map_err(|e| e.to_string())
    };
    let (r_init, _r_resp) = tokio::join!(
        channel::initiate(a, &host, ChannelLimits::default(), &check),
        channel::respond(b, &stage, ChannelLimits::default(), &accept_all),
    );
    r_init.map(|(_, _, peer)| peer).map_err(|e| e.to_string())
}

#[tokio::test]
async fn stage_channel_accepts_nitro_evidence_that_matches_the_policy() {
    let ca = Arc::new(own_ca());
    let verifier = AnyVerifier {
        nitro: ca.verifier(),
    };
    let good_pcr0 = hex::encode(vec![0x10u8; 48]);
    let provider: Arc<dyn AttestationProvider> = Arc::new(SynthProvider(ca.clone()));
    let peer = handshake_with(provider.clone(), verifier.clone(), synth_policy(&good_pcr0))
        .await
        .unwrap();
    let doc = peer.document.unwrap();
    assert_eq!(doc.format, EvidenceFormat::Nitro);
    // user_data is the claims digest, and the claims came beside it.
    let c = peer.claims.unwrap();
    assert_eq!(c, claims(0));
    assert_eq!(
        doc.user_data,
        claims_binding(
            EvidenceFormat::Nitro,
            EvidencePurpose::Channel,
            &proto::cbor::to_vec(&c)
        )
    );
    assert_eq!(doc.user_data.len(), 32);

    // A different PCR0 in the policy: refused inside the handshake.
    let e = handshake_with(provider.clone(), verifier, synth_policy(&"ab".repeat(48)))
        .await
        .unwrap_err();
    assert!(e.contains("not in the policy"), "{e}");
    // The production verifier (pinned AWS root) refuses the self-made chain.
    let e = handshake_with(provider, AnyVerifier::default(), synth_policy(&good_pcr0))
        .await
        .unwrap_err();
    assert!(e.contains("not trusted"), "{e}");
}

/// A Nitro provider (self-made chain) that binds `claims` for `purpose`,
/// whatever it is asked to bind.
struct BindsOther(Arc<TestCa>, EvidencePurpose, StageClaims);

impl AttestationProvider for BindsOther {
    fn format(&self) -> EvidenceFormat {
        EvidenceFormat::Nitro
    }
    fn attest(&self, pk: &[u8], _ud: &[u8], nonce: &[u8]) -> Result<Evidence, AttestError> {
        let ud = claims_binding(EvidenceFormat::Nitro, self.1, &proto::cbor::to_vec(&self.2));
        Ok(Evidence {
            format: EvidenceFormat::Nitro,
            document: self.0.document(pk, &ud, nonce),
        })
    }
}

#[tokio::test]
async fn nitro_evidence_binding_other_claims_is_refused() {
    let ca = Arc::new(own_ca());
    let verifier = AnyVerifier {
        nitro: ca.verifier(),
    };
    let e = handshake_with(
        Arc::new(BindsOther(ca.clone(), EvidencePurpose::Channel, claims(1))),
        verifier,
        synth_policy(&hex::encode(vec![0x10u8; 48])),
    )
    .await
    .unwrap_err();
    assert!(e.contains("does not bind these claims"), "{e}");
}

#[test]
fn attest_claims_binds_the_claims_digest_for_nitro() {
    use proto::attestation::bound_claims;
    let ca = Arc::new(own_ca());
    let provider = SynthProvider(ca.clone());
    let ev = attest_claims(&provider, b"key", EvidencePurpose::Boot, &claims(0), b"n").unwrap();
    let doc = ca.verifier().verify(&ev.document).unwrap().document;
    let c0 = proto::cbor::to_vec(&claims(0));
    let bound = bound_claims(&doc, EvidencePurpose::Boot, Some(&c0));
    assert_eq!(bound, Ok(claims(0)));
    assert!(bound_claims(&doc, EvidencePurpose::Boot, None).is_err());
    let c1 = proto::cbor::to_vec(&claims(1));
    assert!(bound_claims(&doc, EvidencePurpose::Boot, Some(&c1)).is_err());
    // Made for one purpose, refused for the others.
    for other in [EvidencePurpose::Channel, EvidencePurpose::Attestation] {
        let e = bound_claims(&doc, other, Some(&c0)).unwrap_err();
        assert!(e.contains(other.label()), "{e}");
    }
}

/// Issue 18, finding 6: a stage whose channel evidence was made for
/// another purpose (e.g. a document obtained through `/v1/attestation`,
/// binding the right key, nonce and claims) is refused in the handshake.
#[tokio::test]
async fn evidence_made_for_another_purpose_is_not_channel_evidence() {
    let ca = Arc::new(own_ca());
    let pcr0 = hex::encode(vec![0x10u8; 48]);
    for purpose in [EvidencePurpose::Attestation, EvidencePurpose::Boot] {
        let verifier = AnyVerifier {
            nitro: ca.verifier(),
        };
        let provider = Arc::new(BindsOther(ca.clone(), purpose, claims(0)));
        let e = handshake_with(provider, verifier, synth_policy(&pcr0))
            .await
            .unwrap_err();
        assert!(e.contains("for the channel purpose"), "{purpose:?}: {e}");
    }
    // The same provider making channel evidence is accepted.
    let verifier = AnyVerifier {
        nitro: ca.verifier(),
    };
    let provider = Arc::new(BindsOther(ca.clone(), EvidencePurpose::Channel, claims(0)));
    handshake_with(provider, verifier, synth_policy(&pcr0))
        .await
        .unwrap();
}
