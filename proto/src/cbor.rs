//! CBOR encoding helpers used by every message type (ciborium + serde).

use serde::{de::DeserializeOwned, Serialize};

/// Serializes a value to CBOR bytes, into one buffer of the exact size.
///
/// A first pass only counts the bytes. A buffer that grew while encoding
/// would leave a copy of what it held at each reallocation in freed memory,
/// and some messages carry secrets (a request envelope's response key and
/// digest salt): with one allocation there is one copy, which its owner
/// wipes (the `wipe` module). The count costs little: byte strings (tensor
/// data, sealed bodies) are counted by their length, not byte by byte.
pub fn to_vec<T: Serialize>(value: &T) -> Vec<u8> {
    let mut count = Count(0);
    ciborium::into_writer(value, &mut count).expect("counting CBOR bytes cannot fail");
    let mut out = Vec::with_capacity(count.0);
    ciborium::into_writer(value, &mut out).expect("CBOR serialization into a Vec cannot fail");
    debug_assert_eq!(out.len(), count.0, "both passes encode the same value");
    out
}

/// A writer that only counts what it is given.
struct Count(usize);

impl std::io::Write for Count {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Deserializes a value from CBOR bytes, rejecting trailing bytes.
pub fn from_slice<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    let mut cursor = std::io::Cursor::new(bytes);
    let value = ciborium::from_reader(&mut cursor).map_err(|e| format!("bad CBOR: {e}"))?;
    if cursor.position() as usize != bytes.len() {
        return Err("trailing bytes after CBOR item".into());
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 34, item 3: an encoded message is one allocation of the exact
    /// size (no reallocation left a copy of its first part behind).
    #[test]
    fn encoding_allocates_once_and_exactly() {
        #[derive(serde::Serialize)]
        struct M {
            a: Vec<u32>,
            #[serde(with = "serde_bytes")]
            b: Vec<u8>,
            c: String,
            d: [u8; 32],
        }
        for n in [0usize, 1, 100, 10_000] {
            let m = M {
                a: (0..n as u32).collect(),
                b: vec![9; n * 3],
                c: "x".repeat(n),
                d: [5; 32],
            };
            let v = to_vec(&m);
            assert_eq!(v.capacity(), v.len(), "n = {n}");
            let mut plain = Vec::new();
            ciborium::into_writer(&m, &mut plain).unwrap();
            assert_eq!(v, plain);
        }
    }
}
