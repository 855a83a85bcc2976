//! The entry stage's HPKE key set, signed with its receipt key: how keys
//! that rotate after the stage's boot evidence are published and attested.
//!
//! The boot evidence binds the stage's receipt key and its claims, which
//! carry the first HPKE key. When the stage rotates its HPKE key it signs
//! the keys it now accepts with that attested receipt key, which never
//! leaves the enclave: a verifier who checked the evidence trusts the set
//! as much as the claims, with no new evidence (so receipt links keep
//! naming the same boot evidence). COSE_Sign1 as for receipts, content type
//! [`KEY_SET_CONTENT_TYPE`], payload in deterministic CBOR:
//!
//! ```text
//! { 1: issued_at (uint, Unix seconds),
//!   2: [ { 1: key configuration (bstr, RFC 9458), 2: retires_at (uint, Unix seconds; 0 = not scheduled) } ... ] }
//! ```
//!
//! Keys are listed newest first: a client seals to the first. A host can
//! withhold a newer set or replay an older one; that can only make a client
//! seal to a key the stage has retired, which fails with `hpke_key_unknown`
//! and sends the client back for the current set.

use crate::receipt::{
    canonical_bytes, decode_canonical, int_map, parse_signed, sign, uint, verifies, Fields,
    ReceiptError,
};
use crate::sealing::KeyConfig;
use ciborium::value::Value;
use ed25519_dalek::SigningKey;

/// COSE content type of a signed HPKE key set.
pub const KEY_SET_CONTENT_TYPE: &str = "application/vnd.ci.hpke-key-set.v1+cbor";

/// The HPKE keys an entry stage accepts, as it signed them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeySet {
    /// When the stage signed the set (Unix seconds).
    pub issued_at: u64,
    /// The keys, newest first, each with when the stage stops accepting it
    /// (Unix seconds; `None` while no retirement is scheduled).
    pub keys: Vec<(KeyConfig, Option<u64>)>,
}

impl KeySet {
    /// Deterministic CBOR of the payload.
    pub fn to_cbor(&self) -> Vec<u8> {
        let keys = self
            .keys
            .iter()
            .map(|(k, retires)| {
                int_map(vec![
                    (1, Value::Bytes(k.encode())),
                    (2, uint(retires.unwrap_or(0))),
                ])
            })
            .collect();
        canonical_bytes(&int_map(vec![
            (1, uint(self.issued_at)),
            (2, Value::Array(keys)),
        ]))
        .expect("integer keys are distinct")
    }

    /// Parses a payload (deterministic CBOR only).
    pub fn from_cbor(bytes: &[u8]) -> Result<Self, ReceiptError> {
        let bad = |m: String| ReceiptError::Malformed(format!("key set: {m}"));
        let mut f = Fields::new(decode_canonical(bytes)?, 2).map_err(bad)?;
        let issued_at = f.uint(1).map_err(bad)?;
        let Value::Array(items) = f.take(2) else {
            return Err(bad("key 2: not an array".into()));
        };
        if items.is_empty() {
            return Err(bad("no keys".into()));
        }
        let mut keys = Vec::with_capacity(items.len());
        for item in items {
            let mut k = Fields::new(item, 2).map_err(bad)?;
            let raw = k.bytes(1).map_err(bad)?;
            let config =
                KeyConfig::decode(&raw).map_err(|e| bad(format!("key configuration: {e}")))?;
            // Decoding skips suites it does not know; a stage lists only
            // ones it accepts, so what it signed re-encodes to itself.
            if config.encode() != raw {
                return Err(bad(format!(
                    "key {} lists suites this verifier does not know",
                    config.key_id
                )));
            }
            let retires = k.uint(2).map_err(bad)?;
            if keys
                .iter()
                .any(|(c, _): &(KeyConfig, _)| c.key_id == config.key_id)
            {
                return Err(bad(format!("key id {} listed twice", config.key_id)));
            }
            keys.push((config, (retires != 0).then_some(retires)));
        }
        Ok(Self { issued_at, keys })
    }

    /// Signs the set with the stage's receipt key (COSE_Sign1).
    pub fn sign(&self, key: &SigningKey) -> Vec<u8> {
        sign(key, KEY_SET_CONTENT_TYPE, self.to_cbor())
    }

    /// Checks a signed set against the receipt key from the stage's verified
    /// evidence ([`ReceiptError::BadSignature`] if another key signed it)
    /// and returns it.
    pub fn verify(signed: &[u8], receipt_key: &[u8; 32]) -> Result<Self, ReceiptError> {
        let parsed = parse_signed(signed, KEY_SET_CONTENT_TYPE)?;
        if parsed.kid != *receipt_key || !verifies(&parsed, receipt_key) {
            return Err(ReceiptError::BadSignature);
        }
        Self::from_cbor(&parsed.payload)
    }

    /// The key configurations, newest first.
    pub fn configs(&self) -> Vec<KeyConfig> {
        self.keys.iter().map(|(k, _)| k.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::receipt::RECEIPT_CONTENT_TYPE;
    use crate::sealing::ServerKey;

    fn set() -> KeySet {
        KeySet {
            issued_at: 1_700_000_000,
            keys: vec![
                (ServerKey::derive(9, b"new").config(), None),
                (ServerKey::derive(3, b"old").config(), Some(1_700_000_060)),
            ],
        }
    }

    #[test]
    fn signed_sets_verify_under_the_receipt_key_only() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let signed = set().sign(&key);
        let back = KeySet::verify(&signed, &key.verifying_key().to_bytes()).unwrap();
        assert_eq!(back, set());
        assert_eq!(back.configs()[0].key_id, 9);
        let other = SigningKey::from_bytes(&[2; 32]).verifying_key().to_bytes();
        assert!(KeySet::verify(&signed, &other).is_err());
        let mut flipped = signed.clone();
        let n = flipped.len();
        flipped[n - 70] ^= 1;
        assert!(KeySet::verify(&flipped, &key.verifying_key().to_bytes()).is_err());
        // A receipt signature is not a key set signature (content type).
        let body = sign(&key, RECEIPT_CONTENT_TYPE, set().to_cbor());
        assert!(KeySet::verify(&body, &key.verifying_key().to_bytes()).is_err());
    }

    #[test]
    fn malformed_sets_are_refused() {
        let empty = KeySet {
            issued_at: 1,
            keys: Vec::new(),
        };
        assert!(KeySet::from_cbor(&empty.to_cbor()).is_err());
        let mut twice = set();
        twice.keys[1].0.key_id = 9;
        assert!(KeySet::from_cbor(&twice.to_cbor()).is_err());
        let mut trailing = set().to_cbor();
        trailing.push(0);
        assert!(KeySet::from_cbor(&trailing).is_err());
    }

    /// Found by the `receipt` fuzz target: a listed key configuration with
    /// an unknown (KDF, AEAD) pair decoded without it, so the signed bytes
    /// and what the verifier used differed.
    #[test]
    fn a_key_with_unknown_suites_is_refused() {
        let mut config = ServerKey::derive(9, b"new").config().encode();
        config[36] += 4; // the pairs' length (u16 after id, KEM, key): one more pair
        config.extend_from_slice(&[0, 1, 0x2f, 1]); // HKDF-SHA256, an unknown AEAD
        assert!(
            KeyConfig::decode(&config).is_ok(),
            "RFC 9458 decoding skips it"
        );
        let payload = int_map(vec![
            (1, uint(1)),
            (
                2,
                Value::Array(vec![int_map(vec![(1, Value::Bytes(config)), (2, uint(0))])]),
            ),
        ]);
        let bytes = canonical_bytes(&payload).unwrap();
        let err = KeySet::from_cbor(&bytes).unwrap_err();
        assert!(err.to_string().contains("suites"), "{err}");
    }
}
