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

use aes_gcm::aead::{Aead as _, KeyInit, Payload};
use base64::Engine as _;
use hpke::aead::{AeadCtxS, AesGcm128, ChaCha20Poly1305 as HpkeChaCha};
use hpke::kdf::HkdfSha256;
use hpke::kem::X25519HkdfSha256;
use hpke::rand_core::{CryptoRng, RngCore};
use hpke::{Deserializable, Kem as _, OpModeS, Serializable};
use serde::{Deserialize, Serialize};
use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};
use zeroize::{Zeroize, Zeroizing};

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

/// First part of the HPKE `info` of a request (see [`request_info`]).
pub const REQUEST_INFO_LABEL: &[u8] = b"confidential-inference request v1";
/// Exporter context for the response secret.
pub const RESPONSE_EXPORT_LABEL: &[u8] = b"confidential-inference response v1";

/// Header: key id of the key the body is sealed to (decimal, `0`–`255`).
pub const HEADER_KEY_ID: &str = "hpke-key-id";
/// Header: the AEAD's IANA id in decimal (`1` = AES-128-GCM, `3` =
/// ChaCha20-Poly1305).
pub const HEADER_AEAD: &str = "hpke-aead";
/// Header: the encapsulated key, base64url without padding (43 characters).
pub const HEADER_ENCAPSULATED_KEY: &str = "hpke-encapsulated-key";
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
    /// The final chunk was already sealed; nothing more can be sealed.
    #[error("the final chunk was already sealed")]
    Finished,
    /// An earlier error ended this stream.
    #[error("sealed stream already failed")]
    Poisoned,
    /// The underlying HPKE/AEAD operation failed (message limit, export).
    #[error("HPKE operation failed: {0}")]
    Crypto(String),
}

/// An AEAD of the suite.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Aead {
    /// AES-128-GCM, IANA HPKE AEAD id `0x0001`.
    Aes128Gcm,
    /// ChaCha20-Poly1305, IANA HPKE AEAD id `0x0003`.
    ChaCha20Poly1305,
}

impl Aead {
    /// Every supported AEAD, in preference order.
    pub const ALL: [Aead; 2] = [Aead::Aes128Gcm, Aead::ChaCha20Poly1305];

    /// IANA HPKE AEAD id.
    pub fn id(self) -> u16 {
        match self {
            Aead::Aes128Gcm => 0x0001,
            Aead::ChaCha20Poly1305 => 0x0003,
        }
    }

    /// The AEAD with this IANA id.
    pub fn from_id(id: u16) -> Result<Self, SealError> {
        match id {
            0x0001 => Ok(Aead::Aes128Gcm),
            0x0003 => Ok(Aead::ChaCha20Poly1305),
            other => Err(SealError::UnsupportedAead(other)),
        }
    }

    /// Key length `Nk` (16 or 32).
    pub fn key_len(self) -> usize {
        match self {
            Aead::Aes128Gcm => 16,
            Aead::ChaCha20Poly1305 => 32,
        }
    }

    /// Nonce length `Nn` (12).
    pub fn nonce_len(self) -> usize {
        AEAD_NONCE_LEN
    }

    /// Length of the response nonce, `max(Nn, Nk)`.
    pub fn response_nonce_len(self) -> usize {
        self.key_len().max(self.nonce_len())
    }
}

/// A published HPKE key in the RFC 9458 §3 key configuration format.
///
/// ```text
/// key_id (1) ‖ kem_id (2) ‖ public_key (32) ‖ u16be(4·n) ‖ n × (kdf_id (2) ‖ aead_id (2))
/// ```
///
/// The KEM is always DHKEM(X25519, HKDF-SHA256) and the KDF HKDF-SHA256.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyConfig {
    /// Key identifier carried in the `hpke-key-id` header.
    pub key_id: u8,
    /// X25519 public key.
    pub public_key: [u8; KEY_LEN],
    /// AEADs the key holder accepts (must not be empty to encode a valid
    /// configuration).
    pub aeads: Vec<Aead>,
}

impl KeyConfig {
    /// Whether the key holder accepts `aead`.
    pub fn supports(&self, aead: Aead) -> bool {
        self.aeads.contains(&aead)
    }

    /// Encodes one key configuration.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + 2 + KEY_LEN + 2 + 4 * self.aeads.len());
        out.push(self.key_id);
        out.extend_from_slice(&KEM_ID.to_be_bytes());
        out.extend_from_slice(&self.public_key);
        out.extend_from_slice(&((4 * self.aeads.len()) as u16).to_be_bytes());
        for a in &self.aeads {
            out.extend_from_slice(&KDF_ID.to_be_bytes());
            out.extend_from_slice(&a.id().to_be_bytes());
        }
        out
    }

    /// Decodes exactly one key configuration.
    ///
    /// Symmetric algorithm pairs with another KDF or an unknown AEAD are
    /// skipped. A configuration with another KEM, or with no usable pair, is
    /// [`SealError::UnsupportedKeyConfig`]; bad framing is
    /// [`SealError::MalformedKeyConfig`].
    pub fn decode(bytes: &[u8]) -> Result<Self, SealError> {
        let bad = |m: &str| SealError::MalformedKeyConfig(m.to_string());
        if bytes.len() < 3 {
            return Err(bad("shorter than key id and KEM id"));
        }
        let key_id = bytes[0];
        let kem_id = u16::from_be_bytes([bytes[1], bytes[2]]);
        if kem_id != KEM_ID {
            return Err(SealError::UnsupportedKeyConfig(format!(
                "KEM id {kem_id:#06x} (only {KEM_ID:#06x} is supported)"
            )));
        }
        let rest = &bytes[3..];
        if rest.len() < KEY_LEN + 2 {
            return Err(bad("truncated public key or algorithms length"));
        }
        let mut public_key = [0u8; KEY_LEN];
        public_key.copy_from_slice(&rest[..KEY_LEN]);
        let sym_len = u16::from_be_bytes([rest[KEY_LEN], rest[KEY_LEN + 1]]) as usize;
        let sym = &rest[KEY_LEN + 2..];
        if sym_len < 4 || sym_len & 0b11 != 0 {
            return Err(bad(
                "symmetric algorithms length must be a positive multiple of 4",
            ));
        }
        if sym.len() != sym_len {
            return Err(bad(
                "symmetric algorithms length does not match the remaining bytes",
            ));
        }
        let mut aeads = Vec::new();
        for pair in sym.chunks_exact(4) {
            let kdf = u16::from_be_bytes([pair[0], pair[1]]);
            let aead = u16::from_be_bytes([pair[2], pair[3]]);
            if kdf != KDF_ID {
                continue;
            }
            if let Ok(a) = Aead::from_id(aead) {
                if !aeads.contains(&a) {
                    aeads.push(a);
                }
            }
        }
        if aeads.is_empty() {
            return Err(SealError::UnsupportedKeyConfig(
                "no supported KDF/AEAD pair".into(),
            ));
        }
        Ok(Self {
            key_id,
            public_key,
            aeads,
        })
    }

    /// Encodes an `application/ohttp-keys` list: each configuration
    /// prefixed by its length as a `u16be` (RFC 9540 §3).
    pub fn encode_list(configs: &[KeyConfig]) -> Vec<u8> {
        let mut out = Vec::new();
        for c in configs {
            let enc = c.encode();
            out.extend_from_slice(&(enc.len() as u16).to_be_bytes());
            out.extend_from_slice(&enc);
        }
        out
    }

    /// Decodes an `application/ohttp-keys` list. Configurations this
    /// implementation does not support are skipped (RFC 9458 §3: clients
    /// ignore them); framing errors fail the whole list.
    pub fn decode_list(bytes: &[u8]) -> Result<Vec<KeyConfig>, SealError> {
        let mut out = Vec::new();
        let mut rest = bytes;
        while !rest.is_empty() {
            if rest.len() < 2 {
                return Err(SealError::MalformedKeyConfig(
                    "truncated length prefix".into(),
                ));
            }
            let len = u16::from_be_bytes([rest[0], rest[1]]) as usize;
            if rest.len() < 2 + len {
                return Err(SealError::MalformedKeyConfig(
                    "length prefix exceeds the list".into(),
                ));
            }
            match KeyConfig::decode(&rest[2..2 + len]) {
                Ok(c) => out.push(c),
                Err(SealError::UnsupportedKeyConfig(_)) => {}
                Err(e) => return Err(e),
            }
            rest = &rest[2 + len..];
        }
        Ok(out)
    }
}

/// A server's HPKE key pair: the key id and the X25519 private key. It
/// accepts every AEAD in [`Aead::ALL`].
#[derive(Clone)]
pub struct ServerKey {
    key_id: u8,
    secret: <HpkeKem as hpke::Kem>::PrivateKey,
    /// The same scalar, for decapsulation ([`HpkeReceiver`]).
    dh: x25519_dalek::StaticSecret,
    public: [u8; KEY_LEN],
}

impl fmt::Debug for ServerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerKey")
            .field("key_id", &self.key_id)
            .field("public_key", &hex::encode(self.public))
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl ServerKey {
    /// A fresh key from the OS random number generator.
    pub fn generate(key_id: u8) -> Self {
        Self::generate_with_rng(key_id, &mut rand::rngs::OsRng)
    }

    /// A fresh key from `rng`.
    pub fn generate_with_rng<R: CryptoRng + RngCore>(key_id: u8, rng: &mut R) -> Self {
        let (secret, public) = HpkeKem::gen_keypair(rng);
        Self::from_pair(key_id, secret, public)
    }

    /// The key derived from `ikm` by RFC 9180 `DeriveKeyPair` (deterministic;
    /// for tests and vectors).
    pub fn derive(key_id: u8, ikm: &[u8]) -> Self {
        let (secret, public) = HpkeKem::derive_keypair(ikm);
        Self::from_pair(key_id, secret, public)
    }

    /// The key with this private scalar (as returned by
    /// [`ServerKey::secret_bytes`]).
    pub fn from_secret_bytes(key_id: u8, secret: &[u8; KEY_LEN]) -> Self {
        let secret = <HpkeKem as hpke::Kem>::PrivateKey::from_bytes(secret)
            .expect("32 bytes is a valid X25519 private key");
        let public = HpkeKem::sk_to_pk(&secret);
        Self::from_pair(key_id, secret, public)
    }

    fn from_pair(
        key_id: u8,
        secret: <HpkeKem as hpke::Kem>::PrivateKey,
        public: <HpkeKem as hpke::Kem>::PublicKey,
    ) -> Self {
        let mut pk = [0u8; KEY_LEN];
        pk.copy_from_slice(&public.to_bytes());
        let mut sk = Zeroizing::new([0u8; KEY_LEN]);
        sk.copy_from_slice(&secret.to_bytes());
        Self {
            key_id,
            secret,
            dh: x25519_dalek::StaticSecret::from(*sk),
            public: pk,
        }
    }

    /// The private scalar, for persisting a key outside an enclave.
    pub fn secret_bytes(&self) -> Zeroizing<[u8; KEY_LEN]> {
        let mut out = Zeroizing::new([0u8; KEY_LEN]);
        out.copy_from_slice(&self.secret.to_bytes());
        out
    }

    /// The key id.
    pub fn key_id(&self) -> u8 {
        self.key_id
    }

    /// The X25519 public key.
    pub fn public_key(&self) -> [u8; KEY_LEN] {
        self.public
    }

    /// The key configuration to publish (every supported AEAD).
    pub fn config(&self) -> KeyConfig {
        KeyConfig {
            key_id: self.key_id,
            public_key: self.public,
            aeads: Aead::ALL.to_vec(),
        }
    }
}

/// Picks the key a sealed request names, or [`SealError::UnknownKeyId`].
pub fn select_key<'a>(
    keys: &'a [ServerKey],
    headers: &SealedHeaders,
) -> Result<&'a ServerKey, SealError> {
    keys.iter()
        .find(|k| k.key_id == headers.key_id)
        .ok_or(SealError::UnknownKeyId(headers.key_id))
}

/// The HPKE `info` of a request:
/// `"confidential-inference request v1" ‖ 0x00 ‖ key_id ‖ u16be(kem_id) ‖
/// u16be(kdf_id) ‖ u16be(aead_id)` (as the OHTTP header, RFC 9458 §4.3).
pub fn request_info(key_id: u8, aead: Aead) -> Vec<u8> {
    let mut info = Vec::with_capacity(REQUEST_INFO_LABEL.len() + 8);
    info.extend_from_slice(REQUEST_INFO_LABEL);
    info.push(0);
    info.push(key_id);
    info.extend_from_slice(&KEM_ID.to_be_bytes());
    info.extend_from_slice(&KDF_ID.to_be_bytes());
    info.extend_from_slice(&aead.id().to_be_bytes());
    info
}

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
}

impl SealedHeaders {
    /// `(name, value)` for each of the three headers.
    pub fn to_header_values(&self) -> [(&'static str, String); 3] {
        [
            (HEADER_KEY_ID, self.key_id.to_string()),
            (HEADER_AEAD, self.aead.id().to_string()),
            (
                HEADER_ENCAPSULATED_KEY,
                base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(self.enc),
            ),
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
        Ok(Self { key_id, aead, enc })
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

/// What the server side needs to seal a response to one request: the AEAD,
/// the request's encapsulated key and the secret exported from its HPKE
/// context. Serializable (CBOR byte strings) so that the entry stage can hand
/// it to the exit stage inside the attested channel. `Debug` does not print
/// the secret; the secret is zeroed on drop.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResponseKeyMaterial {
    aead: Aead,
    #[serde(with = "serde_bytes")]
    enc: [u8; KEY_LEN],
    #[serde(with = "serde_bytes")]
    secret: Vec<u8>,
}

impl fmt::Debug for ResponseKeyMaterial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseKeyMaterial")
            .field("aead", &self.aead)
            .field("enc", &hex::encode(self.enc))
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl Drop for ResponseKeyMaterial {
    fn drop(&mut self) {
        self.secret.zeroize();
    }
}

impl ResponseKeyMaterial {
    /// The AEAD the response is sealed with (the request's).
    pub fn aead(&self) -> Aead {
        self.aead
    }

    /// The request's encapsulated key.
    pub fn enc(&self) -> &[u8; KEY_LEN] {
        &self.enc
    }

    fn check(&self) -> Result<(), SealError> {
        if self.secret.len() != self.aead.key_len() {
            return Err(SealError::Malformed(format!(
                "response secret is {} bytes, expected {}",
                self.secret.len(),
                self.aead.key_len()
            )));
        }
        Ok(())
    }
}

/// The client's copy of a request's response key material, used to open
/// the response. Serializable so that a CLI can keep it between sealing the
/// request and opening the response.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ClientResponseKey(ResponseKeyMaterial);

impl ClientResponseKey {
    /// The underlying material.
    pub fn material(&self) -> &ResponseKeyMaterial {
        &self.0
    }
}

// ---------------------------------------------------------------------------
// Ciphers behind the chunk framing.

enum HpkeSender {
    Aes(Box<AeadCtxS<AesGcm128, HkdfSha256, HpkeKem>>),
    ChaCha(Box<AeadCtxS<HpkeChaCha, HkdfSha256, HpkeKem>>),
}

fn crypto(e: hpke::HpkeError) -> SealError {
    SealError::Crypto(e.to_string())
}

impl HpkeSender {
    fn setup<R: CryptoRng + RngCore>(
        public_key: &[u8; KEY_LEN],
        info: &[u8],
        aead: Aead,
        rng: &mut R,
    ) -> Result<([u8; KEY_LEN], Self), SealError> {
        let pk = <HpkeKem as hpke::Kem>::PublicKey::from_bytes(public_key)
            .map_err(|e| SealError::MalformedKeyConfig(e.to_string()))?;
        let mode = OpModeS::Base;
        let (enc, ctx) = match aead {
            Aead::Aes128Gcm => {
                let (enc, ctx) = hpke::setup_sender(&mode, &pk, info, rng).map_err(crypto)?;
                (enc, HpkeSender::Aes(Box::new(ctx)))
            }
            Aead::ChaCha20Poly1305 => {
                let (enc, ctx) = hpke::setup_sender(&mode, &pk, info, rng).map_err(crypto)?;
                (enc, HpkeSender::ChaCha(Box::new(ctx)))
            }
        };
        let mut out = [0u8; KEY_LEN];
        out.copy_from_slice(&enc.to_bytes());
        Ok((out, ctx))
    }

    fn seal(&mut self, pt: &[u8], aad: &[u8]) -> Result<Vec<u8>, SealError> {
        match self {
            HpkeSender::Aes(c) => c.seal(pt, aad),
            HpkeSender::ChaCha(c) => c.seal(pt, aad),
        }
        .map_err(crypto)
    }

    fn export(&self, label: &[u8], out: &mut [u8]) -> Result<(), SealError> {
        match self {
            HpkeSender::Aes(c) => c.export(label, out),
            HpkeSender::ChaCha(c) => c.export(label, out),
        }
        .map_err(crypto)
    }
}

/// The receiving side of RFC 9180 base mode for DHKEM(X25519, HKDF-SHA256)
/// and HKDF-SHA256: `Decap` (§4.1), `KeySchedule` (§5.1), `Open` (§5.2) and
/// `Export` (§5.3), over the `x25519-dalek`, `hkdf` and AEAD crates.
///
/// Written out here rather than taken from `hpke::setup_receiver` because
/// that recomputes the recipient's public key from its private key on every
/// call: a second X25519 scalar multiplication, about a third of the cost of
/// opening a request, for a value [`ServerKey`] already holds. The sending
/// side stays on the `hpke` crate, so every sealed round trip in the tests
/// checks one against the other, and the RFC 9180 vectors check this one.
struct HpkeReceiver {
    /// The AEAD with the context's key and base nonce; its counter is the
    /// sequence number (the nonce is `base_nonce XOR I2OSP(seq, Nn)`).
    cipher: Direct,
    exporter_secret: Zeroizing<[u8; 32]>,
    suite: [u8; 10],
}

const HPKE_V1: &[u8] = b"HPKE-v1";

/// `LabeledExtract(salt, label, ikm)` (RFC 9180 §4): the PRK and its HKDF.
fn labeled_extract(
    suite: &[u8],
    salt: &[u8],
    label: &[u8],
    ikm: &[u8],
) -> (Zeroizing<[u8; 32]>, hkdf::Hkdf<sha2::Sha256>) {
    let mut labeled = Zeroizing::new(Vec::with_capacity(
        HPKE_V1.len() + suite.len() + label.len() + ikm.len(),
    ));
    for part in [HPKE_V1, suite, label, ikm] {
        labeled.extend_from_slice(part);
    }
    let (prk, hk) = hkdf::Hkdf::<sha2::Sha256>::extract(Some(salt), &labeled);
    let mut out = Zeroizing::new([0u8; 32]);
    out.copy_from_slice(&prk);
    (out, hk)
}

/// `LabeledExpand(prk, label, info, L)` into `out` (L = `out.len()`).
fn labeled_expand(
    prk: &hkdf::Hkdf<sha2::Sha256>,
    suite: &[u8],
    label: &[u8],
    info: &[u8],
    out: &mut [u8],
) -> Result<(), SealError> {
    let len = u16::try_from(out.len()).map_err(|_| SealError::Crypto("length".into()))?;
    let mut labeled =
        Vec::with_capacity(2 + HPKE_V1.len() + suite.len() + label.len() + info.len());
    labeled.extend_from_slice(&len.to_be_bytes());
    for part in [HPKE_V1, suite, label, info] {
        labeled.extend_from_slice(part);
    }
    prk.expand(&labeled, out)
        .map_err(|e| SealError::Crypto(e.to_string()))
}

impl HpkeReceiver {
    fn setup(
        key: &ServerKey,
        enc: &[u8; KEY_LEN],
        info: &[u8],
        aead: Aead,
    ) -> Result<Self, SealError> {
        // Decap: dh = DH(skR, pkE); an all-zero result (a small-order pkE)
        // is refused, as the RFC requires.
        let dh = key.dh.diffie_hellman(&x25519_dalek::PublicKey::from(*enc));
        if !dh.was_contributory() {
            return Err(SealError::BadEncapsulatedKey);
        }
        let mut kem_suite = [0u8; 5];
        kem_suite[..3].copy_from_slice(b"KEM");
        kem_suite[3..].copy_from_slice(&KEM_ID.to_be_bytes());
        let (_, eae_prk) = labeled_extract(&kem_suite, b"", b"eae_prk", dh.as_bytes());
        let mut kem_context = [0u8; 2 * KEY_LEN];
        kem_context[..KEY_LEN].copy_from_slice(enc);
        kem_context[KEY_LEN..].copy_from_slice(&key.public);
        let mut shared = Zeroizing::new([0u8; 32]);
        labeled_expand(
            &eae_prk,
            &kem_suite,
            b"shared_secret",
            &kem_context,
            &mut *shared,
        )?;
        // KeySchedule, base mode (no PSK).
        let mut suite = [0u8; 10];
        suite[..4].copy_from_slice(b"HPKE");
        suite[4..6].copy_from_slice(&KEM_ID.to_be_bytes());
        suite[6..8].copy_from_slice(&KDF_ID.to_be_bytes());
        suite[8..].copy_from_slice(&aead.id().to_be_bytes());
        let (psk_id_hash, _) = labeled_extract(&suite, b"", b"psk_id_hash", b"");
        let (info_hash, _) = labeled_extract(&suite, b"", b"info_hash", info);
        let mut context = [0u8; 65];
        context[1..33].copy_from_slice(&*psk_id_hash);
        context[33..].copy_from_slice(&*info_hash);
        let (_, secret) = labeled_extract(&suite, &*shared, b"secret", b"");
        let mut aead_key = Zeroizing::new(vec![0u8; aead.key_len()]);
        let mut base_nonce = [0u8; AEAD_NONCE_LEN];
        let mut exporter_secret = Zeroizing::new([0u8; 32]);
        labeled_expand(&secret, &suite, b"key", &context, &mut aead_key)?;
        labeled_expand(&secret, &suite, b"base_nonce", &context, &mut base_nonce)?;
        labeled_expand(&secret, &suite, b"exp", &context, &mut *exporter_secret)?;
        Ok(Self {
            cipher: Direct::new(aead, &aead_key, base_nonce),
            exporter_secret,
            suite,
        })
    }

    /// Opens one ciphertext; the sequence number advances only on success.
    fn open(&mut self, ct: &[u8], aad: &[u8]) -> Option<Vec<u8>> {
        self.cipher.open(ct, aad)
    }

    /// `Export(exporter_context, L)` into `out`.
    fn export(&self, label: &[u8], out: &mut [u8]) -> Result<(), SealError> {
        let prk = hkdf::Hkdf::<sha2::Sha256>::from_prk(&*self.exporter_secret)
            .map_err(|e| SealError::Crypto(e.to_string()))?;
        labeled_expand(&prk, &self.suite, b"sec", label, out)
    }
}

/// The response AEAD: a key, a base nonce and a chunk counter.
struct Direct {
    cipher: DirectAead,
    base_nonce: [u8; AEAD_NONCE_LEN],
    counter: u64,
}

enum DirectAead {
    Aes(Box<aes_gcm::Aes128Gcm>),
    ChaCha(Box<chacha20poly1305::ChaCha20Poly1305>),
}

impl Direct {
    /// RFC 9458 §4.4 key schedule for the response.
    fn for_response(
        material: &ResponseKeyMaterial,
        response_nonce: &[u8],
    ) -> Result<Self, SealError> {
        material.check()?;
        let aead = material.aead;
        let mut salt = Vec::with_capacity(KEY_LEN + response_nonce.len());
        salt.extend_from_slice(&material.enc);
        salt.extend_from_slice(response_nonce);
        let hk = hkdf::Hkdf::<sha2::Sha256>::new(Some(&salt), &material.secret);
        let mut key = Zeroizing::new(vec![0u8; aead.key_len()]);
        let mut base_nonce = [0u8; AEAD_NONCE_LEN];
        hk.expand(b"key", &mut key)
            .and_then(|_| hk.expand(b"nonce", &mut base_nonce))
            .map_err(|e| SealError::Crypto(e.to_string()))?;
        Ok(Self::new(aead, &key, base_nonce))
    }

    /// An AEAD with `key` (`Nk` bytes) and `base_nonce`, counter at 0.
    fn new(aead: Aead, key: &[u8], base_nonce: [u8; AEAD_NONCE_LEN]) -> Self {
        let cipher = match aead {
            Aead::Aes128Gcm => DirectAead::Aes(Box::new(
                aes_gcm::Aes128Gcm::new_from_slice(key).expect("key length is Nk"),
            )),
            Aead::ChaCha20Poly1305 => DirectAead::ChaCha(Box::new(
                chacha20poly1305::ChaCha20Poly1305::new_from_slice(key).expect("key length is Nk"),
            )),
        };
        Self {
            cipher,
            base_nonce,
            counter: 0,
        }
    }

    fn nonce(&self) -> [u8; AEAD_NONCE_LEN] {
        let mut n = self.base_nonce;
        for (b, c) in n[AEAD_NONCE_LEN - 8..]
            .iter_mut()
            .zip(self.counter.to_be_bytes())
        {
            *b ^= c;
        }
        n
    }

    fn seal(&mut self, pt: &[u8], aad: &[u8]) -> Result<Vec<u8>, SealError> {
        let nonce = self.nonce();
        let payload = Payload { msg: pt, aad };
        let ct = match &self.cipher {
            DirectAead::Aes(c) => c.encrypt((&nonce).into(), payload),
            DirectAead::ChaCha(c) => c.encrypt((&nonce).into(), payload),
        }
        .map_err(|e| SealError::Crypto(e.to_string()))?;
        self.counter += 1;
        Ok(ct)
    }

    fn open(&mut self, ct: &[u8], aad: &[u8]) -> Option<Vec<u8>> {
        let nonce = self.nonce();
        let payload = Payload { msg: ct, aad };
        let pt = match &self.cipher {
            DirectAead::Aes(c) => c.decrypt((&nonce).into(), payload),
            DirectAead::ChaCha(c) => c.decrypt((&nonce).into(), payload),
        }
        .ok()?;
        self.counter += 1;
        Some(pt)
    }
}

enum SealCipher {
    Hpke(HpkeSender),
    Direct(Direct),
}

enum OpenCipher {
    Hpke(HpkeReceiver),
    Direct(Direct),
}

impl OpenCipher {
    fn open(&mut self, ct: &[u8], aad: &[u8]) -> Option<Vec<u8>> {
        match self {
            OpenCipher::Hpke(c) => c.open(ct, aad),
            OpenCipher::Direct(c) => c.open(ct, aad),
        }
    }
}

// ---------------------------------------------------------------------------
// Chunk framing.

/// Streaming sealer: turns plaintext pieces into framed chunks.
///
/// [`ChunkSealer::seal`] splits its input into chunks of at most
/// `max_chunk` bytes; the call with `last = true` ends the body with a final
/// chunk (an empty one if `data` is empty). Nothing can be sealed afterwards
/// ([`SealError::Finished`]).
pub struct ChunkSealer {
    cipher: SealCipher,
    max_chunk: usize,
    prefix: Vec<u8>,
    finished: bool,
}

impl ChunkSealer {
    fn new(cipher: SealCipher) -> Self {
        Self {
            cipher,
            max_chunk: DEFAULT_MAX_CHUNK,
            prefix: Vec::new(),
            finished: false,
        }
    }

    /// Sets the largest plaintext per chunk (default [`DEFAULT_MAX_CHUNK`];
    /// at least 1). The receiver's [`SealLimits::max_chunk`] must be at
    /// least this.
    pub fn set_max_chunk(&mut self, max_chunk: usize) {
        self.max_chunk = max_chunk.max(1);
    }

    /// Seals `data` as one or more chunks; with `last`, the final one is
    /// marked final. Returns the framed bytes to send. A non-final call with
    /// empty `data` produces no chunk.
    pub fn seal(&mut self, data: &[u8], last: bool) -> Result<Vec<u8>, SealError> {
        if self.finished {
            return Err(SealError::Finished);
        }
        let pieces = data.len().div_ceil(self.max_chunk);
        let mut out = std::mem::take(&mut self.prefix);
        out.reserve(data.len() + (pieces + 1) * CHUNK_OVERHEAD);
        let mut chunks: Vec<&[u8]> = data.chunks(self.max_chunk).collect();
        if last && chunks.is_empty() {
            chunks.push(&[]);
        }
        let n = chunks.len();
        for (i, piece) in chunks.into_iter().enumerate() {
            let aad = if last && i + 1 == n {
                &AAD_FINAL
            } else {
                &AAD_NOT_FINAL
            };
            let ct = match &mut self.cipher {
                SealCipher::Hpke(c) => c.seal(piece, aad)?,
                SealCipher::Direct(c) => c.seal(piece, aad)?,
            };
            out.extend_from_slice(&(ct.len() as u32).to_be_bytes());
            out.extend_from_slice(&ct);
        }
        if last {
            self.finished = true;
        }
        Ok(out)
    }

    /// Ends the body with an empty final chunk.
    pub fn finish(&mut self) -> Result<Vec<u8>, SealError> {
        self.seal(&[], true)
    }

    /// Ends the body with a trailer: one final chunk sealed with the trailer
    /// AAD (only responses use it). The trailer must fit in one chunk.
    fn seal_trailer(&mut self, trailer: &[u8]) -> Result<Vec<u8>, SealError> {
        if self.finished {
            return Err(SealError::Finished);
        }
        if trailer.len() > self.max_chunk {
            return Err(SealError::Malformed(format!(
                "trailer of {} bytes exceeds the chunk size {}",
                trailer.len(),
                self.max_chunk
            )));
        }
        let ct = match &mut self.cipher {
            SealCipher::Hpke(c) => c.seal(trailer, &AAD_TRAILER)?,
            SealCipher::Direct(c) => c.seal(trailer, &AAD_TRAILER)?,
        };
        let mut out = std::mem::take(&mut self.prefix);
        out.extend_from_slice(&(ct.len() as u32).to_be_bytes());
        out.extend_from_slice(&ct);
        self.finished = true;
        Ok(out)
    }

    /// Whether the final chunk was sealed.
    pub fn is_finished(&self) -> bool {
        self.finished
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum OpenState {
    Open,
    Done,
    Failed,
}

/// Streaming opener: feed it the sealed body in whatever pieces arrive; it
/// returns the plaintext chunks that became complete.
///
/// Any error poisons it (later calls return [`SealError::Poisoned`]).
/// [`ChunkOpener::finish`] must be called at the end of the body: it is
/// [`SealError::Truncated`] unless the final chunk arrived.
pub struct ChunkOpener {
    cipher: OpenCipher,
    limits: SealLimits,
    buf: Vec<u8>,
    received: u64,
    state: OpenState,
    /// Whether a trailer may end the body (responses only).
    allow_trailer: bool,
    trailer: Option<Vec<u8>>,
}

impl ChunkOpener {
    fn new(cipher: OpenCipher, limits: SealLimits, allow_trailer: bool) -> Self {
        Self {
            cipher,
            limits,
            buf: Vec::new(),
            received: 0,
            state: OpenState::Open,
            allow_trailer,
            trailer: None,
        }
    }

    /// Feeds bytes; returns the plaintext of every chunk they completed.
    pub fn feed(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, SealError> {
        let r = self.feed_inner(data);
        if r.is_err() {
            self.state = OpenState::Failed;
            self.buf.clear();
        }
        r
    }

    fn feed_inner(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, SealError> {
        match self.state {
            OpenState::Failed => return Err(SealError::Poisoned),
            OpenState::Done if !data.is_empty() => return Err(SealError::TrailingData),
            _ => {}
        }
        self.count(data.len())?;
        self.buf.extend_from_slice(data);
        let mut out = Vec::new();
        let mut pos = 0;
        let limit = self.limits.max_chunk as u64 + TAG_LEN as u64;
        while self.state == OpenState::Open && self.buf.len() - pos >= LEN_PREFIX {
            let len = u32::from_be_bytes(self.buf[pos..pos + LEN_PREFIX].try_into().unwrap());
            if len as u64 > limit {
                return Err(SealError::ChunkTooLarge {
                    size: len as u64,
                    limit,
                });
            }
            let len = len as usize;
            if len < TAG_LEN {
                return Err(SealError::Malformed(
                    "chunk shorter than the AEAD tag".into(),
                ));
            }
            if self.buf.len() - pos < LEN_PREFIX + len {
                break;
            }
            let ct = &self.buf[pos + LEN_PREFIX..pos + LEN_PREFIX + len];
            if let Some(pt) = self.cipher.open(ct, &AAD_NOT_FINAL) {
                out.push(pt);
            } else if let Some(pt) = self.cipher.open(ct, &AAD_FINAL) {
                self.state = OpenState::Done;
                out.push(pt);
            } else if let Some(pt) = self
                .allow_trailer
                .then(|| self.cipher.open(ct, &AAD_TRAILER))
                .flatten()
            {
                self.state = OpenState::Done;
                self.trailer = Some(pt);
            } else {
                return Err(SealError::Open);
            }
            pos += LEN_PREFIX + len;
        }
        self.buf.drain(..pos);
        if self.state == OpenState::Done && !self.buf.is_empty() {
            return Err(SealError::TrailingData);
        }
        Ok(out)
    }

    fn count(&mut self, n: usize) -> Result<(), SealError> {
        self.received = self.received.saturating_add(n as u64);
        if self.received > self.limits.max_body {
            return Err(SealError::MessageTooLarge {
                limit: self.limits.max_body,
            });
        }
        Ok(())
    }

    /// Whether the final chunk has been opened.
    pub fn is_complete(&self) -> bool {
        self.state == OpenState::Done
    }

    /// Ends the body: `Ok` only if the final chunk arrived and nothing
    /// followed it.
    pub fn finish(self) -> Result<(), SealError> {
        match self.state {
            OpenState::Done => Ok(()),
            OpenState::Open => Err(SealError::Truncated),
            OpenState::Failed => Err(SealError::Poisoned),
        }
    }
}

// ---------------------------------------------------------------------------
// Requests.

/// Starts sealing a request to `config` with `aead` (OS randomness).
/// Returns the headers to send, the body sealer and the key to open the
/// response with.
pub fn seal_request_stream(
    config: &KeyConfig,
    aead: Aead,
) -> Result<(SealedHeaders, ChunkSealer, ClientResponseKey), SealError> {
    seal_request_stream_with_rng(config, aead, &mut rand::rngs::OsRng)
}

/// [`seal_request_stream`] with the caller's random number generator.
pub fn seal_request_stream_with_rng<R: CryptoRng + RngCore>(
    config: &KeyConfig,
    aead: Aead,
    rng: &mut R,
) -> Result<(SealedHeaders, ChunkSealer, ClientResponseKey), SealError> {
    if !config.supports(aead) {
        return Err(SealError::UnsupportedAead(aead.id()));
    }
    let info = request_info(config.key_id, aead);
    let (enc, ctx) = HpkeSender::setup(&config.public_key, &info, aead, rng)?;
    let mut secret = vec![0u8; aead.key_len()];
    ctx.export(RESPONSE_EXPORT_LABEL, &mut secret)?;
    let headers = SealedHeaders {
        key_id: config.key_id,
        aead,
        enc,
    };
    let key = ClientResponseKey(ResponseKeyMaterial { aead, enc, secret });
    Ok((headers, ChunkSealer::new(SealCipher::Hpke(ctx)), key))
}

/// Starts opening a sealed request with `key`. Returns the body opener and
/// the material to seal the response with.
///
/// Errors: [`SealError::UnknownKeyId`] if `headers` name another key;
/// [`SealError::BadEncapsulatedKey`] if decapsulation fails.
pub fn open_request_stream(
    key: &ServerKey,
    headers: &SealedHeaders,
    limits: SealLimits,
) -> Result<(ChunkOpener, ResponseKeyMaterial), SealError> {
    if headers.key_id != key.key_id {
        return Err(SealError::UnknownKeyId(headers.key_id));
    }
    let info = request_info(key.key_id, headers.aead);
    let ctx = HpkeReceiver::setup(key, &headers.enc, &info, headers.aead)?;
    let mut secret = vec![0u8; headers.aead.key_len()];
    ctx.export(RESPONSE_EXPORT_LABEL, &mut secret)?;
    let material = ResponseKeyMaterial {
        aead: headers.aead,
        enc: headers.enc,
        secret,
    };
    Ok((
        ChunkOpener::new(OpenCipher::Hpke(ctx), limits, false),
        material,
    ))
}

/// Seals a whole request body (one-shot).
pub fn seal_request(
    config: &KeyConfig,
    aead: Aead,
    plaintext: &[u8],
) -> Result<(SealedHeaders, Vec<u8>, ClientResponseKey), SealError> {
    let (headers, mut sealer, key) = seal_request_stream(config, aead)?;
    let body = sealer.seal(plaintext, true)?;
    Ok((headers, body, key))
}

/// Opens a whole sealed request body (one-shot, default limits).
pub fn open_request(
    key: &ServerKey,
    headers: &SealedHeaders,
    body: &[u8],
) -> Result<(Vec<u8>, ResponseKeyMaterial), SealError> {
    let (mut opener, material) = open_request_stream(key, headers, SealLimits::default())?;
    let plaintext = opener.feed(body)?.concat();
    opener.finish()?;
    Ok((plaintext, material))
}

// ---------------------------------------------------------------------------
// Responses.

/// Streaming response sealer. The first output of [`ResponseSealer::seal`]
/// starts with the random response nonce; then chunks as for requests.
pub struct ResponseSealer {
    inner: ChunkSealer,
}

impl ResponseSealer {
    /// A sealer with a fresh response nonce from the OS.
    pub fn new(material: &ResponseKeyMaterial) -> Result<Self, SealError> {
        Self::new_with_rng(material, &mut rand::rngs::OsRng)
    }

    /// A sealer with a response nonce from `rng`.
    pub fn new_with_rng<R: CryptoRng + RngCore>(
        material: &ResponseKeyMaterial,
        rng: &mut R,
    ) -> Result<Self, SealError> {
        let mut nonce = vec![0u8; material.aead.response_nonce_len()];
        rng.fill_bytes(&mut nonce);
        let cipher = Direct::for_response(material, &nonce)?;
        let mut inner = ChunkSealer::new(SealCipher::Direct(cipher));
        inner.prefix = nonce;
        Ok(Self { inner })
    }

    /// Sets the largest plaintext per chunk (see [`ChunkSealer::set_max_chunk`]).
    pub fn set_max_chunk(&mut self, max_chunk: usize) {
        self.inner.set_max_chunk(max_chunk);
    }

    /// Seals `data` (see [`ChunkSealer::seal`]); the first call's output
    /// begins with the response nonce.
    pub fn seal(&mut self, data: &[u8], last: bool) -> Result<Vec<u8>, SealError> {
        self.inner.seal(data, last)
    }

    /// Ends the body with an empty final chunk.
    pub fn finish(&mut self) -> Result<Vec<u8>, SealError> {
        self.inner.finish()
    }

    /// Ends the body with `trailer` (e.g. the receipt) as its final chunk,
    /// authenticated with the trailer AAD so that it can never be read as
    /// response data. At most one chunk ([`DEFAULT_MAX_CHUNK`] unless set).
    pub fn finish_with_trailer(&mut self, trailer: &[u8]) -> Result<Vec<u8>, SealError> {
        self.inner.seal_trailer(trailer)
    }

    /// Whether the final chunk was sealed.
    pub fn is_finished(&self) -> bool {
        self.inner.is_finished()
    }
}

/// Streaming response opener: reads the response nonce, derives the keys,
/// then opens chunks like [`ChunkOpener`].
pub struct ResponseOpener {
    key: ClientResponseKey,
    limits: SealLimits,
    nonce: Vec<u8>,
    inner: Option<ChunkOpener>,
    failed: bool,
}

impl ResponseOpener {
    /// An opener for the response to the request sealed with `key`.
    pub fn new(key: &ClientResponseKey, limits: SealLimits) -> Self {
        Self {
            key: key.clone(),
            limits,
            nonce: Vec::new(),
            inner: None,
            failed: false,
        }
    }

    /// Feeds bytes; returns the plaintext of every chunk they completed.
    pub fn feed(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, SealError> {
        if self.failed {
            return Err(SealError::Poisoned);
        }
        let r = self.feed_inner(data);
        if r.is_err() {
            self.failed = true;
        }
        r
    }

    fn feed_inner(&mut self, mut data: &[u8]) -> Result<Vec<Vec<u8>>, SealError> {
        if self.inner.is_none() {
            let need = self.key.0.aead.response_nonce_len();
            if self.limits.max_body < need as u64 {
                return Err(SealError::MessageTooLarge {
                    limit: self.limits.max_body,
                });
            }
            let take = (need - self.nonce.len()).min(data.len());
            self.nonce.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.nonce.len() < need {
                return Ok(Vec::new());
            }
            let cipher = Direct::for_response(&self.key.0, &self.nonce)?;
            let mut opener = ChunkOpener::new(OpenCipher::Direct(cipher), self.limits, true);
            opener.received = need as u64;
            self.inner = Some(opener);
        }
        self.inner.as_mut().expect("set above").feed(data)
    }

    /// Whether the final chunk has been opened.
    pub fn is_complete(&self) -> bool {
        self.inner.as_ref().is_some_and(|o| o.is_complete())
    }

    /// The trailer (the receipt) if the body ended with one; `None` before
    /// the end or when the body ended with a plain final chunk.
    pub fn trailer(&self) -> Option<&[u8]> {
        self.inner.as_ref().and_then(|o| o.trailer.as_deref())
    }

    /// Ends the body: `Ok` only if the final chunk arrived and nothing
    /// followed it.
    pub fn finish(self) -> Result<(), SealError> {
        if self.failed {
            return Err(SealError::Poisoned);
        }
        match self.inner {
            Some(o) => o.finish(),
            None => Err(SealError::Truncated),
        }
    }
}

/// Seals a whole response body (one-shot).
pub fn seal_response(
    material: &ResponseKeyMaterial,
    plaintext: &[u8],
) -> Result<Vec<u8>, SealError> {
    ResponseSealer::new(material)?.seal(plaintext, true)
}

/// Seals a whole response body and ends it with `trailer` (one-shot).
pub fn seal_response_with_trailer(
    material: &ResponseKeyMaterial,
    plaintext: &[u8],
    trailer: &[u8],
) -> Result<Vec<u8>, SealError> {
    let mut sealer = ResponseSealer::new(material)?;
    let mut out = sealer.seal(plaintext, false)?;
    out.extend(sealer.finish_with_trailer(trailer)?);
    Ok(out)
}

/// Opens a whole sealed response body (one-shot, default limits); a
/// trailer, if any, is authenticated and dropped.
pub fn open_response(key: &ClientResponseKey, body: &[u8]) -> Result<Vec<u8>, SealError> {
    open_response_with_trailer(key, body).map(|(plaintext, _)| plaintext)
}

/// Opens a whole sealed response body (one-shot, default limits) and
/// returns it with its trailer (the receipt), if it ended with one.
pub fn open_response_with_trailer(
    key: &ClientResponseKey,
    body: &[u8],
) -> Result<(Vec<u8>, Option<Vec<u8>>), SealError> {
    let mut opener = ResponseOpener::new(key, SealLimits::default());
    let plaintext = opener.feed(body)?.concat();
    let trailer = opener.trailer().map(<[u8]>::to_vec);
    opener.finish()?;
    Ok((plaintext, trailer))
}

// ---------------------------------------------------------------------------
// Replay protection.

/// Remembers the encapsulated keys of sealed requests for a retention
/// window and rejects a second request with the same one.
///
/// Memory is bounded by `capacity` entries. Entries older than the window
/// are evicted (oldest first). When the guard is full of entries still
/// inside their window, a new request is **refused**
/// ([`SealError::ReplayCacheFull`], answer 503 and retry) rather than
/// forgetting an entry: the guard never silently stops detecting a replay
/// inside the window. Size `capacity` for the peak request rate times the
/// window. A request replayed after the window has passed is not detected.
///
/// Check a request only after its first chunk authenticates, so that
/// garbage encapsulated keys cannot fill the guard.
#[derive(Debug)]
pub struct ReplayGuard {
    window: Duration,
    capacity: usize,
    seen: HashSet<[u8; KEY_LEN]>,
    order: VecDeque<(Instant, [u8; KEY_LEN])>,
}

impl ReplayGuard {
    /// A guard remembering keys for `window`, holding at most `capacity`.
    pub fn new(window: Duration, capacity: usize) -> Self {
        Self {
            window,
            capacity,
            seen: HashSet::new(),
            order: VecDeque::new(),
        }
    }

    /// Records `enc` as seen at `now`; [`SealError::Replay`] if it was seen
    /// within the window, [`SealError::ReplayCacheFull`] if there is no room.
    pub fn check_and_insert(&mut self, enc: &[u8; KEY_LEN], now: Instant) -> Result<(), SealError> {
        while let Some((t, k)) = self.order.front() {
            if now.saturating_duration_since(*t) < self.window {
                break;
            }
            self.seen.remove(k);
            self.order.pop_front();
        }
        if self.seen.contains(enc) {
            return Err(SealError::Replay);
        }
        if self.seen.len() >= self.capacity {
            return Err(SealError::ReplayCacheFull);
        }
        // Keep the queue ordered even if callers' clocks interleave: an entry
        // is never evicted earlier than its own window ends.
        let t = self.order.back().map_or(now, |(last, _)| now.max(*last));
        self.seen.insert(*enc);
        self.order.push_back((t, *enc));
        Ok(())
    }

    /// Number of remembered keys.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether no key is remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, SeedableRng};

    fn key() -> ServerKey {
        ServerKey::derive(7, b"sealing test key")
    }

    fn limits() -> SealLimits {
        SealLimits::default()
    }

    /// A request body of several chunks, with its headers and keys.
    fn multi_chunk(
        aead: Aead,
        pieces: &[&[u8]],
    ) -> (SealedHeaders, Vec<Vec<u8>>, ClientResponseKey) {
        let (h, mut s, k) = seal_request_stream(&key().config(), aead).unwrap();
        let mut framed = Vec::new();
        for (i, p) in pieces.iter().enumerate() {
            framed.push(s.seal(p, i + 1 == pieces.len()).unwrap());
        }
        (h, framed, k)
    }

    fn open_all(h: &SealedHeaders, body: &[u8]) -> Result<Vec<u8>, SealError> {
        open_request(&key(), h, body).map(|(p, _)| p)
    }

    #[test]
    fn round_trip_both_aeads() {
        for aead in Aead::ALL {
            for msg in [&b""[..], b"x", &vec![0xabu8; 5000]] {
                let (h, body, ck) = seal_request(&key().config(), aead, msg).unwrap();
                assert_eq!(h.aead, aead);
                let (pt, material) = open_request(&key(), &h, &body).unwrap();
                assert_eq!(pt, msg);
                assert_eq!(&material, ck.material());
                let resp = seal_response(&material, b"the answer").unwrap();
                assert_eq!(open_response(&ck, &resp).unwrap(), b"the answer");
            }
        }
    }

    #[test]
    fn response_trailer_is_separate_and_authenticated() {
        for aead in Aead::ALL {
            let (h, body, ck) = seal_request(&key().config(), aead, b"q").unwrap();
            let (_, material) = open_request(&key(), &h, &body).unwrap();
            // Streamed: data chunks, then the trailer; fed byte by byte.
            let mut s = ResponseSealer::new(&material).unwrap();
            let mut wire = s.seal(b"data: a\n\n", false).unwrap();
            wire.extend(s.seal(b"data: [DONE]\n\n", false).unwrap());
            wire.extend(s.finish_with_trailer(b"RECEIPT").unwrap());
            assert!(s.is_finished());
            assert_eq!(s.seal(b"more", true), Err(SealError::Finished));
            let mut o = ResponseOpener::new(&ck, limits());
            let mut data = Vec::new();
            for b in &wire {
                data.extend(o.feed(std::slice::from_ref(b)).unwrap().concat());
            }
            assert_eq!(data, b"data: a\n\ndata: [DONE]\n\n");
            assert_eq!(o.trailer(), Some(&b"RECEIPT"[..]));
            o.finish().unwrap();
            // One-shot helpers agree; open_response drops the trailer.
            let whole = seal_response_with_trailer(&material, b"body", b"R").unwrap();
            assert_eq!(
                open_response_with_trailer(&ck, &whole).unwrap(),
                (b"body".to_vec(), Some(b"R".to_vec()))
            );
            assert_eq!(open_response(&ck, &whole).unwrap(), b"body");
            // A plain final chunk has no trailer.
            let plain = seal_response(&material, b"body").unwrap();
            assert_eq!(open_response_with_trailer(&ck, &plain).unwrap().1, None);
            // Dropping the trailer chunk leaves the body truncated.
            let cut = whole.len() - (LEN_PREFIX + 1 + TAG_LEN);
            assert_eq!(open_response(&ck, &whole[..cut]), Err(SealError::Truncated));
            // A flipped byte in the trailer fails to open.
            let mut bad = whole.clone();
            *bad.last_mut().unwrap() ^= 1;
            assert_eq!(open_response(&ck, &bad), Err(SealError::Open));
        }
    }

    #[test]
    fn requests_never_accept_a_trailer() {
        // A request body cannot end with a trailer chunk: the request opener
        // does not try the trailer AAD.
        let (h, mut sealer, _) = seal_request_stream(&key().config(), Aead::Aes128Gcm).unwrap();
        let mut body = sealer.seal(b"{}", false).unwrap();
        body.extend(sealer.seal_trailer(b"x").unwrap());
        assert_eq!(open_all(&h, &body), Err(SealError::Open));
    }

    #[test]
    fn response_nonce_length_is_max_nn_nk() {
        assert_eq!(Aead::Aes128Gcm.response_nonce_len(), 16);
        assert_eq!(Aead::ChaCha20Poly1305.response_nonce_len(), 32);
        for aead in Aead::ALL {
            let (h, body, _) = seal_request(&key().config(), aead, b"q").unwrap();
            let (_, m) = open_request(&key(), &h, &body).unwrap();
            let resp = seal_response(&m, b"").unwrap();
            // nonce ‖ u32 len ‖ tag (empty final chunk)
            assert_eq!(resp.len(), aead.response_nonce_len() + CHUNK_OVERHEAD);
        }
    }

    #[test]
    fn wire_layout_of_request_chunks() {
        let (h, body, _) = seal_request(&key().config(), Aead::Aes128Gcm, b"hello").unwrap();
        assert_eq!(body.len(), 4 + 5 + TAG_LEN);
        assert_eq!(&body[..4], &(5u32 + 16).to_be_bytes());
        // Built by hand with the HPKE receiver: chunk 0, AAD 0x01.
        let info = request_info(7, Aead::Aes128Gcm);
        let mut r = HpkeReceiver::setup(&key(), &h.enc, &info, Aead::Aes128Gcm).unwrap();
        assert!(r.open(&body[4..], &[0x00]).is_none());
        assert_eq!(r.open(&body[4..], &[0x01]).unwrap(), b"hello");
    }

    #[test]
    fn streaming_one_byte_feeds() {
        for aead in Aead::ALL {
            let mut sk = key();
            sk.key_id = 9;
            let (h, mut s, ck) = seal_request_stream(&sk.config(), aead).unwrap();
            s.set_max_chunk(7);
            let msg: Vec<u8> = (0..100u8).collect();
            let mut body = s.seal(&msg[..50], false).unwrap();
            body.extend(s.seal(&msg[50..], true).unwrap());
            assert!(s.is_finished());
            assert_eq!(s.seal(b"more", true), Err(SealError::Finished));
            let (mut o, m) = open_request_stream(&sk, &h, limits()).unwrap();
            let mut got = Vec::new();
            let mut chunks = 0;
            for b in &body {
                for c in o.feed(std::slice::from_ref(b)).unwrap() {
                    chunks += 1;
                    got.extend(c);
                }
            }
            assert_eq!(chunks, 8 + 8); // ceil(50/7) + ceil(50/7)
            assert!(o.is_complete());
            o.finish().unwrap();
            assert_eq!(got, msg);

            // Streamed response, fed one byte at a time.
            let mut rs = ResponseSealer::new(&m).unwrap();
            rs.set_max_chunk(3);
            let mut resp = rs.seal(b"data: a\n\n", false).unwrap();
            resp.extend(rs.seal(b"data: [DONE]\n\n", false).unwrap());
            resp.extend(rs.finish().unwrap());
            let mut ro = ResponseOpener::new(&ck, limits());
            let mut got = Vec::new();
            for b in &resp {
                got.extend(ro.feed(std::slice::from_ref(b)).unwrap().concat());
            }
            assert!(ro.is_complete());
            ro.finish().unwrap();
            assert_eq!(got, b"data: a\n\ndata: [DONE]\n\n");
        }
    }

    #[test]
    fn tampered_chunk_tag_and_length() {
        for aead in Aead::ALL {
            let (h, body, _) = seal_request(&key().config(), aead, b"secret prompt").unwrap();
            // Flip every byte of the body: never accepted.
            for i in 0..body.len() {
                let mut bad = body.clone();
                bad[i] ^= 0x01;
                assert!(open_all(&h, &bad).is_err(), "flip at {i} accepted");
            }
            let mut bad = body.clone();
            bad[4] ^= 0x80; // ciphertext
            assert_eq!(open_all(&h, &bad), Err(SealError::Open));
            let mut bad = body.clone();
            *bad.last_mut().unwrap() ^= 0x01; // tag
            assert_eq!(open_all(&h, &bad), Err(SealError::Open));
            let mut bad = body.clone();
            bad[3] -= 1; // length one shorter: misframed chunk
            assert_eq!(open_all(&h, &bad), Err(SealError::Open));
            let mut bad = body.clone();
            bad[3] += 1; // length one longer: waits for a byte that never comes
            assert_eq!(open_all(&h, &bad), Err(SealError::Truncated));
        }
    }

    #[test]
    fn final_flag_is_authenticated() {
        // A body whose last chunk is not final: truncated.
        let (h, mut s, _) = seal_request_stream(&key().config(), Aead::Aes128Gcm).unwrap();
        let body = s.seal(b"abc", false).unwrap();
        assert_eq!(open_all(&h, &body), Err(SealError::Truncated));
        // A final chunk followed by more chunks: trailing data.
        let (h, mut s, _) = seal_request_stream(&key().config(), Aead::Aes128Gcm).unwrap();
        let mut body = s.seal(b"abc", true).unwrap();
        body.extend(body.clone());
        assert_eq!(open_all(&h, &body), Err(SealError::TrailingData));
        // Bytes after the final chunk.
        let (h, mut body, _) = seal_request(&key().config(), Aead::Aes128Gcm, b"abc").unwrap();
        body.push(0);
        assert_eq!(open_all(&h, &body), Err(SealError::TrailingData));
    }

    #[test]
    fn dropped_reordered_duplicated_truncated() {
        for aead in Aead::ALL {
            let (h, c, _) = multi_chunk(aead, &[b"one", b"two", b"three", b"four"]);
            assert_eq!(open_all(&h, &c.concat()).unwrap(), b"onetwothreefour");
            let dropped = [&c[0][..], &c[2], &c[3]].concat();
            assert_eq!(open_all(&h, &dropped), Err(SealError::Open));
            let reordered = [&c[1][..], &c[0], &c[2], &c[3]].concat();
            assert_eq!(open_all(&h, &reordered), Err(SealError::Open));
            let duplicated = [&c[0][..], &c[1], &c[1], &c[2], &c[3]].concat();
            assert_eq!(open_all(&h, &duplicated), Err(SealError::Open));
            let truncated = [&c[0][..], &c[1], &c[2]].concat();
            assert_eq!(open_all(&h, &truncated), Err(SealError::Truncated));
            let partial = &c.concat()[..c.concat().len() - 1];
            assert_eq!(open_all(&h, partial), Err(SealError::Truncated));
            assert_eq!(open_all(&h, &[]), Err(SealError::Truncated));
        }
    }

    #[test]
    fn opener_is_poisoned_after_error() {
        let (h, mut body, _) = seal_request(&key().config(), Aead::Aes128Gcm, b"abc").unwrap();
        body[5] ^= 1;
        let (mut o, _) = open_request_stream(&key(), &h, limits()).unwrap();
        assert_eq!(o.feed(&body), Err(SealError::Open));
        assert_eq!(o.feed(&[]), Err(SealError::Poisoned));
        assert_eq!(o.finish(), Err(SealError::Poisoned));
    }

    #[test]
    fn wrong_key_and_unknown_key_id() {
        let (h, body, _) = seal_request(&key().config(), Aead::ChaCha20Poly1305, b"x").unwrap();
        let other = ServerKey::derive(7, b"another key, same id");
        assert_eq!(
            open_request(&other, &h, &body).map(|_| ()),
            Err(SealError::Open)
        );
        let other_id = ServerKey::derive(8, b"sealing test key");
        assert_eq!(
            open_request(&other_id, &h, &body).map(|_| ()),
            Err(SealError::UnknownKeyId(7))
        );
        let keys = [other_id.clone(), key()];
        assert_eq!(select_key(&keys, &h).unwrap().key_id(), 7);
        assert_eq!(
            select_key(&keys[..1], &h).map(|k| k.key_id()),
            Err(SealError::UnknownKeyId(7))
        );
        // The AEAD is bound in the info: the same enc with the other AEAD fails.
        let mut h2 = h.clone();
        h2.aead = Aead::Aes128Gcm;
        assert!(open_request(&key(), &h2, &body).is_err());
        // So is the key id (a server with key 7 under id 8 cannot open it).
        let mut h3 = h.clone();
        h3.key_id = 8;
        let same_secret_other_id = ServerKey::from_secret_bytes(8, &key().secret_bytes());
        assert_eq!(
            open_request(&same_secret_other_id, &h3, &body).map(|_| ()),
            Err(SealError::Open)
        );
    }

    #[test]
    fn unsupported_aead_in_config() {
        let mut cfg = key().config();
        cfg.aeads = vec![Aead::ChaCha20Poly1305];
        assert_eq!(
            seal_request(&cfg, Aead::Aes128Gcm, b"x").map(|_| ()),
            Err(SealError::UnsupportedAead(1))
        );
        assert_eq!(Aead::from_id(2), Err(SealError::UnsupportedAead(2)));
    }

    #[test]
    fn response_with_another_requests_key_fails() {
        for aead in Aead::ALL {
            let (h1, b1, k1) = seal_request(&key().config(), aead, b"one").unwrap();
            let (_h2, _b2, k2) = seal_request(&key().config(), aead, b"two").unwrap();
            let (_, m1) = open_request(&key(), &h1, &b1).unwrap();
            let resp = seal_response(&m1, b"answer to one").unwrap();
            assert_eq!(open_response(&k2, &resp), Err(SealError::Open));
            // A flipped response-nonce byte changes the keys.
            let mut bad = resp.clone();
            bad[0] ^= 1;
            assert_eq!(open_response(&k1, &bad), Err(SealError::Open));
            assert_eq!(open_response(&k1, &resp).unwrap(), b"answer to one");
            // Too short to hold the nonce.
            assert_eq!(
                open_response(&k1, &resp[..aead.response_nonce_len() - 1]),
                Err(SealError::Truncated)
            );
        }
    }

    #[test]
    fn response_key_schedule_matches_rfc9458_by_hand() {
        let (h, body, ck) = seal_request(&key().config(), Aead::Aes128Gcm, b"q").unwrap();
        let (_, m) = open_request(&key(), &h, &body).unwrap();
        let mut rng = StdRng::seed_from_u64(1);
        let mut rs = ResponseSealer::new_with_rng(&m, &mut rng).unwrap();
        let mut resp = rs.seal(b"first", false).unwrap();
        resp.extend(rs.seal(b"second", true).unwrap());
        // Independent derivation with hkdf + aes-gcm.
        let nonce = &resp[..16];
        let mut salt = h.enc.to_vec();
        salt.extend_from_slice(nonce);
        let hk = hkdf::Hkdf::<sha2::Sha256>::new(Some(&salt), &ck.material().secret);
        let mut k = [0u8; 16];
        let mut n = [0u8; 12];
        hk.expand(b"key", &mut k).unwrap();
        hk.expand(b"nonce", &mut n).unwrap();
        let c = aes_gcm::Aes128Gcm::new_from_slice(&k).unwrap();
        let rest = &resp[16..];
        let l0 = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
        let pt0 = c
            .decrypt(
                (&n).into(),
                Payload {
                    msg: &rest[4..4 + l0],
                    aad: &[0],
                },
            )
            .unwrap();
        assert_eq!(pt0, b"first");
        let rest = &rest[4 + l0..];
        let mut n1 = n;
        n1[11] ^= 1;
        let pt1 = c
            .decrypt(
                (&n1).into(),
                Payload {
                    msg: &rest[4..],
                    aad: &[1],
                },
            )
            .unwrap();
        assert_eq!(pt1, b"second");
        // And the exported secret is the HPKE export with our label.
        let info = request_info(7, Aead::Aes128Gcm);
        let r = HpkeReceiver::setup(&key(), &h.enc, &info, Aead::Aes128Gcm).unwrap();
        let mut s = [0u8; 16];
        r.export(RESPONSE_EXPORT_LABEL, &mut s).unwrap();
        assert_eq!(&s[..], &m.secret[..]);
    }

    #[test]
    fn limits_are_enforced() {
        let (h, mut s, _) = seal_request_stream(&key().config(), Aead::Aes128Gcm).unwrap();
        s.set_max_chunk(100);
        let body = s.seal(&[1u8; 100], true).unwrap();
        let small = SealLimits {
            max_chunk: 99,
            max_body: 1 << 20,
        };
        let (mut o, _) = open_request_stream(&key(), &h, small).unwrap();
        // Rejected as soon as the length prefix arrives.
        assert_eq!(
            o.feed(&body[..4]),
            Err(SealError::ChunkTooLarge {
                size: 116,
                limit: 115
            })
        );
        let tight = SealLimits {
            max_chunk: 100,
            max_body: body.len() as u64 - 1,
        };
        let (mut o, _) = open_request_stream(&key(), &h, tight).unwrap();
        assert_eq!(
            o.feed(&body),
            Err(SealError::MessageTooLarge {
                limit: body.len() as u64 - 1
            })
        );
        let exact = SealLimits {
            max_chunk: 100,
            max_body: body.len() as u64,
        };
        let (mut o, _) = open_request_stream(&key(), &h, exact).unwrap();
        assert_eq!(o.feed(&body).unwrap().concat(), vec![1u8; 100]);
        o.finish().unwrap();
        // A length below the tag size cannot be a chunk.
        let (mut o, _) = open_request_stream(&key(), &h, limits()).unwrap();
        assert!(matches!(
            o.feed(&[0, 0, 0, 15]),
            Err(SealError::Malformed(_))
        ));
        // Response limits count the nonce.
        let (h, b, ck) = seal_request(&key().config(), Aead::Aes128Gcm, b"q").unwrap();
        let (_, m) = open_request(&key(), &h, &b).unwrap();
        let resp = seal_response(&m, &[0u8; 64]).unwrap();
        let mut ro = ResponseOpener::new(
            &ck,
            SealLimits {
                max_chunk: 64,
                max_body: resp.len() as u64 - 1,
            },
        );
        assert!(matches!(
            ro.feed(&resp),
            Err(SealError::MessageTooLarge { .. })
        ));
    }

    #[test]
    fn headers_round_trip_and_errors() {
        let (h, _, _) = seal_request(&key().config(), Aead::ChaCha20Poly1305, b"x").unwrap();
        let values = h.to_header_values();
        assert_eq!(values[0], (HEADER_KEY_ID, "7".to_string()));
        assert_eq!(values[1], (HEADER_AEAD, "3".to_string()));
        assert_eq!(values[2].1.len(), 43);
        let lookup = |vals: Vec<(&'static str, String)>| {
            move |name: &'static str| -> Option<String> {
                vals.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.clone())
            }
        };
        let parse = |vals: Vec<(&'static str, String)>| {
            let l = lookup(vals);
            let owned: Vec<(&'static str, Option<String>)> =
                [HEADER_KEY_ID, HEADER_AEAD, HEADER_ENCAPSULATED_KEY]
                    .iter()
                    .map(|n| (*n, l(n)))
                    .collect();
            SealedHeaders::from_header_values(|n| {
                owned
                    .iter()
                    .find(|(k, _)| *k == n)
                    .and_then(|(_, v)| v.as_deref())
            })
        };
        assert_eq!(parse(values.to_vec()).unwrap(), h);
        let with = |i: usize, v: &str| {
            let mut vals = values.to_vec();
            vals[i].1 = v.to_string();
            parse(vals)
        };
        assert!(matches!(with(0, "x"), Err(SealError::MalformedHeader(_))));
        assert!(matches!(with(0, "256"), Err(SealError::MalformedHeader(_))));
        assert!(matches!(with(0, "-1"), Err(SealError::MalformedHeader(_))));
        assert!(matches!(with(1, "0x3"), Err(SealError::MalformedHeader(_))));
        assert_eq!(with(1, "2"), Err(SealError::UnsupportedAead(2)));
        assert!(matches!(
            with(2, "a+b/"),
            Err(SealError::MalformedHeader(_))
        ));
        assert_eq!(with(2, "AAAA"), Err(SealError::BadEncapsulatedKey));
        let mut missing = values.to_vec();
        missing.remove(2);
        assert!(matches!(parse(missing), Err(SealError::MalformedHeader(_))));
    }

    #[test]
    fn low_order_encapsulated_key_is_rejected() {
        let h = SealedHeaders {
            key_id: 7,
            aead: Aead::Aes128Gcm,
            enc: [0u8; 32],
        };
        assert_eq!(
            open_request_stream(&key(), &h, limits()).map(|_| ()),
            Err(SealError::BadEncapsulatedKey)
        );
    }

    #[test]
    fn key_config_layout_by_hand() {
        let cfg = KeyConfig {
            key_id: 0x2a,
            public_key: [0x11; 32],
            aeads: vec![Aead::Aes128Gcm, Aead::ChaCha20Poly1305],
        };
        let mut expect = vec![0x2a, 0x00, 0x20];
        expect.extend([0x11; 32]);
        expect.extend([0x00, 0x08, 0x00, 0x01, 0x00, 0x01, 0x00, 0x01, 0x00, 0x03]);
        assert_eq!(cfg.encode(), expect);
        assert_eq!(cfg.encode().len(), 45);
        assert_eq!(KeyConfig::decode(&expect).unwrap(), cfg);

        let other = KeyConfig {
            key_id: 1,
            public_key: [0x22; 32],
            aeads: vec![Aead::ChaCha20Poly1305],
        };
        let list = KeyConfig::encode_list(&[cfg.clone(), other.clone()]);
        assert_eq!(&list[..2], &[0x00, 45]);
        assert_eq!(&list[47..49], &[0x00, 41]);
        assert_eq!(list.len(), 2 + 45 + 2 + 41);
        assert_eq!(
            KeyConfig::decode_list(&list).unwrap(),
            vec![cfg.clone(), other.clone()]
        );

        // Unsupported KEM (P-256, 0x0010) in a list is skipped; alone it is an error.
        let mut p256 = vec![9, 0x00, 0x10];
        p256.extend([0x04; 65]);
        p256.extend([0x00, 0x04, 0x00, 0x01, 0x00, 0x01]);
        assert!(matches!(
            KeyConfig::decode(&p256),
            Err(SealError::UnsupportedKeyConfig(_))
        ));
        let mut mixed = (p256.len() as u16).to_be_bytes().to_vec();
        mixed.extend(&p256);
        mixed.extend(KeyConfig::encode_list(std::slice::from_ref(&other)));
        assert_eq!(KeyConfig::decode_list(&mixed).unwrap(), vec![other.clone()]);

        // Unknown pairs are skipped; AES-256-GCM and HKDF-SHA384 here.
        let mut odd = vec![5, 0x00, 0x20];
        odd.extend([0x33; 32]);
        odd.extend([0x00, 0x0c, 0x00, 0x01, 0x00, 0x02, 0x00, 0x02, 0x00, 0x01]);
        odd.extend([0x00, 0x01, 0x00, 0x03]);
        assert_eq!(
            KeyConfig::decode(&odd).unwrap().aeads,
            vec![Aead::ChaCha20Poly1305]
        );

        // Framing errors.
        for bad in [
            &expect[..expect.len() - 1],
            &expect[..3],
            &[0x2a][..],
            &[&expect[..], &[0]].concat()[..],
        ] {
            assert!(
                matches!(
                    KeyConfig::decode(bad),
                    Err(SealError::MalformedKeyConfig(_))
                ),
                "{bad:?}"
            );
        }
        let mut zero_algs = expect[..35].to_vec();
        zero_algs.extend([0, 0]);
        assert!(matches!(
            KeyConfig::decode(&zero_algs),
            Err(SealError::MalformedKeyConfig(_))
        ));
        assert!(matches!(
            KeyConfig::decode_list(&list[..list.len() - 1]),
            Err(SealError::MalformedKeyConfig(_))
        ));
        assert!(matches!(
            KeyConfig::decode_list(&[0]),
            Err(SealError::MalformedKeyConfig(_))
        ));
        assert_eq!(KeyConfig::decode_list(&[]).unwrap(), vec![]);
    }

    #[test]
    fn server_key_round_trips_and_debug_redacts() {
        let k = ServerKey::generate(3);
        let k2 = ServerKey::from_secret_bytes(3, &k.secret_bytes());
        assert_eq!(k.public_key(), k2.public_key());
        let dbg = format!("{k:?}");
        assert!(!dbg.contains(&hex::encode(*k.secret_bytes())));
        assert!(dbg.contains("redacted"));
        let cfg = k.config();
        assert_eq!(cfg.key_id, 3);
        assert_eq!(cfg.aeads, Aead::ALL.to_vec());
    }

    #[test]
    fn response_material_serde_and_debug() {
        let (h, body, ck) = seal_request(&key().config(), Aead::Aes128Gcm, b"q").unwrap();
        let (_, m) = open_request(&key(), &h, &body).unwrap();
        let dbg = format!("{m:?} {ck:?}");
        assert!(!dbg.contains(&hex::encode(&m.secret)));
        assert!(dbg.contains("redacted"));
        let bytes = crate::cbor::to_vec(&m);
        let back: ResponseKeyMaterial = crate::cbor::from_slice(&bytes).unwrap();
        assert_eq!(back, m);
        let ck_bytes = crate::cbor::to_vec(&ck);
        assert_eq!(ck_bytes, bytes, "client key serializes like the material");
        let ck2: ClientResponseKey = crate::cbor::from_slice(&ck_bytes).unwrap();
        let resp = seal_response(&back, b"ok").unwrap();
        assert_eq!(open_response(&ck2, &resp).unwrap(), b"ok");
        // Material with a secret of the wrong length is refused.
        let mut short = m.clone();
        short.secret.pop();
        assert!(matches!(
            ResponseSealer::new(&short).map(|_| ()),
            Err(SealError::Malformed(_))
        ));
    }

    #[test]
    fn replay_guard() {
        let t0 = Instant::now();
        let w = Duration::from_secs(60);
        let mut g = ReplayGuard::new(w, 2);
        assert!(g.is_empty());
        g.check_and_insert(&[1; 32], t0).unwrap();
        assert_eq!(g.check_and_insert(&[1; 32], t0), Err(SealError::Replay));
        assert_eq!(
            g.check_and_insert(&[1; 32], t0 + w - Duration::from_millis(1)),
            Err(SealError::Replay)
        );
        g.check_and_insert(&[2; 32], t0 + Duration::from_secs(1))
            .unwrap();
        // Full of entries inside the window: refuse, forget nothing.
        assert_eq!(
            g.check_and_insert(&[3; 32], t0 + Duration::from_secs(2)),
            Err(SealError::ReplayCacheFull)
        );
        assert_eq!(g.len(), 2);
        // After the window the oldest is evicted and room appears.
        g.check_and_insert(&[3; 32], t0 + w).unwrap();
        assert_eq!(g.len(), 2);
        // [1] left the window: it is accepted again (documented limitation).
        assert_eq!(g.check_and_insert(&[2; 32], t0 + w), Err(SealError::Replay));
        // A sealed request's enc is what the guard sees.
        let (h, _, _) = seal_request(&key().config(), Aead::Aes128Gcm, b"x").unwrap();
        let mut g = ReplayGuard::new(w, 10);
        g.check_and_insert(&h.enc, t0).unwrap();
        assert_eq!(g.check_and_insert(&h.enc, t0), Err(SealError::Replay));
    }

    /// RFC 9180 Appendix A.1.1 (DHKEM(X25519, HKDF-SHA256), HKDF-SHA256,
    /// AES-128-GCM, base mode) and A.2.1 (ChaCha20-Poly1305): the receiver
    /// wiring derives the published keys, opens the published ciphertexts and
    /// reproduces the published exports.
    #[test]
    fn rfc9180_base_mode_vectors() {
        struct Tv {
            aead: Aead,
            ikm_r: &'static str,
            sk_rm: &'static str,
            pk_rm: &'static str,
            ikm_e: &'static str,
            enc: &'static str,
            ct0: &'static str,
            ct1: &'static str,
            export_empty: &'static str,
            export_test_context: &'static str,
        }
        let tvs = [
            Tv {
                aead: Aead::Aes128Gcm,
                ikm_r: "6db9df30aa07dd42ee5e8181afdb977e538f5e1fec8a06223f33f7013e525037",
                sk_rm: "4612c550263fc8ad58375df3f557aac531d26850903e55a9f23f21d8534e8ac8",
                pk_rm: "3948cfe0ad1ddb695d780e59077195da6c56506b027329794ab02bca80815c4d",
                ikm_e: "7268600d403fce431561aef583ee1613527cff655c1343f29812e66706df3234",
                enc: "37fda3567bdbd628e88668c3c8d7e97d1d1253b6d4ea6d44c150f741f1bf4431",
                ct0: "f938558b5d72f1a23810b4be2ab4f84331acc02fc97babc53a52ae8218a355a96d8770ac83d07bea87e13c512a",
                ct1: "af2d7e9ac9ae7e270f46ba1f975be53c09f8d875bdc8535458c2494e8a6eab251c03d0c22a56b8ca42c2063b84",
                export_empty: "3853fe2b4035195a573ffc53856e77058e15d9ea064de3e59f4961d0095250ee",
                export_test_context: "e9e43065102c3836401bed8c3c3c75ae46be1639869391d62c61f1ec7af54931",
            },
            Tv {
                aead: Aead::ChaCha20Poly1305,
                ikm_r: "1ac01f181fdf9f352797655161c58b75c656a6cc2716dcb66372da835542e1df",
                sk_rm: "8057991eef8f1f1af18f4a9491d16a1ce333f695d4db8e38da75975c4478e0fb",
                pk_rm: "4310ee97d88cc1f088a5576c77ab0cf5c3ac797f3d95139c6c84b5429c59662a",
                ikm_e: "909a9b35d3dc4713a5e72a4da274b55d3d3821a37e5d099e74a647db583a904b",
                enc: "1afa08d3dec047a643885163f1180476fa7ddb54c6a8029ea33f95796bf2ac4a",
                ct0: "1c5250d8034ec2b784ba2cfd69dbdb8af406cfe3ff938e131f0def8c8b60b4db21993c62ce81883d2dd1b51a28",
                ct1: "6b53c051e4199c518de79594e1c4ab18b96f081549d45ce015be002090bb119e85285337cc95ba5f59992dc98c",
                export_empty: "4bbd6243b8bb54cec311fac9df81841b6fd61f56538a775e7c80a9f40160606e",
                export_test_context: "5acb09211139c43b3090489a9da433e8a30ee7188ba8b0a9a1ccf0c229283e53",
            },
        ];
        let info = hex::decode("4f6465206f6e2061204772656369616e2055726e").unwrap();
        let pt = b"Beauty is truth, truth beauty";
        for tv in tvs {
            let k = ServerKey::derive(0, &hex::decode(tv.ikm_r).unwrap());
            assert_eq!(hex::encode(*k.secret_bytes()), tv.sk_rm);
            assert_eq!(hex::encode(k.public_key()), tv.pk_rm);
            // The sender's ephemeral key, derived from ikmE, is the enc.
            let e = ServerKey::derive(0, &hex::decode(tv.ikm_e).unwrap());
            assert_eq!(hex::encode(e.public_key()), tv.enc);
            let enc: [u8; 32] = hex::decode(tv.enc).unwrap().try_into().unwrap();
            let mut r = HpkeReceiver::setup(&k, &enc, &info, tv.aead).unwrap();
            assert_eq!(
                r.open(&hex::decode(tv.ct0).unwrap(), b"Count-0").unwrap(),
                pt
            );
            assert_eq!(
                r.open(&hex::decode(tv.ct1).unwrap(), b"Count-1").unwrap(),
                pt
            );
            let mut out = [0u8; 32];
            r.export(b"", &mut out).unwrap();
            assert_eq!(hex::encode(out), tv.export_empty);
            r.export(b"TestContext", &mut out).unwrap();
            assert_eq!(hex::encode(out), tv.export_test_context);
        }
    }
}
