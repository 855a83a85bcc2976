//! SHA-256 digests as a small value type with a hex form.

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use std::fmt;

/// A SHA-256 digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Sha256Digest(#[serde(with = "serde_bytes")] pub [u8; 32]);

impl Sha256Digest {
    /// Digest of one byte string.
    pub fn of(data: &[u8]) -> Self {
        Self(Sha256::digest(data).into())
    }

    /// Digest of several parts, each prefixed by its length so that part
    /// boundaries cannot be shifted (domain-separated by `label`).
    pub fn of_parts(label: &str, parts: &[&[u8]]) -> Self {
        let mut h = Sha256::new();
        h.update((label.len() as u64).to_be_bytes());
        h.update(label.as_bytes());
        for p in parts {
            h.update((p.len() as u64).to_be_bytes());
            h.update(p);
        }
        Self(h.finalize().into())
    }

    /// Digest of a file's contents, streamed.
    pub fn of_file(path: &std::path::Path) -> std::io::Result<Self> {
        use std::io::Read;
        let mut f = std::fs::File::open(path)?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        Ok(Self(h.finalize().into()))
    }

    /// Lower-case hex form.
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses a 64-character hex string (an optional `sha256:` prefix is allowed).
    pub fn from_hex(s: &str) -> Result<Self, String> {
        let s = s.strip_prefix("sha256:").unwrap_or(s);
        let bytes = hex::decode(s).map_err(|e| format!("not hex: {e}"))?;
        let arr: [u8; 32] = bytes
            .try_into()
            .map_err(|_| "a SHA-256 digest is 32 bytes".to_string())?;
        Ok(Self(arr))
    }
}

impl fmt::Debug for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Display for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vector_and_hex_roundtrip() {
        let d = Sha256Digest::of(b"abc");
        assert_eq!(
            d.hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(Sha256Digest::from_hex(&format!("sha256:{d}")).unwrap(), d);
        assert!(Sha256Digest::from_hex("abcd").is_err());
    }

    #[test]
    fn parts_are_length_prefixed() {
        let a = Sha256Digest::of_parts("x", &[b"ab", b"c"]);
        let b = Sha256Digest::of_parts("x", &[b"a", b"bc"]);
        assert_ne!(a, b);
    }
}
