//! The suite's AEADs, published key configurations (`application/ohttp-keys`)
//! and the server's HPKE keys.

use super::error::SealError;
// Via the parent's re-export, not `headers`: `headers` uses this module (no
// module circle, scripts/module_cycles.py).
use super::SealedHeaders;
use super::{HpkeKem, AEAD_NONCE_LEN, KDF_ID, KEM_ID, KEY_LEN, REQUEST_INFO_LABEL};
use hpke::rand_core::{CryptoRng, RngCore};
use hpke::{Deserializable, Kem as _, Serializable};
use serde::{Deserialize, Serialize};
use std::fmt;
use zeroize::Zeroizing;

// Named only in doc links.
#[cfg(doc)]
use super::cipher::HpkeReceiver;

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
/// accepts every AEAD in [`Aead::ALL`]. The private scalar is held once,
/// in a type that wipes it on drop (`x25519_dalek::StaticSecret`), and
/// every copy made on the way in or out is wiped too.
#[derive(Clone)]
pub struct ServerKey {
    pub(super) key_id: u8,
    /// The private scalar, for decapsulation ([`HpkeReceiver`]).
    pub(super) dh: x25519_dalek::StaticSecret,
    pub(super) public: [u8; KEY_LEN],
}

/// Its one secret field wipes itself when dropped.
impl zeroize::ZeroizeOnDrop for ServerKey {}

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

    pub(super) fn from_pair(
        key_id: u8,
        secret: <HpkeKem as hpke::Kem>::PrivateKey,
        public: <HpkeKem as hpke::Kem>::PublicKey,
    ) -> Self {
        let mut pk = [0u8; KEY_LEN];
        pk.copy_from_slice(&public.to_bytes());
        // `to_bytes` returns the scalar by value: copy it into a buffer
        // that is wiped on drop and wipe the library's copy (`secret`
        // itself wipes its own on drop).
        let mut bytes = secret.to_bytes();
        let mut sk = Zeroizing::new([0u8; KEY_LEN]);
        sk.copy_from_slice(&bytes);
        crate::wipe::wipe(&mut bytes);
        Self {
            key_id,
            dh: x25519_dalek::StaticSecret::from(*sk),
            public: pk,
        }
    }

    /// The private scalar, for persisting a key outside an enclave.
    pub fn secret_bytes(&self) -> Zeroizing<[u8; KEY_LEN]> {
        let mut out = Zeroizing::new([0u8; KEY_LEN]);
        out.copy_from_slice(self.dh.as_bytes());
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

/// Who sealed a request, bound in its HPKE `info`: a client (to the entry
/// stage's key or the gateway's) or the host (the gateway sealing a plain
/// client's request, or re-sealing one it opened with its own key). The
/// stage opens a request with the sealer its host label implies, so a host
/// that labels a client's request as its own (to read its metadata, or to
/// pick the replay guard's partition) gets a body that does not open.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sealer {
    /// A client.
    #[default]
    Client,
    /// The host's gateway.
    Host,
}

impl Sealer {
    fn byte(self) -> u8 {
        match self {
            Sealer::Client => 0x01,
            Sealer::Host => 0x02,
        }
    }
}

/// The HPKE `info` of a request:
/// `"confidential-inference request v3" ‖ 0x00 ‖ key_id ‖ u16be(kem_id) ‖
/// u16be(kdf_id) ‖ u16be(aead_id) ‖ u64be(sealed_at) ‖ sealer` (the OHTTP
/// header, RFC 9458 §4.3, the sealing time, and who sealed it: `0x01` a
/// client, `0x02` the host).
pub fn request_info(key_id: u8, aead: Aead, sealed_at: u64, sealer: Sealer) -> Vec<u8> {
    let mut info = Vec::with_capacity(REQUEST_INFO_LABEL.len() + 17);
    info.extend_from_slice(REQUEST_INFO_LABEL);
    info.push(0);
    info.push(key_id);
    info.extend_from_slice(&KEM_ID.to_be_bytes());
    info.extend_from_slice(&KDF_ID.to_be_bytes());
    info.extend_from_slice(&aead.id().to_be_bytes());
    info.extend_from_slice(&sealed_at.to_be_bytes());
    info.push(sealer.byte());
    info
}
