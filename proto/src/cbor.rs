//! CBOR encoding helpers used by every message type (ciborium + serde).

use serde::{de::DeserializeOwned, Serialize};

/// Serializes a value to CBOR bytes.
pub fn to_vec<T: Serialize>(value: &T) -> Vec<u8> {
    let mut out = Vec::new();
    ciborium::into_writer(value, &mut out).expect("CBOR serialization into a Vec cannot fail");
    out
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
