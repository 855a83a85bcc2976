//! HPKE body sealing for HTTP requests and responses (RFC 9180 base mode,
//! framed like Oblivious HTTP, RFC 9458).
//!
//! A client that does not trust the host seals its request **body** to a
//! published HPKE key (a [`KeyConfig`]); the key id, the AEAD and the
//! encapsulated key travel in HTTP headers ([`SealedHeaders`]). The body is
//! a sequence of length-prefixed AEAD chunks so that large requests and
//! streamed (SSE) responses can be processed as they arrive:
//!
//! ```text
//! body  = *chunk                      (exactly one final chunk, and it is last)
//! chunk = u32be(len(ct)) ‖ ct         ct = AEAD-Seal(aad = final ? 0x01 : 0x00, pt)
//! ```
//!
//! - **Suite**: KEM DHKEM(X25519, HKDF-SHA256) `0x0020`, KDF HKDF-SHA256
//!   `0x0001`, AEAD AES-128-GCM `0x0001` or ChaCha20-Poly1305 `0x0003`.
//! - **Request**: the HPKE sender context (info = [`request_info`]) seals the
//!   chunks; its sequence number advances once per chunk, so a dropped,
//!   duplicated or reordered chunk fails to open.
//! - **Response**: keys derived from the request's context exactly like RFC
//!   9458 §4.4 (see [`ResponseKeyMaterial`]); the body is `response_nonce ‖
//!   chunks`, chunk *i* sealed with `aead_nonce XOR i`.
//! - The receiver does not learn the final flag from the wire: it tries the
//!   AAD `0x00` and then `0x01`. A truncated body (the final chunk removed) is
//!   [`SealError::Truncated`]; bytes after the final chunk are
//!   [`SealError::TrailingData`].
//! - A **response** may end with a *trailer* instead: a final chunk sealed
//!   with AAD `0x02` whose plaintext is not part of the body. The exit stage
//!   puts the receipt there, so a sealed client gets the receipt inside the
//!   same authenticated stream ([`ResponseSealer::finish_with_trailer`],
//!   [`ResponseOpener::trailer`]). Requests never carry a trailer.
//!
//! One-shot helpers ([`seal_request`], [`open_request`], [`seal_response`],
//! [`open_response`]) wrap the streaming types ([`ChunkSealer`],
//! [`ChunkOpener`], [`ResponseSealer`], [`ResponseOpener`]). Replays of a
//! sealed request (same encapsulated key) are caught by [`ReplayGuard`].

use hpke::kem::X25519HkdfSha256;
use std::time::Duration;

type HpkeKem = X25519HkdfSha256;

/// KEM id of DHKEM(X25519, HKDF-SHA256).
pub const KEM_ID: u16 = 0x0020;
/// KDF id of HKDF-SHA256.
pub const KDF_ID: u16 = 0x0001;
/// Length of an X25519 public key and of an encapsulated key (`Npk`, `Nenc`).
pub const KEY_LEN: usize = 32;
/// AEAD tag length of both supported AEADs (`Nt`).
pub const TAG_LEN: usize = 16;
/// Length of the 4-byte chunk length prefix.
pub const LEN_PREFIX: usize = 4;
/// Per-chunk wire overhead: length prefix and tag.
pub const CHUNK_OVERHEAD: usize = LEN_PREFIX + TAG_LEN;

/// First part of the HPKE `info` of a request (see [`request_info`]). v2
/// binds the sealing time ([`HEADER_SEALED_AT`]); v3, that every chunk of
/// the request and of its response is padded ([`PAD_BUCKET`]), so a client
/// of another version fails to open rather than misread.
pub const REQUEST_INFO_LABEL: &[u8] = b"confidential-inference request v3";
/// Exporter context for the response secret.
pub const RESPONSE_EXPORT_LABEL: &[u8] = b"confidential-inference response v1";

/// Header: key id of the key the body is sealed to (decimal, `0`–`255`).
pub const HEADER_KEY_ID: &str = "hpke-key-id";
/// Header: the AEAD's IANA id in decimal (`1` = AES-128-GCM, `3` =
/// ChaCha20-Poly1305).
pub const HEADER_AEAD: &str = "hpke-aead";
/// Header: the encapsulated key, base64url without padding (43 characters).
pub const HEADER_ENCAPSULATED_KEY: &str = "hpke-encapsulated-key";
/// Header: when the request was sealed, Unix seconds (decimal). Bound in
/// the HPKE `info`, so a changed value fails to open; a receiver refuses a
/// request sealed more than [`MAX_REQUEST_AGE_SECS`] from its own clock.
pub const HEADER_SEALED_AT: &str = "hpke-sealed-at";

/// How far a sealed request's time ([`HEADER_SEALED_AT`]) may be from the
/// receiver's clock, either way, in seconds: 5 minutes, for clients' and
/// enclaves' clocks that are not exactly right. Older requests are refused
/// outright ([`SealError::Stale`]); a [`ReplayGuard`] that remembers
/// requests for [`REPLAY_WINDOW`] therefore catches every replay that is
/// not refused for its age.
pub const MAX_REQUEST_AGE_SECS: u64 = 300;
/// How long a receiver must remember a sealed request to refuse its
/// replays: longer than every span in which it is fresh. A request is
/// fresh for `2 × MAX_REQUEST_AGE_SECS` whole seconds of the receiver's
/// clock, both ends included (601 s of real time at most, since the
/// seconds are rounded down); the guard records it at a moment it is fresh
/// ([`check_fresh`] again under the guard's lock) and keeps it 2 s beyond.
pub const REPLAY_WINDOW: Duration = Duration::from_secs(2 * MAX_REQUEST_AGE_SECS + 2);
/// Media type of a key configuration list (RFC 9540 §3).
pub const KEYS_MEDIA_TYPE: &str = "application/ohttp-keys";

/// Default largest plaintext per chunk (1 MiB).
pub const DEFAULT_MAX_CHUNK: usize = 1 << 20;
/// Default largest sealed body on the wire (64 MiB).
pub const DEFAULT_MAX_BODY: u64 = 64 << 20;

const AAD_NOT_FINAL: [u8; 1] = [0x00];
const AAD_FINAL: [u8; 1] = [0x01];
const AAD_TRAILER: [u8; 1] = [0x02];
const AEAD_NONCE_LEN: usize = 12;

mod chunks;
mod cipher;
mod error;
mod freshness;
mod headers;
mod keys;
mod padding;
mod replay;
mod request;
mod response;
mod response_key;
#[cfg(test)]
mod tests;

pub use chunks::{ChunkOpener, ChunkSealer};
pub use error::SealError;
pub use freshness::{check_fresh, unix_now};
pub use headers::{SealLimits, SealedHeaders};
pub use keys::{request_info, select_key, Aead, KeyConfig, Sealer, ServerKey};
pub use padding::{padded_len, padded_len_with, PAD_BUCKET};
pub use replay::ReplayGuard;
pub use request::{
    open_request, open_request_as, open_request_stream, open_request_stream_as, seal_request,
    seal_request_as, seal_request_stream, seal_request_stream_as, seal_request_stream_at,
    seal_request_stream_with_rng,
};
pub use response::{
    open_response, open_response_with_trailer, seal_response, seal_response_with_trailer,
    ResponseOpener, ResponseSealer,
};
pub use response_key::{ClientResponseKey, ResponseKeyMaterial};
