//! The handshake's messages and their length-prefixed framing, as bytes:
//! encoding and decoding only, no I/O.

use super::ChannelError;
use crate::attestation::Evidence;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// The handshake version both sides must speak.
pub(super) const VERSION: u32 = 1;
/// Largest handshake message (evidence documents are a few KiB).
pub const HANDSHAKE_MAX: usize = 256 * 1024;

/// Message 1, initiator → responder.
#[derive(Serialize, Deserialize)]
pub(super) struct ClientHello {
    pub version: u32,
    pub attested: bool,
    #[serde(with = "serde_bytes")]
    pub eph: [u8; 32],
    #[serde(with = "serde_bytes")]
    pub challenge: [u8; 32],
}

/// Message 2, responder → initiator.
#[derive(Serialize, Deserialize)]
pub(super) struct ServerHello {
    pub version: u32,
    #[serde(with = "serde_bytes")]
    pub eph: [u8; 32],
    #[serde(with = "serde_bytes")]
    pub challenge: [u8; 32],
    pub evidence: Evidence,
    /// The claims whose digest the evidence binds (Nitro); absent for mock.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "serde_bytes")]
    pub claims: Option<Vec<u8>>,
}

/// Message 3, initiator → responder.
#[derive(Serialize, Deserialize)]
pub(super) struct Finish {
    pub evidence: Option<Evidence>,
    /// As in `ServerHello`.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "serde_bytes")]
    pub claims: Option<Vec<u8>>,
}

/// The responder's verdict on the initiator: the first record it sends.
#[derive(Serialize, Deserialize)]
pub(super) enum Outcome {
    Accepted,
    Rejected(String),
}

/// Frames one handshake message: `u32 length ‖ bytes`.
pub fn frame(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + bytes.len());
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(bytes);
    out
}

/// The length a handshake frame's 4-byte prefix announces, refused above
/// [`HANDSHAKE_MAX`].
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, ChannelError> {
    let len = u32::from_be_bytes(prefix) as usize;
    if len > HANDSHAKE_MAX {
        return Err(ChannelError::RecordTooLarge {
            size: len,
            limit: HANDSHAKE_MAX,
        });
    }
    Ok(len)
}

/// Decodes one handshake message; `what` names it in the error.
pub(super) fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, ChannelError> {
    crate::cbor::from_slice(bytes).map_err(|e| ChannelError::Handshake(format!("{what}: {e}")))
}
