//! Signed receipts: COSE_Sign1 (EdDSA / Ed25519) over deterministic CBOR.
//!
//! A receipt says which request went through which attested stages and what
//! came out. Every stage makes one **link** ([`Link`]): the receipt id, the
//! stage index and layer range, the digest of the stage's evidence, the
//! digests of what the stage received and what it sent, and the digest of the
//! previous stage's signed link (a hash chain).
//!
//! - Each stage before the exit stage signs its link with its receipt key as
//!   its own COSE_Sign1 ([`sign_link`]) and passes it on.
//! - The exit stage puts its own link, unsigned on its own, into the
//!   **receipt** ([`ReceiptBody`], [`sign_receipt`]), which it signs with the
//!   same key: id, time, endpoint, model, the digests of the exact request and
//!   response bytes, the client's nonce, a per-key sequence number, the mock
//!   flag, how the request was sealed, the signed links of the stages before
//!   it in stage order, and its link. One signature covers both statements
//!   (one Ed25519 signature fewer per request than a separately signed exit
//!   link; the per-request crypto budget in `benchmark_results/crypto.md`).
//!
//! Payloads are maps with small unsigned integer keys in **deterministic
//! CBOR** (RFC 8949 §4.2.1: keys sorted by their encoded bytes, definite
//! lengths, smallest integer encodings, no duplicate keys). A verifier
//! re-encodes every payload and rejects it unless the bytes are identical
//! ([`ReceiptError::NotCanonical`]). COSE objects are untagged; the protected
//! header holds exactly `alg` (EdDSA, -8), `content type` (3,
//! [`RECEIPT_CONTENT_TYPE`] or [`LINK_CONTENT_TYPE`]) and `kid` (4, the
//! signer's 32-byte Ed25519 public key); the unprotected header is empty;
//! the external AAD is empty.
//!
//! [`verify_receipt`] checks a receipt against the stage keys taken from
//! verified evidence ([`StageKeys`]) and optionally the request bytes, the
//! response bytes and the expected nonce, and returns a [`VerifyReport`] with
//! one line per check. The checks and their order are in `docs/receipts.md`.

mod canonical;
mod error;
mod format;
mod report;
mod salt;
mod sign;
#[cfg(test)]
mod tests;
mod verify;

pub use canonical::{canonical_bytes, canonicalize, decode_canonical};
// The COSE and canonical-CBOR helpers the signed key set
// (`crate::key_rotation`) is built with too.
pub(crate) use canonical::{int_map, uint, Fields};
pub use error::ReceiptError;
pub use format::{Link, OpenedKey, ReceiptBody, ReceiptVersion, Sealing};
pub use report::{Check, CheckStatus, VerifyReport};
pub use salt::{salted_digest, DigestSalt, ReceiptTrailer, DIGEST_SALT_LEN};
pub use sign::{
    link_digest, parse_unverified, sign, sign_link, sign_link_as, sign_receipt, verify_link,
};
pub(crate) use sign::{parse_signed, verifies};
pub use verify::{verify_receipt, SealedTo, StageKeys, VerifyInputs};

/// COSE content type of a receipt (the current format, v4: salted digests).
pub const RECEIPT_CONTENT_TYPE: &str = "application/vnd.ci.receipt.v4+cbor";
/// COSE content type of a stage link (the current format, link v3).
pub const LINK_CONTENT_TYPE: &str = "application/vnd.ci.receipt-link.v3+cbor";
/// COSE content type of a v3 receipt (unsalted digests); still verified, as
/// what it is.
pub const RECEIPT_CONTENT_TYPE_V3: &str = "application/vnd.ci.receipt.v3+cbor";
/// COSE content type of the links inside a v3 receipt.
pub const LINK_CONTENT_TYPE_V2: &str = "application/vnd.ci.receipt-link.v2+cbor";
/// COSE content type of a v2 receipt (before links said which key the entry
/// stage opened); still verified, as what it is.
pub const RECEIPT_CONTENT_TYPE_V2: &str = "application/vnd.ci.receipt.v2+cbor";
/// COSE content type of the links inside a v2 receipt.
pub const LINK_CONTENT_TYPE_V1: &str = "application/vnd.ci.receipt-link.v1+cbor";
/// Length of a receipt id.
pub const RECEIPT_ID_LEN: usize = 16;

/// A receipt id (16 random bytes).
pub type ReceiptId = [u8; RECEIPT_ID_LEN];
