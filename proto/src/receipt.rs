//! Signed receipts: COSE_Sign1 (EdDSA / Ed25519) over deterministic CBOR.
//!
//! A receipt says which request went through which attested stages and what
//! came out. Every stage makes one **link** ([`Link`]): the receipt id, the
//! stage index and layer range, the digest of the stage's evidence, the
//! digests of what the stage received and what it sent, and the digest of the
//! previous stage's signed link (a hash chain).
//!
//! - Each stage before the exit stage signs its link with its receipt key as
//!   its own COSE_Sign1 ([`sign_link`]) and passes it on.
//! - The exit stage puts its own link, unsigned on its own, into the
//!   **receipt** ([`ReceiptBody`], [`sign_receipt`]), which it signs with the
//!   same key: id, time, endpoint, model, the digests of the exact request and
//!   response bytes, the client's nonce, a per-key sequence number, the mock
//!   flag, how the request was sealed, the signed links of the stages before
//!   it in stage order, and its link. One signature covers both statements
//!   (one Ed25519 signature fewer per request than a separately signed exit
//!   link; the per-request crypto budget in `benchmark_results/crypto.md`).
//!
//! Payloads are maps with small unsigned integer keys in **deterministic
//! CBOR** (RFC 8949 §4.2.1: keys sorted by their encoded bytes, definite
//! lengths, smallest integer encodings, no duplicate keys). A verifier
//! re-encodes every payload and rejects it unless the bytes are identical
//! ([`ReceiptError::NotCanonical`]). COSE objects are untagged; the protected
//! header holds exactly `alg` (EdDSA, -8), `content type` (3,
//! [`RECEIPT_CONTENT_TYPE`] or [`LINK_CONTENT_TYPE`]) and `kid` (4, the
//! signer's 32-byte Ed25519 public key); the unprotected header is empty;
//! the external AAD is empty.
//!
//! [`verify_receipt`] checks a receipt against the stage keys taken from
//! verified evidence ([`StageKeys`]) and optionally the request bytes, the
//! response bytes and the expected nonce, and returns a [`VerifyReport`] with
//! one line per check. The checks and their order are in `docs/receipts.md`.

use crate::digest::Sha256Digest;
use ciborium::value::{Integer, Value};
use coset::{iana, CborSerializable, CoseSign1, CoseSign1Builder, HeaderBuilder};
use ed25519_dalek::{Signer, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use std::fmt;

/// COSE content type of a receipt (the current format, v3).
pub const RECEIPT_CONTENT_TYPE: &str = "application/vnd.ci.receipt.v3+cbor";
/// COSE content type of a stage link (the current format, link v2).
pub const LINK_CONTENT_TYPE: &str = "application/vnd.ci.receipt-link.v2+cbor";
/// COSE content type of a v2 receipt (before links said which key the entry
/// stage opened); still verified, as what it is.
pub const RECEIPT_CONTENT_TYPE_V2: &str = "application/vnd.ci.receipt.v2+cbor";
/// COSE content type of the links inside a v2 receipt.
pub const LINK_CONTENT_TYPE_V1: &str = "application/vnd.ci.receipt-link.v1+cbor";
/// Length of a receipt id.
pub const RECEIPT_ID_LEN: usize = 16;

/// A receipt id (16 random bytes).
pub type ReceiptId = [u8; RECEIPT_ID_LEN];

/// Why a receipt (or one of its checks) failed. [`ReceiptError::code`] is
/// the stable machine-readable name used in reports and test vectors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReceiptError {
    /// The stage keys given to the verifier are inconsistent.
    #[error("stage keys from the evidence are inconsistent: {0}")]
    BadStageKeys(String),
    /// The receipt is not a well-formed COSE_Sign1 or its payload does not
    /// decode as a receipt.
    #[error("malformed receipt: {0}")]
    Malformed(String),
    /// The receipt's COSE headers are not the expected ones.
    #[error("unexpected receipt header: {0}")]
    BadHeader(String),
    /// A payload is not in deterministic CBOR.
    #[error("payload is not deterministic CBOR")]
    NotCanonical,
    /// The receipt's signature does not verify under its `kid`.
    #[error("receipt signature does not verify")]
    BadSignature,
    /// The receipt is validly signed by a key that is in no stage's evidence.
    #[error("receipt signed by a key that is not in the evidence")]
    UnknownSigner,
    /// The receipt is validly signed by a stage that is not the exit stage.
    #[error("receipt signed by stage {stage}, not by the exit stage")]
    SignerNotExitStage {
        /// Index of the stage whose key signed.
        stage: u32,
    },
    /// A mock receipt, and the caller's policy forbids mock evidence.
    #[error("mock receipt, and the policy does not allow mock evidence")]
    MockNotAllowed,
    /// The receipt names another model manifest than expected.
    #[error("manifest digest differs from the evidence")]
    ManifestMismatch,
    /// The chain has another number of links (signed links plus the exit
    /// stage's) than there are stages (a stage dropped or duplicated).
    #[error("chain has {got} links, the evidence has {expected} stages")]
    ChainLength {
        /// Number of stages in the evidence.
        expected: usize,
        /// Number of links in the receipt.
        got: usize,
    },
    /// A link does not parse.
    #[error("link {position} is malformed: {detail}")]
    LinkMalformed {
        /// Position in the chain.
        position: usize,
        /// What is wrong.
        detail: String,
    },
    /// A signed link's signature does not verify under its `kid`.
    #[error("link {position}: signature does not verify")]
    LinkBadSignature {
        /// Position in the chain.
        position: usize,
    },
    /// A link is validly signed by a key in no stage's evidence (a stage
    /// swapped for an unattested one).
    #[error("link {position}: signed by a key that is not in the evidence")]
    LinkUnknownSigner {
        /// Position in the chain.
        position: usize,
    },
    /// A link is signed by another stage than the one at its position (links
    /// reordered, or one stage's link duplicated in place of another's).
    #[error("link {position}: signed by stage {signer_stage}")]
    LinkWrongStage {
        /// Position in the chain.
        position: usize,
        /// Index of the stage whose key signed.
        signer_stage: u32,
    },
    /// A link's stage index is not its position.
    #[error("link {position}: claims stage index {got}")]
    LinkStageIndex {
        /// Position in the chain.
        position: usize,
        /// The index it claims.
        got: u32,
    },
    /// A link names another receipt id than the receipt.
    #[error("link {position}: receipt id differs from the receipt's")]
    LinkReceiptId {
        /// Position in the chain.
        position: usize,
    },
    /// A link's layer range differs from the stage's evidence.
    #[error("link {position}: layer range differs from the evidence")]
    LinkLayers {
        /// Position in the chain.
        position: usize,
    },
    /// A link's evidence digest differs from the stage's evidence.
    #[error("link {position}: evidence digest differs from the evidence")]
    LinkEvidence {
        /// Position in the chain.
        position: usize,
    },
    /// A link's previous-link digest is not the digest of the link before it
    /// (or is not null for stage 0).
    #[error("link {position}: previous-link digest does not match")]
    LinkPrevDigest {
        /// Position in the chain.
        position: usize,
    },
    /// What a stage received is not what the previous stage sent.
    #[error("link {position}: received digest differs from the previous stage's sent digest")]
    LinkDataFlow {
        /// Position in the chain.
        position: usize,
    },
    /// The first stage did not receive the request the receipt names.
    #[error("first link's received digest differs from the request digest")]
    ChainRequestDigest,
    /// The last stage did not send the response the receipt names.
    #[error("last link's sent digest differs from the response digest")]
    ChainResponseDigest,
    /// The request bytes given do not match the receipt.
    #[error("request bytes do not match the receipt's request digest")]
    RequestMismatch,
    /// The response bytes given do not match the receipt.
    #[error("response bytes do not match the receipt's response digest")]
    ResponseMismatch,
    /// A nonce was expected and the receipt carries none.
    #[error("receipt carries no client nonce, one was expected")]
    NonceMissing,
    /// The receipt carries another nonce than expected.
    #[error("client nonce differs from the expected one")]
    NonceMismatch,
    /// The entry stage's link does not say which key it opened, or a later
    /// stage's link claims to have opened one (v3 receipts).
    #[error("link {position}: the opened-key field is missing or misplaced")]
    LinkOpened {
        /// Position in the chain.
        position: usize,
    },
    /// What the entry stage opened contradicts the receipt's `sealing`: it
    /// opened another encapsulated key than the client's, yet the receipt
    /// says `enclave` (the host opened the request and re-sealed it), or it
    /// opened the client's own while the receipt says otherwise.
    #[error("sealing: {0}")]
    SealingMismatch(String),
}

impl ReceiptError {
    /// Stable machine-readable reason name.
    pub fn code(&self) -> &'static str {
        use ReceiptError::*;
        match self {
            BadStageKeys(_) => "bad_stage_keys",
            Malformed(_) => "malformed",
            BadHeader(_) => "bad_header",
            NotCanonical => "not_canonical",
            BadSignature => "bad_signature",
            UnknownSigner => "unknown_signer",
            SignerNotExitStage { .. } => "signer_not_exit_stage",
            MockNotAllowed => "mock_not_allowed",
            ManifestMismatch => "manifest_mismatch",
            ChainLength { .. } => "chain_length",
            LinkMalformed { .. } => "link_malformed",
            LinkBadSignature { .. } => "link_bad_signature",
            LinkUnknownSigner { .. } => "link_unknown_signer",
            LinkWrongStage { .. } => "link_wrong_stage",
            LinkStageIndex { .. } => "link_stage_index",
            LinkReceiptId { .. } => "link_receipt_id",
            LinkLayers { .. } => "link_layers",
            LinkEvidence { .. } => "link_evidence",
            LinkPrevDigest { .. } => "link_prev_digest",
            LinkDataFlow { .. } => "link_data_flow",
            ChainRequestDigest => "chain_request_digest",
            ChainResponseDigest => "chain_response_digest",
            RequestMismatch => "request_mismatch",
            ResponseMismatch => "response_mismatch",
            NonceMissing => "nonce_missing",
            NonceMismatch => "nonce_mismatch",
            LinkOpened { .. } => "link_opened",
            SealingMismatch(_) => "sealing_mismatch",
        }
    }
}

// ---------------------------------------------------------------------------
// Deterministic CBOR.

fn encode(value: &Value) -> Vec<u8> {
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

fn uint(n: u64) -> Value {
    Value::Integer(Integer::from(n))
}

fn int_map(entries: Vec<(u64, Value)>) -> Value {
    Value::Map(entries.into_iter().map(|(k, v)| (uint(k), v)).collect())
}

/// Reads an integer-keyed map with exactly the keys `1..=n`.
struct Fields(Vec<Option<Value>>);

impl Fields {
    fn new(value: Value, n: u64) -> Result<Self, String> {
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

    fn take(&mut self, k: u64) -> Value {
        self.0[k as usize - 1].take().expect("checked in new")
    }

    fn uint(&mut self, k: u64) -> Result<u64, String> {
        match self.take(k) {
            Value::Integer(i) => u64::try_from(i).map_err(|_| format!("key {k}: not a uint")),
            _ => Err(format!("key {k}: not a uint")),
        }
    }

    fn u32(&mut self, k: u64) -> Result<u32, String> {
        u32::try_from(self.uint(k)?).map_err(|_| format!("key {k}: out of range"))
    }

    fn bytes(&mut self, k: u64) -> Result<Vec<u8>, String> {
        match self.take(k) {
            Value::Bytes(b) => Ok(b),
            _ => Err(format!("key {k}: not a byte string")),
        }
    }

    fn array<const N: usize>(&mut self, k: u64) -> Result<[u8; N], String> {
        self.bytes(k)?
            .try_into()
            .map_err(|_| format!("key {k}: not {N} bytes"))
    }

    fn digest(&mut self, k: u64) -> Result<Sha256Digest, String> {
        Ok(Sha256Digest(self.array::<32>(k)?))
    }

    fn opt_digest(&mut self, k: u64) -> Result<Option<Sha256Digest>, String> {
        match self.take(k) {
            Value::Null => Ok(None),
            Value::Bytes(b) => Ok(Some(Sha256Digest(
                b.try_into().map_err(|_| format!("key {k}: not 32 bytes"))?,
            ))),
            _ => Err(format!("key {k}: not a byte string or null")),
        }
    }

    fn text(&mut self, k: u64) -> Result<String, String> {
        match self.take(k) {
            Value::Text(t) => Ok(t),
            _ => Err(format!("key {k}: not a text string")),
        }
    }

    fn boolean(&mut self, k: u64) -> Result<bool, String> {
        match self.take(k) {
            Value::Bool(b) => Ok(b),
            _ => Err(format!("key {k}: not a bool")),
        }
    }
}

// ---------------------------------------------------------------------------
// Payloads.

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
    V3,
}

impl ReceiptVersion {
    /// The version this code produces.
    pub const CURRENT: Self = ReceiptVersion::V3;

    /// The COSE content type of a receipt in this version.
    pub fn receipt_content_type(self) -> &'static str {
        match self {
            ReceiptVersion::V2 => RECEIPT_CONTENT_TYPE_V2,
            ReceiptVersion::V3 => RECEIPT_CONTENT_TYPE,
        }
    }

    /// The COSE content type of a signed link in this version.
    pub fn link_content_type(self) -> &'static str {
        match self {
            ReceiptVersion::V2 => LINK_CONTENT_TYPE_V1,
            ReceiptVersion::V3 => LINK_CONTENT_TYPE,
        }
    }

    fn from_receipt_content_type(ct: &str) -> Option<Self> {
        [ReceiptVersion::V2, ReceiptVersion::V3]
            .into_iter()
            .find(|v| v.receipt_content_type() == ct)
    }

    /// Number of keys of a link payload in this version.
    fn link_keys(self) -> u64 {
        match self {
            ReceiptVersion::V2 => 7,
            ReceiptVersion::V3 => 8,
        }
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

    fn to_value(self) -> Value {
        Value::Array(vec![
            uint(self.key_id.into()),
            Value::Bytes(self.enc_digest.0.to_vec()),
        ])
    }

    fn from_value(v: Value) -> Result<Option<Self>, String> {
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
    fn to_value(&self, version: ReceiptVersion) -> Value {
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

    fn from_cbor_as(bytes: &[u8], version: ReceiptVersion) -> Result<Self, ReceiptError> {
        let value = decode_canonical(bytes)?;
        Self::from_value(value, version).map_err(ReceiptError::Malformed)
    }

    fn from_value(value: Value, version: ReceiptVersion) -> Result<Self, String> {
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
            ReceiptVersion::V3 => OpenedKey::from_value(f.take(8))?,
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

    fn parse(s: &str) -> Option<Self> {
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

    fn to_value(&self) -> Value {
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

    fn from_value(value: Value, version: ReceiptVersion) -> Result<Self, String> {
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

// ---------------------------------------------------------------------------
// COSE_Sign1.

fn sign(key: &SigningKey, content_type: &str, payload: Vec<u8>) -> Vec<u8> {
    CoseSign1Builder::new()
        .protected(
            HeaderBuilder::new()
                .algorithm(iana::Algorithm::EdDSA)
                .content_type(content_type.to_string())
                .key_id(key.verifying_key().to_bytes().to_vec())
                .build(),
        )
        .payload(payload)
        .create_signature(b"", |tbs| key.sign(tbs).to_bytes().to_vec())
        .build()
        .to_vec()
        .expect("COSE_Sign1 encoding cannot fail")
}

/// Signs a link with the stage's receipt key; returns the COSE_Sign1 bytes
/// that go into [`ReceiptBody::chain`].
pub fn sign_link(key: &SigningKey, link: &Link) -> Vec<u8> {
    sign_link_as(key, link, ReceiptVersion::CURRENT)
}

/// [`sign_link`] in the link format of `version` (an older one only to make
/// test vectors).
pub fn sign_link_as(key: &SigningKey, link: &Link, version: ReceiptVersion) -> Vec<u8> {
    sign(key, version.link_content_type(), link.to_cbor_as(version))
}

/// Signs a receipt (and with it the exit stage's link) with the exit
/// stage's receipt key, in the body's `version`; returns the COSE_Sign1
/// bytes (the receipt).
pub fn sign_receipt(key: &SigningKey, body: &ReceiptBody) -> Vec<u8> {
    sign(key, body.version.receipt_content_type(), body.to_cbor())
}

/// Digest of a signed link, as the next link's `prev_link_digest`.
pub fn link_digest(signed_link: &[u8]) -> Sha256Digest {
    Sha256Digest::of(signed_link)
}

/// A parsed, not yet verified COSE_Sign1 of ours.
struct Signed {
    sign1: CoseSign1,
    kid: [u8; 32],
    payload: Vec<u8>,
}

/// Parses a COSE_Sign1 and checks its headers: malformed structure →
/// `Err(Malformed)`, unexpected headers → `Err(BadHeader)`.
fn parse_signed(bytes: &[u8], content_type: &str) -> Result<Signed, ReceiptError> {
    parse_signed_any(bytes, &[content_type]).map(|(s, _)| s)
}

/// [`parse_signed`] accepting any of `content_types`; also returns which.
fn parse_signed_any<'c>(
    bytes: &[u8],
    content_types: &[&'c str],
) -> Result<(Signed, &'c str), ReceiptError> {
    let sign1 = CoseSign1::from_slice(bytes).map_err(|e| ReceiptError::Malformed(e.to_string()))?;
    if sign1.clone().to_vec().ok().as_deref() != Some(bytes) {
        return Err(ReceiptError::Malformed(
            "COSE_Sign1 is not in its canonical encoding".into(),
        ));
    }
    let h = &sign1.protected.header;
    if h.alg
        != Some(coset::RegisteredLabelWithPrivate::Assigned(
            iana::Algorithm::EdDSA,
        ))
    {
        return Err(ReceiptError::BadHeader("algorithm is not EdDSA".into()));
    }
    let content_type = content_types
        .iter()
        .find(|ct| h.content_type == Some(coset::RegisteredLabel::Text(ct.to_string())))
        .copied()
        .ok_or_else(|| {
            ReceiptError::BadHeader(format!(
                "content type is not {}",
                content_types.join(" or ")
            ))
        })?;
    let kid: [u8; 32] = h
        .key_id
        .clone()
        .try_into()
        .map_err(|_| ReceiptError::BadHeader("kid is not a 32-byte Ed25519 key".into()))?;
    if !h.crit.is_empty()
        || !h.iv.is_empty()
        || !h.partial_iv.is_empty()
        || !h.counter_signatures.is_empty()
        || !h.rest.is_empty()
    {
        return Err(ReceiptError::BadHeader(
            "unexpected protected header parameters".into(),
        ));
    }
    if !sign1.unprotected.is_empty() {
        return Err(ReceiptError::BadHeader(
            "unprotected header is not empty".into(),
        ));
    }
    let payload = sign1
        .payload
        .clone()
        .ok_or_else(|| ReceiptError::Malformed("detached payload".into()))?;
    Ok((
        Signed {
            sign1,
            kid,
            payload,
        },
        content_type,
    ))
}

/// Parses a receipt's COSE_Sign1 in any format version this code reads.
fn parse_receipt(bytes: &[u8]) -> Result<(Signed, ReceiptVersion), ReceiptError> {
    let (signed, ct) = parse_signed_any(bytes, &[RECEIPT_CONTENT_TYPE, RECEIPT_CONTENT_TYPE_V2])?;
    let version =
        ReceiptVersion::from_receipt_content_type(ct).expect("one of the listed content types");
    Ok((signed, version))
}

/// Whether `signed` verifies under `key` (strict Ed25519).
fn verifies(signed: &Signed, key: &[u8; 32]) -> bool {
    let Ok(vk) = VerifyingKey::from_bytes(key) else {
        return false;
    };
    signed
        .sign1
        .verify_signature(b"", |sig, tbs| {
            let sig = ed25519_dalek::Signature::from_slice(sig).map_err(|_| ())?;
            vk.verify_strict(tbs, &sig).map_err(|_| ())
        })
        .is_ok()
}

/// Decodes a receipt **without verifying anything** (e.g. to read its id
/// for storage). Returns the body and the signer's key (`kid`).
pub fn parse_unverified(receipt: &[u8]) -> Result<(ReceiptBody, [u8; 32]), ReceiptError> {
    let (signed, version) = parse_receipt(receipt)?;
    Ok((
        ReceiptBody::from_cbor(&signed.payload, version)?,
        signed.kid,
    ))
}

// ---------------------------------------------------------------------------
// Verification.

mod hex_or_bytes {
    //! `[u8; 32]` as lower-case hex in human-readable formats (JSON) and as a
    //! byte string otherwise (CBOR).
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_str(&hex::encode(v))
        } else {
            serde_bytes::serialize(v, s)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
        let v: Vec<u8> = if d.is_human_readable() {
            let s = String::deserialize(d)?;
            hex::decode(s.strip_prefix("sha256:").unwrap_or(&s)).map_err(D::Error::custom)?
        } else {
            serde_bytes::deserialize(d)?
        };
        v.try_into()
            .map_err(|_| D::Error::custom("expected 32 bytes"))
    }

    pub mod digest {
        use crate::digest::Sha256Digest;
        use serde::{Deserializer, Serializer};

        pub fn serialize<S: Serializer>(v: &Sha256Digest, s: S) -> Result<S::Ok, S::Error> {
            super::serialize(&v.0, s)
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Sha256Digest, D::Error> {
            super::deserialize(d).map(Sha256Digest)
        }
    }
}

/// What the verifier trusts about one stage, taken from its verified
/// evidence. In JSON the digest and key are hex strings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageKeys {
    /// The stage's index (0 = entry stage).
    pub stage_index: u32,
    /// The stage's layer range `[start, end)` from its claims.
    pub layers: [u32; 2],
    /// Digest of the stage's evidence.
    #[serde(with = "hex_or_bytes::digest")]
    pub evidence_digest: Sha256Digest,
    /// The stage's Ed25519 receipt-signing public key.
    #[serde(with = "hex_or_bytes")]
    pub receipt_key: [u8; 32],
}

/// What to verify a receipt against.
#[derive(Clone, Copy, Debug)]
pub struct VerifyInputs<'a> {
    /// The receipt (COSE_Sign1 bytes).
    pub receipt: &'a [u8],
    /// Every stage's trusted keys, in stage order.
    pub stages: &'a [StageKeys],
    /// The exact request bytes the client sent, if kept.
    pub request: Option<&'a [u8]>,
    /// The exact response bytes the client received, if kept.
    pub response: Option<&'a [u8]>,
    /// The nonce the client sent, if any.
    pub expected_nonce: Option<&'a [u8]>,
    /// The manifest digest the evidence names, if it should be checked.
    pub expected_manifest: Option<Sha256Digest>,
    /// Whether the caller's policy accepts mock evidence.
    pub allow_mock: bool,
    /// The HPKE key the client sealed its request to, if it sealed it and
    /// kept the encapsulated key: checked against what the entry stage says
    /// it opened ([`Link::opened`]).
    pub sealed_to: Option<SealedTo<'a>>,
}

/// The HPKE key a client sealed its request to.
#[derive(Clone, Copy, Debug)]
pub struct SealedTo<'a> {
    /// The key id it sealed to.
    pub key_id: u8,
    /// The encapsulated key it sent (`hpke-encapsulated-key`).
    pub enc: &'a [u8],
}

impl<'a> VerifyInputs<'a> {
    /// Inputs with only the receipt and the stages; everything optional
    /// unset and mock forbidden.
    pub fn new(receipt: &'a [u8], stages: &'a [StageKeys]) -> Self {
        Self {
            receipt,
            stages,
            request: None,
            response: None,
            expected_nonce: None,
            expected_manifest: None,
            allow_mock: false,
            sealed_to: None,
        }
    }
}

/// Outcome of one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckStatus {
    /// The check held.
    Pass,
    /// The check failed.
    Fail,
    /// Not checked (input not given).
    Skipped,
}

/// One line of a verification report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    /// Check name, e.g. `receipt.signature`, `link[1].data_flow`.
    pub name: String,
    /// Outcome.
    pub status: CheckStatus,
    /// Human-readable detail.
    pub detail: String,
    /// The reason, when it failed.
    pub error: Option<ReceiptError>,
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self.status {
            CheckStatus::Pass => "PASS",
            CheckStatus::Fail => "FAIL",
            CheckStatus::Skipped => "SKIP",
        };
        write!(f, "{s} {}: {}", self.name, self.detail)?;
        if let Some(e) = &self.error {
            write!(f, " [{}]", e.code())?;
        }
        Ok(())
    }
}

/// The result of [`verify_receipt`]: every check in order and the verdict
/// (the first failure).
#[derive(Clone, Debug)]
pub struct VerifyReport {
    /// Checks in the order they ran.
    pub checks: Vec<Check>,
    /// The decoded receipt, once its signature and signer verified.
    pub receipt: Option<ReceiptBody>,
    /// Whether the receipt's `sealing` was proven against the client's own
    /// encapsulated key (check `sealing` passed), rather than taken on the
    /// host's word.
    pub sealing_proven: bool,
}

impl VerifyReport {
    /// `Some(sealing)` only when it was proven against the client's key:
    /// `Some(Sealing::Enclave)` means the entry stage opened exactly what the
    /// client sealed, so the host relayed ciphertext only.
    pub fn proven_sealing(&self) -> Option<Sealing> {
        self.receipt
            .as_ref()
            .filter(|_| self.sealing_proven && self.ok())
            .map(|r| r.sealing)
    }

    /// Whether every check passed (skipped ones aside).
    pub fn ok(&self) -> bool {
        self.failure().is_none()
    }

    /// The first failed check's reason.
    pub fn failure(&self) -> Option<&ReceiptError> {
        self.checks.iter().find_map(|c| c.error.as_ref())
    }

    /// `Ok` or the first failure.
    pub fn verdict(&self) -> Result<(), ReceiptError> {
        self.failure().map_or(Ok(()), |e| Err(e.clone()))
    }

    /// Machine-readable form: `{ok, reason, checks: [{name, status, detail,
    /// reason}], receipt: {…} | null}`.
    pub fn to_json(&self) -> serde_json::Value {
        let checks: Vec<_> = self
            .checks
            .iter()
            .map(|c| {
                serde_json::json!({
                    "name": c.name,
                    "status": c.status,
                    "detail": c.detail,
                    "reason": c.error.as_ref().map(|e| e.code()),
                })
            })
            .collect();
        let receipt = self.receipt.as_ref().map(|r| {
            serde_json::json!({
                "receipt_id": hex::encode(r.receipt_id),
                "issued_at_ms": r.issued_at_ms,
                "endpoint": r.endpoint,
                "model_id": r.model_id,
                "manifest_digest": r.manifest_digest.hex(),
                "request_digest": r.request_digest.hex(),
                "response_digest": r.response_digest.hex(),
                "client_nonce": r.client_nonce.as_ref().map(hex::encode),
                "sequence": r.sequence,
                "mock": r.mock,
                "sealing": r.sealing.as_str(),
                "sealing_proven": self.sealing_proven,
                "version": r.version,
                "stages": r.links(),
            })
        });
        serde_json::json!({
            "ok": self.ok(),
            "reason": self.failure().map(|e| e.code()),
            "checks": checks,
            "receipt": receipt,
        })
    }
}

struct Report(Vec<Check>);

impl Report {
    fn pass(&mut self, name: impl Into<String>, detail: impl Into<String>) {
        self.0.push(Check {
            name: name.into(),
            status: CheckStatus::Pass,
            detail: detail.into(),
            error: None,
        });
    }

    fn skip(&mut self, name: impl Into<String>, detail: impl Into<String>) {
        self.0.push(Check {
            name: name.into(),
            status: CheckStatus::Skipped,
            detail: detail.into(),
            error: None,
        });
    }

    fn fail(&mut self, name: impl Into<String>, error: ReceiptError) {
        self.0.push(Check {
            name: name.into(),
            status: CheckStatus::Fail,
            detail: error.to_string(),
            error: Some(error),
        });
    }

    /// Records `result`; returns whether it passed.
    fn check(&mut self, name: impl Into<String>, result: Result<String, ReceiptError>) -> bool {
        match result {
            Ok(detail) => {
                self.pass(name, detail);
                true
            }
            Err(e) => {
                self.fail(name, e);
                false
            }
        }
    }
}

fn check_stage_keys(stages: &[StageKeys]) -> Result<String, ReceiptError> {
    let bad = |m: String| Err(ReceiptError::BadStageKeys(m));
    if stages.is_empty() {
        return bad("no stages".into());
    }
    for (i, s) in stages.iter().enumerate() {
        if s.stage_index as usize != i {
            return bad(format!("entry {i} has stage index {}", s.stage_index));
        }
        if s.layers[0] >= s.layers[1] {
            return bad(format!("stage {i} has an empty layer range"));
        }
        if i > 0 && stages[i - 1].layers[1] != s.layers[0] {
            return bad(format!(
                "stage {i}'s layers do not follow stage {}'s",
                i - 1
            ));
        }
        if stages[..i].iter().any(|p| p.receipt_key == s.receipt_key) {
            return bad(format!(
                "stage {i} shares its receipt key with another stage"
            ));
        }
    }
    Ok(format!(
        "{} stages, layers {}..{}",
        stages.len(),
        stages[0].layers[0],
        stages[stages.len() - 1].layers[1]
    ))
}

fn stage_of(stages: &[StageKeys], key: &[u8; 32]) -> Option<u32> {
    stages
        .iter()
        .find(|s| &s.receipt_key == key)
        .map(|s| s.stage_index)
}

/// Verifies a receipt. Never panics on hostile input; every failure is a
/// failed check with its reason. The verdict is the first failure in this
/// order: stage keys, receipt structure and headers, receipt signature,
/// signer, payload, mock policy, manifest, chain length, each link in order
/// (structure, signature, signer, payload, stage index, receipt id, layers,
/// evidence, previous-link digest, data flow), chain end, request bytes,
/// response bytes, nonce. A failure of the first five stops verification.
pub fn verify_receipt(inputs: &VerifyInputs<'_>) -> VerifyReport {
    let mut r = Report(Vec::new());
    let receipt = verify_into(inputs, &mut r);
    let sealing_proven =
        r.0.iter()
            .any(|c| c.name == "sealing" && c.status == CheckStatus::Pass);
    VerifyReport {
        checks: r.0,
        receipt,
        sealing_proven,
    }
}

fn verify_into(inputs: &VerifyInputs<'_>, r: &mut Report) -> Option<ReceiptBody> {
    let stages = inputs.stages;
    if !r.check("stage_keys", check_stage_keys(stages)) {
        return None;
    }
    let exit = &stages[stages.len() - 1];

    let (signed, version) = match parse_receipt(inputs.receipt) {
        Ok(s) => s,
        Err(e) => {
            r.fail("receipt.structure", e);
            return None;
        }
    };
    r.pass(
        "receipt.structure",
        format!(
            "COSE_Sign1, EdDSA, {}, 32-byte kid",
            version.receipt_content_type()
        ),
    );
    if !r.check(
        "receipt.signature",
        if verifies(&signed, &signed.kid) {
            Ok(format!("valid under kid {}", hex::encode(signed.kid)))
        } else {
            Err(ReceiptError::BadSignature)
        },
    ) {
        return None;
    }
    let signer = if signed.kid == exit.receipt_key {
        Ok(format!("exit stage {}'s receipt key", exit.stage_index))
    } else {
        match stage_of(stages, &signed.kid) {
            Some(stage) => Err(ReceiptError::SignerNotExitStage { stage }),
            None => Err(ReceiptError::UnknownSigner),
        }
    };
    if !r.check("receipt.signer", signer) {
        return None;
    }
    let body = match ReceiptBody::from_cbor(&signed.payload, version) {
        Ok(b) => b,
        Err(e) => {
            r.fail("receipt.payload", e);
            return None;
        }
    };
    r.pass(
        "receipt.payload",
        format!(
            "id {}, {} {}, sequence {}, sealing {}",
            hex::encode(body.receipt_id),
            body.endpoint,
            body.model_id,
            body.sequence,
            body.sealing.as_str()
        ),
    );

    r.check(
        "mock",
        match (body.mock, inputs.allow_mock) {
            (false, _) => Ok("not mock".into()),
            (true, true) => Ok("MOCK receipt (allowed by policy)".into()),
            (true, false) => Err(ReceiptError::MockNotAllowed),
        },
    );
    match inputs.expected_manifest {
        Some(m) => {
            r.check(
                "manifest",
                if m == body.manifest_digest {
                    Ok(format!("manifest {}", m.hex()))
                } else {
                    Err(ReceiptError::ManifestMismatch)
                },
            );
        }
        None => r.skip("manifest", "no expected manifest given"),
    }

    let entry_link = check_chain(&body, stages, r);

    match inputs.request {
        Some(req) => {
            r.check(
                "request",
                if Sha256Digest::of(req) == body.request_digest {
                    Ok(format!("sha256 {}", body.request_digest.hex()))
                } else {
                    Err(ReceiptError::RequestMismatch)
                },
            );
        }
        None => r.skip("request", "no request bytes given"),
    }
    match inputs.response {
        Some(resp) => {
            r.check(
                "response",
                if Sha256Digest::of(resp) == body.response_digest {
                    Ok(format!("sha256 {}", body.response_digest.hex()))
                } else {
                    Err(ReceiptError::ResponseMismatch)
                },
            );
        }
        None => r.skip("response", "no response bytes given"),
    }
    match (inputs.expected_nonce, &body.client_nonce) {
        (None, None) => r.skip("nonce", "no nonce expected or carried"),
        (None, Some(n)) => r.skip("nonce", format!("carries {} (not checked)", hex::encode(n))),
        (Some(_), None) => r.fail("nonce", ReceiptError::NonceMissing),
        (Some(e), Some(n)) => {
            r.check(
                "nonce",
                if e == n.as_slice() {
                    Ok(format!("matches {}", hex::encode(n)))
                } else {
                    Err(ReceiptError::NonceMismatch)
                },
            );
        }
    }
    check_sealing(&body, entry_link.as_ref(), inputs.sealed_to, r);
    Some(body)
}

/// Whether the entry stage opened the key the client sealed to.
fn check_sealing(
    body: &ReceiptBody,
    entry_link: Option<&Link>,
    sealed_to: Option<SealedTo<'_>>,
    r: &mut Report,
) {
    let claimed = body.sealing.as_str();
    if body.version == ReceiptVersion::V2 {
        r.skip(
            "sealing",
            format!(
                "a v2 receipt does not say which key the entry stage opened: \
                 sealing {claimed:?} is the host's word"
            ),
        );
        return;
    }
    let Some(opened) = entry_link.and_then(|l| l.opened) else {
        r.skip("sealing", "the entry stage's link is unusable");
        return;
    };
    let Some(client) = sealed_to else {
        r.skip(
            "sealing",
            format!(
                "the receipt says {claimed:?} (the host's word); the entry stage opened {opened}: \
                 give the client's encapsulated key to check that it was the client's"
            ),
        );
        return;
    };
    let yours = opened == OpenedKey::of(client.key_id, client.enc);
    let mismatch = || {
        ReceiptError::SealingMismatch(if yours {
            format!("the receipt says {claimed:?}, but the entry stage opened the client's own key")
        } else {
            format!(
                "the receipt says {claimed:?}, but the entry stage opened {opened}, not the key \
                 the client sealed to (key id {}): the host opened the request",
                client.key_id
            )
        })
    };
    r.check(
        "sealing",
        match (yours, body.sealing) {
            (true, Sealing::Enclave) => Ok(format!(
                "enclave: the entry stage opened the key the client sealed to ({opened}); \
                 the host relayed ciphertext only"
            )),
            (false, Sealing::Gateway) => Ok(format!(
                "gateway: the entry stage opened {opened}, not the client's: the gateway opened \
                 the request and re-sealed it (the client sealed to the gateway's key)"
            )),
            _ => Err(mismatch()),
        },
    );
}

/// Runs the chain checks; returns the entry stage's link if it is usable.
fn check_chain(body: &ReceiptBody, stages: &[StageKeys], r: &mut Report) -> Option<Link> {
    let links = body.links();
    r.check(
        "chain.length",
        if links == stages.len() {
            Ok(format!(
                "{} signed links and the exit stage's link",
                body.chain.len()
            ))
        } else {
            Err(ReceiptError::ChainLength {
                expected: stages.len(),
                got: links,
            })
        },
    );
    let exit_stage = stages[stages.len() - 1].stage_index;
    let mut prev: Option<Link> = None;
    let mut entry: Option<Link> = None;
    for (i, stage) in stages.iter().enumerate().take(links) {
        let name = |what: &str| format!("link[{i}].{what}");
        let link = match body.chain.get(i) {
            Some(bytes) => check_link(i, bytes, body.version, stage, stages, r),
            None => {
                // The exit stage's link: signed by the receipt's signature,
                // whose key `receipt.signer` found to be the exit stage's.
                r.pass(name("signature"), "covered by the receipt's signature");
                let signer = if stage.stage_index == exit_stage {
                    Ok(format!("exit stage {exit_stage}'s receipt key"))
                } else {
                    Err(ReceiptError::LinkWrongStage {
                        position: i,
                        signer_stage: exit_stage,
                    })
                };
                r.check(name("signer"), signer)
                    .then(|| body.exit_link.clone())
            }
        };
        let Some(link) = link else {
            prev = None;
            continue;
        };
        r.check(
            name("stage_index"),
            if link.stage_index as usize == i {
                Ok(format!("stage {i}"))
            } else {
                Err(ReceiptError::LinkStageIndex {
                    position: i,
                    got: link.stage_index,
                })
            },
        );
        if body.version != ReceiptVersion::V2 {
            r.check(
                name("opened"),
                match (i, link.opened) {
                    (0, Some(o)) => Ok(format!("the entry stage opened {o}")),
                    (1.., None) => Ok("not the entry stage".into()),
                    _ => Err(ReceiptError::LinkOpened { position: i }),
                },
            );
        }
        r.check(
            name("receipt_id"),
            if link.receipt_id == body.receipt_id {
                Ok("matches the receipt".into())
            } else {
                Err(ReceiptError::LinkReceiptId { position: i })
            },
        );
        r.check(
            name("layers"),
            if link.layers == stage.layers {
                Ok(format!("layers {}..{}", link.layers[0], link.layers[1]))
            } else {
                Err(ReceiptError::LinkLayers { position: i })
            },
        );
        r.check(
            name("evidence"),
            if link.evidence_digest == stage.evidence_digest {
                Ok(format!("evidence {}", link.evidence_digest.hex()))
            } else {
                Err(ReceiptError::LinkEvidence { position: i })
            },
        );
        let expected_prev = (i > 0).then(|| link_digest(&body.chain[i - 1]));
        r.check(
            name("prev_link"),
            if link.prev_link_digest == expected_prev {
                Ok(match expected_prev {
                    Some(d) => format!("follows link {} ({})", i - 1, d.hex()),
                    None => "first link (null)".into(),
                })
            } else {
                Err(ReceiptError::LinkPrevDigest { position: i })
            },
        );
        if i == 0 {
            r.check(
                name("data_flow"),
                if link.received_digest == body.request_digest {
                    Ok("received the receipt's request".into())
                } else {
                    Err(ReceiptError::ChainRequestDigest)
                },
            );
        } else if let Some(p) = &prev {
            r.check(
                name("data_flow"),
                if link.received_digest == p.sent_digest {
                    Ok(format!("received what stage {} sent", i - 1))
                } else {
                    Err(ReceiptError::LinkDataFlow { position: i })
                },
            );
        } else {
            r.skip(name("data_flow"), "previous link unusable");
        }
        if i == 0 {
            entry = Some(link.clone());
        }
        prev = Some(link);
    }
    if links == stages.len() {
        match &prev {
            Some(last) => {
                r.check(
                    "chain.response",
                    if last.sent_digest == body.response_digest {
                        Ok("exit stage sent the receipt's response".into())
                    } else {
                        Err(ReceiptError::ChainResponseDigest)
                    },
                );
            }
            None => r.skip("chain.response", "last link unusable"),
        }
    }
    entry
}

/// Structure, signature, signer and payload of link `i`.
fn check_link(
    i: usize,
    bytes: &[u8],
    version: ReceiptVersion,
    stage: &StageKeys,
    stages: &[StageKeys],
    r: &mut Report,
) -> Option<Link> {
    let name = |what: &str| format!("link[{i}].{what}");
    let malformed = |detail: String| ReceiptError::LinkMalformed {
        position: i,
        detail,
    };
    let signed = match parse_signed(bytes, version.link_content_type()) {
        Ok(s) => s,
        Err(e) => {
            r.fail(name("structure"), malformed(e.to_string()));
            return None;
        }
    };
    if !verifies(&signed, &signed.kid) {
        r.fail(
            name("signature"),
            ReceiptError::LinkBadSignature { position: i },
        );
        return None;
    }
    r.pass(name("signature"), "valid under its kid");
    let signer = if signed.kid == stage.receipt_key {
        Ok(format!("stage {}'s receipt key", stage.stage_index))
    } else {
        match stage_of(stages, &signed.kid) {
            Some(signer_stage) => Err(ReceiptError::LinkWrongStage {
                position: i,
                signer_stage,
            }),
            None => Err(ReceiptError::LinkUnknownSigner { position: i }),
        }
    };
    if !r.check(name("signer"), signer) {
        return None;
    }
    match Link::from_cbor_as(&signed.payload, version) {
        Ok(l) => {
            r.pass(name("payload"), "decodes");
            Some(l)
        }
        Err(e) => {
            let e = match e {
                ReceiptError::Malformed(d) => malformed(d),
                ReceiptError::NotCanonical => malformed("not deterministic CBOR".into()),
                other => other,
            };
            r.fail(name("payload"), e);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixture {
        keys: Vec<SigningKey>,
        stages: Vec<StageKeys>,
        request: Vec<u8>,
        response: Vec<u8>,
        nonce: Vec<u8>,
        /// The client's encapsulated key (sealed to key id 7).
        enc: Vec<u8>,
    }

    fn signing_key(label: &str) -> SigningKey {
        SigningKey::from_bytes(&Sha256Digest::of(label.as_bytes()).0)
    }

    fn fixture() -> Fixture {
        let keys: Vec<_> = (0..3).map(|i| signing_key(&format!("stage {i}"))).collect();
        let stages = keys
            .iter()
            .enumerate()
            .map(|(i, k)| StageKeys {
                stage_index: i as u32,
                layers: [2 * i as u32, 2 * i as u32 + 2],
                evidence_digest: Sha256Digest::of(format!("evidence {i}").as_bytes()),
                receipt_key: k.verifying_key().to_bytes(),
            })
            .collect();
        Fixture {
            keys,
            stages,
            request: br#"{"input":"hi"}"#.to_vec(),
            response: br#"{"data":[]}"#.to_vec(),
            nonce: b"nonce-1".to_vec(),
            enc: Sha256Digest::of(b"client enc").0.to_vec(),
        }
    }

    fn links(f: &Fixture, id: ReceiptId) -> Vec<Link> {
        let n = f.stages.len();
        (0..n)
            .map(|i| Link {
                receipt_id: id,
                stage_index: i as u32,
                layers: f.stages[i].layers,
                evidence_digest: f.stages[i].evidence_digest,
                received_digest: if i == 0 {
                    Sha256Digest::of(&f.request)
                } else {
                    Sha256Digest::of(format!("act {}", i - 1).as_bytes())
                },
                sent_digest: if i + 1 == n {
                    Sha256Digest::of(&f.response)
                } else {
                    Sha256Digest::of(format!("act {i}").as_bytes())
                },
                prev_link_digest: None,
                opened: (i == 0).then(|| OpenedKey::of(7, &f.enc)),
            })
            .collect()
    }

    /// Signs the links before the exit stage's in order, filling
    /// prev_link_digest; returns them and the exit stage's (unsigned) link.
    fn chain(f: &Fixture, links: &[Link]) -> (Vec<Vec<u8>>, Link) {
        chain_as(f, links, ReceiptVersion::CURRENT)
    }

    /// [`chain`] with the links signed in the link format of `version`.
    fn chain_as(f: &Fixture, links: &[Link], version: ReceiptVersion) -> (Vec<Vec<u8>>, Link) {
        let mut out: Vec<Vec<u8>> = Vec::new();
        let (exit, upstream) = links.split_last().unwrap();
        for (i, l) in upstream.iter().enumerate() {
            let mut l = l.clone();
            l.prev_link_digest = out.last().map(|p| link_digest(p));
            out.push(sign_link_as(&f.keys[i], &l, version));
        }
        let mut exit = exit.clone();
        exit.prev_link_digest = out.last().map(|p| link_digest(p));
        (out, exit)
    }

    fn body(f: &Fixture, (chain, exit_link): (Vec<Vec<u8>>, Link)) -> ReceiptBody {
        ReceiptBody {
            version: ReceiptVersion::CURRENT,
            receipt_id: [7; 16],
            issued_at_ms: 1_700_000_000_000,
            endpoint: "/v1/embeddings".into(),
            model_id: "all-MiniLM-L6-v2".into(),
            manifest_digest: Sha256Digest::of(b"manifest"),
            request_digest: Sha256Digest::of(&f.request),
            response_digest: Sha256Digest::of(&f.response),
            client_nonce: Some(f.nonce.clone()),
            sequence: 1,
            mock: true,
            sealing: Sealing::Enclave,
            chain,
            exit_link,
        }
    }

    fn valid(f: &Fixture) -> Vec<u8> {
        let c = chain(f, &links(f, [7; 16]));
        sign_receipt(&f.keys[2], &body(f, c))
    }

    fn inputs<'a>(f: &'a Fixture, receipt: &'a [u8]) -> VerifyInputs<'a> {
        VerifyInputs {
            receipt,
            stages: &f.stages,
            request: Some(&f.request),
            response: Some(&f.response),
            expected_nonce: Some(&f.nonce),
            expected_manifest: Some(Sha256Digest::of(b"manifest")),
            allow_mock: true,
            sealed_to: Some(SealedTo {
                key_id: 7,
                enc: &f.enc,
            }),
        }
    }

    fn reason(f: &Fixture, receipt: &[u8]) -> Option<ReceiptError> {
        verify_receipt(&inputs(f, receipt)).failure().cloned()
    }

    #[test]
    fn valid_receipt_verifies() {
        let f = fixture();
        let rc = valid(&f);
        let report = verify_receipt(&inputs(&f, &rc));
        assert!(report.ok(), "{:#?}", report.checks);
        assert!(report.checks.iter().all(|c| c.status == CheckStatus::Pass));
        assert_eq!(report.receipt.as_ref().unwrap().sequence, 1);
        let json = report.to_json();
        assert_eq!(json["ok"], true);
        assert_eq!(json["receipt"]["sealing"], "enclave");
        // With nothing optional: passes with skips.
        let mut bare = VerifyInputs::new(&rc, &f.stages);
        bare.allow_mock = true;
        let report = verify_receipt(&bare);
        assert!(report.ok());
        assert!(report
            .checks
            .iter()
            .any(|c| c.status == CheckStatus::Skipped));
        let (b, kid) = parse_unverified(&rc).unwrap();
        assert_eq!(b.receipt_id, [7; 16]);
        assert_eq!(kid, f.stages[2].receipt_key);
    }

    #[test]
    fn payload_is_deterministic_cbor_with_sorted_integer_keys() {
        let f = fixture();
        let b = body(&f, chain(&f, &links(&f, [7; 16])));
        let bytes = b.to_cbor();
        // Map of 13 entries, keys 1..13 in order, each a one-byte uint.
        assert_eq!(bytes[0], 0xad);
        let Value::Map(entries) = decode_canonical(&bytes).unwrap() else {
            panic!()
        };
        let keys: Vec<u64> = entries
            .iter()
            .map(|(k, _)| u64::try_from(k.as_integer().unwrap()).unwrap())
            .collect();
        assert_eq!(keys, (1..=13).collect::<Vec<_>>());
        assert_eq!(&bytes[1..3], &[0x01, 0x50]); // key 1, bstr(16)
        assert_eq!(
            ReceiptBody::from_cbor(&bytes, ReceiptVersion::CURRENT).unwrap(),
            b
        );

        // Canonical ordering is by encoded bytes: 10 (0x0a) < 23 (0x17) < 24 (0x1818) < -1 (0x20).
        let v = Value::Map(vec![
            (Value::Integer((-1).into()), Value::Null),
            (uint(24), Value::Null),
            (uint(10), Value::Null),
            (uint(23), Value::Null),
        ]);
        assert_eq!(
            canonical_bytes(&v).unwrap(),
            vec![0xa4, 0x0a, 0xf6, 0x17, 0xf6, 0x18, 0x18, 0xf6, 0x20, 0xf6]
        );
        // Nested maps are sorted too; duplicates are refused.
        let nested = Value::Array(vec![Value::Map(vec![
            (uint(2), Value::Null),
            (uint(1), Value::Null),
        ])]);
        assert_eq!(
            canonical_bytes(&nested).unwrap(),
            vec![0x81, 0xa2, 0x01, 0xf6, 0x02, 0xf6]
        );
        let dup = Value::Map(vec![(uint(1), Value::Null), (uint(1), Value::Null)]);
        assert_eq!(canonical_bytes(&dup), Err(ReceiptError::NotCanonical));

        // Non-canonical encodings of the same value are refused.
        assert_eq!(
            decode_canonical(&[0xa2, 0x02, 0xf6, 0x01, 0xf6]),
            Err(ReceiptError::NotCanonical)
        ); // unsorted keys
        assert_eq!(
            decode_canonical(&[0xa1, 0x18, 0x01, 0xf6]),
            Err(ReceiptError::NotCanonical)
        ); // key 1 in two bytes
        assert_eq!(
            decode_canonical(&[0xbf, 0x01, 0xf6, 0xff]),
            Err(ReceiptError::NotCanonical)
        ); // indefinite-length map
        assert_eq!(
            decode_canonical(&[0x5f, 0x41, 0x00, 0xff]),
            Err(ReceiptError::NotCanonical)
        ); // indefinite-length bstr
        assert!(matches!(
            decode_canonical(&[0xa1, 0x01, 0xf6, 0x00]),
            Err(ReceiptError::Malformed(_))
        ));
        let link = links(&f, [7; 16]).remove(0);
        assert_eq!(Link::from_cbor(&link.to_cbor()).unwrap(), link);
        // Link v2: 8 keys, the entry stage's key 8 = [key id, sha256(enc)].
        assert_eq!(link.to_cbor()[0], 0xa8);
        let v1 = link.to_cbor_as(ReceiptVersion::V2);
        assert_eq!(v1[0], 0xa7);
        let back = Link::from_cbor_as(&v1, ReceiptVersion::V2).unwrap();
        assert_eq!(back.opened, None);
        // A link of one format does not parse as the other.
        assert!(Link::from_cbor(&v1).is_err());
        assert!(Link::from_cbor_as(&link.to_cbor(), ReceiptVersion::V2).is_err());
    }

    #[test]
    fn every_flipped_byte_is_rejected() {
        let f = fixture();
        let rc = valid(&f);
        for i in 0..rc.len() {
            let mut bad = rc.clone();
            bad[i] ^= 0x01;
            assert!(reason(&f, &bad).is_some(), "flip at byte {i} accepted");
        }
        // A flip inside the payload is a bad signature.
        let mut bad = rc.clone();
        let n = bad.len();
        bad[n / 2] ^= 0x01;
        assert_eq!(reason(&f, &bad), Some(ReceiptError::BadSignature));
    }

    #[test]
    fn signer_checks() {
        let f = fixture();
        let b = body(&f, chain(&f, &links(&f, [7; 16])));
        let foreign = signing_key("foreign");
        assert_eq!(
            reason(&f, &sign_receipt(&foreign, &b)),
            Some(ReceiptError::UnknownSigner)
        );
        assert_eq!(
            reason(&f, &sign_receipt(&f.keys[0], &b)),
            Some(ReceiptError::SignerNotExitStage { stage: 0 })
        );
        // A link is not a receipt, even though the exit stage signed it.
        let link2 = sign_link(&f.keys[2], &chain(&f, &links(&f, [7; 16])).1);
        assert!(matches!(
            reason(&f, &link2),
            Some(ReceiptError::BadHeader(_))
        ));
    }

    #[test]
    fn chain_attacks() {
        let f = fixture();
        let ls = links(&f, [7; 16]);
        let (good, exit) = chain(&f, &ls);
        let with_chain = |c: Vec<Vec<u8>>| sign_receipt(&f.keys[2], &body(&f, (c, exit.clone())));

        // Swapped for an unattested stage: link 1 signed by a foreign key.
        let mut c = good.clone();
        let mut l1 = ls[1].clone();
        l1.prev_link_digest = Some(link_digest(&good[0]));
        c[1] = sign_link(&signing_key("foreign"), &l1);
        assert_eq!(
            reason(&f, &with_chain(c)),
            Some(ReceiptError::LinkUnknownSigner { position: 1 })
        );
        // Reordered.
        let c = vec![good[1].clone(), good[0].clone()];
        assert_eq!(
            reason(&f, &with_chain(c)),
            Some(ReceiptError::LinkWrongStage {
                position: 0,
                signer_stage: 1
            })
        );
        // Dropped.
        let c = vec![good[0].clone()];
        assert_eq!(
            reason(&f, &with_chain(c)),
            Some(ReceiptError::ChainLength {
                expected: 3,
                got: 2
            })
        );
        // Duplicated (extra link).
        let c = vec![good[0].clone(), good[1].clone(), good[1].clone()];
        assert_eq!(
            reason(&f, &with_chain(c)),
            Some(ReceiptError::ChainLength {
                expected: 3,
                got: 4
            })
        );
        // Duplicated in place of another.
        let c = vec![good[0].clone(), good[0].clone()];
        assert_eq!(
            reason(&f, &with_chain(c)),
            Some(ReceiptError::LinkWrongStage {
                position: 1,
                signer_stage: 0
            })
        );
        // The exit stage's link signed on its own and put into the chain
        // as well: one link too many.
        let c = vec![
            good[0].clone(),
            good[1].clone(),
            sign_link(&f.keys[2], &exit),
        ];
        assert_eq!(
            reason(&f, &with_chain(c)),
            Some(ReceiptError::ChainLength {
                expected: 3,
                got: 4
            })
        );
        // A one-stage chain for a three-stage pipeline: the exit stage's
        // link lands at position 0.
        assert_eq!(
            reason(&f, &with_chain(Vec::new())),
            Some(ReceiptError::ChainLength {
                expected: 3,
                got: 1
            })
        );
        // A link's signature broken.
        let mut c = good.clone();
        let n = c[1].len();
        c[1][n - 70] ^= 1;
        assert_eq!(
            reason(&f, &with_chain(c)),
            Some(ReceiptError::LinkBadSignature { position: 1 })
        );
        // Garbage as a link.
        let mut c = good.clone();
        c[1] = vec![0x01];
        assert!(matches!(
            reason(&f, &with_chain(c)),
            Some(ReceiptError::LinkMalformed { position: 1, .. })
        ));
    }

    #[test]
    fn link_content_checks() {
        let f = fixture();
        let base = links(&f, [7; 16]);
        let case = |edit: &dyn Fn(&mut Vec<Link>)| {
            let mut ls = base.clone();
            edit(&mut ls);
            let c = chain(&f, &ls);
            reason(&f, &sign_receipt(&f.keys[2], &body(&f, c)))
        };
        assert_eq!(
            case(&|ls| ls[1].stage_index = 2),
            Some(ReceiptError::LinkStageIndex {
                position: 1,
                got: 2
            })
        );
        assert_eq!(
            case(&|ls| ls[2].receipt_id = [8; 16]),
            Some(ReceiptError::LinkReceiptId { position: 2 })
        );
        assert_eq!(
            case(&|ls| ls[1].layers = [2, 5]),
            Some(ReceiptError::LinkLayers { position: 1 })
        );
        assert_eq!(
            case(&|ls| ls[0].evidence_digest = Sha256Digest::of(b"other")),
            Some(ReceiptError::LinkEvidence { position: 0 })
        );
        assert_eq!(
            case(&|ls| ls[2].received_digest = Sha256Digest::of(b"other")),
            Some(ReceiptError::LinkDataFlow { position: 2 })
        );
        assert_eq!(
            case(&|ls| ls[0].received_digest = Sha256Digest::of(b"other")),
            Some(ReceiptError::ChainRequestDigest)
        );
        assert_eq!(
            case(&|ls| ls[2].sent_digest = Sha256Digest::of(b"other")),
            Some(ReceiptError::ChainResponseDigest)
        );
        // The exit stage's link points at link 0 instead of link 1.
        let (c, mut exit) = chain(&f, &base);
        exit.prev_link_digest = Some(link_digest(&c[0]));
        assert_eq!(
            reason(&f, &sign_receipt(&f.keys[2], &body(&f, (c, exit)))),
            Some(ReceiptError::LinkPrevDigest { position: 2 })
        );
        // A signed link pointing at the wrong link.
        let (mut c, exit) = chain(&f, &base);
        let mut l1 = base[1].clone();
        l1.prev_link_digest = Some(link_digest(&c[1]));
        c[1] = sign_link(&f.keys[1], &l1);
        assert_eq!(
            reason(&f, &sign_receipt(&f.keys[2], &body(&f, (c, exit)))),
            Some(ReceiptError::LinkPrevDigest { position: 1 })
        );
        // Stage 0 with a non-null previous digest.
        let (mut c, exit) = chain(&f, &base);
        let mut l0 = base[0].clone();
        l0.prev_link_digest = Some(Sha256Digest::of(b"x"));
        c[0] = sign_link(&f.keys[0], &l0);
        assert_eq!(
            reason(&f, &sign_receipt(&f.keys[2], &body(&f, (c, exit)))),
            Some(ReceiptError::LinkPrevDigest { position: 0 })
        );
        // A one-stage pipeline: the exit stage's link is the whole chain.
        let one = &f.stages[..1];
        let mut only = base[0].clone();
        only.sent_digest = Sha256Digest::of(&f.response);
        let mut b = body(&f, (Vec::new(), only));
        let rc = sign_receipt(&f.keys[0], &b);
        let mut i = inputs(&f, &rc);
        i.stages = one;
        assert!(verify_receipt(&i).ok());
        b.exit_link.stage_index = 1;
        let rc = sign_receipt(&f.keys[0], &b);
        let mut i = inputs(&f, &rc);
        i.stages = one;
        assert_eq!(
            verify_receipt(&i).failure(),
            Some(&ReceiptError::LinkStageIndex {
                position: 0,
                got: 1
            })
        );
    }

    #[test]
    fn inputs_checks() {
        let f = fixture();
        let rc = valid(&f);
        let mut i = inputs(&f, &rc);
        i.request = Some(b"another request");
        assert_eq!(
            verify_receipt(&i).failure(),
            Some(&ReceiptError::RequestMismatch)
        );
        let mut i = inputs(&f, &rc);
        i.response = Some(b"another response");
        assert_eq!(
            verify_receipt(&i).failure(),
            Some(&ReceiptError::ResponseMismatch)
        );
        let mut i = inputs(&f, &rc);
        i.expected_nonce = Some(b"nonce-2");
        assert_eq!(
            verify_receipt(&i).failure(),
            Some(&ReceiptError::NonceMismatch)
        );
        let mut i = inputs(&f, &rc);
        i.allow_mock = false;
        assert_eq!(
            verify_receipt(&i).failure(),
            Some(&ReceiptError::MockNotAllowed)
        );
        let mut i = inputs(&f, &rc);
        i.expected_manifest = Some(Sha256Digest::of(b"other"));
        assert_eq!(
            verify_receipt(&i).failure(),
            Some(&ReceiptError::ManifestMismatch)
        );
        let mut b = body(&f, chain(&f, &links(&f, [7; 16])));
        b.client_nonce = None;
        let rc2 = sign_receipt(&f.keys[2], &b);
        assert_eq!(reason(&f, &rc2), Some(ReceiptError::NonceMissing));
        // Stage keys inconsistent.
        let mut bad = f.stages.clone();
        bad[1].layers = [3, 4];
        let i = VerifyInputs::new(&rc, &bad);
        assert!(matches!(
            verify_receipt(&i).failure(),
            Some(ReceiptError::BadStageKeys(_))
        ));
        let mut bad = f.stages.clone();
        bad.swap(0, 1);
        assert!(matches!(
            verify_receipt(&VerifyInputs::new(&rc, &bad)).failure(),
            Some(ReceiptError::BadStageKeys(_))
        ));
    }

    /// Signs a receipt over `links` with `edit` applied to the body.
    fn receipt_with(f: &Fixture, ls: &[Link], edit: impl Fn(&mut ReceiptBody)) -> Vec<u8> {
        let mut b = body(f, chain(f, ls));
        edit(&mut b);
        sign_receipt(&f.keys[2], &b)
    }

    fn check_status(report: &VerifyReport, name: &str) -> Option<CheckStatus> {
        report
            .checks
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.status)
    }

    #[test]
    fn sealing_is_proven_only_against_the_clients_own_key() {
        let f = fixture();
        let rc = valid(&f);
        // The entry stage opened the client's key: enclave, proven.
        let report = verify_receipt(&inputs(&f, &rc));
        assert!(report.ok(), "{:#?}", report.checks);
        assert_eq!(report.proven_sealing(), Some(Sealing::Enclave));
        assert_eq!(report.to_json()["receipt"]["sealing_proven"], true);

        // A host that opened the client's request (sealed to a key of its
        // own) and re-sealed it to the entry stage: the entry stage opened
        // another encapsulated key, yet the receipt says "enclave".
        let other_enc = Sha256Digest::of(b"host's enc").0.to_vec();
        let mut ls = links(&f, [7; 16]);
        ls[0].opened = Some(OpenedKey::of(7, &other_enc));
        let resealed = receipt_with(&f, &ls, |_| {});
        let report = verify_receipt(&inputs(&f, &resealed));
        assert!(
            matches!(report.failure(), Some(ReceiptError::SealingMismatch(_))),
            "{:#?}",
            report.checks
        );
        assert_eq!(report.proven_sealing(), None);
        // The same key id with the client's enc but another key id also fails.
        let mut ls = links(&f, [7; 16]);
        ls[0].opened = Some(OpenedKey::of(8, &f.enc));
        let report = verify_receipt(&inputs(&f, &receipt_with(&f, &ls, |_| {})));
        assert_eq!(report.failure().map(|e| e.code()), Some("sealing_mismatch"));

        // Sealed to the gateway's key: the entry stage opened the gateway's
        // re-sealing, and the receipt says so.
        let mut ls = links(&f, [7; 16]);
        ls[0].opened = Some(OpenedKey::of(3, &other_enc));
        let gw = receipt_with(&f, &ls, |b| b.sealing = Sealing::Gateway);
        let report = verify_receipt(&inputs(&f, &gw));
        assert!(report.ok(), "{:#?}", report.checks);
        assert_eq!(report.proven_sealing(), Some(Sealing::Gateway));
        // "gateway" (or "plain") although the enclave opened the client's key.
        for s in [Sealing::Gateway, Sealing::Plain] {
            let lie = receipt_with(&f, &links(&f, [7; 16]), |b| b.sealing = s);
            assert_eq!(reason(&f, &lie).map(|e| e.code()), Some("sealing_mismatch"));
        }

        // Without the client's key the claim is the host's word: skipped.
        let mut bare = inputs(&f, &rc);
        bare.sealed_to = None;
        let report = verify_receipt(&bare);
        assert!(report.ok());
        assert_eq!(check_status(&report, "sealing"), Some(CheckStatus::Skipped));
        assert_eq!(report.proven_sealing(), None);
        let mut bare = inputs(&f, &resealed);
        bare.sealed_to = None;
        assert!(verify_receipt(&bare).ok());
    }

    #[test]
    fn opened_key_belongs_to_the_entry_link_only() {
        let f = fixture();
        let mut ls = links(&f, [7; 16]);
        ls[0].opened = None;
        assert_eq!(
            reason(&f, &receipt_with(&f, &ls, |_| {})),
            Some(ReceiptError::LinkOpened { position: 0 })
        );
        for i in 1..3 {
            let mut ls = links(&f, [7; 16]);
            ls[i].opened = Some(OpenedKey::of(7, &f.enc));
            assert_eq!(
                reason(&f, &receipt_with(&f, &ls, |_| {})),
                Some(ReceiptError::LinkOpened { position: i })
            );
        }
    }

    #[test]
    fn v2_receipts_verify_as_what_they_are() {
        let f = fixture();
        // A v2 receipt: v1 links (no key 8), the v2 content types.
        let mut ls = links(&f, [7; 16]);
        ls[0].opened = None;
        let mut b = body(&f, chain_as(&f, &ls, ReceiptVersion::V2));
        b.version = ReceiptVersion::V2;
        let rc = sign_receipt(&f.keys[2], &b);
        let report = verify_receipt(&inputs(&f, &rc));
        assert!(report.ok(), "{:#?}", report.checks);
        assert_eq!(check_status(&report, "sealing"), Some(CheckStatus::Skipped));
        assert_eq!(report.proven_sealing(), None);
        assert_eq!(report.receipt.as_ref().unwrap().version, ReceiptVersion::V2);
        // A v3 link inside a v2 receipt (or the reverse) is refused.
        let mut mixed = b.clone();
        mixed.chain[0] = sign_link(&f.keys[0], &links(&f, [7; 16])[0]);
        assert_eq!(
            reason(&f, &sign_receipt(&f.keys[2], &mixed)).map(|e| e.code()),
            Some("link_malformed")
        );
        let mut mixed = body(&f, chain_v3_with_v1_link(&f));
        mixed.version = ReceiptVersion::V3;
        assert_eq!(
            reason(&f, &sign_receipt(&f.keys[2], &mixed)).map(|e| e.code()),
            Some("link_malformed")
        );
        // Unverified parsing reads both.
        assert_eq!(parse_unverified(&rc).unwrap().0.version, ReceiptVersion::V2);
        assert_eq!(
            parse_unverified(&valid(&f)).unwrap().0.version,
            ReceiptVersion::V3
        );
    }

    /// A v3 chain whose first link is signed in the v1 link format.
    fn chain_v3_with_v1_link(f: &Fixture) -> (Vec<Vec<u8>>, Link) {
        let (mut c, exit) = chain(f, &links(f, [7; 16]));
        c[0] = sign_link_as(&f.keys[0], &links(f, [7; 16])[0], ReceiptVersion::V2);
        (c, exit)
    }

    #[test]
    fn entry_link_unverified_reads_the_opened_key() {
        let f = fixture();
        let (b, _) = parse_unverified(&valid(&f)).unwrap();
        assert_eq!(
            b.entry_link_unverified().unwrap().opened,
            Some(OpenedKey::of(7, &f.enc))
        );
        // One stage: the exit link is the entry link.
        let mut one = body(&f, (Vec::new(), links(&f, [7; 16]).remove(0)));
        one.chain.clear();
        assert_eq!(
            one.entry_link_unverified().unwrap().opened,
            Some(OpenedKey::of(7, &f.enc))
        );
    }

    #[test]
    fn non_canonical_payload_is_refused() {
        let f = fixture();
        let b = body(&f, chain(&f, &links(&f, [7; 16])));
        // Same map with keys in reverse order, properly signed.
        let Value::Map(mut entries) = b.to_value() else {
            panic!()
        };
        entries.reverse();
        let payload = encode(&Value::Map(entries));
        let rc = sign(&f.keys[2], RECEIPT_CONTENT_TYPE, payload);
        assert_eq!(reason(&f, &rc), Some(ReceiptError::NotCanonical));
        // Unknown extra key.
        let Value::Map(mut entries) = b.to_value() else {
            panic!()
        };
        entries.push((uint(14), Value::Null));
        let rc = sign(
            &f.keys[2],
            RECEIPT_CONTENT_TYPE,
            encode(&Value::Map(entries)),
        );
        assert!(matches!(reason(&f, &rc), Some(ReceiptError::Malformed(_))));
    }

    #[test]
    fn stage_keys_json_uses_hex() {
        let f = fixture();
        let json = serde_json::to_string(&f.stages[0]).unwrap();
        assert!(json.contains(&f.stages[0].evidence_digest.hex()));
        assert!(json.contains(&hex::encode(f.stages[0].receipt_key)));
        let back: StageKeys = serde_json::from_str(&json).unwrap();
        assert_eq!(back, f.stages[0]);
        let cbor = crate::cbor::to_vec(&f.stages[0]);
        let back: StageKeys = crate::cbor::from_slice(&cbor).unwrap();
        assert_eq!(back, f.stages[0]);
    }
}
