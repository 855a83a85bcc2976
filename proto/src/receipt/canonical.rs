//! Deterministic CBOR (RFC 8949 §4.2.1) and integer-keyed map fields.

use super::error::ReceiptError;
use crate::digest::Sha256Digest;
use ciborium::value::{Integer, Value};
pub(super) fn encode(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    ciborium::into_writer(value, &mut out).expect("CBOR serialization into a Vec cannot fail");
    out
}

/// Returns `value` with every map's entries sorted by the bytewise order of
/// their encoded keys (RFC 8949 §4.2.1). Fails on duplicate keys.
pub fn canonicalize(value: &Value) -> Result<Value, ReceiptError> {
    Ok(match value {
        Value::Map(entries) => {
            let mut sorted = entries
                .iter()
                .map(|(k, v)| Ok((encode(k), canonicalize(k)?, canonicalize(v)?)))
                .collect::<Result<Vec<_>, ReceiptError>>()?;
            sorted.sort_by(|a, b| a.0.cmp(&b.0));
            if sorted.windows(2).any(|w| w[0].0 == w[1].0) {
                return Err(ReceiptError::NotCanonical);
            }
            Value::Map(sorted.into_iter().map(|(_, k, v)| (k, v)).collect())
        }
        Value::Array(items) => Value::Array(
            items
                .iter()
                .map(canonicalize)
                .collect::<Result<_, ReceiptError>>()?,
        ),
        Value::Tag(t, inner) => Value::Tag(*t, Box::new(canonicalize(inner)?)),
        other => other.clone(),
    })
}

/// Deterministic CBOR encoding of `value` (maps sorted, definite lengths,
/// smallest integer encodings; ciborium always writes the latter two).
pub fn canonical_bytes(value: &Value) -> Result<Vec<u8>, ReceiptError> {
    Ok(encode(&canonicalize(value)?))
}

/// Decodes exactly one CBOR item and checks that `bytes` are its
/// deterministic encoding.
pub fn decode_canonical(bytes: &[u8]) -> Result<Value, ReceiptError> {
    let mut cursor = std::io::Cursor::new(bytes);
    let value: Value = ciborium::from_reader(&mut cursor)
        .map_err(|e| ReceiptError::Malformed(format!("bad CBOR: {e}")))?;
    if cursor.position() as usize != bytes.len() {
        return Err(ReceiptError::Malformed(
            "trailing bytes after CBOR item".into(),
        ));
    }
    if canonical_bytes(&value)? != bytes {
        return Err(ReceiptError::NotCanonical);
    }
    Ok(value)
}

pub(crate) fn uint(n: u64) -> Value {
    Value::Integer(Integer::from(n))
}

pub(crate) fn int_map(entries: Vec<(u64, Value)>) -> Value {
    Value::Map(entries.into_iter().map(|(k, v)| (uint(k), v)).collect())
}

/// Reads an integer-keyed map with exactly the keys `1..=n`.
pub(crate) struct Fields(Vec<Option<Value>>);

impl Fields {
    pub(crate) fn new(value: Value, n: u64) -> Result<Self, String> {
        let Value::Map(entries) = value else {
            return Err("payload is not a map".into());
        };
        let mut slots: Vec<Option<Value>> = vec![None; n as usize];
        for (k, v) in entries {
            let k = match k {
                Value::Integer(i) => u64::try_from(i).ok(),
                _ => None,
            }
            .filter(|k| (1..=n).contains(k))
            .ok_or("unexpected map key")?;
            if slots[k as usize - 1].replace(v).is_some() {
                return Err(format!("duplicate key {k}"));
            }
        }
        if let Some(i) = slots.iter().position(Option::is_none) {
            return Err(format!("missing key {}", i + 1));
        }
        Ok(Self(slots))
    }

    pub(crate) fn take(&mut self, k: u64) -> Value {
        self.0[k as usize - 1].take().expect("checked in new")
    }

    pub(crate) fn uint(&mut self, k: u64) -> Result<u64, String> {
        match self.take(k) {
            Value::Integer(i) => u64::try_from(i).map_err(|_| format!("key {k}: not a uint")),
            _ => Err(format!("key {k}: not a uint")),
        }
    }

    pub(super) fn u32(&mut self, k: u64) -> Result<u32, String> {
        u32::try_from(self.uint(k)?).map_err(|_| format!("key {k}: out of range"))
    }

    pub(crate) fn bytes(&mut self, k: u64) -> Result<Vec<u8>, String> {
        match self.take(k) {
            Value::Bytes(b) => Ok(b),
            _ => Err(format!("key {k}: not a byte string")),
        }
    }

    pub(super) fn array<const N: usize>(&mut self, k: u64) -> Result<[u8; N], String> {
        self.bytes(k)?
            .try_into()
            .map_err(|_| format!("key {k}: not {N} bytes"))
    }

    pub(crate) fn digest(&mut self, k: u64) -> Result<Sha256Digest, String> {
        Ok(Sha256Digest(self.array::<32>(k)?))
    }

    pub(super) fn opt_digest(&mut self, k: u64) -> Result<Option<Sha256Digest>, String> {
        match self.take(k) {
            Value::Null => Ok(None),
            Value::Bytes(b) => Ok(Some(Sha256Digest(
                b.try_into().map_err(|_| format!("key {k}: not 32 bytes"))?,
            ))),
            _ => Err(format!("key {k}: not a byte string or null")),
        }
    }

    pub(crate) fn text(&mut self, k: u64) -> Result<String, String> {
        match self.take(k) {
            Value::Text(t) => Ok(t),
            _ => Err(format!("key {k}: not a text string")),
        }
    }

    pub(super) fn boolean(&mut self, k: u64) -> Result<bool, String> {
        match self.take(k) {
            Value::Bool(b) => Ok(b),
            _ => Err(format!("key {k}: not a bool")),
        }
    }
}
