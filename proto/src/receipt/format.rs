//! The payloads: format versions, the opened key, links, sealing and the
//! receipt body, with their CBOR maps.

use super::canonical::{canonical_bytes, decode_canonical, int_map, uint, Fields};
use super::error::ReceiptError;
use super::sign::parse_signed;
use super::{
    ReceiptId, LINK_CONTENT_TYPE, LINK_CONTENT_TYPE_V1, LINK_CONTENT_TYPE_V2, RECEIPT_CONTENT_TYPE,
    RECEIPT_CONTENT_TYPE_V2, RECEIPT_CONTENT_TYPE_V3,
};
use crate::digest::Sha256Digest;
use ciborium::value::Value;
use serde::{Deserialize, Serialize};
use std::fmt;

// Named only in doc links.
#[cfg(doc)]
use super::{link_digest, salted_digest, sign_link, verify_receipt};

/// Receipt format versions this code reads. It writes only
/// [`ReceiptVersion::CURRENT`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReceiptVersion {
    /// Receipt v2 with link v1: links do not say which key the entry stage
    /// opened, so `sealing` is only the host's word.
    V2,
    /// Receipt v3 with link v2: the entry stage's link binds the HPKE key id
    /// and the digest of the encapsulated key it opened ([`OpenedKey`]).
    /// Its digests are plain SHA-256, so whoever holds the receipt can
    /// confirm a guess of a short request or response.
    V3,
    /// Receipt v4 with link v3: the v3 payloads, with every digest of
    /// request, response and activations **salted** with a per-request
    /// secret that only the enclave and the client learn ([`salted_digest`]).
    V4,
}

impl ReceiptVersion {
    /// The version this code produces.
    pub const CURRENT: Self = ReceiptVersion::V4;

    /// Every version this code reads, oldest first.
    pub const ALL: [Self; 3] = [ReceiptVersion::V2, ReceiptVersion::V3, ReceiptVersion::V4];

    /// The COSE content type of a receipt in this version.
    pub fn receipt_content_type(self) -> &'static str {
        match self {
            ReceiptVersion::V2 => RECEIPT_CONTENT_TYPE_V2,
            ReceiptVersion::V3 => RECEIPT_CONTENT_TYPE_V3,
            ReceiptVersion::V4 => RECEIPT_CONTENT_TYPE,
        }
    }

    /// The COSE content type of a signed link in this version.
    pub fn link_content_type(self) -> &'static str {
        match self {
            ReceiptVersion::V2 => LINK_CONTENT_TYPE_V1,
            ReceiptVersion::V3 => LINK_CONTENT_TYPE_V2,
            ReceiptVersion::V4 => LINK_CONTENT_TYPE,
        }
    }

    pub(super) fn from_receipt_content_type(ct: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|v| v.receipt_content_type() == ct)
    }

    /// Number of keys of a link payload in this version.
    pub(super) fn link_keys(self) -> u64 {
        match self {
            ReceiptVersion::V2 => 7,
            ReceiptVersion::V3 | ReceiptVersion::V4 => 8,
        }
    }

    /// Whether the receipt's digests are salted ([`salted_digest`]).
    pub fn salted(self) -> bool {
        self == ReceiptVersion::V4
    }
}

/// Which HPKE key the entry stage opened a request with: the key id and
/// the SHA-256 of the encapsulated key (`enc`) from the request headers.
/// A client that kept its `enc` (the client key file of `gateway seal`)
/// learns from this whether the enclave opened *its* ciphertext or one the
/// host made after opening the request itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenedKey {
    /// The HPKE key id (`hpke-key-id`).
    pub key_id: u8,
    /// SHA-256 of the encapsulated key (`hpke-encapsulated-key`).
    pub enc_digest: Sha256Digest,
}

impl OpenedKey {
    /// The opened key for a request sealed to `key_id` with encapsulated
    /// key `enc`.
    pub fn of(key_id: u8, enc: &[u8]) -> Self {
        Self {
            key_id,
            enc_digest: Sha256Digest::of(enc),
        }
    }

    pub(super) fn to_value(self) -> Value {
        Value::Array(vec![
            uint(self.key_id.into()),
            Value::Bytes(self.enc_digest.0.to_vec()),
        ])
    }

    pub(super) fn from_value(v: Value) -> Result<Option<Self>, String> {
        const WHAT: &str = "key 8: not [uint8, bstr .size 32] or null";
        match v {
            Value::Null => Ok(None),
            Value::Array(a) if a.len() == 2 => {
                let mut it = a.into_iter();
                let key_id = match it.next() {
                    Some(Value::Integer(i)) => u8::try_from(i).map_err(|_| WHAT)?,
                    _ => return Err(WHAT.into()),
                };
                let enc_digest = match it.next() {
                    Some(Value::Bytes(b)) => Sha256Digest(b.try_into().map_err(|_| WHAT)?),
                    _ => return Err(WHAT.into()),
                };
                Ok(Some(Self { key_id, enc_digest }))
            }
            _ => Err(WHAT.into()),
        }
    }
}

impl fmt::Display for OpenedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "key id {} with encapsulated key sha256 {}",
            self.key_id,
            self.enc_digest.hex()
        )
    }
}

/// One stage's statement about one request (signed by that stage).
///
/// ```cddl
/// link = {
///   1 => bstr .size 16,     ; receipt_id
///   2 => uint,              ; stage_index
///   3 => [uint, uint],      ; layers [start, end)
///   4 => bstr .size 32,     ; evidence_digest
///   5 => bstr .size 32,     ; received_digest
///   6 => bstr .size 32,     ; sent_digest
///   7 => bstr .size 32 / null, ; prev_link_digest (null for stage 0)
///   8 => [uint, bstr .size 32] / null, ; opened: key id, sha256(enc)
///                           ;   (stage 0 only; absent in link v1)
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    /// The receipt this link belongs to.
    pub receipt_id: ReceiptId,
    /// The stage's index (0 = entry stage).
    pub stage_index: u32,
    /// The stage's layer range `[start, end)`.
    pub layers: [u32; 2],
    /// Digest of the stage's evidence (as the verifier computes it).
    pub evidence_digest: Sha256Digest,
    /// Digest of what the stage received for this request (stage 0: the
    /// plaintext request bytes).
    pub received_digest: Sha256Digest,
    /// Digest of what the stage sent on (the exit stage: the response bytes).
    pub sent_digest: Sha256Digest,
    /// [`link_digest`] of the previous stage's signed link; `None` for stage 0.
    pub prev_link_digest: Option<Sha256Digest>,
    /// The key the entry stage opened the request with; `None` for every
    /// later stage (and in v1 links, which do not have the field).
    pub opened: Option<OpenedKey>,
}

impl Link {
    pub(super) fn to_value(&self, version: ReceiptVersion) -> Value {
        let mut entries = vec![
            (1, Value::Bytes(self.receipt_id.to_vec())),
            (2, uint(self.stage_index.into())),
            (
                3,
                Value::Array(vec![
                    uint(self.layers[0].into()),
                    uint(self.layers[1].into()),
                ]),
            ),
            (4, Value::Bytes(self.evidence_digest.0.to_vec())),
            (5, Value::Bytes(self.received_digest.0.to_vec())),
            (6, Value::Bytes(self.sent_digest.0.to_vec())),
            (
                7,
                self.prev_link_digest
                    .map_or(Value::Null, |d| Value::Bytes(d.0.to_vec())),
            ),
        ];
        if version != ReceiptVersion::V2 {
            entries.push((8, self.opened.map_or(Value::Null, OpenedKey::to_value)));
        }
        int_map(entries)
    }

    /// Deterministic CBOR of the link payload (current format).
    pub fn to_cbor(&self) -> Vec<u8> {
        self.to_cbor_as(ReceiptVersion::CURRENT)
    }

    /// Deterministic CBOR of the link payload in the link format of
    /// `version` (an older one only to make test vectors).
    pub fn to_cbor_as(&self, version: ReceiptVersion) -> Vec<u8> {
        canonical_bytes(&self.to_value(version)).expect("integer keys are distinct")
    }

    /// Decodes a link payload of the current format (must be deterministic
    /// CBOR).
    pub fn from_cbor(bytes: &[u8]) -> Result<Self, ReceiptError> {
        Self::from_cbor_as(bytes, ReceiptVersion::CURRENT)
    }

    pub(super) fn from_cbor_as(
        bytes: &[u8],
        version: ReceiptVersion,
    ) -> Result<Self, ReceiptError> {
        let value = decode_canonical(bytes)?;
        Self::from_value(value, version).map_err(ReceiptError::Malformed)
    }

    pub(super) fn from_value(value: Value, version: ReceiptVersion) -> Result<Self, String> {
        let mut f = Fields::new(value, version.link_keys())?;
        let layers = match f.take(3) {
            Value::Array(a) if a.len() == 2 => {
                let n = |v: &Value| match v {
                    Value::Integer(i) => u32::try_from(*i).ok(),
                    _ => None,
                };
                match (n(&a[0]), n(&a[1])) {
                    (Some(s), Some(e)) => [s, e],
                    _ => return Err("key 3: not [uint, uint]".into()),
                }
            }
            _ => return Err("key 3: not [uint, uint]".into()),
        };
        let opened = match version {
            ReceiptVersion::V2 => None,
            ReceiptVersion::V3 | ReceiptVersion::V4 => OpenedKey::from_value(f.take(8))?,
        };
        Ok(Self {
            receipt_id: f.array(1)?,
            stage_index: f.u32(2)?,
            layers,
            evidence_digest: f.digest(4)?,
            received_digest: f.digest(5)?,
            sent_digest: f.digest(6)?,
            prev_link_digest: f.opt_digest(7)?,
            opened,
        })
    }
}

/// Which key the client sealed its request to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Sealing {
    /// To the entry stage's enclave-held HPKE key: the host saw ciphertext.
    Enclave,
    /// To the gateway's own key: the gateway opened and re-sealed it.
    Gateway,
    /// Not sealed by the client (plain OpenAI request; the gateway sealed it).
    Plain,
}

impl Sealing {
    /// The wire form (`"enclave"`, `"gateway"`, `"plain"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Sealing::Enclave => "enclave",
            Sealing::Gateway => "gateway",
            Sealing::Plain => "plain",
        }
    }

    pub(super) fn parse(s: &str) -> Option<Self> {
        match s {
            "enclave" => Some(Sealing::Enclave),
            "gateway" => Some(Sealing::Gateway),
            "plain" => Some(Sealing::Plain),
            _ => None,
        }
    }
}

/// The receipt payload (signed by the exit stage).
///
/// ```cddl
/// receipt = {
///   1 => bstr .size 16,        ; receipt_id
///   2 => uint,                 ; issued_at, Unix milliseconds
///   3 => tstr,                 ; endpoint, e.g. "/v1/embeddings"
///   4 => tstr,                 ; model_id
///   5 => bstr .size 32,        ; manifest_digest
///   6 => bstr .size 32,        ; request_digest
///   7 => bstr .size 32,        ; response_digest
///   8 => bstr / null,          ; client_nonce
///   9 => uint,                 ; sequence (per signing key)
///   10 => bool,                ; mock
///   11 => "enclave" / "gateway" / "plain", ; sealing
///   12 => [* bstr],            ; chain: signed links (COSE_Sign1 bytes) of the
///                              ;   stages before the exit stage, stage order
///   13 => link,                ; the exit stage's link (signed by this receipt)
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceiptBody {
    /// The format version (from the COSE content type; not in the payload).
    pub version: ReceiptVersion,
    /// Random id (also the `receipt` response header and the lookup key).
    pub receipt_id: ReceiptId,
    /// Issue time, Unix milliseconds.
    pub issued_at_ms: u64,
    /// The API endpoint, e.g. `/v1/embeddings`.
    pub endpoint: String,
    /// Model id from the manifest.
    pub model_id: String,
    /// Digest of the model manifest.
    pub manifest_digest: Sha256Digest,
    /// SHA-256 of the exact plaintext request bytes the client sent.
    pub request_digest: Sha256Digest,
    /// SHA-256 of the exact response bytes (for SSE the whole event stream).
    pub response_digest: Sha256Digest,
    /// The client's nonce, if it sent one.
    pub client_nonce: Option<Vec<u8>>,
    /// Monotonic sequence number of the signing key.
    pub sequence: u64,
    /// Whether the evidence is mock.
    pub mock: bool,
    /// Which key the client sealed to, as the gateway reported it to the
    /// entry stage: the host's word. What the entry stage itself opened is
    /// in the entry link's [`Link::opened`] (v3).
    pub sealing: Sealing,
    /// The signed links ([`sign_link`] output) of the stages before the
    /// exit stage, in stage order (empty for a one-stage pipeline).
    pub chain: Vec<Vec<u8>>,
    /// The exit stage's link, covered by the receipt's signature.
    pub exit_link: Link,
}

impl ReceiptBody {
    /// Number of links (one per stage): the signed ones and the exit link.
    pub fn links(&self) -> usize {
        self.chain.len() + 1
    }

    pub(super) fn to_value(&self) -> Value {
        int_map(vec![
            (1, Value::Bytes(self.receipt_id.to_vec())),
            (2, uint(self.issued_at_ms)),
            (3, Value::Text(self.endpoint.clone())),
            (4, Value::Text(self.model_id.clone())),
            (5, Value::Bytes(self.manifest_digest.0.to_vec())),
            (6, Value::Bytes(self.request_digest.0.to_vec())),
            (7, Value::Bytes(self.response_digest.0.to_vec())),
            (
                8,
                self.client_nonce
                    .as_ref()
                    .map_or(Value::Null, |n| Value::Bytes(n.clone())),
            ),
            (9, uint(self.sequence)),
            (10, Value::Bool(self.mock)),
            (11, Value::Text(self.sealing.as_str().into())),
            (
                12,
                Value::Array(self.chain.iter().cloned().map(Value::Bytes).collect()),
            ),
            (13, self.exit_link.to_value(self.version)),
        ])
    }

    /// Deterministic CBOR of the receipt payload (in its `version`).
    pub fn to_cbor(&self) -> Vec<u8> {
        canonical_bytes(&self.to_value()).expect("integer keys are distinct")
    }

    /// Decodes a receipt payload of the given version (must be
    /// deterministic CBOR).
    pub fn from_cbor(bytes: &[u8], version: ReceiptVersion) -> Result<Self, ReceiptError> {
        let value = decode_canonical(bytes)?;
        Self::from_value(value, version).map_err(ReceiptError::Malformed)
    }

    /// The entry stage's link, parsed **without verifying** its signature
    /// (the first signed link, or the exit link of a one-stage pipeline):
    /// for a client tool that checks [`Link::opened`] before it has the
    /// evidence. [`verify_receipt`] is what proves it.
    pub fn entry_link_unverified(&self) -> Result<Link, ReceiptError> {
        match self.chain.first() {
            None => Ok(self.exit_link.clone()),
            Some(bytes) => {
                let signed = parse_signed(bytes, self.version.link_content_type())?;
                Link::from_cbor_as(&signed.payload, self.version)
            }
        }
    }

    pub(super) fn from_value(value: Value, version: ReceiptVersion) -> Result<Self, String> {
        let mut f = Fields::new(value, 13)?;
        let client_nonce = match f.take(8) {
            Value::Null => None,
            Value::Bytes(b) => Some(b),
            _ => return Err("key 8: not a byte string or null".into()),
        };
        let sealing = f.text(11)?;
        let chain = match f.take(12) {
            Value::Array(a) => a
                .into_iter()
                .map(|v| match v {
                    Value::Bytes(b) => Ok(b),
                    _ => Err("key 12: not an array of byte strings".to_string()),
                })
                .collect::<Result<Vec<_>, _>>()?,
            _ => return Err("key 12: not an array".into()),
        };
        Ok(Self {
            version,
            receipt_id: f.array(1)?,
            issued_at_ms: f.uint(2)?,
            endpoint: f.text(3)?,
            model_id: f.text(4)?,
            manifest_digest: f.digest(5)?,
            request_digest: f.digest(6)?,
            response_digest: f.digest(7)?,
            client_nonce,
            sequence: f.uint(9)?,
            mock: f.boolean(10)?,
            sealing: Sealing::parse(&sealing).ok_or("key 11: unknown sealing")?,
            chain,
            exit_link: Link::from_value(f.take(13), version).map_err(|e| format!("key 13: {e}"))?,
        })
    }
}
