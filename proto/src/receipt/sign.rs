//! COSE_Sign1: signing links and receipts, parsing them back.

use super::error::ReceiptError;
// Via the parent's re-exports, not `format`: `format` uses this module (no
// module circle, scripts/module_cycles.py).
use super::{Link, ReceiptBody, ReceiptVersion};
use crate::digest::Sha256Digest;
use coset::{iana, CborSerializable, CoseSign1, CoseSign1Builder, HeaderBuilder};
use ed25519_dalek::{Signer, SigningKey, VerifyingKey};

/// Signs `payload` as a COSE_Sign1 of `content_type` (EdDSA, the key id the
/// verifying key). [`sign_link`] and [`sign_receipt`] encode their payloads
/// canonically first; test vectors call this directly to sign payloads that
/// are not canonical, which verification must refuse.
pub fn sign(key: &SigningKey, content_type: &str, payload: Vec<u8>) -> Vec<u8> {
    CoseSign1Builder::new()
        .protected(
            HeaderBuilder::new()
                .algorithm(iana::Algorithm::EdDSA)
                .content_type(content_type.to_string())
                .key_id(key.verifying_key().to_bytes().to_vec())
                .build(),
        )
        .payload(payload)
        .create_signature(b"", |tbs| key.sign(tbs).to_bytes().to_vec())
        .build()
        .to_vec()
        .expect("COSE_Sign1 encoding cannot fail")
}

/// Signs a link with the stage's receipt key; returns the COSE_Sign1 bytes
/// that go into [`ReceiptBody::chain`].
pub fn sign_link(key: &SigningKey, link: &Link) -> Vec<u8> {
    sign_link_as(key, link, ReceiptVersion::CURRENT)
}

/// [`sign_link`] in the link format of `version` (an older one only to make
/// test vectors).
pub fn sign_link_as(key: &SigningKey, link: &Link, version: ReceiptVersion) -> Vec<u8> {
    sign(key, version.link_content_type(), link.to_cbor_as(version))
}

/// Signs a receipt (and with it the exit stage's link) with the exit
/// stage's receipt key, in the body's `version`; returns the COSE_Sign1
/// bytes (the receipt).
pub fn sign_receipt(key: &SigningKey, body: &ReceiptBody) -> Vec<u8> {
    sign(key, body.version.receipt_content_type(), body.to_cbor())
}

/// A link signed in the current format, checked as the next stage checks
/// its predecessor's before signing its own: canonical COSE_Sign1, signed
/// (strict Ed25519) by `key` itself, payload decoded.
pub fn verify_link(signed: &[u8], key: &[u8; 32]) -> Result<Link, ReceiptError> {
    let version = ReceiptVersion::CURRENT;
    let s = parse_signed(signed, version.link_content_type())?;
    if s.kid != *key || !verifies(&s, key) {
        return Err(ReceiptError::BadHeader(
            "link is not signed by the expected stage key".into(),
        ));
    }
    Link::from_cbor_as(&s.payload, version)
}

/// Digest of a signed link, as the next link's `prev_link_digest`.
pub fn link_digest(signed_link: &[u8]) -> Sha256Digest {
    Sha256Digest::of(signed_link)
}

/// A parsed, not yet verified COSE_Sign1 of ours.
pub(crate) struct Signed {
    pub(super) sign1: CoseSign1,
    pub(crate) kid: [u8; 32],
    pub(crate) payload: Vec<u8>,
}

/// Parses a COSE_Sign1 and checks its headers: malformed structure →
/// `Err(Malformed)`, unexpected headers → `Err(BadHeader)`.
pub(crate) fn parse_signed(bytes: &[u8], content_type: &str) -> Result<Signed, ReceiptError> {
    parse_signed_any(bytes, &[content_type]).map(|(s, _)| s)
}

/// [`parse_signed`] accepting any of `content_types`; also returns which.
pub(super) fn parse_signed_any<'c>(
    bytes: &[u8],
    content_types: &[&'c str],
) -> Result<(Signed, &'c str), ReceiptError> {
    let sign1 = CoseSign1::from_slice(bytes).map_err(|e| ReceiptError::Malformed(e.to_string()))?;
    if sign1.clone().to_vec().ok().as_deref() != Some(bytes) {
        return Err(ReceiptError::Malformed(
            "COSE_Sign1 is not in its canonical encoding".into(),
        ));
    }
    let h = &sign1.protected.header;
    if h.alg
        != Some(coset::RegisteredLabelWithPrivate::Assigned(
            iana::Algorithm::EdDSA,
        ))
    {
        return Err(ReceiptError::BadHeader("algorithm is not EdDSA".into()));
    }
    let content_type = content_types
        .iter()
        .find(|ct| h.content_type == Some(coset::RegisteredLabel::Text(ct.to_string())))
        .copied()
        .ok_or_else(|| {
            ReceiptError::BadHeader(format!(
                "content type is not {}",
                content_types.join(" or ")
            ))
        })?;
    let kid: [u8; 32] = h
        .key_id
        .clone()
        .try_into()
        .map_err(|_| ReceiptError::BadHeader("kid is not a 32-byte Ed25519 key".into()))?;
    if !h.crit.is_empty()
        || !h.iv.is_empty()
        || !h.partial_iv.is_empty()
        || !h.counter_signatures.is_empty()
        || !h.rest.is_empty()
    {
        return Err(ReceiptError::BadHeader(
            "unexpected protected header parameters".into(),
        ));
    }
    if !sign1.unprotected.is_empty() {
        return Err(ReceiptError::BadHeader(
            "unprotected header is not empty".into(),
        ));
    }
    let payload = sign1
        .payload
        .clone()
        .ok_or_else(|| ReceiptError::Malformed("detached payload".into()))?;
    Ok((
        Signed {
            sign1,
            kid,
            payload,
        },
        content_type,
    ))
}

/// Parses a receipt's COSE_Sign1 in any format version this code reads.
pub(super) fn parse_receipt(bytes: &[u8]) -> Result<(Signed, ReceiptVersion), ReceiptError> {
    let types = ReceiptVersion::ALL.map(ReceiptVersion::receipt_content_type);
    let (signed, ct) = parse_signed_any(bytes, &types)?;
    let version =
        ReceiptVersion::from_receipt_content_type(ct).expect("one of the listed content types");
    Ok((signed, version))
}

/// Whether `signed` verifies under `key` (strict Ed25519).
pub(crate) fn verifies(signed: &Signed, key: &[u8; 32]) -> bool {
    let Ok(vk) = VerifyingKey::from_bytes(key) else {
        return false;
    };
    signed
        .sign1
        .verify_signature(b"", |sig, tbs| {
            let sig = ed25519_dalek::Signature::from_slice(sig).map_err(|_| ())?;
            vk.verify_strict(tbs, &sig).map_err(|_| ())
        })
        .is_ok()
}

/// Decodes a receipt **without verifying anything** (e.g. to read its id
/// for storage). Returns the body and the signer's key (`kid`).
pub fn parse_unverified(receipt: &[u8]) -> Result<(ReceiptBody, [u8; 32]), ReceiptError> {
    let (signed, version) = parse_receipt(receipt)?;
    Ok((
        ReceiptBody::from_cbor(&signed.payload, version)?,
        signed.kid,
    ))
}
