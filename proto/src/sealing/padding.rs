//! Padding every chunk's plaintext to a bucket, inside the AEAD, so that a
//! sealed chunk's length does not tell the length of what it carries (a
//! streamed token's text, a tool call's name, an error's message).
//!
//! A chunk's plaintext is `data ‖ 0x80 ‖ 0x00*` (the ISO/IEC 7816-4 rule:
//! one marker byte, then zeros), its length [`padded_len`] of
//! `len(data) + 1`, capped at the sender's `max_chunk`: a multiple of
//! [`PAD_BUCKET`] bytes, rounded further up (Padmé, Nikitin et al., PETS
//! 2019) so that a large body leaks about `log log` of its size bits, for at
//! most ~12 % more bytes. The receiver strips the zeros and the marker; a
//! plaintext without the marker is malformed. The bucket is a protocol
//! constant, not a setting: the host could otherwise choose a stage's.

use super::error::SealError;

/// Plaintexts are padded to a multiple of this many bytes.
pub const PAD_BUCKET: usize = 256;

const MARKER: u8 = 0x80;

/// The padded length of a plaintext of `n` bytes (marker included).
pub fn padded_len(n: usize) -> usize {
    padded_len_with(n.max(1), PAD_BUCKET)
}

/// `n` rounded up to a multiple of `bucket`, then by Padmé (0 stays 0).
pub fn padded_len_with(n: usize, bucket: usize) -> usize {
    padme(n.div_ceil(bucket) * bucket)
}

/// Padmé: `l` rounded up so that only its top `⌊log₂ ⌊log₂ l⌋⌋ + 1` bits
/// may be non-zero.
fn padme(l: usize) -> usize {
    if l < 2 {
        return l;
    }
    let e = usize::BITS - 1 - l.leading_zeros();
    let s = u32::BITS - e.leading_zeros();
    let mask = (1usize << (e - s)) - 1;
    (l + mask) & !mask
}

/// `data` padded for a chunk of at most `max_chunk` plaintext bytes
/// (`data.len() < max_chunk`).
pub(super) fn pad(data: &[u8], max_chunk: usize) -> Vec<u8> {
    debug_assert!(data.len() < max_chunk);
    let len = padded_len(data.len() + 1).min(max_chunk);
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(data);
    out.push(MARKER);
    out.resize(len, 0);
    out
}

/// Strips the padding of an opened chunk.
pub(super) fn unpad(mut pt: Vec<u8>) -> Result<Vec<u8>, SealError> {
    let end = pt.iter().rposition(|&b| b != 0);
    match end {
        Some(i) if pt[i] == MARKER => {
            pt.truncate(i);
            Ok(pt)
        }
        _ => Err(SealError::Malformed(
            "a chunk's padding has no end marker".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_fall_in_buckets_and_grow_by_at_most_an_eighth() {
        for n in [1, 2, 200, 255, 256] {
            assert_eq!(padded_len(n), 256, "{n}");
        }
        assert_eq!(padded_len(257), 512);
        assert_eq!(padded_len(2048), 2048);
        for n in (1..200_000).step_by(37) {
            let p = padded_len(n);
            assert!(p >= n && p.is_multiple_of(PAD_BUCKET), "{n} -> {p}");
            assert!(p <= (n + PAD_BUCKET) * 9 / 8 + PAD_BUCKET, "{n} -> {p}");
        }
        // Far fewer distinct sizes than buckets for large bodies: 33
        // between 64 and 128 KiB, where 256-byte buckets alone give 257.
        let sizes: std::collections::BTreeSet<usize> = (65_536..=131_072).map(padded_len).collect();
        assert_eq!(sizes.len(), 33);
    }

    #[test]
    fn padding_round_trips_and_a_missing_marker_is_refused() {
        for data in [&b""[..], b"x", b"\x80\x00", &[0u8; 300], &[0x80; 255]] {
            let p = pad(data, 1 << 20);
            assert_eq!(p.len(), padded_len(data.len() + 1));
            assert_eq!(unpad(p).unwrap(), data);
        }
        // Capped at the chunk size.
        assert_eq!(pad(b"abc", 4).len(), 4);
        assert!(unpad(vec![0; 256]).is_err());
        assert!(unpad(vec![]).is_err());
        assert!(unpad(b"ab\x01\x00".to_vec()).is_err());
    }
}
