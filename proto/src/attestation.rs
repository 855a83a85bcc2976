//! Attestation: the mock provider and verifier used where no enclave
//! hardware exists, the dispatch to the AWS Nitro verifier
//! ([`crate::nitro`]), and the binding of a stage's claims into its
//! documents. The evidence types and traits are in [`crate::evidence`]
//! (re-exported here).
//!
//! A document binds three things the verifier checks against the session:
//! `public_key` (the stage's ephemeral channel key, or its receipt key in
//! boot and bundle evidence), `nonce` (the verifier's fresh challenge) and
//! `user_data` (the stage's claims: index, layer range, manifest digest,
//! keys; see [`claims_binding`]). The mock document has the same shape as a
//! Nitro one, is a COSE_Sign1 signed with a **publicly known** Ed25519 key,
//! and says `mock: true` in its payload: it proves nothing and a production
//! policy rejects it.

pub use crate::claims::{
    attest_claims, bound_claims, claims_binding, legacy_claims_binding, EvidencePurpose,
};
use crate::digest::Sha256Digest;
pub use crate::evidence::{
    AttestError, AttestationProvider, BindingError, Evidence, EvidenceFormat, EvidenceVerifier,
    ExpectedBinding, Measurement, VerifiedDocument,
};
use crate::nitro::{NitroVerifier, VerifyTime};
use coset::{iana, CborSerializable, CoseSign1, CoseSign1Builder, HeaderBuilder};
use ed25519_dalek::{Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};
use std::time::{SystemTime, UNIX_EPOCH};

/// Seed of the public mock signing key. Anyone can sign mock evidence.
const MOCK_KEY_SEED_LABEL: &[u8] = b"confidential-inference MOCK attestation key: NOT SECURE";

/// Warning text carried in every mock document.
pub const MOCK_WARNING: &str =
    "MOCK ATTESTATION: not produced by enclave hardware; proves nothing about where code runs";

/// The warning every output involving a Nitro enclave in debug mode carries
/// (stage logs, the gateway's `/readyz` and `/v1/attestation`).
pub const DEBUG_WARNING: &str = "NITRO DEBUG MODE: the enclave's PCRs read zero and the parent instance can read its memory; \
     for a first bring-up only (scripts/build-eif.sh --debug-policy), refused by every production policy";

fn mock_signing_key() -> SigningKey {
    SigningKey::from_bytes(&Sha256Digest::of(MOCK_KEY_SEED_LABEL).0)
}

/// The measurement a mock provider reports: SHA-256 over the digests of
/// the stage binary, the model manifest it serves and the policy file it
/// judges its peers by (what it runs, what it computes, whom it trusts: a
/// stage started with a laxer policy is another stage). A Nitro image
/// holds all three, so its PCRs cover them alike.
pub fn mock_measurement(
    binary: &Sha256Digest,
    manifest: &Sha256Digest,
    policy: &Sha256Digest,
) -> Measurement {
    Measurement::Mock(Sha256Digest::of_parts(
        "mock-measurement/v2",
        &[&binary.0, &manifest.0, &policy.0],
    ))
}

#[derive(Serialize, Deserialize)]
struct MockPayload {
    module_id: String,
    mock: bool,
    warning: String,
    timestamp: u64,
    #[serde(with = "serde_bytes")]
    measurement: Vec<u8>,
    #[serde(with = "serde_bytes")]
    public_key: Vec<u8>,
    #[serde(with = "serde_bytes")]
    user_data: Vec<u8>,
    #[serde(with = "serde_bytes")]
    nonce: Vec<u8>,
}

/// Mock provider: signs documents with the public mock key.
pub struct MockProvider {
    module_id: String,
    measurement: Measurement,
}

impl MockProvider {
    /// A provider reporting `measurement` (from [`mock_measurement`]; a
    /// Nitro measurement makes every `attest` fail).
    pub fn new(module_id: impl Into<String>, measurement: &Measurement) -> Self {
        Self {
            module_id: module_id.into(),
            measurement: measurement.clone(),
        }
    }
}

impl AttestationProvider for MockProvider {
    fn format(&self) -> EvidenceFormat {
        EvidenceFormat::Mock
    }

    fn attest(
        &self,
        public_key: &[u8],
        user_data: &[u8],
        nonce: &[u8],
    ) -> Result<Evidence, AttestError> {
        let Measurement::Mock(measurement) = &self.measurement else {
            return Err(AttestError::Provider(
                "the mock provider reports mock measurements only".into(),
            ));
        };
        let payload = MockPayload {
            module_id: self.module_id.clone(),
            mock: true,
            warning: MOCK_WARNING.into(),
            timestamp: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            measurement: measurement.0.to_vec(),
            public_key: public_key.to_vec(),
            user_data: user_data.to_vec(),
            nonce: nonce.to_vec(),
        };
        let key = mock_signing_key();
        let sign1 = CoseSign1Builder::new()
            .protected(
                HeaderBuilder::new()
                    .algorithm(iana::Algorithm::EdDSA)
                    .build(),
            )
            .payload(crate::cbor::to_vec(&payload))
            .create_signature(b"", |tbs| key.sign(tbs).to_bytes().to_vec())
            .build();
        let document = sign1
            .to_vec()
            .map_err(|e| AttestError::Provider(e.to_string()))?;
        Ok(Evidence {
            format: EvidenceFormat::Mock,
            document,
        })
    }
}

/// Verifier for mock documents (checks the mock key's signature).
pub struct MockVerifier;

impl EvidenceVerifier for MockVerifier {
    fn verify(&self, evidence: &Evidence) -> Result<VerifiedDocument, AttestError> {
        if evidence.format != EvidenceFormat::Mock {
            return Err(AttestError::UnsupportedFormat(evidence.format));
        }
        let sign1 = CoseSign1::from_slice(&evidence.document)
            .map_err(|e| AttestError::Malformed(e.to_string()))?;
        if sign1.protected.header.alg
            != Some(coset::RegisteredLabelWithPrivate::Assigned(
                iana::Algorithm::EdDSA,
            ))
        {
            return Err(AttestError::Malformed("algorithm is not EdDSA".into()));
        }
        let vk: VerifyingKey = mock_signing_key().verifying_key();
        sign1
            .verify_signature(b"", |sig, tbs| {
                let sig = ed25519_dalek::Signature::from_slice(sig).map_err(|_| ())?;
                vk.verify(tbs, &sig).map_err(|_| ())
            })
            .map_err(|_| AttestError::BadSignature)?;
        let payload = sign1
            .payload
            .as_deref()
            .ok_or_else(|| AttestError::Malformed("no payload".into()))?;
        let p: MockPayload = crate::cbor::from_slice(payload).map_err(AttestError::Malformed)?;
        if !p.mock {
            return Err(AttestError::Malformed(
                "mock-signed document without mock flag".into(),
            ));
        }
        let measurement: [u8; 32] = p
            .measurement
            .try_into()
            .map_err(|_| AttestError::Malformed("measurement is not 32 bytes".into()))?;
        Ok(VerifiedDocument {
            format: EvidenceFormat::Mock,
            module_id: p.module_id,
            timestamp_ms: p.timestamp,
            measurement: Measurement::Mock(Sha256Digest(measurement)),
            public_key: p.public_key,
            user_data: p.user_data,
            nonce: p.nonce,
        })
    }
}

impl EvidenceVerifier for NitroVerifier {
    fn verify(&self, evidence: &Evidence) -> Result<VerifiedDocument, AttestError> {
        if evidence.format != EvidenceFormat::Nitro {
            return Err(AttestError::UnsupportedFormat(evidence.format));
        }
        NitroVerifier::verify(self, &evidence.document).map(|v| v.document)
    }
}

/// Verifies every supported format: mock documents with [`MockVerifier`],
/// Nitro documents with a [`NitroVerifier`] (by default: the pinned AWS
/// root and the system clock).
#[derive(Clone, Debug, Default)]
pub struct AnyVerifier {
    /// The Nitro verifier used.
    pub nitro: NitroVerifier,
}

impl EvidenceVerifier for AnyVerifier {
    fn verify(&self, evidence: &Evidence) -> Result<VerifiedDocument, AttestError> {
        match evidence.format {
            EvidenceFormat::Mock => MockVerifier.verify(evidence),
            EvidenceFormat::Nitro => EvidenceVerifier::verify(&self.nitro, evidence),
        }
    }
}

impl AnyVerifier {
    /// The same verifier judging Nitro certificates at each document's own
    /// time (for boot evidence; see [`VerifyTime::DocumentTime`]).
    pub fn at_document_time(&self) -> Self {
        Self {
            nitro: self.nitro.clone().with_time(VerifyTime::DocumentTime),
        }
    }
}

/// Verifies any supported evidence format (Nitro: pinned AWS root, system clock).
pub fn verify_any(evidence: &Evidence) -> Result<VerifiedDocument, AttestError> {
    AnyVerifier::default().verify(evidence)
}

/// Verifies boot evidence (made at stage start, bound to no nonce): as
/// [`verify_any`], but Nitro certificates are judged at the document's own
/// time, since the leaf certificate expires hours after the stage started.
pub fn verify_boot(evidence: &Evidence) -> Result<VerifiedDocument, AttestError> {
    AnyVerifier::default().at_document_time().verify(evidence)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provider() -> MockProvider {
        let d = |s: &[u8]| Sha256Digest::of(s);
        let m = mock_measurement(&d(b"bin"), &d(b"manifest"), &d(b"policy"));
        MockProvider::new("stage-0", &m)
    }

    #[test]
    fn mock_roundtrip_binds_fields() {
        let ev = provider().attest(b"pk", b"ud", b"nonce").unwrap();
        let doc = MockVerifier.verify(&ev).unwrap();
        assert_eq!(doc.public_key, b"pk");
        assert_eq!(doc.user_data, b"ud");
        assert_eq!(doc.nonce, b"nonce");
        assert_eq!(doc.format, EvidenceFormat::Mock);
        assert!(doc.measurement.pinned_form().starts_with("mock:"));
    }

    #[test]
    fn measurement_depends_on_binary_manifest_and_policy() {
        let d = |s: &[u8]| Sha256Digest::of(s);
        let a = mock_measurement(&d(b"bin"), &d(b"m"), &d(b"p"));
        let b = mock_measurement(&d(b"bin2"), &d(b"m"), &d(b"p"));
        let c = mock_measurement(&d(b"bin"), &d(b"m2"), &d(b"p"));
        let e = mock_measurement(&d(b"bin"), &d(b"m"), &d(b"p2"));
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, e);
    }

    #[test]
    fn every_flipped_byte_is_rejected() {
        let ev = provider().attest(b"pk", b"ud", b"nonce").unwrap();
        for i in 0..ev.document.len() {
            let mut bad = ev.clone();
            bad.document[i] ^= 0x01;
            assert!(
                MockVerifier.verify(&bad).is_err(),
                "flip at byte {i} accepted"
            );
        }
    }
}
