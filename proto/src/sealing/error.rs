//! Sealing errors.

/// Sealing errors. Each names its reason; the HTTP layer maps them to
/// statuses (e.g. [`SealError::UnknownKeyId`] tells the client to refetch
/// the key set).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// No key with this id: the client's key set is stale and must be
    /// refetched.
    #[error("unknown HPKE key id {0}: refetch the key configuration")]
    UnknownKeyId(u8),
    /// The AEAD id is not supported (or not offered by the key).
    #[error("unsupported HPKE AEAD id {0:#06x}")]
    UnsupportedAead(u16),
    /// A key configuration uses a KEM or KDF this implementation lacks.
    #[error("unsupported key configuration: {0}")]
    UnsupportedKeyConfig(String),
    /// A key configuration (or list) does not parse.
    #[error("malformed key configuration: {0}")]
    MalformedKeyConfig(String),
    /// A sealing header is missing or does not parse.
    #[error("malformed sealing header: {0}")]
    MalformedHeader(String),
    /// The encapsulated key has the wrong length or decapsulation failed.
    #[error("bad encapsulated key")]
    BadEncapsulatedKey,
    /// A chunk failed authentication (tampered, reordered, dropped,
    /// duplicated, or sealed to another key).
    #[error("sealed chunk failed authentication")]
    Open,
    /// The sealed body's framing or key material is malformed.
    #[error("malformed sealed body: {0}")]
    Malformed(String),
    /// The body ended before its final chunk.
    #[error("sealed body truncated: no final chunk")]
    Truncated,
    /// Bytes follow the final chunk.
    #[error("bytes after the final chunk")]
    TrailingData,
    /// A chunk's length prefix exceeds the limit.
    #[error("sealed chunk of {size} bytes exceeds the limit of {limit}")]
    ChunkTooLarge {
        /// Ciphertext length announced by the prefix.
        size: u64,
        /// Largest ciphertext length accepted (`max_chunk + TAG_LEN`).
        limit: u64,
    },
    /// The whole sealed body exceeds the limit.
    #[error("sealed body exceeds the limit of {limit} bytes")]
    MessageTooLarge {
        /// Largest body accepted, in wire bytes.
        limit: u64,
    },
    /// The encapsulated key was already seen within the retention window.
    #[error("replayed sealed request (encapsulated key already seen)")]
    Replay,
    /// The replay guard is full of entries still inside their window; the
    /// request is refused rather than forgetting one (retry later).
    #[error("replay guard is full; retry later")]
    ReplayCacheFull,
    /// The request was sealed too long before (or after) the receiver's
    /// clock ([`MAX_REQUEST_AGE_SECS`]).
    #[error(
        "the request was sealed at {sealed_at} (Unix s) and the receiver's clock says {now}: \
         more than 300 s apart; seal it again (and check the sender's clock)"
    )]
    Stale {
        /// The request's sealing time.
        sealed_at: u64,
        /// The receiver's time.
        now: u64,
    },
    /// The final chunk was already sealed; nothing more can be sealed.
    #[error("the final chunk was already sealed")]
    Finished,
    /// An earlier error ended this stream.
    #[error("sealed stream already failed")]
    Poisoned,
    /// The AEAD sequence number of this stream is spent: another chunk
    /// would reuse a nonce (RFC 9180 §5.2 `MessageLimitReachedError`).
    #[error("message limit reached: the AEAD sequence number is spent")]
    MessageLimitReached,
    /// The underlying HPKE/AEAD operation failed (export, key length).
    #[error("HPKE operation failed: {0}")]
    Crypto(String),
}
