//! The stage's own keys, generated at start and never leaving the process:
//! the Ed25519 receipt-signing key, the entry stage's HPKE key, and the
//! boot evidence that binds them (receipt links name its digest).

use ed25519_dalek::SigningKey;
use proto::attestation::{
    attest_claims, AttestError, AttestationProvider, Evidence, EvidenceFormat, EvidencePurpose,
};
use proto::digest::Sha256Digest;
use proto::frames::StageClaims;
use proto::sealing::{KeyConfig, ServerKey};
use std::sync::atomic::{AtomicU64, Ordering};

/// Enclave-held HPKE key ids are drawn from this range at every start, so a
/// client holding a restarted stage's old key is told to refetch (unknown key
/// id) rather than failing to open; ids from 0x80 are the gateway's.
pub const ENCLAVE_HPKE_KEY_IDS: std::ops::RangeInclusive<u8> = 1..=0x7f;

/// Keys and boot evidence of one stage.
pub struct StageKeys {
    /// Receipt-signing key.
    pub receipt: SigningKey,
    /// The entry stage's HPKE key.
    pub hpke: Option<ServerKey>,
    /// Evidence made at start: binds the receipt key (`public_key`) and the
    /// claims (`user_data`, see `proto::attestation::claims_binding`) with
    /// an empty nonce.
    pub boot_evidence: Evidence,
    /// Digest of `boot_evidence`, named in this stage's receipt links.
    pub evidence_digest: Sha256Digest,
    /// Whether the evidence is mock (recorded in receipts).
    pub mock: bool,
    sequence: AtomicU64,
}

impl StageKeys {
    /// Generates the keys, fills them into `claims` and makes the boot evidence.
    pub fn generate(
        claims: &mut StageClaims,
        provider: &dyn AttestationProvider,
    ) -> Result<Self, AttestError> {
        let receipt = SigningKey::generate(&mut rand::rngs::OsRng);
        let hpke = claims.is_entry().then(|| {
            use rand::Rng;
            ServerKey::generate(rand::rngs::OsRng.gen_range(ENCLAVE_HPKE_KEY_IDS))
        });
        claims.receipt_key = receipt.verifying_key().to_bytes();
        claims.hpke_keys = hpke
            .as_ref()
            .map(|k| KeyConfig::encode_list(&[k.config()]))
            .unwrap_or_default();
        let boot_evidence = attest_claims(
            provider,
            &claims.receipt_key,
            EvidencePurpose::Boot,
            claims,
            &[],
        )?;
        Ok(Self {
            evidence_digest: boot_evidence.digest(),
            mock: provider.format() == EvidenceFormat::Mock,
            boot_evidence,
            receipt,
            hpke,
            sequence: AtomicU64::new(0),
        })
    }

    /// The next receipt sequence number of this key (monotonic from 0).
    pub fn next_sequence(&self) -> u64 {
        self.sequence.fetch_add(1, Ordering::SeqCst)
    }
}
