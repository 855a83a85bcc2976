//! Target `evidence`: what a client or the gateway verifies about enclaves:
//! evidence bundles (`GET /v1/attestation`, CBOR) against a policy, AWS Nitro
//! attestation documents (COSE_Sign1, CBOR payload, X.509 chain to the
//! pinned AWS root; raw or base64), and single evidence values as the
//! stage channel carries them.
//!
//! Nitro documents are judged at their own time, so the recorded real
//! documents in the seed corpus verify all the way and mutations of them
//! reach every step.

use proto::attestation::{AnyVerifier, Evidence, EvidenceVerifier};
use proto::bundle::EvidenceBundle;
use proto::digest::Sha256Digest;
use proto::nitro::{decode_document, parse_cose, parse_payload, NitroVerifier, VerifyTime};
use proto::policy::Policy;
use std::sync::OnceLock;

/// The nonce the seed bundle binds.
pub const NONCE: &[u8] = b"fuzz-nonce";

fn verifier() -> &'static AnyVerifier {
    static V: OnceLock<AnyVerifier> = OnceLock::new();
    V.get_or_init(|| AnyVerifier {
        nitro: NitroVerifier::aws().with_time(VerifyTime::DocumentTime),
    })
}

fn policy() -> &'static Policy {
    static P: OnceLock<Policy> = OnceLock::new();
    P.get_or_init(|| {
        let text = format!(
            "allow_mock = true\nmanifest_sha256 = \"{}\"\n\
             [[stages]]\nindex = 0\nlayers = [0, 3]\nmeasurements = [\"{}\"]\n",
            Sha256Digest::of(b"manifest").hex(),
            crate::channel::measurement().pinned_form()
        );
        Policy::from_toml(&text).expect("policy")
    })
}

/// Whether `bytes` is a bundle that verifies against the target's policy
/// (the seed bundle does).
pub fn bundle_verifies(bytes: &[u8]) -> bool {
    proto::cbor::from_slice::<EvidenceBundle>(bytes).is_ok_and(|bundle| {
        let (lines, verified) = bundle.verify_with(policy(), NONCE, verifier());
        assert!(!lines.is_empty(), "a verdict names its checks");
        verified.is_some()
    })
}

/// Runs one input: the first byte picks bundle, Nitro document or evidence.
pub fn run(data: &[u8]) {
    if let Some((which, bytes)) = crate::selector(data) {
        match which % 3 {
            0 => _ = bundle_verifies(bytes),
            1 => {
                if let Ok(doc) = decode_document(bytes) {
                    if let Ok((sign1, _)) = parse_cose(&doc) {
                        if let Some(payload) = sign1.payload.as_deref() {
                            let _ = parse_payload(payload);
                        }
                    }
                    let _ = verifier().nitro.verify(&doc);
                }
            }
            _ => {
                if let Ok(evidence) = proto::cbor::from_slice::<Evidence>(bytes) {
                    let _ = verifier().verify(&evidence);
                }
            }
        }
    }
}
