//! What attestation evidence is, independent of who makes or checks it:
//! the wire form ([`Evidence`]), what a verified document says
//! ([`VerifiedDocument`], [`Measurement`], [`Pcrs`]), the errors, and the
//! provider and verifier traits. A leaf module: the mock provider and
//! verifier (`attestation`), the Nitro verifier (`nitro`), the policy
//! (`policy`) and the pipeline frames (`frames`) all build on it, and it
//! refers to none of them.

use crate::digest::Sha256Digest;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The kind of evidence a document is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum EvidenceFormat {
    /// Development evidence signed by the public mock key. Proves nothing.
    Mock,
    /// An AWS Nitro Enclaves attestation document (COSE_Sign1, ES384).
    Nitro,
}

/// Attestation evidence as carried on the wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evidence {
    /// Which verifier understands `document`.
    pub format: EvidenceFormat,
    /// The raw signed document.
    #[serde(with = "serde_bytes")]
    pub document: Vec<u8>,
}

impl Evidence {
    /// Digest of the evidence as it is encoded on the wire.
    pub fn digest(&self) -> Sha256Digest {
        Sha256Digest::of(&crate::cbor::to_vec(self))
    }
}

/// What a stage's measurement is, by evidence format.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Measurement {
    /// Mock: SHA-256 over the stage binary and the model manifest
    /// (see [`mock_measurement`]).
    Mock(Sha256Digest),
    /// Nitro: the document's PCRs (PCR0 image, PCR1 kernel, PCR2
    /// application, PCR8 signing certificate, ...).
    Nitro(Pcrs),
}

impl Measurement {
    /// The printable form (`mock:<hex>`, or `nitro:pcr0=…,pcr1=…,pcr2=…`).
    pub fn pinned_form(&self) -> String {
        match self {
            Measurement::Mock(d) => format!("mock:{}", d.hex()),
            Measurement::Nitro(p) => p.pinned_form(),
        }
    }
}

/// The fields of a document that verified.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifiedDocument {
    /// Evidence format (mock documents are flagged here).
    pub format: EvidenceFormat,
    /// Issuer's module id.
    pub module_id: String,
    /// Time the document was made, Unix milliseconds.
    pub timestamp_ms: u64,
    /// The measurement of the attested code.
    pub measurement: Measurement,
    /// Bound public key.
    pub public_key: Vec<u8>,
    /// Bound user data.
    pub user_data: Vec<u8>,
    /// Bound nonce.
    pub nonce: Vec<u8>,
}

/// What a session expects a document to bind; `None` is not checked.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExpectedBinding<'a> {
    /// The verifier's nonce.
    pub nonce: Option<&'a [u8]>,
    /// The key the document must bind.
    pub public_key: Option<&'a [u8]>,
    /// The user data (e.g. `attestation::claims_binding` of the claims) it must bind.
    pub user_data: Option<&'a [u8]>,
}

/// Why a verified document does not bind what the session expects.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BindingError {
    /// Another nonce: stale or replayed evidence.
    #[error("the document does not bind the expected nonce (stale or replayed evidence)")]
    Nonce,
    /// Another public key.
    #[error("the document does not bind the expected public key")]
    PublicKey,
    /// Other user data.
    #[error("the document does not bind the expected user data")]
    UserData,
}

impl VerifiedDocument {
    /// Checks the document's `nonce`, `public_key` and `user_data` against
    /// what the session expects (exact byte equality).
    pub fn check_binding(&self, expected: &ExpectedBinding<'_>) -> Result<(), BindingError> {
        if expected.nonce.is_some_and(|n| n != self.nonce) {
            return Err(BindingError::Nonce);
        }
        if expected.public_key.is_some_and(|k| k != self.public_key) {
            return Err(BindingError::PublicKey);
        }
        if expected.user_data.is_some_and(|u| u != self.user_data) {
            return Err(BindingError::UserData);
        }
        Ok(())
    }
}

/// Attestation errors. Each names its reason.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AttestError {
    /// The document does not parse.
    #[error("malformed attestation document: {0}")]
    Malformed(String),
    /// The signature does not verify.
    #[error("attestation signature does not verify")]
    BadSignature,
    /// The document is signed with an algorithm this verifier refuses.
    #[error("unsupported signature algorithm {0}")]
    UnsupportedAlgorithm(String),
    /// A certificate of the chain has expired at the verification time.
    #[error(
        "certificate chain: a certificate expired at {not_after} (Unix s); verification time {now}"
    )]
    CertificateExpired {
        /// Verification time, Unix seconds.
        now: u64,
        /// The certificate's notAfter, Unix seconds.
        not_after: u64,
    },
    /// A certificate of the chain is not yet valid at the verification time.
    #[error("certificate chain: a certificate is not valid before {not_before} (Unix s); verification time {now}")]
    CertificateNotYetValid {
        /// Verification time, Unix seconds.
        now: u64,
        /// The certificate's notBefore, Unix seconds.
        not_before: u64,
    },
    /// The chain does not lead to the pinned root.
    #[error("certificate chain is not trusted: {0}")]
    UntrustedChain(String),
    /// A certificate is malformed, misused or badly signed.
    #[error("certificate chain: {0}")]
    BadCertificate(String),
    /// This verifier does not handle this format.
    #[error("no verifier for evidence format {0:?}")]
    UnsupportedFormat(EvidenceFormat),
    /// The provider could not produce a document.
    #[error("attestation provider failed: {0}")]
    Provider(String),
}

/// Something that can produce attestation documents for this process.
pub trait AttestationProvider: Send + Sync {
    /// The format this provider produces.
    fn format(&self) -> EvidenceFormat;
    /// Produces a document binding `public_key`, `user_data` and `nonce`.
    fn attest(
        &self,
        public_key: &[u8],
        user_data: &[u8],
        nonce: &[u8],
    ) -> Result<Evidence, AttestError>;
}

/// Something that can check attestation documents' signatures.
pub trait EvidenceVerifier: Send + Sync {
    /// Verifies the document's signature chain and returns its fields.
    /// Binding and policy checks are the caller's (the `policy` module).
    fn verify(&self, evidence: &Evidence) -> Result<VerifiedDocument, AttestError>;
}

/// A document's platform configuration registers, by index.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pcrs(pub BTreeMap<u8, Vec<u8>>);

impl Pcrs {
    /// The value of PCR `index`, if the document has it.
    pub fn get(&self, index: u8) -> Option<&[u8]> {
        self.0.get(&index).map(Vec::as_slice)
    }

    /// Whether the enclave runs in debug mode: AWS zeroes PCR0 (and 1, 2)
    /// of enclaves started with `--debug-mode`, whose memory the parent can read.
    pub fn is_debug(&self) -> bool {
        self.get(0).is_none_or(|p| p.iter().all(|&b| b == 0))
    }

    /// The measurement form policies print and pin:
    /// `nitro:pcr0=<hex>,pcr1=<hex>,pcr2=<hex>` plus `,pcr8=<hex>` when
    /// PCR8 (the EIF signing certificate) is set.
    pub fn pinned_form(&self) -> String {
        let hex_of = |i: u8| self.get(i).map(hex::encode).unwrap_or_default();
        let mut s = format!(
            "nitro:pcr0={},pcr1={},pcr2={}",
            hex_of(0),
            hex_of(1),
            hex_of(2)
        );
        if self.get(8).is_some_and(|p| p.iter().any(|&b| b != 0)) {
            s += &format!(",pcr8={}", hex_of(8));
        }
        s
    }
}
