//! Typed log entries. A leaf is an entry's deterministic CBOR bytes
//! (RFC 8949 §4.2.1, integer keys), hashed as RFC 6962 prescribes.

use crate::digest::Sha256Digest;
use crate::receipt::{canonical_bytes, decode_canonical, int_map, uint, Fields};
use ciborium::value::Value;

/// What a release entry says a stage image measures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Measurement {
    /// The mock provider's measurement, as lowercase hex.
    Mock(String),
    /// A Nitro enclave image's PCRs 0, 1, 2 and 8 (48 bytes each; PCR8 is
    /// all zeros for an unsigned image).
    Nitro {
        /// PCR0: the enclave image.
        pcr0: Vec<u8>,
        /// PCR1: the kernel and boot ramfs.
        pcr1: Vec<u8>,
        /// PCR2: the application.
        pcr2: Vec<u8>,
        /// PCR8: the signing certificate.
        pcr8: Vec<u8>,
    },
}

/// A stage image released for one model's layer range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReleaseEntry {
    /// The image's measurement.
    pub measurement: Measurement,
    /// Digest of the model manifest the stage serves.
    pub manifest_digest: Sha256Digest,
    /// The stage's layer range, half-open `[start, end)`.
    pub layers: (u32, u32),
    /// The release's version string.
    pub version: String,
    /// Digest of the reproducible build's record (its exact file bytes).
    pub build_record_digest: Sha256Digest,
}

/// An HPKE key set an entry stage signed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeySetEntry {
    /// Digest of the signed key-set bytes.
    pub key_set_digest: Sha256Digest,
    /// The key ids the set publishes.
    pub key_ids: Vec<u8>,
}

/// A receipt, by digest only (never its content).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceiptEntry {
    /// Digest of the receipt's bytes.
    pub receipt_digest: Sha256Digest,
}

impl ReceiptEntry {
    /// The log entry (leaf bytes) of the receipt `receipt` (its COSE_Sign1
    /// bytes): its digest only.
    pub fn leaf_of(receipt: &[u8]) -> Vec<u8> {
        Entry::Receipt(Self {
            receipt_digest: Sha256Digest::of(receipt),
        })
        .to_bytes()
    }
}

/// One log entry; its leaf is [`Entry::to_bytes`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// A stage image release (kind 1).
    Release(ReleaseEntry),
    /// A signed HPKE key set (kind 2).
    KeySet(KeySetEntry),
    /// A receipt digest (kind 3).
    Receipt(ReceiptEntry),
}

const KIND_RELEASE: u64 = 1;
const KIND_KEY_SET: u64 = 2;
const KIND_RECEIPT: u64 = 3;

fn bytes(b: &[u8]) -> Value {
    Value::Bytes(b.to_vec())
}

impl Measurement {
    fn to_value(&self) -> Value {
        match self {
            Self::Mock(hex) => int_map(vec![(1, uint(0)), (2, Value::Text(hex.clone()))]),
            Self::Nitro {
                pcr0,
                pcr1,
                pcr2,
                pcr8,
            } => int_map(vec![
                (1, uint(1)),
                (2, bytes(pcr0)),
                (3, bytes(pcr1)),
                (4, bytes(pcr2)),
                (5, bytes(pcr8)),
            ]),
        }
    }

    fn from_value(v: Value) -> Result<Self, String> {
        match kind_of(&v)? {
            0 => {
                let mut f = Fields::new(v, 2)?;
                let hex = f.text(2)?;
                if hex.is_empty() || !hex.len().is_multiple_of(2) || !is_lower_hex(&hex) {
                    return Err("mock measurement is not lowercase hex".into());
                }
                Ok(Self::Mock(hex))
            }
            1 => {
                let mut f = Fields::new(v, 5)?;
                let mut pcr = |k| {
                    let b = f.bytes(k)?;
                    if b.len() != 48 {
                        return Err(format!("PCR at key {k} is not 48 bytes"));
                    }
                    Ok(b)
                };
                Ok(Self::Nitro {
                    pcr0: pcr(2)?,
                    pcr1: pcr(3)?,
                    pcr2: pcr(4)?,
                    pcr8: pcr(5)?,
                })
            }
            k => Err(format!("unknown measurement kind {k}")),
        }
    }
}

impl ReleaseEntry {
    /// Whether this is the release of a stage measuring `measurement`
    /// (pinned form, as evidence checks print it) that serves the model of
    /// manifest `manifest` at `layers`: what the gateway looks up, a client
    /// pins from and a bundle's proof must name.
    pub fn is_release_of(
        &self,
        measurement: &str,
        manifest: &Sha256Digest,
        layers: [u32; 2],
    ) -> bool {
        self.measurement.pinned_form() == measurement
            && self.manifest_digest == *manifest
            && self.layers == (layers[0], layers[1])
    }
}

impl Measurement {
    /// The form policies pin and print: `mock:<hex>`, or
    /// `nitro:pcr0=…,pcr1=…,pcr2=…` with `,pcr8=…` when PCR8 is not zero.
    pub fn pinned_form(&self) -> String {
        match self {
            Self::Mock(h) => format!("mock:{h}"),
            Self::Nitro {
                pcr0,
                pcr1,
                pcr2,
                pcr8,
            } => crate::evidence::Pcrs(
                [(0, pcr0), (1, pcr1), (2, pcr2), (8, pcr8)]
                    .into_iter()
                    .map(|(i, v)| (i, v.clone()))
                    .collect(),
            )
            .pinned_form(),
        }
    }

    /// The release form of a measurement that evidence reports (or a policy
    /// pins): the mock digest, or Nitro PCRs 0, 1, 2 and 8 (PCR8 zero when
    /// absent). `None` for Nitro evidence missing PCR0-2 or with PCRs not
    /// 48 bytes long.
    pub fn of_evidence(m: &crate::evidence::Measurement) -> Option<Self> {
        match m {
            crate::evidence::Measurement::Mock(d) => Some(Self::Mock(d.hex())),
            crate::evidence::Measurement::Nitro(p) => {
                let pcr = |i: u8| p.get(i).filter(|v| v.len() == 48).map(<[u8]>::to_vec);
                Some(Self::Nitro {
                    pcr0: pcr(0)?,
                    pcr1: pcr(1)?,
                    pcr2: pcr(2)?,
                    pcr8: match p.get(8) {
                        None => vec![0; 48],
                        Some(_) => pcr(8)?,
                    },
                })
            }
        }
    }
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Key 1 of an integer-keyed map: the kind that decides the other keys.
fn kind_of(v: &Value) -> Result<u64, String> {
    let Value::Map(entries) = v else {
        return Err("not a map".into());
    };
    entries
        .iter()
        .find(|(k, _)| matches!(k, Value::Integer(i) if u64::try_from(*i) == Ok(1)))
        .and_then(|(_, v)| match v {
            Value::Integer(i) => u64::try_from(*i).ok(),
            _ => None,
        })
        .ok_or_else(|| "no kind at key 1".into())
}

impl Entry {
    /// The entry's deterministic CBOR bytes: the log leaf.
    pub fn to_bytes(&self) -> Vec<u8> {
        let v = match self {
            Self::Release(r) => int_map(vec![
                (1, uint(KIND_RELEASE)),
                (2, r.measurement.to_value()),
                (3, bytes(&r.manifest_digest.0)),
                (
                    4,
                    Value::Array(vec![uint(r.layers.0.into()), uint(r.layers.1.into())]),
                ),
                (5, Value::Text(r.version.clone())),
                (6, bytes(&r.build_record_digest.0)),
            ]),
            Self::KeySet(k) => int_map(vec![
                (1, uint(KIND_KEY_SET)),
                (2, bytes(&k.key_set_digest.0)),
                (
                    3,
                    Value::Array(k.key_ids.iter().map(|&i| uint(i.into())).collect()),
                ),
            ]),
            Self::Receipt(r) => int_map(vec![
                (1, uint(KIND_RECEIPT)),
                (2, bytes(&r.receipt_digest.0)),
            ]),
        };
        canonical_bytes(&v).expect("entry maps have distinct keys")
    }

    /// Parses a leaf, requiring its deterministic encoding and exactly the
    /// keys its kind defines.
    pub fn from_bytes(leaf: &[u8]) -> Result<Self, String> {
        let v = decode_canonical(leaf).map_err(|e| e.to_string())?;
        match kind_of(&v)? {
            KIND_RELEASE => {
                let mut f = Fields::new(v, 6)?;
                let measurement = Measurement::from_value(f.take(2))?;
                let manifest_digest = f.digest(3)?;
                let layers = match f.take(4) {
                    Value::Array(a) if a.len() == 2 => {
                        let n = |v: &Value| match v {
                            Value::Integer(i) => u32::try_from(*i).ok(),
                            _ => None,
                        };
                        match (n(&a[0]), n(&a[1])) {
                            (Some(s), Some(e)) if s < e => (s, e),
                            _ => return Err("bad layer range".into()),
                        }
                    }
                    _ => return Err("layers is not a pair".into()),
                };
                let version = f.text(5)?;
                let build_record_digest = f.digest(6)?;
                Ok(Self::Release(ReleaseEntry {
                    measurement,
                    manifest_digest,
                    layers,
                    version,
                    build_record_digest,
                }))
            }
            KIND_KEY_SET => {
                let mut f = Fields::new(v, 3)?;
                let key_set_digest = f.digest(2)?;
                let key_ids = match f.take(3) {
                    Value::Array(a) => a
                        .iter()
                        .map(|v| match v {
                            Value::Integer(i) => u8::try_from(*i).ok(),
                            _ => None,
                        })
                        .collect::<Option<Vec<u8>>>()
                        .ok_or("key id is not a byte")?,
                    _ => return Err("key ids is not an array".into()),
                };
                Ok(Self::KeySet(KeySetEntry {
                    key_set_digest,
                    key_ids,
                }))
            }
            KIND_RECEIPT => {
                let mut f = Fields::new(v, 2)?;
                Ok(Self::Receipt(ReceiptEntry {
                    receipt_digest: f.digest(2)?,
                }))
            }
            k => Err(format!("unknown entry kind {k}")),
        }
    }

    /// The entry's RFC 6962 leaf hash (`SHA-256(0x00 || bytes)`).
    pub fn leaf_hash(&self) -> tlog_tiles::Hash {
        tlog_tiles::record_hash(&self.to_bytes())
    }
}
