//! Salted digests (receipt v4) and the trailer that hands the salt to the
//! client.
//!
//! A plain SHA-256 of a short request ("Does the patient have HIV?") lets
//! anyone who holds the receipt, the host included, confirm a guess of it.
//! From v4 on, every digest a receipt carries (request, response, and the
//! activations each stage received and sent) is salted with a fresh 32-byte
//! secret the entry stage draws for the request. The salt travels with the
//! request inside the attested channels and reaches the client only inside
//! the sealed response, next to the receipt ([`ReceiptTrailer`]).

use super::error::ReceiptError;
use crate::digest::Sha256Digest;
use ciborium::value::Value;

/// Length of a digest salt.
pub const DIGEST_SALT_LEN: usize = 32;

/// The per-request secret that salts a v4 receipt's digests.
///
/// A plain array (CBOR: an array of 32 integers inside [`Envelope`]'s
/// encoding, a byte string in the trailer). The types that hold it inside
/// a stage wipe it when dropped ([`Envelope`], [`ReceiptTrailer`]); so do
/// the channel's buffers that carry it encoded.
///
/// [`Envelope`]: crate::frames::Envelope
pub type DigestSalt = [u8; DIGEST_SALT_LEN];

/// The digest a v4 receipt carries for content whose plain SHA-256 is
/// `inner`: SHA-256 over the length-prefixed label `receipt-digest/v4`,
/// the salt and `inner` ([`Sha256Digest::of_parts`]).
pub fn salted_digest(salt: &DigestSalt, inner: &Sha256Digest) -> Sha256Digest {
    Sha256Digest::of_parts("receipt-digest/v4", &[salt, &inner.0])
}

/// What the exit stage seals after the response body: the receipt and the
/// salt of its digests. CBOR: `{1: bstr receipt, 2: bstr .size 32 salt}`.
/// A v3 exit stage sealed the bare receipt; [`ReceiptTrailer::decode`]
/// reads that as a trailer without a salt. The salt is wiped when the
/// trailer is dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceiptTrailer {
    /// The receipt (COSE_Sign1 bytes).
    pub receipt: Vec<u8>,
    /// The salt of its digests (none for a bare v3 receipt).
    pub digest_salt: Option<DigestSalt>,
}

impl Drop for ReceiptTrailer {
    fn drop(&mut self) {
        if let Some(salt) = &mut self.digest_salt {
            zeroize::Zeroize::zeroize(salt);
        }
    }
}

impl zeroize::ZeroizeOnDrop for ReceiptTrailer {}

/// The length of [`bstr_head`]'s output for `len`.
fn bstr_head_len(len: usize) -> usize {
    match len as u64 {
        0..=23 => 1,
        24..=0xff => 2,
        0x100..=0xffff => 3,
        0x1_0000..=0xffff_ffff => 5,
        _ => 9,
    }
}

/// The head of a CBOR byte string of `len` bytes (major type 2, shortest
/// length form).
fn bstr_head(len: usize, out: &mut Vec<u8>) {
    let len = len as u64;
    match len {
        0..=23 => out.push(0x40 | len as u8),
        24..=0xff => out.extend_from_slice(&[0x58, len as u8]),
        0x100..=0xffff => {
            out.push(0x59);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(0x5a);
            out.extend_from_slice(&(len as u32).to_be_bytes());
        }
        _ => {
            out.push(0x5b);
            out.extend_from_slice(&len.to_be_bytes());
        }
    }
}

impl ReceiptTrailer {
    /// Deterministic CBOR of the trailer (a bare receipt without a salt).
    ///
    /// Written straight into one buffer of the exact size, so that the salt
    /// is never copied into a temporary (or a reallocated buffer) that
    /// would be freed unwiped; the caller owns the one copy returned.
    pub fn encode(&self) -> Vec<u8> {
        let Some(salt) = &self.digest_salt else {
            return self.receipt.clone();
        };
        // {1: bstr receipt, 2: bstr .size 32 salt}, keys in order.
        let receipt = self.receipt.len();
        let mut out = Vec::with_capacity(
            2 + bstr_head_len(receipt) + receipt + 1 + bstr_head_len(salt.len()) + salt.len(),
        );
        out.push(0xa2);
        out.push(0x01);
        bstr_head(self.receipt.len(), &mut out);
        out.extend_from_slice(&self.receipt);
        out.push(0x02);
        bstr_head(salt.len(), &mut out);
        out.extend_from_slice(salt);
        out
    }

    /// Decodes a trailer: the map above in its deterministic encoding, or a
    /// bare receipt (a CBOR array).
    pub fn decode(bytes: &[u8]) -> Result<Self, ReceiptError> {
        let bad = |m: &str| ReceiptError::Malformed(format!("receipt trailer: {m}"));
        // Major type 5 (map) in the first byte; a COSE_Sign1 is an array.
        if bytes.first().map(|b| b >> 5) != Some(5) {
            return Ok(Self {
                receipt: bytes.to_vec(),
                digest_salt: None,
            });
        }
        let value: Value = ciborium::from_reader(bytes).map_err(|e| bad(&e.to_string()))?;
        let Value::Map(entries) = value else {
            return Err(bad("not a map"));
        };
        let (mut receipt, mut salt) = (None, None);
        for (k, v) in entries {
            match (k.as_integer().and_then(|i| u64::try_from(i).ok()), v) {
                (Some(1), Value::Bytes(b)) if receipt.is_none() => receipt = Some(b),
                (Some(2), Value::Bytes(mut b)) if salt.is_none() => {
                    let parsed = DigestSalt::try_from(b.as_slice());
                    crate::wipe::wipe(&mut b);
                    salt = Some(parsed.map_err(|_| bad("the salt is not 32 bytes"))?)
                }
                _ => return Err(bad("unexpected or repeated key")),
            }
        }
        let trailer = match (receipt, salt) {
            (Some(receipt), Some(salt)) => Self {
                receipt,
                digest_salt: Some(salt),
            },
            _ => return Err(bad("needs keys 1 (receipt) and 2 (salt)")),
        };
        // One encoding only: nothing after the map (the CBOR reader stops
        // at its end), no other key order or integer width.
        let mut again = trailer.encode();
        let canonical = again == bytes;
        crate::wipe::wipe(&mut again);
        if !canonical {
            return Err(bad("not in its deterministic encoding, or bytes follow it"));
        }
        Ok(trailer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::receipt::canonical::canonical_bytes;

    #[test]
    fn trailer_round_trips_and_reads_a_bare_receipt() {
        let t = ReceiptTrailer {
            receipt: vec![0x84, 1, 2, 3],
            digest_salt: Some([7; 32]),
        };
        assert_eq!(ReceiptTrailer::decode(&t.encode()).unwrap(), t);
        let bare = ReceiptTrailer::decode(&[0x84, 1, 2, 3]).unwrap();
        assert_eq!(bare.receipt, vec![0x84, 1, 2, 3]);
        assert_eq!(bare.digest_salt, None);
        // A short salt, a missing key and an extra key are refused.
        let short = canonical_bytes(&Value::Map(vec![
            (Value::from(1u64), Value::Bytes(vec![0x84])),
            (Value::from(2u64), Value::Bytes(vec![0; 31])),
        ]))
        .unwrap();
        assert!(ReceiptTrailer::decode(&short).is_err());
        let missing = canonical_bytes(&Value::Map(vec![(
            Value::from(1u64),
            Value::Bytes(vec![0x84]),
        )]))
        .unwrap();
        assert!(ReceiptTrailer::decode(&missing).is_err());
        let extra = canonical_bytes(&Value::Map(vec![
            (Value::from(1u64), Value::Bytes(vec![0x84])),
            (Value::from(2u64), Value::Bytes(vec![0; 32])),
            (Value::from(3u64), Value::Null),
        ]))
        .unwrap();
        assert!(ReceiptTrailer::decode(&extra).is_err());
        let mut truncated = t.encode();
        truncated.pop();
        assert!(ReceiptTrailer::decode(&truncated).is_err());
    }

    /// Found by the `receipt` fuzz target: the CBOR reader stops at the
    /// map's end, so bytes after it were accepted (and another key order).
    #[test]
    fn a_trailer_has_one_encoding() {
        let t = ReceiptTrailer {
            receipt: vec![0x84, 1, 2, 3],
            digest_salt: Some([7; 32]),
        };
        let mut followed = t.encode();
        followed.extend_from_slice(&[0x5a; 9]);
        let err = ReceiptTrailer::decode(&followed).unwrap_err();
        assert!(err.to_string().contains("deterministic"), "{err}");
        let mut swapped = vec![0xa2, 0x02, 0x58, 0x20];
        swapped.extend_from_slice(&[7; 32]);
        swapped.extend_from_slice(&[0x01, 0x44, 0x84, 1, 2, 3]);
        assert!(ReceiptTrailer::decode(&swapped).is_err());
    }

    /// Issue 34, item 3: a trailer wipes its salt when dropped (the
    /// envelope that carries it between stages: `frames::tests`).
    #[test]
    fn a_trailer_is_zeroize_on_drop() {
        fn assert_zod<T: zeroize::ZeroizeOnDrop>() {}
        assert_zod::<ReceiptTrailer>();
    }

    /// The trailer is written by hand (so that the salt is never copied
    /// into a temporary): the same bytes as the deterministic encoding of
    /// its map, at every length form of the receipt's byte string.
    #[test]
    fn the_hand_written_trailer_is_the_deterministic_encoding() {
        for len in [0, 1, 23, 24, 255, 256, 65_535, 65_536] {
            let t = ReceiptTrailer {
                receipt: vec![0x84; len],
                digest_salt: Some([7; 32]),
            };
            let want = canonical_bytes(&Value::Map(vec![
                (Value::from(1u64), Value::Bytes(t.receipt.clone())),
                (Value::from(2u64), Value::Bytes(vec![7; 32])),
            ]))
            .unwrap();
            let got = t.encode();
            assert_eq!(got, want, "receipt of {len} bytes");
            assert_eq!(got.capacity(), got.len(), "one exact allocation");
            assert_eq!(ReceiptTrailer::decode(&got).unwrap(), t);
        }
    }

    #[test]
    fn salted_digest_depends_on_the_salt() {
        let inner = Sha256Digest::of(b"Does the patient have HIV?");
        assert_ne!(salted_digest(&[1; 32], &inner), inner);
        assert_ne!(
            salted_digest(&[1; 32], &inner),
            salted_digest(&[2; 32], &inner)
        );
        assert_eq!(
            salted_digest(&[1; 32], &inner),
            salted_digest(&[1; 32], &inner)
        );
    }
}
