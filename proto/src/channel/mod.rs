//! The attested stage channel.
//!
//! Handshake (three length-prefixed CBOR messages, then one record):
//! 1. initiator → responder `ClientHello { version, attested, eph_i, challenge_i }`
//! 2. responder → initiator `ServerHello { eph_r, challenge_r, evidence_r,
//!    claims_r? }`, where evidence_r binds `public_key = eph_r`,
//!    `nonce = challenge_i` and the stage's claims for the `channel`
//!    purpose: mock evidence carries `user_data = "channel" ‖ 0 ‖
//!    CBOR(StageClaims)`, Nitro evidence a digest of both with the claims
//!    beside it in `claims_r` (see [`crate::attestation::claims_binding`]);
//! 3. initiator → responder `Finish { evidence_i?, claims_i? }` (a stage
//!    initiator binds `eph_i` and `challenge_r` the same way; the host
//!    gateway has no evidence);
//! 4. keys: HKDF-SHA256(salt = H(transcript of 1..3), ikm = X25519(eph_i,
//!    eph_r)) expanded into one ChaCha20-Poly1305 key per direction; the
//!    responder's first record says whether it accepted the initiator.
//!
//! Records: `u32 length ‖ u64 sequence ‖ AEAD(ciphertext)`, where the
//! sequence is also the AEAD nonce and the 12-byte header (length and
//! sequence) is authenticated as associated data.
//! Sequence numbers are strictly contiguous per direction from 0: a dropped,
//! duplicated, reordered or replayed record is an error that poisons the
//! channel. A message is one or more records (a flag byte marks the last);
//! record and message sizes are bounded on send and on receive. A direction
//! stops before `max_records`, far below the 2^64 nonce space, so no nonce
//! is ever reused under a key; the endpoints then open a new channel.
//!
//! Written here rather than taken from a TLS crate because the handshake
//! must carry enclave attestation documents bound to the ephemeral keys and
//! the peer's challenge, which rustls has no place for.
//!
//! This module does no I/O, like rustls's core: [`messages`] encodes the
//! handshake, [`handshake`] is its state machine, [`record`] the record
//! layer. The tokio driver over a byte stream, with the transports, is
//! the crate's `io` module (feature `io`, which the gateway and the stages
//! enable and the client crate does not).

pub mod handshake;
pub mod messages;
pub mod record;
#[cfg(test)]
mod tests;

pub use handshake::{LocalIdentity, PeerCheck, PeerInfo};

use std::time::Duration;

/// Size limits of a channel.
#[derive(Clone, Copy, Debug)]
pub struct ChannelLimits {
    /// Largest plaintext chunk in one record.
    pub max_record: usize,
    /// Largest whole message.
    pub max_message: usize,
    /// Records a direction may carry before the channel must be replaced.
    pub max_records: u64,
    /// Time allowed for the whole handshake.
    pub handshake_timeout: Duration,
}

impl Default for ChannelLimits {
    fn default() -> Self {
        Self {
            max_record: 1 << 20,
            max_message: 256 << 20,
            max_records: 1 << 48,
            handshake_timeout: Duration::from_secs(30),
        }
    }
}

/// Channel errors. Any error poisons the half it happened on.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// Transport failure.
    #[error("transport: {0}")]
    Io(#[from] std::io::Error),
    /// The peer closed the stream in the middle of a record or message.
    #[error("peer closed the channel mid-message")]
    Truncated,
    /// Handshake protocol failure.
    #[error("handshake: {0}")]
    Handshake(String),
    /// The peer's evidence or claims were not accepted.
    #[error("peer not accepted: {0}")]
    PeerRejected(String),
    /// The peer did not accept us.
    #[error("rejected by peer: {0}")]
    RejectedByPeer(String),
    /// A record arrived out of sequence (dropped, duplicated, reordered, replayed).
    #[error("record out of sequence: expected {expected}, got {got}")]
    OutOfSequence {
        /// The next sequence number expected.
        expected: u64,
        /// The one received.
        got: u64,
    },
    /// A record failed authentication.
    #[error("record {0} failed authentication")]
    Authentication(u64),
    /// A record is larger than allowed.
    #[error("record of {size} bytes exceeds the limit of {limit}")]
    RecordTooLarge {
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A message is larger than allowed.
    #[error("message of at least {size} bytes exceeds the limit of {limit}")]
    MessageTooLarge {
        /// Its size (so far).
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// This direction has used up its record budget.
    #[error("record limit of {0} reached; the channel must be replaced")]
    RecordLimit(u64),
    /// A message did not decode.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// An earlier error closed this half.
    #[error("channel closed after an earlier error")]
    Poisoned,
}
