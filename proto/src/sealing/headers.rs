//! The sealing parameters carried in HTTP headers, and size limits.

use super::error::SealError;
use super::keys::Aead;
use super::{
    DEFAULT_MAX_BODY, DEFAULT_MAX_CHUNK, HEADER_AEAD, HEADER_ENCAPSULATED_KEY, HEADER_KEY_ID,
    HEADER_SEALED_AT, KEY_LEN,
};
use base64::Engine as _;
use serde::{Deserialize, Serialize};

/// The sealing parameters that travel in HTTP headers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealedHeaders {
    /// Id of the key the body is sealed to ([`HEADER_KEY_ID`]).
    pub key_id: u8,
    /// AEAD of the chunks ([`HEADER_AEAD`]).
    pub aead: Aead,
    /// The HPKE encapsulated key ([`HEADER_ENCAPSULATED_KEY`]).
    #[serde(with = "serde_bytes")]
    pub enc: [u8; KEY_LEN],
    /// When it was sealed, Unix seconds ([`HEADER_SEALED_AT`]; bound in the
    /// HPKE `info`).
    pub sealed_at: u64,
}

impl SealedHeaders {
    /// `(name, value)` for each of the four headers.
    pub fn to_header_values(&self) -> [(&'static str, String); 4] {
        [
            (HEADER_KEY_ID, self.key_id.to_string()),
            (HEADER_AEAD, self.aead.id().to_string()),
            (
                HEADER_ENCAPSULATED_KEY,
                base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(self.enc),
            ),
            (HEADER_SEALED_AT, self.sealed_at.to_string()),
        ]
    }

    /// Parses the headers; `get(name)` returns a header's value if present
    /// (e.g. `|n| headers.get(n).and_then(|v| v.to_str().ok())`).
    ///
    /// Missing or unparsable values are [`SealError::MalformedHeader`]; an
    /// AEAD id we lack is [`SealError::UnsupportedAead`]; an encapsulated key
    /// that is not 32 bytes is [`SealError::BadEncapsulatedKey`].
    pub fn from_header_values<'a>(
        get: impl Fn(&'static str) -> Option<&'a str>,
    ) -> Result<Self, SealError> {
        let field = |name: &'static str| {
            get(name)
                .map(str::trim)
                .ok_or_else(|| SealError::MalformedHeader(format!("missing {name}")))
        };
        let decimal = |name: &'static str, v: &str, max: u32| -> Result<u32, SealError> {
            if v.is_empty() || v.len() > 5 || !v.bytes().all(|b| b.is_ascii_digit()) {
                return Err(SealError::MalformedHeader(format!(
                    "{name} must be a decimal number"
                )));
            }
            let n: u32 = v
                .parse()
                .map_err(|_| SealError::MalformedHeader(format!("{name} is not a number")))?;
            if n > max {
                return Err(SealError::MalformedHeader(format!("{name} out of range")));
            }
            Ok(n)
        };
        let key_id = decimal(HEADER_KEY_ID, field(HEADER_KEY_ID)?, u8::MAX as u32)? as u8;
        let aead_id = decimal(HEADER_AEAD, field(HEADER_AEAD)?, u16::MAX as u32)? as u16;
        let aead = Aead::from_id(aead_id)?;
        let enc = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(field(HEADER_ENCAPSULATED_KEY)?)
            .map_err(|_| {
                SealError::MalformedHeader(format!("{HEADER_ENCAPSULATED_KEY} is not base64url"))
            })?;
        let enc: [u8; KEY_LEN] = enc.try_into().map_err(|_| SealError::BadEncapsulatedKey)?;
        let at = field(HEADER_SEALED_AT)?;
        let sealed_at =
            (!at.is_empty() && at.len() <= 20 && at.bytes().all(|b| b.is_ascii_digit()))
                .then(|| at.parse::<u64>().ok())
                .flatten()
                .ok_or_else(|| {
                    SealError::MalformedHeader(format!(
                        "{HEADER_SEALED_AT} must be Unix seconds, a decimal number"
                    ))
                })?;
        Ok(Self {
            key_id,
            aead,
            enc,
            sealed_at,
        })
    }
}

/// Limits a receiver enforces while opening a sealed body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SealLimits {
    /// Largest plaintext per chunk; a length prefix above `max_chunk +
    /// TAG_LEN` is [`SealError::ChunkTooLarge`] (checked before buffering).
    pub max_chunk: usize,
    /// Largest sealed body in wire bytes (prefixes, tags and the response
    /// nonce included); more is [`SealError::MessageTooLarge`].
    pub max_body: u64,
}

impl Default for SealLimits {
    fn default() -> Self {
        Self {
            max_chunk: DEFAULT_MAX_CHUNK,
            max_body: DEFAULT_MAX_BODY,
        }
    }
}
